"""Write reference logits of a Hugging Face checkpoint for the k3jax logit checker.

Given a model directory that transformers can load WITHOUT trust_remote_code (for Kimi Linear:
the native `kimi_linear` layout; for Kimi K2: `deepseek_v3`), and some token ids, this runs one
full forward per prompt (no cache) and writes

    FILE.npz:  tokens  [B, T] int32     the prompt token ids
               logits  [B, T, V] float32  the model's logits at every position

All prompts must have the same length T (no padding is involved, so no attention mask either).

Usage (run with the torch venv described in scripts/make_goldens.py; triton must not be
installed there unless you pass --allow-fla on a GPU machine that has fla kernels):

    .venv-golden/bin/python scripts/make_golden_logits.py MODEL_DIR --out FILE.npz \
        --ids "1 2 3 4" --ids "5 6 7 8"
    .venv-golden/bin/python scripts/make_golden_logits.py MODEL_DIR --out FILE.npz --tokens ids.txt

Token files: `.npy` (int array [B, T] or [T]), `.npz` (key `tokens` or `input_ids`), or text
with one prompt per line, ids separated by spaces or commas (blank lines and lines starting
with # are skipped).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import numpy as np

DTYPES = ("float32", "bfloat16", "float16")


def parse_ids(text: str) -> list[int]:
    """'1 2, 3' -> [1, 2, 3]; raises ValueError on anything that is not an integer."""
    return [int(tok) for tok in re.split(r"[\s,]+", text.strip()) if tok]


def load_tokens(path: Path) -> np.ndarray:
    """Read a token file (see module docstring) into an int64 array [B, T]."""
    if path.suffix == ".npy":
        arr = np.load(path)
    elif path.suffix == ".npz":
        with np.load(path) as data:
            key = next((k for k in ("tokens", "input_ids") if k in data), None)
            if key is None:
                raise ValueError(f"{path}: expected a 'tokens' or 'input_ids' array, found {sorted(data)}")
            arr = data[key]
    else:
        rows = [
            parse_ids(line)
            for line in path.read_text().splitlines()
            if line.strip() and not line.lstrip().startswith("#")
        ]
        return stack_rows(rows, str(path))
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{path}: token ids must be integers, got {arr.dtype}")
    if arr.ndim == 1:
        arr = arr[None]
    if arr.ndim != 2:
        raise ValueError(f"{path}: expected token ids of shape [B, T] or [T], got {arr.shape}")
    return arr.astype(np.int64)


def stack_rows(rows: list[list[int]], source: str) -> np.ndarray:
    """Stack equal-length prompts into [B, T] int64; ragged prompts are an error (no padding)."""
    if not rows:
        raise ValueError(f"{source}: no prompts")
    lengths = sorted({len(r) for r in rows})
    if len(lengths) != 1 or lengths[0] == 0:
        raise ValueError(f"{source}: all prompts must be non-empty and of equal length, got lengths {lengths}")
    return np.asarray(rows, dtype=np.int64)


def compute_logits(model_dir: str, tokens: np.ndarray, dtype: str, device: str, batch_size: int) -> np.ndarray:
    """Run the checkpoint on `tokens` [B, T]; returns float32 logits [B, T, V].

    Eager attention keeps the reference math independent of installed fused kernels.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=False)
    vocab = config.get_text_config().vocab_size
    if tokens.min() < 0 or tokens.max() >= vocab:
        raise ValueError(f"token ids must lie in [0, {vocab}), got [{tokens.min()}, {tokens.max()}]")
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, trust_remote_code=False, dtype=getattr(torch, dtype), attn_implementation="eager"
    ).to(device)
    model.eval()
    out = []
    with torch.no_grad():
        for start in range(0, tokens.shape[0], batch_size):
            ids = torch.from_numpy(tokens[start : start + batch_size]).to(device)
            logits = model(input_ids=ids, use_cache=False).logits
            out.append(logits.float().cpu().numpy())
    return np.concatenate(out, axis=0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir", help="Hugging Face model directory (config.json + safetensors)")
    parser.add_argument("--out", required=True, type=Path, help="output .npz file")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--tokens", type=Path, help="token file (.npy, .npz or text, one prompt per line)")
    source.add_argument("--ids", action="append", help="one prompt's token ids, e.g. '1 2 3'; repeatable")
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="model compute dtype")
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda")
    parser.add_argument("--batch-size", type=int, default=1, help="prompts per forward pass")
    parser.add_argument(
        "--allow-fla",
        action="store_true",
        help="let transformers use flash-linear-attention kernels (GPU only; default blocks them)",
    )
    args = parser.parse_args(argv)

    if not args.allow_fla:
        # With triton installed, transformers binds fla's triton kernels at import and CPU forwards
        # crash; blocking the package makes it use its PyTorch reference implementations.
        sys.modules.setdefault("fla", None)
    if args.batch_size < 1:
        parser.error("--batch-size must be >= 1")
    if args.tokens is not None:
        tokens = load_tokens(args.tokens)
    else:
        tokens = stack_rows([parse_ids(text) for text in args.ids], "--ids")

    logits = compute_logits(args.model_dir, tokens, args.dtype, args.device, args.batch_size)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez(args.out, tokens=tokens.astype(np.int32), logits=logits.astype(np.float32))
    print(f"wrote {args.out}: tokens {tokens.shape} int32, logits {logits.shape} float32 "
          f"(std {logits.std():.4f}, max |x| {np.abs(logits).max():.4f})")


if __name__ == "__main__":
    main()
