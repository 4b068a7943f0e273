"""Kimi Delta Attention (KDA) token-mixing core: reference, chunked XLA, Pallas TPU, decode.

Every implementation has the signature

    fn(q, k, v, g, beta, *, scale=None, initial_state=None, segment_ids=None)
        -> (o [B, T, H, V] in v.dtype, final_state [B, H, K, V] f32)

with q, k [B, T, H, K] (l2-normalised by the caller), v [B, T, H, V], g [B, T, H, K] f32
log-decay <= 0, beta [B, T, H] f32, initial_state [B, H, K, V] f32 and segment_ids [B, T] int32
(the state resets where the id changes; t = 0 never resets). See docs/kernels.md.

"tokamax" (tokamax's kernels, K3's bounded gate fused in them) differs in one argument: in place
of g it takes the pre-activation gate f [B, T, H, K] f32 plus a_log [H] and dt_bias [H, K] as
keywords (kernels/kda/tokamax.py).
"""
from __future__ import annotations

import functools

from k3jax.kernels.kda.chunked import chunked_flops_per_token, kda_chunked
from k3jax.kernels.kda.decode import kda_decode_step, short_conv, short_conv_step
from k3jax.kernels.kda.pallas_tpu import check_platform, kda_pallas
from k3jax.kernels.kda.reference import kda_reference
from k3jax.kernels.kda.sharded import shard_kda
from k3jax.kernels.kda.tokamax import TOKAMAX_CHUNK, default_implementation, kda_tokamax
from k3jax.kernels.platform import resolve, target_platform

KDA_IMPLS = {
    "reference": kda_reference,
    "chunked": kda_chunked,
    "pallas_tpu": kda_pallas,
    "tokamax": kda_tokamax,
}


def _tokamax_core(lower_bound: float, max_num_segments: int):
    """kda_tokamax with its implementation picked from the platform the call lowers for (read at
    trace time, so an AOT compile for a TPU topology from a CPU host gets the Mosaic kernels)."""
    def core(q, k, v, f, beta, *, a_log, dt_bias, scale=None, initial_state=None, segment_ids=None):
        return kda_tokamax(q, k, v, f, beta, a_log=a_log, dt_bias=dt_bias, lower_bound=lower_bound,
                           scale=scale, initial_state=initial_state, segment_ids=segment_ids,
                           max_num_segments=max_num_segments,
                           implementation=default_implementation(target_platform()))
    return core


def _auto_core(*args, chunk_size, interpret, batch_axes, head_axis, lower_bound, max_num_segments, **kwargs):
    """kda_impl=auto: the core is picked when the call is traced, for the platform it lowers for
    (kernels.platform.AUTO)."""
    return get_kda_fn(resolve("kda_impl", "auto"), chunk_size=chunk_size, interpret=interpret, batch_axes=batch_axes,
                      head_axis=head_axis, lower_bound=lower_bound, max_num_segments=max_num_segments)(*args, **kwargs)


def get_kda_fn(name: str, *, chunk_size: int = 64, interpret: bool = False, batch_axes=None,
               head_axis=None, lower_bound: float | None = None, max_num_segments: int = 1):
    """The KDA core called `name` (a key of KDA_IMPLS, or "auto": the one kernels.platform.AUTO
    picks for the platform the call lowers for, never "tokamax") with the common signature.

    `chunk_size` (config `kda_chunk_size`, a power of two >= 16) is bound into the chunked
    implementations ("chunked", "pallas_tpu"); "reference" is token-serial and has no chunks.
    `lower_bound` (K3's bounded gate, None for an unbounded gate) is bound into "chunked", whose
    relation matrices then take the cheaper bounded form (intra.rel_forward_mid), and "tokamax".

    `interpret` only concerns "pallas_tpu": True runs its kernels in the Pallas interpreter;
    False requires a TPU target and raises RuntimeError otherwise (never a silent fallback).
    "pallas_tpu" comes wrapped in `shard_kda` (ambient mesh) over `batch_axes` / `head_axis`, the
    mesh axes of the activations' rows and heads (required for it): GSPMD cannot partition a
    Mosaic custom call, so on a multi-device mesh each device runs the kernels on its own batch
    rows and heads. "reference" and "chunked" are plain XLA that GSPMD partitions itself.

    "tokamax" runs tokamax's Mosaic kernels when the target platform is TPU and its xla_chunked
    path elsewhere, with the bounded gate's `lower_bound` fused in (required) and
    `max_num_segments` documents per row at most (kernels/kda/tokamax.py); chunk_size must be 64
    (tokamax's only chunk). It is wrapped in `shard_kda` like "pallas_tpu" (a Mosaic call again).
    """
    if name == "auto":      # a partial, like the named cores: its settings stay readable (.keywords)
        return functools.partial(_auto_core, chunk_size=chunk_size, interpret=interpret, batch_axes=batch_axes,
                                 head_axis=head_axis, lower_bound=lower_bound, max_num_segments=max_num_segments)
    if name not in KDA_IMPLS:
        raise ValueError(f"unknown KDA implementation {name!r}; valid: auto, {', '.join(sorted(KDA_IMPLS))}")
    if name == "tokamax":
        if lower_bound is None or chunk_size != TOKAMAX_CHUNK:
            raise ValueError(f"tokamax KDA needs the bounded gate's lower_bound and chunk_size="
                             f"{TOKAMAX_CHUNK}; got lower_bound={lower_bound}, chunk_size={chunk_size}")
        if batch_axes is None:
            raise ValueError("tokamax needs batch_axes (and head_axis): the mesh axes it maps rows "
                             "(and heads) over")
        return shard_kda(_tokamax_core(lower_bound, max_num_segments), batch_axes=batch_axes,
                         head_axis=head_axis)
    if name == "pallas_tpu":
        check_platform(interpret)
        if batch_axes is None:
            raise ValueError("pallas_tpu needs batch_axes (and head_axis): the mesh axes it maps rows "
                             "(and heads) over")
        return shard_kda(functools.partial(kda_pallas, chunk_size=chunk_size, interpret=interpret),
                         batch_axes=batch_axes, head_axis=head_axis)
    if name == "chunked":
        # The bounded gate's lower_bound lets the chunked path use its bounded relation form
        # (as accurate as the general form against the float64 model reference, docs/kernels.md).
        return functools.partial(kda_chunked, chunk_size=chunk_size, lower_bound=lower_bound)
    return KDA_IMPLS[name]


__all__ = ["KDA_IMPLS", "get_kda_fn", "kda_reference", "kda_chunked", "kda_pallas", "kda_tokamax",
           "kda_decode_step", "short_conv", "short_conv_step", "chunked_flops_per_token",
           "shard_kda"]
