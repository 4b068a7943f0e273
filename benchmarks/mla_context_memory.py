"""Compiled TPU memory of MLA attention under context parallelism at K3's layer shape, side by side:
the flash walk (kernels/attention/context_parallel.py, with and without the zigzag load balance)
against expanding the whole sequence's keys/values from the gathered latent and attending in
query blocks (what that kernel did before the walk; kept here as the baseline).

One MLA layer's attention, forward + gradient of (q, latent, rope key, W_kv), B = 1, `--tokens`
per shard, H = 96, dn = dv = 128, Rr = 64, R = 512, bf16, compiled ahead of time with libtpu for
each `--topology` (its chips form the context axis). Nothing runs; memory from memory_analysis().

    .venv/bin/python benchmarks/mla_context_memory.py --topology v5p:2x2x2 v5p:4x4x2
Results: stdout table and benchmarks/results/mla_context_memory.json (--out to change).
"""
from __future__ import annotations

import argparse
import functools
import time

from common import cpu_only, machine, print_table, result_path, write_json

cpu_only()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

from k3jax import topology as TP  # noqa: E402
from k3jax.kernels.attention.common import NEG_INF  # noqa: E402
from k3jax.kernels.attention.context_parallel import _expand, mla_context_parallel_attention  # noqa: E402

H, DN, RR, DV, R = 96, 128, 64, 128, 512


def expanded_baseline(q, lat, k_r, kv_b, seg, *, axis_name, scale, block=512):
    """Gather the latent, expand every key/value, attend 512-query blocks (remat) to all keys."""
    b, t, h, _ = q.shape
    gather = functools.partial(lax.all_gather, axis_name=axis_name, axis=1, tiled=True)
    lat_all, kr_all, seg_all = gather(lat), gather(k_r), gather(seg)
    k, v = _expand(lat_all, kr_all, kv_b, h, q.shape[-1] - k_r.shape[-1])
    s = k.shape[1]
    offset = lax.axis_index(axis_name) * t
    qs = q.reshape(b, t // block, block, h, -1).swapaxes(0, 1)
    ss = seg.reshape(b, t // block, block).swapaxes(0, 1)

    @functools.partial(jax.checkpoint, policy=jax.checkpoint_policies.nothing_saveable)
    def one(qb, sb, j):
        logits = jnp.einsum("bthk,bshk->bhts", qb, k, preferred_element_type=jnp.float32) * scale
        pos = offset + j * block + jnp.arange(block)
        mask = ((jnp.arange(s)[None, :] <= pos[:, None])[None] & (sb[:, :, None] == seg_all[:, None, :]))[:, None]
        p = jax.nn.softmax(jnp.where(mask, logits, NEG_INF), axis=-1)
        return jnp.einsum("bhts,bshv->bthv", p.astype(v.dtype), v).astype(v.dtype)

    o = lax.map(lambda xs: one(*xs), (qs, ss, jnp.arange(t // block)))
    return o.swapaxes(0, 1).reshape(b, t, h, -1), jnp.zeros((h,), jnp.float32)


VARIANTS = {
    "flash_balanced": functools.partial(mla_context_parallel_attention, load_balance=True),
    "flash_unbalanced": functools.partial(mla_context_parallel_attention, load_balance=False),
    "expanded_baseline": expanded_baseline,
}


def compile_one(topology: str, tokens: int, variant: str) -> dict:
    devs = TP.devices(TP.resolve(topology), 1)
    n = len(devs)
    mesh = jax.sharding.Mesh(np.array(devs).reshape(n), ("context",), axis_types=(AxisType.Explicit,))
    seq3, row = P(None, "context", None), P(None, "context", None, None)
    sds = lambda shape, spec, dt=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(mesh, spec))  # noqa: E731
    t = n * tokens
    args = (sds((1, t, H, DN + RR), row), sds((1, t, R), seq3), sds((1, t, RR), seq3), sds((R, H * (DN + DV)), P()),
            sds((1, t), P(None, "context"), jnp.int32))
    body = functools.partial(VARIANTS[variant], axis_name="context", scale=0.07)
    mapped = jax.shard_map(body, mesh=mesh, in_specs=(row, seq3, seq3, P(), P(None, "context")), out_specs=(row, P()))

    def loss(q, lat, k_r, kv_b, seg):
        return jnp.sum(mapped(q, lat, k_r, kv_b, seg)[0].astype(jnp.float32) ** 2)

    t0 = time.perf_counter()
    ma = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).lower(*args).compile().memory_analysis()
    return {"topology": topology, "context": n, "sequence": t, "tokens_per_shard": tokens, "variant": variant,
            "temp_gib": ma.temp_size_in_bytes / 2 ** 30, "argument_gib": ma.argument_size_in_bytes / 2 ** 30,
            "compile_s": time.perf_counter() - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--topology", nargs="+", default=["v5p:2x2x2", "v5p:4x4x2"])
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per context shard (a multiple of 1024)")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--out", default=result_path("mla_context_memory"))
    args = ap.parse_args()
    rows = [compile_one(topo, args.tokens, v) for topo in args.topology for v in args.variants]
    print_table(rows, [("topology", "topology", "s"), ("context", "context", "d"), ("sequence", "sequence", "d"),
                       ("variant", "variant", "s"), ("temporaries GiB", "temp_gib", ".2f"),
                       ("compile s", "compile_s", ".0f")])
    write_json(args.out, {"machine": machine(), "args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
