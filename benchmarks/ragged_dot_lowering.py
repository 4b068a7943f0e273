"""Does the backend's ragged_dot run every group on every row? The MoE's grouped matmul, checked.

`moe_impl=auto` picks `jax.lax.ragged_dot` on GPU and TPU on the premise that their compilers
lower it as a grouped matmul; XLA:CPU does not (it computes every group on every row and masks,
docs/moe.md), which is why CPU gets `blocked`. This compiles ragged_dot with G groups over M rows
(rows spread evenly over the groups) beside the one dense [M, K] x [K, N] matmul that does the same
useful work, and reports from the compiled programs:
  flops x      the compiler's FLOP count of ragged_dot over the dense matmul's (cost_analysis;
               about G when every group meets every row, about 1 when grouped)
  time x       their measured time ratio (median of --repeats)
  dots         dot / ragged-dot / custom-call instruction counts in ragged_dot's optimized HLO
and a verdict: "grouped" when both ratios stay under G / 4, else "every group on every row".

    .venv/bin/python benchmarks/ragged_dot_lowering.py                  # CPU: the known answer
    python benchmarks/ragged_dot_lowering.py --gpu                       # on the card
Results: stdout table and benchmarks/results/ragged_dot_lowering.json.
"""
from __future__ import annotations

import argparse
import re
import sys

from common import machine, median_time, print_table, result_path, select_platform, write_json


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=None, help="M (default: 16384 on GPU, 2048 elsewhere)")
    p.add_argument("--dims", type=int, nargs=2, default=None, metavar=("K", "N"),
                   help="default: 2048 1024 on GPU, 256 256 elsewhere")
    p.add_argument("--groups", type=int, default=64)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None, help="default: bf16 on GPU, else f32")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--gpu", action="store_true", help="run on the GPU")
    p.add_argument("--dry-run", action="store_true", help="with --gpu: the same on the host CPU")
    p.add_argument("--out", default=result_path("ragged_dot_lowering"))
    a = p.parse_args(argv)
    select_platform(sys.argv[1:] if argv is None else argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    on_gpu = jax.default_backend() == "gpu"
    m = a.rows or (16384 if on_gpu else 2048)
    k, n = a.dims or ((2048, 1024) if on_gpu else (256, 256))
    g = a.groups
    dtype = jnp.dtype(a.dtype or ("bfloat16" if on_gpu else "float32"))
    if m % g:
        raise SystemExit(f"error: --rows {m} must be a multiple of --groups {g}")
    r = np.random.default_rng(0)
    x = jnp.asarray(r.normal(size=(m, k)), dtype)
    w = jnp.asarray(r.normal(size=(g, k, n)) * k ** -0.5, dtype)
    sizes = jnp.full((g,), m // g, jnp.int32)

    ragged = jax.jit(lambda x, w, s: jax.lax.ragged_dot(x, w, s))
    dense = jax.jit(lambda x, w: x @ w[0])
    rows = []
    for name, fn, args in (("ragged_dot", ragged, (x, w, sizes)), ("dense", dense, (x, w))):
        compiled = fn.lower(*args).compile()
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        hlo = compiled.as_text()
        sec, _ = median_time(lambda: jax.block_until_ready(compiled(*args)), warmup=1, repeats=a.repeats)
        rows.append({"program": name, "gflop": float((cost or {}).get("flops", 0.0)) / 1e9, "ms": 1e3 * sec,
                     "dot": len(re.findall(r"= \S+ dot\(", hlo)), "ragged_dot": len(re.findall(r"ragged-dot\(", hlo)),
                     "custom_call": len(re.findall(r"custom-call\(", hlo))})
    rd, de = rows
    flops_x = rd["gflop"] / de["gflop"] if de["gflop"] else None
    time_x = rd["ms"] / de["ms"]
    grouped = time_x < g / 4 and (flops_x is None or flops_x < g / 4)
    verdict = "grouped" if grouped else "every group on every row"
    for row in rows:
        row["flops_x"] = row["gflop"] / de["gflop"] if de["gflop"] else None
        row["time_x"] = row["ms"] / de["ms"]
    print(f"ragged_dot on {jax.devices()[0].device_kind}: M={m} K={k} N={n} G={g} {dtype.name}, "
          f"{a.repeats} repeats")
    print_table(rows, [("program", "program", "s"), ("GFLOP", "gflop", ".3g"), ("flops x", "flops_x", ".2f"),
                       ("ms", "ms", ".3f"), ("time x", "time_x", ".2f"), ("dot", "dot", "d"),
                       ("ragged-dot", "ragged_dot", "d"), ("custom-call", "custom_call", "d")])
    print(f"verdict: {verdict} (flops x {flops_x if flops_x is None else round(flops_x, 2)}, "
          f"time x {time_x:.2f}, G={g})")
    write_json(a.out, {"benchmark": "ragged_dot_lowering", "machine": machine(), "dry_run": a.dry_run,
                       "shape": {"M": m, "K": k, "N": n, "G": g, "dtype": dtype.name}, "rows": rows,
                       "flops_x": flops_x, "time_x": time_x, "verdict": verdict})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
