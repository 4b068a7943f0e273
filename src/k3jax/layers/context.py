"""Context parallelism for the layers: the ambient mesh's context axis (sharding.CONTEXT_AXIS, the
mesh axis of the "seq" activations) and the shard_map entries of the context-parallel kernels.

Each wrapper is a `jax.shard_map` that is manual over the context axis ONLY: the sequence
dimension of its inputs is split into contiguous slices (spec "context" on it), every other
dimension and mesh axis stays automatic, so GSPMD partitions the kernels' XLA over batch rows and
heads inside the map exactly as it does without context parallelism (and the Pallas KDA core's
shard_kda maps the remaining axes itself). The mixers call these when `context_size()` > 1 and
their plain kernels otherwise, so a mesh without the axis (or with context=1) runs unchanged.
"""
from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from k3jax import sharding as S
from k3jax.config import ConfigError
from k3jax.kernels.attention.context_parallel import mla_context_parallel_attention
from k3jax.kernels.kda.context_parallel import kda_context_parallel, short_conv_context_parallel

AX = S.CONTEXT_AXIS
SEQ2, SEQ3, SEQ4 = P(None, AX), P(None, AX, None), P(None, AX, None, None)


def context_size() -> int:
    """Size of the ambient mesh's context axis (1 without a mesh, the axis, or inside a map
    already manual over it)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or AX not in mesh.shape or AX in mesh.manual_axes:
        return 1
    return mesh.shape[AX]


def _map(fn, in_specs, out_specs, length: int):
    n = context_size()
    if length % n:
        raise ConfigError(f"a sequence of {length} tokens does not split into {n} equal context slices "
                         f"(ici_/dcn_context_parallelism); pad it to a multiple of {n}")
    return jax.shard_map(fn, mesh=jax.sharding.get_abstract_mesh(), in_specs=in_specs,
                         out_specs=out_specs, axis_names=frozenset({AX}))


def kda(core, q, k, v, g, beta, *, scale: float, segment_ids, strategy: str, **kw):
    """`core` (the layer's KDA fn) over the context-sharded sequence -> (o, final state)."""
    def body(q, k, v, g, beta, seg):
        return kda_context_parallel(q, k, v, g, beta, axis_name=AX, scale=scale, segment_ids=seg,
                                    strategy=strategy, kda_fn=core, **kw)
    return _map(body, (SEQ4, SEQ4, SEQ4, SEQ4, SEQ3, SEQ2), (SEQ4, P()), q.shape[1])(q, k, v, g, beta, segment_ids)


def short_conv(x, weight, *, segment_ids):
    """kda/decode.short_conv over the context-sharded sequence -> (y, final conv state)."""
    def body(x, w, seg):
        return short_conv_context_parallel(x, w, axis_name=AX, segment_ids=seg)
    return _map(body, (SEQ3, P(), SEQ2), (SEQ3, P()), x.shape[1])(x, weight, segment_ids)


def mla_attention(q, lat, k_r, kv_b, segment_ids, *, scale: float, load_balance: bool):
    """MLA attention of the context-sharded queries over the all-gathered latent -> (o, max_logit)."""
    def body(q, lat, k_r, kv_b, seg):
        return mla_context_parallel_attention(q, lat, k_r, kv_b, seg, axis_name=AX, scale=scale,
                                              load_balance=load_balance)
    return _map(body, (SEQ4, SEQ3, SEQ3, P(), SEQ2), (SEQ4, P()), q.shape[1])(q, lat, k_r, kv_b, segment_ids)
