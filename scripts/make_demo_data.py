"""Regenerate the demo's training documents and tokenizer from the committed book.

    python scripts/make_demo_data.py            # writes data/demo/alice.jsonl and data/demo/tokenizer/

Input: ``data/demo/alice.txt``, Project Gutenberg EBook #11 exactly as shipped in the wordcloud
1.9.6 sdist (see data/demo/README.md). Outputs, both committed so that neither set-up nor CI
retrains anything:

- ``alice.jsonl``: one ``{"text": paragraph}`` per paragraph of the book between Gutenberg's START
  and END markers (the licence header and footer are not training text); hard line breaks inside
  a paragraph become spaces, so a document is prose as a reader sees it.
- ``tokenizer/``: a byte-level BPE tokenizer in the Kimi tiktoken layout (``tiktoken.model`` +
  ``tokenizer_config.json`` with the reserved block and chat template), learned on the same
  paragraphs by ``k3jax.data.tiny_tokenizer`` with Kimi's pre-tokenisation regex. The demo reads it
  through ``tokenizer_path``, the code path of the real Kimi tokenizer.

Deterministic: the merge order breaks ties by the smallest pair, so a rerun writes identical bytes.
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from k3jax.data import tiny_tokenizer

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "data" / "demo"
VOCAB_SIZE = 1024   # the demo model's vocab_size (scripts/demo.sh); 256 bytes + merges + reserved


def paragraphs(book: str) -> list[str]:
    """The book's paragraphs between the Gutenberg markers, each on one line."""
    text = book.lstrip("\ufeff").replace("\r\n", "\n")
    start = re.search(r"^\*\*\* START OF .*\*\*\*$", text, re.M)
    end = re.search(r"^\*\*\* END OF .*\*\*\*$", text, re.M)
    if not (start and end):
        raise SystemExit("alice.txt has no Project Gutenberg START/END markers; is it the committed file?")
    body = text[start.end():end.start()]
    return [" ".join(p.split()) for p in re.split(r"\n\s*\n", body) if p.strip()]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--book", default=str(DEMO / "alice.txt"))
    ap.add_argument("--out", default=str(DEMO))
    ap.add_argument("--vocab_size", type=int, default=VOCAB_SIZE)
    a = ap.parse_args(argv)
    paras = paragraphs(Path(a.book).read_text(encoding="utf-8"))
    out = Path(a.out)
    with (out / "alice.jsonl").open("w", encoding="utf-8") as f:
        for p in paras:
            f.write(json.dumps({"text": p}, ensure_ascii=False) + "\n")
    reserved = tiny_tokenizer.MIN_RESERVED   # room for Kimi's special-token layout, the rest merges
    tiny_tokenizer.build(out / "tokenizer", vocab_size=a.vocab_size, num_reserved=reserved,
                         corpus="\n".join(paras), num_merges=a.vocab_size - 256 - reserved)
    print(f"wrote {out / 'alice.jsonl'} ({len(paras)} paragraphs) and {out / 'tokenizer'} "
          f"(vocab {a.vocab_size}: 256 bytes, {a.vocab_size - 256 - reserved} merges, {reserved} reserved)")


if __name__ == "__main__":
    main()
