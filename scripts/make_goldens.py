"""Regenerate the golden reference assets in tests/assets/ from Hugging Face transformers.

Two tiny, randomly initialised float32 reference models are built with the NATIVE transformers
implementations (no trust_remote_code), their weights are overwritten with deliberately large
random values (so that small implementation mistakes move the logits visibly), and their outputs
are written next to the checkpoint:

    tests/assets/kimi_linear_tiny/   KimiLinearForCausalLM  (KDA + NoPE MLA, sigmoid MoE)
    tests/assets/deepseek_v3_tiny/   DeepseekV3ForCausalLM  (Kimi-K2-like MLA + YaRN, grouped MoE)

and a vision asset, made by scripts/make_vision_goldens.py (`--only kimi_k25_vision_tiny` here):

    tests/assets/kimi_k25_vision_tiny/   Kimi_K25ForConditionalGeneration  (MoonViT3d + patchmerger)

Each folder holds config.json, model.safetensors (native transformers parameter names, float32),
golden.npz and meta.json; tests/assets/README.md documents the contents and the reference
semantics.

How to run (from the repository root; a separate Python 3.11 venv because the main venv is 3.12
and must not carry torch; triton must NOT be installed there, see docs/spec/ecosystem.md section 9):

    python3.11 -m venv .venv-golden
    .venv-golden/bin/pip install torch==2.13.0+cpu \
        transformers==5.25.0 safetensors numpy
    .venv-golden/bin/python scripts/make_goldens.py            # all three assets, ~1 min on 2 cores
    .venv-golden/bin/python scripts/make_goldens.py --only kimi_linear_tiny

Every random draw comes from a fixed torch seed and torch runs on one thread, so rerunning with
the same torch version reproduces the files byte for byte (transformers 5.24.0 and 5.25.0 give
identical outputs here); a host whose CPU kernels differ may move the last bits. The script asserts
that incremental decode with the cache reproduces the full-forward logits and that the saved
checkpoint reloads to the same logits.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

# Never let transformers bind fla's triton kernels: on a CPU box they crash at the first forward.
sys.modules.setdefault("fla", None)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    KimiLinearConfig,
    KimiLinearForCausalLM,
)

import make_vision_goldens  # noqa: E402  (a sibling script: this folder is on sys.path)
from goldens_common import IMPLEMENTATIONS, MIN_ROUTING_MARGIN, REPO_ROOT, randomize_, routing_margins  # noqa: E402

BATCH, SEQ_LEN, PROMPT_LEN = 2, 72, 60
# Incremental decode must reproduce the full forward; both run in float32 on CPU, and the only
# difference is the KDA chunked vs recurrent formulation and the summation order in attention.
DECODE_TOL = 1e-4
RELOAD_TOL = 0.0  # from_pretrained must give bit-identical logits (same weights, same kernels)


def kimi_linear_config() -> KimiLinearConfig:
    """Tiny Kimi Linear: 6 layers, KDA at 0-based 0,1,2,4 and NoPE MLA at 3 and 5.

    `layer_types` is passed explicitly: without it (and without `linear_attn_config`) the native
    config puts full attention at 0-based 4, 8, ..., off by one from the released schedule.
    """
    return KimiLinearConfig(
        vocab_size=512,
        hidden_size=64,
        num_hidden_layers=6,
        layer_types=[
            "linear_attention",
            "linear_attention",
            "linear_attention",
            "full_attention",
            "linear_attention",
            "full_attention",
        ],
        linear_num_heads=4,
        linear_head_dim=16,
        linear_conv_kernel_dim=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=None,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        first_k_dense_replace=1,  # read from kwargs by __post_init__ -> mlp_layer_types
        intermediate_size=128,
        num_local_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        moe_intermediate_size=32,
        routed_scaling_factor=2.446,
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        hidden_act="silu",
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        pad_token_id=None,  # the 48B default (163839) is outside a 512-token vocabulary
        bos_token_id=1,
        eos_token_id=2,
    )


def deepseek_v3_config() -> DeepseekV3Config:
    """Tiny Kimi-K2-like DeepSeek-V3: 4 MLA layers with YaRN, dense layer 0, grouped top-k MoE."""
    return DeepseekV3Config(
        vocab_size=512,
        hidden_size=64,
        num_hidden_layers=4,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        intermediate_size=128,
        moe_intermediate_size=32,
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_shared_experts=1,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        hidden_act="silu",
        max_position_embeddings=128,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 50000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 32,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        rope_interleave=True,  # the default, and what Kimi K2 / DeepSeek-V3 checkpoints use
        rms_norm_eps=1e-6,  # Kimi K2 / DeepSeek-V3 value
        tie_word_embeddings=False,
        num_mtp_layers=0,  # Kimi K2 ships no MTP layer
        pad_token_id=None,
        bos_token_id=1,
        eos_token_id=2,
    )


@torch.no_grad()
def full_forward(model, input_ids: torch.Tensor) -> dict[str, np.ndarray]:
    """Full-sequence forward (no cache): logits, all hidden states, last layer's raw output.

    `hidden_states` follows transformers: entry 0 is the embedding output, entry i (1 <= i < L)
    the residual stream after decoder layer i-1, and entry L the FINAL-NORMED last hidden state.
    `last_layer_output` is the residual stream after the last decoder layer, before the norm.
    """
    captured = {}
    hook = model.model.layers[-1].register_forward_hook(lambda m, a, out: captured.__setitem__("h", out))
    try:
        out = model(input_ids=input_ids, use_cache=False, output_hidden_states=True)
    finally:
        hook.remove()
    hidden = torch.stack(out.hidden_states, dim=0)
    return {
        "logits": out.logits.float().numpy(),
        "hidden_states": hidden.float().numpy(),
        "last_layer_output": captured["h"].float().numpy(),
    }


@torch.no_grad()
def incremental_decode(model, input_ids: torch.Tensor, prompt_len: int) -> np.ndarray:
    """Prefill `prompt_len` tokens with a cache, then feed the rest one token at a time.

    Returns [B, T - prompt_len, V] float32: step i feeds token prompt_len + i and returns the
    logits at that position (same position as full_forward's logits[:, prompt_len + i]).
    transformers 5.24 and 5.25 name the cache argument `cache=` (`past_key_values=` is deprecated).
    """
    out = model(input_ids=input_ids[:, :prompt_len], use_cache=True)
    cache = out.cache
    steps = []
    for pos in range(prompt_len, input_ids.shape[1]):
        out = model(input_ids=input_ids[:, pos : pos + 1], cache=cache, use_cache=True)
        cache = out.cache
        steps.append(out.logits[:, -1].float())
    return torch.stack(steps, dim=1).numpy()


@torch.no_grad()
def perturbation_gain(model, input_ids: torch.Tensor, seed: int, rel: float = 1e-7) -> float:
    """Max |logit change| when the embeddings are multiplied by (1 + rel * N(0, 1)).

    Measures how strongly the random network amplifies float32-level rounding, which sets the
    tolerance a float32 reimplementation can be held to (README, "Measured numbers and tolerances").
    """
    gen = torch.Generator().manual_seed(seed)
    emb = model.model.embed_tokens(input_ids)
    noise = torch.randn(emb.shape, generator=gen)
    base = model(inputs_embeds=emb, use_cache=False).logits
    moved = model(inputs_embeds=emb * (1.0 + rel * noise), use_cache=False).logits
    return float((moved - base).abs().max())


@torch.no_grad()
def biased_router_logits(model, input_ids: torch.Tensor) -> np.ndarray:
    """Full-forward logits under the remote-code router convention (weights from s + b).

    Native transformers gathers the top-k weights from the unbiased sigmoid scores s; Kimi
    Linear's remote code (and NeMo's `router_weight_uses_score_correction_bias`) gathers them from
    s + b. A forward hook swaps the weights while keeping the selected experts, so the returned
    logits show how far apart the two conventions are on this asset (recorded in meta.json).
    """

    def hook(router, _args, out):
        router_logits, _weights, indices = out
        weights = (router_logits.sigmoid() + router.e_score_correction_bias).gather(1, indices)
        if router.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return router_logits, weights * router.routed_scaling_factor, indices

    routers = [m for m in model.modules() if type(m).__name__.endswith("TopkRouter")]
    handles = [r.register_forward_hook(hook) for r in routers]
    try:
        return model(input_ids=input_ids, use_cache=False).logits.numpy()
    finally:
        for handle in handles:
            handle.remove()


def build_asset(name: str, config, model_cls, seed: int, out_root: Path) -> dict:
    """Build, randomise, run and save one asset folder; returns its meta dict."""
    torch.manual_seed(seed)
    # eager attention and the eager per-expert loop: the plain reference math, no fused kernels.
    model = model_cls._from_config(config, dtype=torch.float32, **IMPLEMENTATIONS)
    model.eval()
    rules = randomize_(model, seed + 1)

    gen = torch.Generator().manual_seed(seed + 2)
    input_ids = torch.randint(0, config.vocab_size, (BATCH, SEQ_LEN), generator=gen, dtype=torch.int64)

    golden = full_forward(model, input_ids)
    assert all(np.isfinite(v).all() for v in golden.values()), f"{name}: non-finite outputs"
    decode_logits = incremental_decode(model, input_ids, PROMPT_LEN)
    decode_diff = float(np.abs(decode_logits - golden["logits"][:, PROMPT_LEN:]).max())
    print(f"[{name}] decode vs full forward: max |diff| = {decode_diff:.3e}")
    assert decode_diff < DECODE_TOL, f"{name}: incremental decode diverges from full forward ({decode_diff})"

    margins = routing_margins(model, input_ids)
    min_margin = min(v for m in margins for v in m.values() if v is not None)
    print(f"[{name}] smallest routing margin = {min_margin:.2e}")
    assert min_margin > MIN_ROUTING_MARGIN, f"{name}: near-tie in routing ({min_margin}); change the seed"
    gain = perturbation_gain(model, input_ids, seed + 3)
    print(f"[{name}] logits move by {gain:.2e} under a 1e-7 relative embedding perturbation")
    biased_diff = float(np.abs(biased_router_logits(model, input_ids) - golden["logits"]).max())
    print(f"[{name}] biased-router convention moves logits by {biased_diff:.3f}")
    assert biased_diff > 100 * DECODE_TOL, f"{name}: goldens cannot tell the router conventions apart"

    out_dir = out_root / name
    out_dir.mkdir(parents=True, exist_ok=True)
    # save_original_format=False pins the native parameter names (fused gate_up_proj, fused
    # conv1d, forget_gate.*). The default (True) re-applies the reverse of whatever weight
    # conversion happened at load time; a model built from a config has none, so the names are
    # the same today, but a model loaded from a remote-code checkpoint would be written back in
    # the legacy layout.
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, save_original_format=False)
        for fname in ("config.json", "model.safetensors"):
            os.replace(Path(tmp) / fname, out_dir / fname)
            os.chmod(out_dir / fname, 0o644)  # tempfile's 0600 would stick to the moved file

    reloaded = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32, **IMPLEMENTATIONS)
    reloaded.eval()
    with torch.no_grad():
        reload_logits = reloaded(input_ids=input_ids, use_cache=False).logits.numpy()
    reload_diff = float(np.abs(reload_logits - golden["logits"]).max())
    print(f"[{name}] reloaded checkpoint vs in-memory model: max |diff| = {reload_diff:.3e}")
    assert reload_diff <= RELOAD_TOL, f"{name}: saved checkpoint does not reproduce the logits ({reload_diff})"

    np.savez_compressed(
        out_dir / "golden.npz",
        input_ids=input_ids.numpy(),
        logits=golden["logits"],
        hidden_states=golden["hidden_states"],
        last_layer_output=golden["last_layer_output"],
        decode_prompt_len=np.int64(PROMPT_LEN),
        decode_logits=decode_logits,
    )
    logits = golden["logits"]
    meta = {
        "asset": name,
        "model_class": model_cls.__name__,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "numpy_version": np.__version__,
        "python_version": platform.python_version(),
        "torch_threads": torch.get_num_threads(),
        "implementations": IMPLEMENTATIONS,
        "seeds": {"torch_init": seed, "weights": seed + 1, "input_ids": seed + 2, "perturbation": seed + 3},
        "weight_rules": sorted(set(rules.values())),
        "num_parameters": int(sum(p.numel() for p in model.state_dict().values())),
        "shapes": {
            "input_ids": list(input_ids.shape),
            "logits": list(logits.shape),
            "hidden_states": list(golden["hidden_states"].shape),
            "last_layer_output": list(golden["last_layer_output"].shape),
            "decode_logits": list(decode_logits.shape),
        },
        "decode_prompt_len": PROMPT_LEN,
        "decode_vs_forward_max_abs_diff": decode_diff,
        "reload_vs_forward_max_abs_diff": reload_diff,
        "routing_min_margins_per_moe_layer": margins,
        "logits_max_change_under_1e-7_relative_embedding_noise": gain,
        "logits_max_diff_if_router_weights_used_biased_scores": biased_diff,
        "logits_std": float(logits.std()),
        "logits_max_abs": float(np.abs(logits).max()),
        "command": "scripts/make_goldens.py (run with .venv-golden/bin/python, see its docstring)",
    }
    (out_dir / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


VISION_ASSET = "kimi_k25_vision_tiny"  # scripts/make_vision_goldens.py
ASSETS = {
    "kimi_linear_tiny": (kimi_linear_config, KimiLinearForCausalLM, 1234),
    "deepseek_v3_tiny": (deepseek_v3_config, DeepseekV3ForCausalLM, 5678),
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "tests" / "assets")
    parser.add_argument("--only", choices=sorted(ASSETS) + [VISION_ASSET], action="append")
    args = parser.parse_args(argv)

    try:  # a present triton makes transformers bind fla kernels; refuse rather than crash later
        import triton  # noqa: F401

        raise SystemExit("triton is installed in this venv: uninstall it (see docs/spec/ecosystem.md section 9)")
    except ImportError:
        pass
    torch.use_deterministic_algorithms(True)
    # One intra-op thread: torch's CPU reductions split by thread count, so the outputs of a 1-,
    # 2- and 8-thread host differ in the last bits (up to 8e-5 absolute in kimi_linear_tiny's
    # logits). With one thread a rerun reproduces every file byte for byte on any host with the
    # same CPU kernels, whatever its core count.
    torch.set_num_threads(1)
    for name in args.only or sorted(ASSETS) + [VISION_ASSET]:
        if name == VISION_ASSET:
            make_vision_goldens.main(["--out", str(args.out)])
            continue
        make_config, model_cls, seed = ASSETS[name]
        meta = build_asset(name, make_config(), model_cls, seed, args.out)
        size = sum(f.stat().st_size for f in (args.out / name).iterdir())
        print(f"[{name}] {meta['num_parameters']} parameters, folder {size / 2**20:.2f} MiB, "
              f"logits std {meta['logits_std']:.3f} max {meta['logits_max_abs']:.2f}")


if __name__ == "__main__":
    main()
