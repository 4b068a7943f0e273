"""Logits of a Hugging Face model directory on a chat it renders itself (transformers + torch).

    .venv-golden/bin/python scripts/hf_chat_logits.py MODEL_DIR --out FILE.npz

Loads the directory as a user would (``AutoTokenizer`` and ``AutoModelForCausalLM``, no remote
code), renders a fixed two-turn chat with the directory's own chat template
(``apply_chat_template``), and writes ``tokens`` [1, T] and ``logits`` [1, T, V] for
``python -m k3jax.logit_check golden=FILE.npz``. Used by scripts/finetune_tiny.sh to check an
export of a fine-tuned model against the k3jax checkpoint it came from.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_golden_logits import compute_logits  # noqa: E402

CHAT = [{"role": "user", "content": "What is 3 plus 4?"}, {"role": "assistant", "content": "3 plus 4 is 7."},
        {"role": "user", "content": "And 5 plus 2?"}, {"role": "assistant", "content": "5 plus 2 is 7."}]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir")
    ap.add_argument("--out", required=True, type=Path)
    a = ap.parse_args(argv)
    sys.modules.setdefault("fla", None)   # CPU: transformers' reference kernels, never triton's (see make_golden_logits)
    from transformers import AutoTokenizer
    ids = AutoTokenizer.from_pretrained(a.model_dir).apply_chat_template(CHAT, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    tokens = np.asarray([ids], np.int64)
    logits = compute_logits(a.model_dir, tokens, "float32", "cpu", 1)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez(a.out, tokens=tokens.astype(np.int32), logits=logits.astype(np.float32))
    print(f"wrote {a.out}: {tokens.shape[1]} chat-template tokens, logits {logits.shape} "
          f"(std {logits.std():.4f}, max |x| {np.abs(logits).max():.4f})")


if __name__ == "__main__":
    main()
