"""Kimi Delta Attention (KDA) token-mixing core: reference, chunked XLA, Pallas TPU, decode.

Every implementation has the signature

    fn(q, k, v, g, beta, *, scale=None, initial_state=None, segment_ids=None)
        -> (o [B, T, H, V] in v.dtype, final_state [B, H, K, V] f32)

with q, k [B, T, H, K] (l2-normalised by the caller), v [B, T, H, V], g [B, T, H, K] f32
log-decay <= 0, beta [B, T, H] f32, initial_state [B, H, K, V] f32 and segment_ids [B, T] int32
(the state resets where the id changes; t = 0 never resets). See docs/kernels.md.
"""
from __future__ import annotations

import functools

from k3jax.kernels.kda.chunked import chunked_flops_per_token, kda_chunked
from k3jax.kernels.kda.decode import kda_decode_step, short_conv, short_conv_step
from k3jax.kernels.kda.pallas_tpu import check_platform, kda_pallas
from k3jax.kernels.kda.reference import kda_reference
from k3jax.kernels.kda.sharded import shard_kda

KDA_IMPLS = {
    "reference": kda_reference,
    "chunked": kda_chunked,
    "pallas_tpu": kda_pallas,
}


def get_kda_fn(name: str, *, chunk_size: int = 64, interpret: bool = False, batch_axes=None,
               head_axis=None):
    """The KDA core called `name` (a key of KDA_IMPLS) with the common signature.

    `chunk_size` (config `kda_chunk_size`, a power of two >= 16) is bound into the chunked
    implementations ("chunked", "pallas_tpu"); "reference" is token-serial and has no chunks.

    `interpret` only concerns "pallas_tpu": True runs its kernels in the Pallas interpreter;
    False requires a TPU target and raises RuntimeError otherwise (never a silent fallback).
    "pallas_tpu" comes wrapped in `shard_kda` (ambient mesh) over `batch_axes` / `head_axis`, the
    mesh axes of the activations' rows and heads (required for it): GSPMD cannot partition a
    Mosaic custom call, so on a multi-device mesh each device runs the kernels on its own batch
    rows and heads. "reference" and "chunked" are plain XLA that GSPMD partitions itself.
    """
    if name not in KDA_IMPLS:
        raise ValueError(f"unknown KDA implementation {name!r}; valid: {sorted(KDA_IMPLS)}")
    if name == "pallas_tpu":
        check_platform(interpret)
        if batch_axes is None:
            raise ValueError("pallas_tpu needs batch_axes (and head_axis): the mesh axes it maps rows "
                             "(and heads) over")
        return shard_kda(functools.partial(kda_pallas, chunk_size=chunk_size, interpret=interpret),
                         batch_axes=batch_axes, head_axis=head_axis)
    if name == "chunked":
        return functools.partial(kda_chunked, chunk_size=chunk_size)
    return KDA_IMPLS[name]


__all__ = ["KDA_IMPLS", "get_kda_fn", "kda_reference", "kda_chunked", "kda_pallas",
           "kda_decode_step", "short_conv", "short_conv_step", "chunked_flops_per_token",
           "shard_kda"]
