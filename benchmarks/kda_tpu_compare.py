"""KDA's two TPU kernels, compiled ahead of time from this host: k3jax pallas_tpu vs tokamax mosaic.

For one chip of a TPU topology (default v5p) at the K3 layer shape (B=1, T=4096, H=96, K=V=128,
q/k/v bf16, packed segment ids as the layer passes them), each core is lowered and compiled
for the forward and for the forward + backward (jax.grad of sum(o^2) + sum(S^2) wrt q, k, v,
the gate, beta and, for tokamax, a_log and dt_bias). Nothing runs: the numbers are the
compiler's, from compiled.cost_analysis() (flops, bytes accessed) and memory_analysis()
(argument, output, temp and generated-code bytes), plus the compile time.

Read with care: XLA's cost analysis does not look inside Mosaic custom calls (neither kernel
gives a pallas CostEstimate), so "flops" and "bytes accessed" count only the XLA ops around
them: for pallas_tpu the intra-chunk algebra (XLA) but not the chunk walk (Mosaic); for tokamax
almost nothing, since both its passes are Mosaic. The memory figures are complete.

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/kda_tpu_compare.py                 # K3 shape
    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/kda_tpu_compare.py --heads 4 --length 256
Results: stdout table and benchmarks/results/kda_tpu_compare.json (--out to change).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5p-8")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental import topologies  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "src"))  # run as a script without installing

from common import write_json  # noqa: E402
from k3jax.kernels.kda import get_kda_fn  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "kda_tpu_compare.json")
LB = -5.0


def _fns(impl, core):
    def fwd(q, k, v, f, beta, seg, a_log, dt_bias):
        if impl == "tokamax":
            return core(q, k, v, f, beta, a_log=a_log, dt_bias=dt_bias, segment_ids=seg)
        g = LB * jax.nn.sigmoid(jnp.exp(a_log)[:, None] * (f + dt_bias))   # the layer's gate
        return core(q, k, v, g, beta, segment_ids=seg)

    def loss(*a):
        o, S = fwd(*a)
        return jnp.sum(o.astype(jnp.float32) ** 2) + jnp.sum(S ** 2)

    return {"fwd": fwd, "fwd+bwd": jax.grad(loss, argnums=(0, 1, 2, 3, 4, 6, 7))}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--topology", default="v5p:2x2x1", help="TPU topology; one chip of it is used")
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=96)
    ap.add_argument("--dim", type=int, default=128, help="K = V")
    ap.add_argument("--max-segments", type=int, default=16,
                    help="tokamax's max_num_segments (config kda_tokamax_max_segments)")
    ap.add_argument("--impls", nargs="+", default=["pallas_tpu", "tokamax"], choices=["pallas_tpu", "tokamax"])
    ap.add_argument("--passes", nargs="+", default=["fwd", "fwd+bwd"], choices=["fwd", "fwd+bwd"])
    ap.add_argument("--out", default=RESULTS)
    args = ap.parse_args(argv)
    devices = topologies.get_topology_desc(topology_name=args.topology, platform="tpu").devices[:1]
    mesh = jax.make_mesh((1,), ("data",), devices=devices)
    T, H, D = args.length, args.heads, args.dim
    sds = lambda s, d: jax.ShapeDtypeStruct(s, d, sharding=NamedSharding(mesh, P()))  # noqa: E731
    shapes = [sds((1, T, H, D), jnp.bfloat16)] * 3 + [
        sds((1, T, H, D), jnp.float32), sds((1, T, H), jnp.float32), sds((1, T), jnp.int32),
        sds((H,), jnp.float32), sds((H, D), jnp.float32)]
    axes = dict(batch_axes=("data",), head_axis=None)
    print(f"{devices[0].device_kind} ({args.topology}, one chip) B=1 T={T} H={H} K=V={D} bf16, "
          f"segment ids, tokamax max_num_segments={args.max_segments}")
    head = f"{'impl':>10} {'pass':>8} {'GFLOP*':>8} {'GB acc*':>8} {'arg MiB':>8} {'out MiB':>8} " \
           f"{'temp MiB':>9} {'code KiB':>8} {'compile s':>9}"
    print(head)
    rows = []
    with jax.set_mesh(mesh):
        cores = {"pallas_tpu": get_kda_fn("pallas_tpu", **axes),
                 "tokamax": get_kda_fn("tokamax", lower_bound=LB, max_num_segments=args.max_segments, **axes)}
        for impl in args.impls:
            for name, fn in _fns(impl, cores[impl]).items():
                if name not in args.passes:
                    continue
                t0 = time.perf_counter()
                compiled = jax.jit(fn).lower(*shapes).compile()
                secs = time.perf_counter() - t0
                cost = compiled.cost_analysis() or {}
                cost = cost[0] if isinstance(cost, (list, tuple)) else cost
                mem = compiled.memory_analysis()
                row = {"impl": impl, "pass": name, "compile_s": secs,
                       "flops_xla_only": float(cost.get("flops", 0.0)),
                       "bytes_accessed_xla_only": float(cost.get("bytes accessed", 0.0)),
                       "argument_bytes": int(mem.argument_size_in_bytes),
                       "output_bytes": int(mem.output_size_in_bytes),
                       "temp_bytes": int(mem.temp_size_in_bytes),
                       "generated_code_bytes": int(mem.generated_code_size_in_bytes),
                       "mosaic_calls": compiled.as_text().count("tpu_custom_call")}
                rows.append(row)
                print(f"{impl:>10} {name:>8} {row['flops_xla_only'] / 1e9:8.1f} "
                      f"{row['bytes_accessed_xla_only'] / 1e9:8.2f} {row['argument_bytes'] / 2**20:8.1f} "
                      f"{row['output_bytes'] / 2**20:8.1f} {row['temp_bytes'] / 2**20:9.1f} "
                      f"{row['generated_code_bytes'] / 2**10:8.1f} {secs:9.1f}", flush=True)
    print("* XLA's count: the ops outside Mosaic custom calls only (see the module docstring)")
    result = {"device_kind": devices[0].device_kind, "topology": args.topology, "B": 1, "T": T, "H": H,
              "K": D, "V": D, "dtype": "bfloat16", "max_num_segments": args.max_segments, "rows": rows}
    write_json(args.out, result)


if __name__ == "__main__":
    main()
