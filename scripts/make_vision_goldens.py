"""The vision golden asset tests/assets/kimi_k25_vision_tiny/ from transformers' native
``Kimi_K25ForConditionalGeneration`` (Kimi K2.5's MoonViT3d tower + patchmerger projector on a tiny
DeepSeek-V3 text model), float32, eager attention.

Run through scripts/make_goldens.py (``--only kimi_k25_vision_tiny``) or directly, in the same
Python 3.11 venv (its docstring):

    .venv-golden/bin/python scripts/make_vision_goldens.py [--out tests/assets]

Inputs are three media packed into one sequence, as the tower's forward takes them: two images
and one 4-frame video chunk of different grids (the 8 x 8 position table down- and upsampled,
non-square), with synthetic normalised pixels. Outputs: every stage of the tower (patch + position
embedding, each block, final norm), the sd2_tpool merge, the projector, and the full-model logits
of a prompt that holds the three media's placeholder runs. tests/assets/README.md documents the
files; tests/test_vision_golden.py checks k3jax against them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

sys.modules.setdefault("fla", None)  # never bind fla's triton kernels (see make_goldens.py)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import Kimi_K25Config, Kimi_K25ForConditionalGeneration  # noqa: E402

from goldens_common import IMPLEMENTATIONS, MIN_ROUTING_MARGIN, REPO_ROOT, randomize_, routing_margins  # noqa: E402

NAME = "kimi_k25_vision_tiny"
SEED = 2525
# (t, h, w) in patches: image A (6 x 10: the 8 x 8 table down- and upsampled), image B (12 x 4),
# a 4-frame video chunk (4 x 6), packed in this order (the tower sees all three in one sequence).
GRIDS = [(1, 6, 10), (1, 12, 4), (4, 4, 6)]
KINDS = ["image", "image", "video"]
IMAGE_TOKEN, VIDEO_TOKEN = 200, 201
VISION_NORM_STD = 0.2  # tower / projector norm weights 1 + N(0, 0.2); every bias N(0, 0.2)
RELOAD_TOL = 0.0


def kimi_k25_config() -> Kimi_K25Config:
    """Tiny K2.5: tower width 64, 2 heads of 32, 2 blocks, MLP 96, 8 x 8 position table, merge 2 x 2;
    projector 256 -> 256 -> 32; a 2-layer DeepSeek-V3 text model (layer 0 dense, layer 1 MoE)."""
    text = dict(model_type="deepseek_v3", vocab_size=256, hidden_size=32, num_hidden_layers=2,
                first_k_dense_replace=1, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=16,
                kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, intermediate_size=64,
                moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                n_group=1, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True, hidden_act="silu",
                rms_norm_eps=1e-6, max_position_embeddings=128, rope_interleave=True, num_mtp_layers=0,
                tie_word_embeddings=False, pad_token_id=None, bos_token_id=1, eos_token_id=2)
    vision = dict(hidden_size=64, num_attention_heads=2, num_hidden_layers=2, intermediate_size=96,
                  hidden_act="gelu_pytorch_tanh", patch_size=14, pos_emb_height=8, pos_emb_width=8,
                  pos_emb_time=4, merge_kernel_size=[2, 2])
    # transformers' Kimi_K25Config ties the embeddings by default; the released models do not.
    return Kimi_K25Config(text_config=text, vision_config=vision, projection_hidden_size=64,
                          projection_layer_norm_eps=1e-5, image_token_id=IMAGE_TOKEN, video_token_id=VIDEO_TOKEN,
                          tie_word_embeddings=False)


def randomize_vision_(model, seed: int) -> dict[str, str]:
    """Every tower and projector tensor, in sorted-name order from one generator: the position
    table N(0, 1) (vision.md section 10); norm weights 1 + N(0, 0.2); biases (norm biases too)
    N(0, 0.2); matrices N(0, 1 / fan_in), so activations stay O(1) through the blocks."""
    gen = torch.Generator().manual_seed(seed)
    rules = {}
    state = {k: v for k, v in model.state_dict().items() if k.startswith(("model.vision_tower.", "model.mm_projector."))}
    with torch.no_grad():
        for name in sorted(state):
            t = state[name]
            if name.endswith("position_embeddings"):
                t.copy_(torch.randn(t.shape, generator=gen))
                rule = "N(0,1)"
            elif t.ndim == 1 and "norm" in name and name.endswith("weight"):
                t.copy_(1.0 + torch.randn(t.shape, generator=gen) * VISION_NORM_STD)
                rule = f"1+N(0,{VISION_NORM_STD})"
            elif t.ndim == 1:
                t.copy_(torch.randn(t.shape, generator=gen) * VISION_NORM_STD)
                rule = f"N(0,{VISION_NORM_STD})"
            else:
                fan_in = int(np.prod(t.shape[1:]))
                t.copy_(torch.randn(t.shape, generator=gen) / fan_in ** 0.5)
                rule = "N(0,1/fan_in)"
            rules[name] = rule
    return rules


def prompt_ids(gen: torch.Generator, vocab: int) -> torch.Tensor:
    """[1, T]: bos, random text, then per media (image A, the video, image B: the video between the
    images) its run of placeholders, (h/2)(w/2) each, with random text between them."""
    def text(n):
        return torch.randint(3, IMAGE_TOKEN, (n,), generator=gen).tolist()

    order = [0, 2, 1]
    ids = [1] + text(5)
    for i in order:
        _, h, w = GRIDS[i]
        ids += [IMAGE_TOKEN if KINDS[i] == "image" else VIDEO_TOKEN] * (h // 2 * (w // 2)) + text(3)
    assert max(ids) < vocab
    return torch.tensor([ids], dtype=torch.int64)


@torch.no_grad()
def tower_parts(model, pixels: torch.Tensor, grid: torch.Tensor) -> dict[str, np.ndarray]:
    """The tower on all media packed in one sequence, every stage captured by forward hooks."""
    tower = model.model.vision_tower
    seen = {}
    hooks = [tower.patch_embed.register_forward_hook(lambda m, a, o: seen.__setitem__("embed", o))]
    for i, layer in enumerate(tower.layers):
        hooks.append(layer.register_forward_hook(lambda m, a, o, i=i: seen.__setitem__(i, o)))
    try:
        out = tower(pixels, grid_thw=grid)
    finally:
        for h in hooks:
            h.remove()
    pooled = out.pooler_output
    return {"patch_embeds": seen["embed"].numpy(),
            "hidden_states": torch.stack([seen[i] for i in range(len(tower.layers))]).numpy(),
            "last_hidden_state": out.last_hidden_state.numpy(),
            "pooled": pooled.numpy(),
            "projected": model.model.mm_projector(pooled).squeeze(1).numpy()}


@torch.no_grad()
def full_inputs(pixels: torch.Tensor, grid: torch.Tensor, input_ids: torch.Tensor) -> dict:
    """The model's kwargs: images as pixel_values / image_grid_thw, the video chunk as
    pixel_values_videos / video_grid_thw (the same patches as the packed tower run)."""
    sizes = [t * h * w for t, h, w in GRIDS]
    chunks = torch.split(pixels, sizes)
    img = [i for i, k in enumerate(KINDS) if k == "image"]
    vid = [i for i, k in enumerate(KINDS) if k == "video"]
    return dict(input_ids=input_ids, use_cache=False,
                pixel_values=torch.cat([chunks[i] for i in img]), image_grid_thw=grid[img],
                pixel_values_videos=torch.cat([chunks[i] for i in vid]), video_grid_thw=grid[vid])


def build(out_root: Path) -> dict:
    torch.manual_seed(SEED)
    config = kimi_k25_config()
    model = Kimi_K25ForConditionalGeneration._from_config(config, dtype=torch.float32, **IMPLEMENTATIONS).eval()
    text = torch.nn.ModuleDict({"language_model": model.model.language_model, "lm_head": model.lm_head})
    rules = randomize_(text, SEED + 1)
    rules.update(randomize_vision_(model, SEED + 2))

    gen = torch.Generator().manual_seed(SEED + 3)
    grid = torch.tensor(GRIDS, dtype=torch.int64)
    n = sum(t * h * w for t, h, w in GRIDS)
    # normalised pixels as the processor makes them: (u8 / 255 - 0.5) / 0.5, in [-1, 1]
    pixels = (torch.randint(0, 256, (n, 3, 14, 14), generator=gen).float() / 255 - 0.5) / 0.5
    input_ids = prompt_ids(gen, config.text_config.vocab_size)

    parts = tower_parts(model, pixels, grid)
    assert all(np.isfinite(v).all() for v in parts.values()), "non-finite tower outputs"
    inputs = full_inputs(pixels, grid, input_ids)
    with torch.no_grad():
        out = model(**inputs)
    logits = out.logits.numpy()
    # The model runs images and the video as two tower calls; per media they equal the packed run.
    ntok = [h // 2 * (w // 2) for _, h, w in GRIDS]
    feats = np.split(parts["projected"], np.cumsum(ntok)[:-1])
    model_feats = [f.numpy() for f in out.image_outputs.pooler_output] + [f.numpy() for f in out.video_outputs.pooler_output]
    split_diff = max(float(np.abs(a - b).max()) for a, b in zip(feats, model_feats))
    print(f"[{NAME}] packed tower vs the model's image/video calls: max |diff| = {split_diff:.3e}")
    assert split_diff < 1e-5, split_diff
    margins = routing_margins(model, input_ids, **{k: v for k, v in inputs.items() if k != "input_ids"})
    min_margin = min(v for m in margins for v in m.values() if v is not None)
    print(f"[{NAME}] smallest routing margin = {min_margin:.2e}")
    assert min_margin > MIN_ROUTING_MARGIN, f"near-tie in routing ({min_margin}); change the seed"

    out_dir = out_root / NAME
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:  # native names, q/k rows in rotate-half order
        model.save_pretrained(tmp, save_original_format=False)
        for fname in ("config.json", "model.safetensors"):
            os.replace(Path(tmp) / fname, out_dir / fname)
            os.chmod(out_dir / fname, 0o644)
    reloaded = Kimi_K25ForConditionalGeneration.from_pretrained(out_dir, dtype=torch.float32, **IMPLEMENTATIONS).eval()
    with torch.no_grad():
        reload_diff = float(np.abs(reloaded(**inputs).logits.numpy() - logits).max())
    reload_parts = tower_parts(reloaded, pixels, grid)
    reload_diff = max([reload_diff] + [float(np.abs(reload_parts[k] - parts[k]).max()) for k in parts])
    print(f"[{NAME}] reloaded checkpoint vs in-memory model: max |diff| = {reload_diff:.3e}")
    assert reload_diff <= RELOAD_TOL, reload_diff

    np.savez_compressed(out_dir / "golden.npz", pixel_values=pixels.numpy(), grid_thw=grid.numpy(),
                        media_is_video=np.array([k == "video" for k in KINDS]), input_ids=input_ids.numpy(),
                        logits=logits, **parts)
    meta = {
        "asset": NAME,
        "model_class": type(model).__name__,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "numpy_version": np.__version__,
        "python_version": platform.python_version(),
        "implementations": IMPLEMENTATIONS,
        "seeds": {"torch_init": SEED, "text_weights": SEED + 1, "vision_weights": SEED + 2, "inputs": SEED + 3},
        "weight_rules": sorted(set(rules.values())),
        "num_parameters": int(sum(p.numel() for p in model.state_dict().values())),
        "num_vision_parameters": int(sum(v.numel() for k, v in model.state_dict().items()
                                         if k.startswith(("model.vision_tower.", "model.mm_projector.")))),
        "grid_thw": GRIDS,
        "media": KINDS,
        "prompt_media_order": "image 0, video (media 2), image 1",
        "shapes": {k: list(v.shape) for k, v in parts.items()} | {"input_ids": list(input_ids.shape),
                                                                   "logits": list(logits.shape)},
        "packed_vs_model_media_calls_max_abs_diff": split_diff,
        "reload_vs_forward_max_abs_diff": reload_diff,
        "routing_min_margins_per_moe_layer": margins,
        "scale": {k: float(np.abs(v).max()) for k, v in parts.items()} | {"logits": float(np.abs(logits).max())},
        "command": ".venv-golden/bin/python scripts/make_goldens.py --only kimi_k25_vision_tiny "
                   "(or scripts/make_vision_goldens.py; venv in make_goldens.py's docstring)",
    }
    (out_dir / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "tests" / "assets")
    args = parser.parse_args(argv)
    torch.use_deterministic_algorithms(True)
    meta = build(args.out)
    size = sum(f.stat().st_size for f in (args.out / NAME).iterdir())
    print(f"[{NAME}] {meta['num_parameters']} parameters ({meta['num_vision_parameters']} tower + projector), "
          f"folder {size / 2**20:.2f} MiB")


if __name__ == "__main__":
    main()
