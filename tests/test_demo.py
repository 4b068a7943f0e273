"""``make demo`` on a shorter run: scripts/demo.sh itself, with the committed book and its tokenizer
(read through tokenizer_path, the real Kimi tokenizer's code path), on a 5-layer variant of the
demo model for 120 steps instead of the 13-layer model's 400. It must checkpoint, write the loss
curve, and continue "Alice was" with words of the book: the full demo reaches >= 70% of its
generated words in the book (README); this run must reach 50%. A model that learned nothing
emits byte-pair fragments that glue into non-words (well under 50%)."""
import os
import re
import subprocess
import sys
from pathlib import Path

from xla_flags import TEST_COMPILE_FLAGS

ROOT = Path(__file__).resolve().parents[1]


def test_demo_learns_words_of_the_book(tmp_path):
    env = dict(os.environ, PY=sys.executable, OUT=str(tmp_path), RUN="short", STEPS="120",
               EXTRA="num_layers=5 mla_extra_layers=[4] attn_res_block_size=4", JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = TEST_COMPILE_FLAGS   # one CPU device, as make demo has
    p = subprocess.run(["bash", "scripts/demo.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    run = tmp_path / "short"
    assert (run / "checkpoints" / "120" / "params").is_dir()
    assert (run / "curves.png").read_bytes().startswith(b"\x89PNG") and f"wrote {run / 'curves.png'}" in p.stdout
    sample = (run / "sample.txt").read_text()
    assert sample.startswith("Alice was") and len(sample.split("\nprefill")[0]) > len("Alice was") + 20, sample
    found, total = map(int, re.search(r"(\d+) of (\d+) generated words", p.stdout).groups())
    assert total >= 8 and found / total >= 0.5, sample
