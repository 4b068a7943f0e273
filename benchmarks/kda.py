"""KDA core: reference (token-serial scan) vs chunked (WY/UT + chunk walk) vs tokamax's xla_chunked.

Part 1 times, jitted, best of N after a warm-up run, at B=1, H=4, K=V=128, f32 and
T in {512, 2048, 8192}, each implementation in the same process on the same inputs:
  fwd      kda(q, k, v, g, beta) -> (o, final_state)
  fwd+bwd  jax.grad of sum(o * c) + sum(S * c_S) wrt q, k, v, the gate, beta and the initial state
and the speed-ups reference / chunked and tokamax / chunked. The gate is K3's bounded gate
g = -5 * sigmoid(f) of a random pre-activation f (a_log = 0, dt_bias = 0): ours compute g from f
inside the timed function ("chunked" with lower_bound=-5 as the K3 layer passes it, so its
bounded relation form; "chunked_general" without, the form any gate <= 0 gets), tokamax (kda_impl=tokamax's xla_chunked path, no segment ids, so its
fixed-length path) fuses it into its kernel.
Part 2 reports the temp memory XLA plans for the chunked fwd+bwd (compile().memory_analysis()),
which must grow linearly in T (the residuals are the inputs and T/C chunk states; the rest is
a fixed per-scan-step working set), shown as the marginal bytes per token between lengths.
Part 3 is analytic: matmul FLOPs per token of one chunked forward at the K3 shape
(H=96, K=V=128, C=64), `chunked.chunked_flops_per_token`, for MFU accounting.

On CPU the numbers are relative only; nothing about TPU speed follows.

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/kda.py                     # table + JSON
    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/kda.py --lengths 512 2048 --repeats 2

GPU mode (--gpu; scripts/gpu_check.sh): jax on the CUDA card (common.GPU_XLA_FLAGS), the shape of
the fla comparison (B=1, H=16, K=V=128, T in {2048, 8192}), q, k, v, the gate pre-activation and
beta in bfloat16 (the gate g = -5 sigmoid(f) and beta enter the core in f32, the initial state is
f32, as fla asserts), "chunked" only by default, median of --repeats after two warm-up calls.
--save-io DIR writes each length's inputs, cotangents, the chunked core's outputs and gradients
as float32 .npy (the bf16 values exactly) for benchmarks/kda_fla.py, which runs fla's Triton
chunk_kda on the same inputs in a torch process and compares. --dry-run: the GPU mode on the host
CPU (CI, small T).

    python benchmarks/kda.py --gpu --save-io /tmp/kda_io --out /tmp/kda_gpu.json
    python benchmarks/kda_fla.py /tmp/kda_io --out /tmp/kda_fla.json
Results: stdout table and benchmarks/results/kda.json (--out to change).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

from common import gpu_mode, machine, select_platform, write_json  # also puts src/ on sys.path

select_platform()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from k3jax.kernels.kda.chunked import chunked_flops_per_token, kda_chunked, valid_chunk_size  # noqa: E402
from k3jax.kernels.kda.reference import kda_reference  # noqa: E402
from k3jax.kernels.kda.tokamax import kda_tokamax  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "kda.json")
K3 = dict(H=96, K=128, V=128, chunk=64)


def _problem(T, H, K, V, dtype=jnp.float32):
    ks = jax.random.split(jax.random.key(0), 8)
    nrm = lambda x: x / jnp.sqrt(jnp.sum(x * x, -1, keepdims=True) + 1e-6)  # noqa: E731
    q = nrm(jax.random.normal(ks[0], (1, T, H, K)))
    k = nrm(jax.random.normal(ks[1], (1, T, H, K)))
    v = jax.random.normal(ks[2], (1, T, H, V))
    f = jax.random.normal(ks[3], (1, T, H, K))          # gate pre-activation: g = -5 sigmoid(f)
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (1, T, H)))
    h0 = jax.random.normal(ks[5], (1, H, K, V)) * 0.1
    co = jax.random.normal(ks[6], (1, T, H, V))
    cs = jax.random.normal(ks[7], (1, H, K, V))
    low = lambda x: x.astype(dtype)  # noqa: E731   the state and its cotangent stay f32
    return (low(q), low(k), low(v), low(f), low(beta), h0), (low(co), cs)


def _bounded(kda):
    """A core of the common signature fed the K3 gate of f (A = exp(0) = 1, dt_bias = 0)."""
    return lambda q, k, v, f, beta, **kw: kda(q, k, v, -5.0 * jax.nn.sigmoid(f.astype(jnp.float32)),
                                              beta.astype(jnp.float32), **kw)


def _tokamax(q, k, v, f, beta, **kw):
    H, K = q.shape[2], q.shape[3]
    return kda_tokamax(q, k, v, f, beta, a_log=jnp.zeros(H), dt_bias=jnp.zeros((H, K)), lower_bound=-5.0,
                       implementation="xla_chunked", **kw)


def _fns(kda):
    def fwd(q, k, v, f, beta, h0):
        return kda(q, k, v, f, beta, initial_state=h0)

    def loss(args, cots):
        o, S = fwd(*args)
        return jnp.sum(o * cots[0]) + jnp.sum(S * cots[1])

    return jax.jit(fwd), jax.jit(jax.grad(loss))


def _best(fn, args, repeats, median=False):
    # Two warm-up calls: tokamax's op traces again on the second call of a fresh jitted function
    # (its jit cache holds 2 entries afterwards), which would otherwise land in the timing.
    for _ in range(2):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) if median else min(times)


def _compiled(fwd, grad, inputs, cots):
    """GPU mode: each program compiled once, ahead of the calls, and reused for the timing, the
    memory plan and the saved outputs (no second compile for memory_analysis)."""
    f, g = fwd.lower(*inputs).compile(), grad.lower(inputs, cots).compile()
    return f, g, g


def _save_io(io_dir, T, inputs, cots, fwd, grad):
    """T<T>_<name>.npy, float32: inputs, cotangents, the core's (o, S) and its gradients."""
    os.makedirs(io_dir, exist_ok=True)
    o, S = fwd(*inputs)
    grads = grad(inputs, cots)
    named = dict(zip(("q", "k", "v", "f", "beta", "h0"), inputs)) | {"co": cots[0], "cs": cots[1], "o": o, "S": S}
    named |= {f"d{n}": x for n, x in zip(("q", "k", "v", "f", "beta", "h0"), grads)}
    for name, x in named.items():
        np.save(os.path.join(io_dir, f"T{T}_{name}.npy"), np.asarray(jnp.asarray(x, jnp.float32)))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=None, help="default 512 2048 8192; --gpu 2048 8192")
    ap.add_argument("--heads", type=int, default=None, help="default 4; --gpu 16")
    ap.add_argument("--dim", type=int, default=128, help="K = V")
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--gpu", action="store_true", help="GPU mode: bf16, fla's shape (module docstring)")
    ap.add_argument("--dry-run", action="store_true", help="with --gpu: the GPU mode on the host CPU")
    ap.add_argument("--save-io", default=None, metavar="DIR", help="write inputs / outputs / grads as .npy")
    ap.add_argument("--impls", nargs="+", default=None,
                    help="default reference chunked chunked_general tokamax; --gpu chunked")
    ap.add_argument("--out", default=RESULTS)
    args = ap.parse_args(argv)
    gpu = gpu_mode(argv)
    args.lengths = args.lengths or ([2048, 8192] if gpu else [512, 2048, 8192])
    args.heads = args.heads or (16 if gpu else 4)
    args.impls = args.impls or (["chunked"] if gpu else ["reference", "chunked", "chunked_general", "tokamax"])
    bad = [i for i in args.impls if i not in ("reference", "chunked", "chunked_general", "tokamax")]
    if bad:
        ap.error(f"--impls: unknown {bad}; choose from reference chunked chunked_general tokamax")
    dtype = jnp.bfloat16 if gpu else jnp.float32
    if not valid_chunk_size(args.chunk):
        ap.error(f"--chunk must be a power of two >= 16 (the chunked kernels' tile), got {args.chunk}")
    H, D = args.heads, args.dim
    impls = {"reference": _bounded(kda_reference),
             "chunked": _bounded(lambda *a, **kw: kda_chunked(*a, chunk_size=args.chunk,
                                                              lower_bound=-5.0, **kw)),
             "chunked_general": _bounded(lambda *a, **kw: kda_chunked(*a, chunk_size=args.chunk,
                                                                      **kw)),
             "tokamax": _tokamax}
    impls = {n: impls[n] for n in ["chunked"] + [i for i in args.impls if i != "chunked"]}
    rows = []
    info = machine()
    dname = jnp.dtype(dtype).name
    print(f"backend={jax.default_backend()} ({info['device_kind']}) B=1 H={H} K=V={D} {dname} chunk={args.chunk} "
          f"{'median' if gpu else 'best'} of {args.repeats}")
    print(f"{'T':>6} {'impl':>15} {'fwd ms':>10} {'fwd+bwd ms':>11} {'temp MiB':>9}")
    for T in args.lengths:
        inputs, cots = _problem(T, H, D, D, dtype)
        row = {"T": T}
        for name, kda in impls.items():
            fwd, grad = _fns(kda)
            if gpu:
                fwd, grad, planned = _compiled(fwd, grad, inputs, cots)
            else:
                planned = grad.lower(inputs, cots).compile()
            t_f = _best(fwd, inputs, args.repeats, median=gpu)
            t_b = _best(grad, (inputs, cots), args.repeats, median=gpu)
            if args.save_io and name == "chunked":
                _save_io(args.save_io, T, inputs, cots, fwd, grad)
            mem = planned.memory_analysis()
            temp = None if mem is None else int(mem.temp_size_in_bytes)
            row[name] = {"fwd_s": t_f, "fwd_bwd_s": t_b, "fwd_bwd_temp_bytes": temp}
            tmib = "n/a" if temp is None else f"{temp / 2**20:9.1f}"
            print(f"{T:>6} {name:>15} {t_f * 1e3:10.1f} {t_b * 1e3:11.1f} {tmib:>9}")
        for other, key in (("reference", "speedup"), ("tokamax", "speedup_vs_tokamax"),
                           ("chunked_general", "speedup_vs_general")):
            if other in row:          # how many times faster chunked is than `other`
                row[f"{key}_fwd"] = row[other]["fwd_s"] / row["chunked"]["fwd_s"]
                row[f"{key}_fwd_bwd"] = row[other]["fwd_bwd_s"] / row["chunked"]["fwd_bwd_s"]
                label = {"chunked_general": "gen"}.get(other, other[:3]) + "/chunked"
                print(f"{T:>6} {label:>15} {row[f'{key}_fwd']:9.2f}x "
                      f"{row[f'{key}_fwd_bwd']:10.2f}x")
        rows.append(row)
        if gpu:                       # each length as soon as it is done (gpu_check.sh's timeouts)
            write_json(args.out, {"benchmark": "kda", "mode": "gpu", "machine": info, "B": 1, "H": H, "K": D,
                                  "V": D, "chunk": args.chunk, "dtype": dname, "repeats": args.repeats,
                                  "timing": "median", "rows": rows})
    temps = [(r["T"], r["chunked"]["fwd_bwd_temp_bytes"]) for r in rows
             if r["chunked"]["fwd_bwd_temp_bytes"] is not None]
    # Linear growth = a constant marginal cost per token (plus a fixed per-group working set).
    slopes = [(t1, (b1 - b0) / (t1 - t0)) for (t0, b0), (t1, b1) in zip(temps, temps[1:])]
    print("chunked fwd+bwd temp memory, marginal bytes per token: "
          + ", ".join(f"up to T={T}: {s:,.0f}" for T, s in slopes))
    flops = chunked_flops_per_token(**K3)
    print(f"chunked forward matmul FLOPs per token at K3 shape {K3}: {flops / 1e6:.2f} MFLOP "
          f"({flops / K3['H'] / 1e3:.1f} kFLOP per head)")
    result = {"benchmark": "kda", "mode": "gpu" if gpu else "cpu", "machine": info,
              "timing": "median" if gpu else "best", "backend": jax.default_backend(), "B": 1, "H": H, "K": D, "V": D,
              "chunk": args.chunk, "impls": list(impls), "dtype": dname, "repeats": args.repeats, "rows": rows,
              "chunked_temp_marginal_bytes_per_token": dict(slopes),
              "chunked_flops_per_token_k3": {"shape": K3, "flops": flops}}
    write_json(args.out, result)


if __name__ == "__main__":
    main()
