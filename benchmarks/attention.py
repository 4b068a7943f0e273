"""MLA prefill attention, forward+backward per implementation: the evidence behind attention_impl=auto.

Times the jitted gradient (wrt q, k, v) of sum(o^2) for each ``attention_impl`` that runs on the
default backend, at the default model's shape and at a K3-like MLA shape (qk head 192, v head 128),
one document per row, f32 unless ``--dtype``. ``cudnn`` runs only on a GPU (bf16/fp16); on other
backends its same call is timed with ``implementation="xla"`` (row ``cudnn_xla``), which says
nothing about cuDNN's speed.

    .venv/bin/python benchmarks/attention.py                 # CPU: table + JSON
    .venv/bin/python benchmarks/attention.py --dtype bfloat16 --gpu
Results: stdout table and benchmarks/results/attention.json.
"""
from __future__ import annotations

import argparse
import sys

from common import machine, median_time, print_table, result_path, select_platform, write_json

SHAPES = {"default": (2, 64, 2, 24, 16), "k3_mla_t2048": (1, 2048, 8, 192, 128)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--gpu", action="store_true", help="run on the GPU (default: the host CPU)")
    p.add_argument("--out", default=result_path("attention"))
    a = p.parse_args(argv)
    select_platform(sys.argv[1:] if argv is None else argv)

    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np

    from k3jax.kernels.attention.prefill import blocked_attention
    from k3jax.kernels.attention.reference import causal_attention
    from k3jax.kernels.attention.cudnn import cudnn_attention

    impls = {"jnp": causal_attention, "blocked": blocked_attention}
    if jax.default_backend() == "gpu":
        impls["cudnn"] = cudnn_attention
    else:
        impls["cudnn_xla"] = functools.partial(cudnn_attention, implementation="xla")
    dtype = jnp.dtype(a.dtype)
    rows = []
    for name in a.shapes:
        b, t, h, dqk, dv = SHAPES[name]
        r = np.random.default_rng(0)
        q, k = (jnp.asarray(r.normal(size=(b, t, h, dqk)), dtype) for _ in range(2))
        v = jnp.asarray(r.normal(size=(b, t, h, dv)), dtype)
        seg = jnp.ones((b, t), jnp.int32)
        row = {"shape": name, "B,T,H,dqk,dv": f"{b},{t},{h},{dqk},{dv}"}
        for impl, fn in impls.items():
            grad = jax.jit(jax.grad(lambda q, k, v, fn=fn: jnp.sum(fn(q, k, v, seg, scale=dqk ** -0.5)[0]
                                                                    .astype(jnp.float32) ** 2), (0, 1, 2)))
            sec, _ = median_time(lambda: jax.block_until_ready(grad(q, k, v)), warmup=1, repeats=a.repeats)
            row[f"{impl}_ms"] = 1e3 * sec
        row["blocked_vs_jnp"] = row["blocked_ms"] / row["jnp_ms"]
        rows.append(row)
    print(f"attention fwd+bwd median ms, {a.dtype}, {a.repeats} repeats")
    print_table(rows, [("shape", "shape", "s"), ("B,T,H,dqk,dv", "B,T,H,dqk,dv", "s")]
                + [(f"{i} ms", f"{i}_ms", ".2f") for i in impls] + [("blocked / jnp", "blocked_vs_jnp", ".2f")])
    write_json(a.out, {"benchmark": "attention", "machine": machine(), "dtype": a.dtype, "repeats": a.repeats,
                       "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
