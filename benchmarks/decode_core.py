"""Decode speed through the inference core vs the left-padded ``while_loop`` path it replaced,
side by side in one run (one CPU device; this machine is shared, so only the ratio means much).

The baseline is ``generate`` of src/k3jax/decode.py at git revision --baseline (the last revision
that had it), loaded from git into a temporary module; the core is
``k3jax.inference.generate.generate``. Both run greedy on the same random prompts of --prompt-len
tokens, --new-tokens per row, no stop ids (every row runs to the end), compile excluded (a first
call compiles; then --repeats calls alternate between the two paths). Reported: each path's
median prefill and decode tokens/s, and core / baseline.

    .venv/bin/python benchmarks/decode_core.py                      # tiny, batch 1 / 8 / 32
    .venv/bin/python benchmarks/decode_core.py --config small --batch 1 8 32
Results: stdout table and benchmarks/results/decode_core.json (--out to change).
"""
from __future__ import annotations

import argparse
import importlib.util
import pathlib
import statistics
import subprocess
import sys
import tempfile

from common import cpu_only, machine, print_table, result_path, write_json

cpu_only()

import jax  # noqa: E402
import numpy as np  # noqa: E402

from k3jax import config as C  # noqa: E402
from k3jax.inference.generate import generate  # noqa: E402
from k3jax.sharding import make_mesh  # noqa: E402
from k3jax.state import init_state  # noqa: E402
from flax import nnx  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[1]
BASELINE = "d169a77"   # the last revision whose k3jax/decode.py holds the while_loop generate


def _module_at(rev: str, path: str, name: str, replace=()):
    src = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=REPO, capture_output=True, text=True,
                         check=True).stdout
    for a, b in replace:
        src = src.replace(a, b)
    file = pathlib.Path(tempfile.mkdtemp()) / f"{name}.py"
    file.write_text(src)
    spec = importlib.util.spec_from_file_location(name, file)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def baseline_generate(rev: str):
    """The ``generate`` of k3jax/decode.py at ``rev``, with that revision's k3jax/sampling.py (both
    read from git, unchanged but for the one import that names the other)."""
    _module_at(rev, "src/k3jax/sampling.py", "sampling_baseline")
    return _module_at(rev, "src/k3jax/decode.py", "decode_baseline",
                      [("from k3jax.sampling import sample", "from sampling_baseline import sample")]).generate


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--baseline", default=BASELINE)
    ap.add_argument("--out", default=result_path("decode_core"))
    a = ap.parse_args(argv)
    old = baseline_generate(a.baseline)
    cfg = C.load(overrides=[f"model_name={a.config}", "dtype=float32", "weight_dtype=float32"])
    mesh = make_mesh(cfg, jax.devices()[:1])
    gdef, st, _ = init_state(cfg, mesh, seed=0)
    model = nnx.merge(gdef, st["params"], st["rest"])
    rows = []
    for b in a.batch:
        rng = np.random.default_rng(b)
        prompts = rng.integers(1, cfg.model.vocab_size, size=(b, a.prompt_len)).tolist()
        runs = {"loop": old, "core": generate}
        got = {k: [] for k in runs}
        outs = {}
        with jax.set_mesh(mesh):
            for name, fn in runs.items():           # compile
                outs[name] = fn(model, prompts, max_new_tokens=a.new_tokens)[0]
            for _ in range(a.repeats):
                for name, fn in runs.items():
                    got[name].append(fn(model, prompts, max_new_tokens=a.new_tokens)[1])
        row = {"batch": b, "prompt_len": a.prompt_len, "new_tokens": a.new_tokens,
               "same_tokens": bool((outs["loop"] == outs["core"]).all())}
        for name in runs:
            row[f"{name}_prefill_tok_s"] = statistics.median(t["prefill_tokens_per_s"] for t in got[name])
            row[f"{name}_decode_tok_s"] = statistics.median(t["decode_tokens_per_s"] for t in got[name])
        row["decode_ratio"] = row["core_decode_tok_s"] / row["loop_decode_tok_s"]
        row["prefill_ratio"] = row["core_prefill_tok_s"] / row["loop_prefill_tok_s"]
        rows.append(row)
        print(row, file=sys.stderr, flush=True)
    print_table(rows, [("batch", "batch", "d"), ("loop decode tok/s", "loop_decode_tok_s", ".0f"),
                       ("core decode tok/s", "core_decode_tok_s", ".0f"), ("decode core/loop", "decode_ratio", ".2f"),
                       ("loop prefill tok/s", "loop_prefill_tok_s", ".0f"),
                       ("core prefill tok/s", "core_prefill_tok_s", ".0f"), ("prefill core/loop", "prefill_ratio", ".2f"),
                       ("same tokens", "same_tokens", "")])
    write_json(a.out, {"machine": machine(), "args": vars(a), "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
