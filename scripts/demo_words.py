"""How English is the demo's decoded text: the share of its words that occur in the training book.

    python scripts/demo_words.py SAMPLE.txt [--prompt "Alice was"] [--book data/demo/alice.txt]

SAMPLE.txt is what ``python -m k3jax.decode ... stream=false`` printed: the prompt and its
continuation, then the "prefill ... tokens/s" line. Words are runs of letters (with inner
apostrophes), compared in lower case with the words of the book's text between the Project
Gutenberg markers. A model that has learned nothing emits byte soup and scores near 0; one that
learned the book's words scores near 1 even when its sentences wander.
"""
from __future__ import annotations

import argparse
import re
from pathlib import Path

WORD = re.compile(r"[A-Za-z]+(?:'[A-Za-z]+)*")
ROOT = Path(__file__).resolve().parents[1]


def book_words(book: str) -> set[str]:
    text = book.replace("\r\n", "\n")
    start = re.search(r"^\*\*\* START OF .*$", text, re.M)
    end = re.search(r"^\*\*\* END OF .*$", text, re.M)
    body = text[start.end():end.start()] if start and end else text
    return {w.lower() for w in WORD.findall(body)}


def generated_text(decode_stdout: str, prompt: str) -> str:
    """The continuation: the decode output before its timing line, without the prompt."""
    text = decode_stdout.split("\nprefill ", 1)[0]
    return text[len(prompt):] if text.startswith(prompt) else text


def word_fraction(text: str, vocabulary: set[str]) -> tuple[int, int]:
    """(words of ``text`` found in ``vocabulary``, words of ``text``)."""
    words = [w.lower() for w in WORD.findall(text)]
    return sum(w in vocabulary for w in words), len(words)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sample")
    ap.add_argument("--prompt", default="Alice was")
    ap.add_argument("--book", default=str(ROOT / "data" / "demo" / "alice.txt"))
    a = ap.parse_args(argv)
    text = generated_text(Path(a.sample).read_text(encoding="utf-8"), a.prompt)
    found, total = word_fraction(text, book_words(Path(a.book).read_text(encoding="utf-8-sig")))
    share = found / total if total else 0.0
    print(f"{found} of {total} generated words ({100 * share:.0f}%) occur in {Path(a.book).name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
