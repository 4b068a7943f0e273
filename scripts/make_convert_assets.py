"""Make tests/assets/kimi_linear_formats/: one tiny Kimi Linear in the three layouts hf_to_k3jax
must read, with reference logits from transformers (run in the golden venv, see make_goldens.py):

    native/     save_pretrained(save_original_format=False): transformers' own names (fused conv1d,
                experts.gate_up_proj), float32, dtype "float32" in config.json
    original/   save_pretrained() with its default original-format layout: per-expert w1/w2/w3 and
                q/k/v_conv1d under block_sparse_moe, where the dense first-layer MLP lands too;
                bfloat16 (saved with dtype=bfloat16)
    remote/     the released remote-code layout (Kimi-Linear-48B-A3B-Instruct): the original
                format's tensors with the dense MLP under mlp.* and the remote config.json
                (linear_attn_config with 1-based full_attn_layers, auto_map, model_type kimi_linear);
                float32; assembled from the original-format files by this script, since the remote
                code is never run here
    golden.npz  input_ids [1, 24], logits [1, 24, V] of the native model (router weights from the
                unbiased scores), logits_biased (the remote code's convention: weights from
                score + bias) and logits_bf16 (the native model with its weights rounded to
                bfloat16 as saved in original/, computed in float32)

    /work/venv-golden/bin/python scripts/make_convert_assets.py     # a few seconds
"""
from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_goldens as G  # noqa: E402  (sets sys.modules["fla"] = None before transformers loads)
from goldens_common import IMPLEMENTATIONS, REPO_ROOT, randomize_  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import KimiLinearConfig, KimiLinearForCausalLM  # noqa: E402

OUT = REPO_ROOT / "tests" / "assets" / "kimi_linear_formats"
SEED = 4321


def config() -> KimiLinearConfig:
    """4 layers (KDA 0-2, NoPE MLA 3), dense layer 0, 4 experts top-2: about 60K parameters."""
    return KimiLinearConfig(
        vocab_size=256, hidden_size=32, num_hidden_layers=4,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        linear_num_heads=2, linear_head_dim=16, linear_conv_kernel_dim=4,
        num_attention_heads=2, num_key_value_heads=2, q_lora_rank=None, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
        first_k_dense_replace=1, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, moe_intermediate_size=16, routed_scaling_factor=2.446, n_group=1, topk_group=1,
        norm_topk_prob=True, hidden_act="silu", rms_norm_eps=1e-5, tie_word_embeddings=False,
        pad_token_id=None, bos_token_id=1, eos_token_id=2)


def remote_config(native: dict) -> dict:
    """config.json in the released remote-code form: transformers' keys without the native
    schedule lists, with linear_attn_config (1-based full_attn_layers), auto_map and torch_dtype."""
    full = [i + 1 for i, t in enumerate(native["layer_types"]) if t == "full_attention"]
    kda = [i + 1 for i, t in enumerate(native["layer_types"]) if t != "full_attention"]
    drop = ("layer_types", "mlp_layer_types", "linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim", "dtype",
            "transformers_version")
    c = {k: v for k, v in native.items() if k not in drop}
    c.update(auto_map={"AutoConfig": "configuration_kimi.KimiLinearConfig",
                       "AutoModel": "modeling_kimi.KimiLinearModel",
                       "AutoModelForCausalLM": "modeling_kimi.KimiLinearForCausalLM"},
             torch_dtype="float32",
             linear_attn_config={"full_attn_layers": full, "kda_layers": kda, "num_heads": native["linear_num_heads"],
                                 "head_dim": native["linear_head_dim"],
                                 "short_conv_kernel_size": native["linear_conv_kernel_dim"]})
    return c


def main() -> None:
    torch.manual_seed(SEED)
    model = KimiLinearForCausalLM._from_config(config(), dtype=torch.float32, **IMPLEMENTATIONS).eval()
    randomize_(model, SEED + 1)
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(SEED + 2))
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits.float().numpy()
    biased = G.biased_router_logits(model, ids)
    assert np.abs(biased - logits).max() > 1e-2, "the two router conventions must differ on this asset"
    shutil.rmtree(OUT, ignore_errors=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model.save_pretrained(tmp / "native", save_original_format=False)
        model.save_pretrained(tmp / "original32")               # the remote layout's float32 source
        model.to(torch.bfloat16).save_pretrained(tmp / "original")
        for layout in ("native", "original"):
            (OUT / layout).mkdir(parents=True)
            for f in ("config.json", "model.safetensors"):
                shutil.copy(tmp / layout / f, OUT / layout / f)
        tensors = load_file(str(tmp / "original32" / "model.safetensors"))
        native_cfg = json.loads((tmp / "native" / "config.json").read_text())
    # The released layout: the dense first layer's MLP under mlp.*, float32, remote config.json.
    remote = {k.replace(".block_sparse_moe.", ".mlp.") if k.startswith("model.layers.0.") else k: v
              for k, v in tensors.items()}
    (OUT / "remote").mkdir()
    save_file({k: v.to(torch.float32).contiguous() for k, v in remote.items()}, str(OUT / "remote" / "model.safetensors"),
              metadata={"format": "pt"})
    (OUT / "remote" / "config.json").write_text(json.dumps(remote_config(native_cfg), indent=2) + "\n")
    with torch.no_grad():   # the bfloat16 checkpoint's own reference: its rounded weights, computed in float32
        logits_bf16 = model.to(torch.float32)(input_ids=ids, use_cache=False).logits.float().numpy()
    np.savez(OUT / "golden.npz", input_ids=ids.numpy().astype(np.int32), logits=logits, logits_biased=biased,
             logits_bf16=logits_bf16)
    names = {lay: sorted(load_file(str(OUT / lay / "model.safetensors"))) for lay in ("native", "original", "remote")}
    meta = {"transformers": transformers.__version__, "torch": torch.__version__, "seed": SEED,
            "tensors": {k: len(v) for k, v in names.items()},
            "layer0_mlp": {k: [n for n in v if n.startswith("model.layers.0.") and "proj" in n and "attn" not in n]
                           for k, v in names.items()}}
    (OUT / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(json.dumps(meta["layer0_mlp"], indent=1))


if __name__ == "__main__":
    main()
