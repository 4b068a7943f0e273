"""deepseek3-tiny train steps: MaxText and k3jax alternately in one run, tokens/s and their ratio.

Each round runs MaxText's trainer and then ours, each as a fresh process on the same CPU (one
device), with the same model and training settings: MaxText's deepseek3-tiny cut to 4 layers (1
dense) and a 32000 vocabulary (configs/models/deepseek3-tiny.yml is that shape), per-device batch 2
x 256 tokens, float32 activations and weights, scanned layers, full remat, Muon with QK-clip,
synthetic data, no checkpoints. Each side keeps its own kernel defaults for the CPU (ours:
``moe_impl=auto`` is the blocked grouped matmul there), plus ``--ours-set`` (default: nothing).

  MaxText   ``python -m maxtext.trainers.pre_train.train`` in its own venv (``--maxtext-python``;
            ``pip install "maxtext[tpu]==0.2.5"`` into a Python 3.12 venv) with ``hardware=cpu
            skip_jax_distributed_system=True``; tokens/s per step read from its log lines
            (``Tokens/s/device``), the first ``--skip`` steps (compilation) dropped, the median kept.
  k3jax     ``benchmarks/train_step.py --config deepseek3-tiny`` (the real jitted train step of
            ``python -m k3jax.train``), ``--steps - --skip`` timed steps after ``--skip`` warm-up
            steps, the median step time.

Alternating rounds put both sides under the same slice of a shared machine's load; the ratio of the
medians over all rounds is printed with each round's figures.

    .venv/bin/python benchmarks/train_vs_maxtext.py --maxtext-python /work/venv-maxtext/bin/python
Results: stdout table and benchmarks/results/train_vs_maxtext.json (--out to change).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

from common import machine, print_table, result_path, write_json

HERE = os.path.dirname(os.path.abspath(__file__))
SHARED = {"per_device_batch_size": "2", "max_target_length": "256", "dtype": "float32",
          "weight_dtype": "float32", "scan_layers": "true", "remat_policy": "full", "opt_type": "muon",
          "use_qk_clip": "true"}
MAXTEXT_MODEL = ["model_name=deepseek3-tiny", "base_num_decoder_layers=4", "first_num_dense_layers=1",
                 "vocab_size=32000", "override_model_config=True"]
TOKENS = re.compile(r"completed step: (\d+), seconds: ([0-9.]+).*?Tokens/s/device: ([0-9.]+)")


def run_maxtext(python: str, steps: int, skip: int, workdir: str, extra: list[str]) -> dict:
    code = ("import os, maxtext; print(os.path.join(os.path.dirname(maxtext.__file__), 'configs', 'base.yml'))")
    base = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    args = [python, "-m", "maxtext.trainers.pre_train.train", base, *MAXTEXT_MODEL,
            *[f"{k}={'True' if v == 'true' else v}" for k, v in SHARED.items()],
            "hardware=cpu", "skip_jax_distributed_system=True", "dataset_type=synthetic", f"steps={steps}",
            "enable_checkpointing=False", f"base_output_directory={workdir}", f"run_name=mt{time.time_ns()}", *extra]
    t0 = time.perf_counter()
    out = subprocess.run(args, capture_output=True, text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    wall = time.perf_counter() - t0
    log = out.stdout + out.stderr
    rows = [(int(s), float(sec), float(tok)) for s, sec, tok in TOKENS.findall(log)]
    if out.returncode or len(rows) <= skip:
        sys.exit(f"error: MaxText run failed (exit {out.returncode}, {len(rows)} step lines); its log ends:\n"
                 + log[-3000:])
    timed = rows[skip:]
    return {"tokens_per_s": statistics.median(r[2] for r in timed), "step_s": statistics.median(r[1] for r in timed),
            "steps_timed": len(timed), "wall_s": wall}


def run_ours(steps: int, skip: int, extra: list[str], workdir: str) -> dict:
    out_json = os.path.join(workdir, f"ours{time.time_ns()}.json")
    args = [sys.executable, os.path.join(HERE, "train_step.py"), "--config", "deepseek3-tiny",
            "--warmup", str(skip), "--repeats", str(steps - skip), "--out", out_json,
            "--set", *[f"{k}={v}" for k, v in SHARED.items()], *extra]
    t0 = time.perf_counter()
    out = subprocess.run(args, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if out.returncode:
        sys.exit(f"error: k3jax run failed (exit {out.returncode}); its log ends:\n" + (out.stdout + out.stderr)[-3000:])
    with open(out_json) as fh:
        row = json.load(fh)["rows"][0]
    return {"tokens_per_s": row["tokens_per_s"], "step_s": row["step_s"], "steps_timed": len(row["step_times_s"]),
            "wall_s": wall}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--maxtext-python", required=True, help="python of the venv where maxtext 0.2.5 is installed")
    p.add_argument("--rounds", type=int, default=2, help="MaxText-then-k3jax rounds")
    p.add_argument("--steps", type=int, default=12, help="train steps per run (both sides)")
    p.add_argument("--skip", type=int, default=2, help="first steps of each run not timed (compilation)")
    p.add_argument("--maxtext-set", nargs="*", default=["sparse_matmul=False"], metavar="KEY=VALUE",
                   help="extra MaxText overrides (default: its dense MoE matmul; its megablox kernel is "
                        "a TPU Pallas kernel)")
    p.add_argument("--ours-set", nargs="*", default=[], metavar="KEY=VALUE",
                   help="extra k3jax config overrides")
    p.add_argument("--out", default=result_path("train_vs_maxtext"))
    a = p.parse_args(argv)
    if a.steps <= a.skip or a.skip < 1 or a.rounds < 1:
        p.error("need --rounds >= 1, --skip >= 1 and --steps > --skip")
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for r in range(a.rounds):
            for side in ("MaxText", "k3jax"):
                load = os.getloadavg()[0]
                res = (run_maxtext(a.maxtext_python, a.steps, a.skip, work, a.maxtext_set) if side == "MaxText"
                       else run_ours(a.steps, a.skip, a.ours_set, work))
                rows.append({"round": r + 1, "side": side, "load": load, **res})
                print(f"round {r + 1} {side}: {res['tokens_per_s']:.0f} tokens/s (load {load:.1f})", flush=True)
    mt = statistics.median(x["tokens_per_s"] for x in rows if x["side"] == "MaxText")
    ours = statistics.median(x["tokens_per_s"] for x in rows if x["side"] == "k3jax")
    print(f"\ndeepseek3-tiny (4 layers, vocab 32000), 2 x 256 tokens, f32, Muon + QK-clip, remat full, scan; "
          f"median of {a.steps - a.skip} steps per run; MaxText {' '.join(a.maxtext_set) or '(defaults)'}; "
          f"k3jax --set {' '.join(a.ours_set) or '(none)'}")
    print_table(rows, [("round", "round", "d"), ("side", "side", "s"), ("tokens/s", "tokens_per_s", ".0f"),
                       ("load at start", "load", ".1f"), ("run wall s", "wall_s", ".0f")])
    print(f"\nk3jax / MaxText tokens/s (medians over rounds): {ours:.0f} / {mt:.0f} = {ours / mt:.2f}x")
    write_json(a.out, {"benchmark": "train_vs_maxtext", "machine": machine(), "settings": SHARED,
                       "maxtext_model": MAXTEXT_MODEL, "maxtext_set": a.maxtext_set, "ours_set": a.ours_set, "rows": rows,
                       "maxtext_tokens_per_s": mt, "k3jax_tokens_per_s": ours, "ratio": ours / mt})


if __name__ == "__main__":
    main()
