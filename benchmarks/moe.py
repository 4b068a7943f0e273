"""MoE forward+backward throughput per implementation, and EP communication volume for K3.

Part 1 times `jax.value_and_grad` (wrt x, routing weights and the three expert weights) of:
  ragged_dot   dispatch.moe_dropless(impl="ragged_dot")
  tokamax      dispatch.moe_dropless(impl="tokamax_ragged_dot") (tokamax.ragged_dot: its XLA op
               off TPU, the Mosaic kernel on TPU)
  dense        dispatch.moe_dense_reference (every expert on every token)
  capacity     dispatch.moe_capacity(capacity_factor=1.25)
  megablox     dispatch.moe_dropless(impl="megablox"), interpret mode off TPU (--megablox)
at one small shape on the default backend (CPU here: relative numbers only; XLA:CPU lowers
ragged_dot to ~G dense matmuls, ecosystem.md §4, so nothing about TPU speed follows).

Part 2 is analytic: bytes a device sends per token for expert-parallel dispatch + combine at the
K3 routed-expert shape (latent D = 3584, top-16, 896 experts, expert axis 32, bf16), forward and
backward, dropless vs capacity (expert_parallel.dispatch_bytes_per_token).

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/moe.py               # table + JSON
    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/moe.py --megablox    # adds interpret megablox
Results: stdout table and benchmarks/results/moe.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "src"))  # run as a script without installing

from k3jax.kernels.moe.dispatch import moe_capacity, moe_dense_reference, moe_dropless  # noqa: E402
from k3jax.kernels.moe.expert_parallel import dispatch_bytes_per_token  # noqa: E402
from k3jax.kernels.moe.routing import route  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "moe.json")
K3 = dict(d_model=3584, top_k=16, num_experts=896, ep=32, bytes_per_elem=2)


def swiglu(g, u):
    return jax.nn.silu(g) * u


def _impls(megablox: bool, interpret: bool):
    impls = {
        "ragged_dot": lambda *a: moe_dropless(*a, swiglu, impl="ragged_dot"),
        "tokamax": lambda *a: moe_dropless(*a, swiglu, impl="tokamax_ragged_dot"),
        "dense": lambda *a: moe_dense_reference(*a, swiglu),
        "capacity": lambda *a: moe_capacity(*a, swiglu, capacity_factor=1.25)[0],
    }
    if megablox:
        impls["megablox"] = lambda *a: moe_dropless(*a, swiglu, impl="megablox",
                                                    interpret=interpret)
    return impls


def _problem(n, d, f, e, k, dtype):
    ks = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(ks[0], (n, d)).astype(dtype)
    w_gate = (jax.random.normal(ks[1], (e, d, f)) * d ** -0.5).astype(dtype)
    w_up = (jax.random.normal(ks[2], (e, d, f)) * d ** -0.5).astype(dtype)
    w_down = (jax.random.normal(ks[3], (e, f, d)) * f ** -0.5).astype(dtype)
    weights, idx = route(jax.random.normal(ks[4], (n, e)), None, top_k=k)
    return x, weights, idx, w_gate, w_up, w_down


def _time(fn, args, repeats):
    def loss(x, w, wg, wu, wd, idx):
        return jnp.sum(fn(x, w, idx, wg, wu, wd) ** 2)

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))
    x, w, idx, wg, wu, wd = args
    t0 = time.perf_counter()
    jax.block_until_ready(step(x, w, wg, wu, wd, idx))                  # compile + first run
    compile_s = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(step(x, w, wg, wu, wd, idx))
        times.append(time.perf_counter() - t0)
    return statistics.median(times), compile_s


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--d-ff", type=int, default=512)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--megablox", action="store_true", help="also time megablox (slow off TPU)")
    p.add_argument("--out", default=RESULTS)
    a = p.parse_args(argv)

    backend = jax.default_backend()
    interpret = backend != "tpu"
    args = _problem(a.tokens, a.d_model, a.d_ff, a.experts, a.top_k, jnp.dtype(a.dtype))
    rows = []
    for name, fn in _impls(a.megablox, interpret).items():
        sec, compile_s = _time(fn, args, a.repeats)
        rows.append({"impl": name, "step_s": sec, "compile_s": compile_s,
                     "tokens_per_s": a.tokens / sec,
                     "interpret": interpret if name == "megablox" else None})
    base = next(r["tokens_per_s"] for r in rows if r["impl"] == "ragged_dot")
    for r in rows:
        r["vs_ragged_dot"] = r["tokens_per_s"] / base

    shape = f"N={a.tokens} D={a.d_model} F={a.d_ff} E={a.experts} k={a.top_k} {a.dtype}"
    print(f"MoE forward+backward on {backend} ({os.cpu_count()} cores), {shape}")
    print(f"{'impl':<20}{'step ms':>10}{'tokens/s':>12}{'vs ragged':>11}{'compile s':>11}")
    for r in rows:
        name = r["impl"] + (" (interp)" if r["interpret"] else "")
        print(f"{name:<20}{1e3 * r['step_s']:>10.1f}{r['tokens_per_s']:>12.0f}"
              f"{r['vs_ragged_dot']:>11.2f}{r['compile_s']:>11.1f}")

    comm = {}
    for mode, cf in (("dropless", 1.0), ("capacity", 1.25)):
        comm[mode] = dict(capacity_factor=cf if mode == "capacity" else None,
                          **dispatch_bytes_per_token(
                              d_model=K3["d_model"], top_k=K3["top_k"], ep=K3["ep"],
                              bytes_per_elem=K3["bytes_per_elem"], mode=mode,
                              capacity_factor=cf))
    print(f"\nEP dispatch+combine bytes per token, K3 shape (D={K3['d_model']}, top-"
          f"{K3['top_k']}, {K3['num_experts']} experts, expert axis {K3['ep']}, bf16)")
    print(f"{'mode':<20}{'forward KB':>12}{'backward KB':>13}{'total KB':>10}")
    for mode, v in comm.items():
        label = mode + (f" cf={v['capacity_factor']}" if v["capacity_factor"] else "")
        print(f"{label:<20}{v['forward'] / 1e3:>12.1f}{v['backward'] / 1e3:>13.1f}"
              f"{v['total'] / 1e3:>10.1f}")

    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as fh:
        json.dump({"benchmark": "moe", "backend": backend, "cpu_count": os.cpu_count(),
                   "shape": dict(tokens=a.tokens, d_model=a.d_model, d_ff=a.d_ff,
                                 experts=a.experts, top_k=a.top_k, dtype=a.dtype),
                   "repeats": a.repeats, "rows": rows,
                   "ep_comm_k3": dict(shape=K3, **comm)}, fh, indent=2)
    print(f"\nwrote {a.out}")


if __name__ == "__main__":
    main()
