"""KDA and its short convolution under context parallelism: the sequence split into contiguous
slices over one mesh axis, called per shard inside a `jax.shard_map` that maps that axis.

The KDA state update is affine in the state (kda.md §1.2): per batch row and head,

    S_t = (I - beta_t k_t k_t^T) diag(exp g_t) S_{t-1} + beta_t k_t v_t^T   (S <- 0 at a reset)

so a whole slice maps its incoming state to its outgoing one as S_out = Phi S_in + Psi, with
Phi [K, K] the product of the slice's transitions (zero once a reset occurred in the slice) and
Psi [K, V] the slice's final state from a zero start. Its outputs are affine too:
o_t = o_t|0 + (scale q_t)^T Phi_t S_in, with Phi_t the product up to token t. All of it comes
out of ONE run of the ordinary kernel on augmented values and state (`slice_maps`):

    v' = [v | 0_K],  h0' = [0_V | I_K]   ->   o' = [o|0 | Q Phi],   S' = [Psi | Phi]

because the V+K value columns evolve independently and the last K columns start at the identity
and never receive a write. Then (`kda_context_parallel`):

1. every shard runs that on its slice: o|0, QPhi [B, Tl, H, K], Phi, Psi;
2. a document boundary exactly at the slice start (its first segment id differs from the
   previous shard's last one, fetched with a ppermute) zeroes the slice's dependence on S_in;
3. the maps are combined in sequence order: `strategy="allgather"` gathers every (Phi, Psi)
   ([n, B, H, K, K + V] per shard) and composes the prefix locally (n small matmuls);
   `strategy="ring"` passes states shard to shard (n - 1 ppermute rounds of [B, H, K, V],
   no gathered stack);
4. each shard adds QPhi @ S_in to its outputs; the last shard's S_out is the final state,
   returned on every shard (replicated over the axis).

The backward is plain autodiff: the kernel's own custom_vjp (whose cotangents for o' and S'
carry the dependence through QPhi and Phi), and the transposes of the collectives (an
all-gather's is a reduce-scatter, a ppermute's the reverse ppermute). This is exact, not an
approximation. Cost over the unsharded kernel per shard: the kernel runs with V + K value
columns (the intra-chunk factors, the bulk of it for V = K, are computed once), plus one
[Tl, K] x [K, V] matmul and the combine.

tokamax's KDA (`context_parallel_metadata=`, its cp_utils) follows the same all-gather idea
inside its Pallas kernels with separate forward and backward merges and explicit chain metadata
(`pre_num_ranks` ...) derived from segment ids; here the reset at the slice start is the only
metadata needed, because a reset inside a slice is already inside Phi.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

from k3jax.kernels.kda.chunked import check_inputs, kda_chunked
from k3jax.kernels.kda.common import compute_dtype, match_vma, mm
from k3jax.kernels.kda.decode import short_conv

STRATEGIES = ("allgather", "ring")


def _shift_right(x: jax.Array, axis_name: str, n: int) -> jax.Array:
    """Shard j receives shard j - 1's x; shard 0 receives zeros."""
    return lax.ppermute(x, axis_name, perm=[(j, j + 1) for j in range(n - 1)])


def slice_maps(q, k, v, g, beta, *, scale: float, segment_ids=None, kda_fn: Callable = kda_chunked,
               **kda_kwargs):
    """One slice from a zero state, plus its affine state map, in one kernel call.

    Returns (o0 [B, T, H, V] in the compute dtype, QPhi [B, T, H, K], Phi [B, H, K, K],
    Psi [B, H, K, V]): o0 and Psi are the slice's outputs and final state from S_in = 0, and
    with any S_in the outputs are o0 + QPhi @ S_in and the final state Phi @ S_in + Psi.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    dt = compute_dtype(q, k, v, g, beta)
    v_aug = jnp.concatenate([v.astype(dt), jnp.zeros((B, T, H, K), dt)], axis=-1)
    eye = jnp.broadcast_to(jnp.eye(K, dtype=dt), (B, H, K, K))
    h0_aug = jnp.concatenate([jnp.zeros((B, H, K, V), dt), eye], axis=-1)
    o, S = kda_fn(q, k, v_aug, g, beta, scale=scale, initial_state=match_vma(h0_aug, q),
                  segment_ids=segment_ids, **kda_kwargs)
    return o[..., :V], o[..., V:], S[..., V:], S[..., :V]


def _apply(phi, psi, S):
    """phi [B,H,K,K] @ S [B,H,K,V] + psi."""
    return mm("bhkj,bhjv->bhkv", phi, S) + psi


def kda_context_parallel(q, k, v, g, beta, *, axis_name: str, scale: float | None = None,
                         initial_state=None, segment_ids=None, strategy: str = "allgather",
                         kda_fn: Callable = kda_chunked, **kda_kwargs):
    """KDA over a sequence split in contiguous slices along mesh axis `axis_name`.

    Call it inside a `jax.shard_map` that maps `axis_name` (manual), with this shard's slice:
    shard j of n holds tokens [j * Tl, (j + 1) * Tl) of every row.

    Args:
      q, k: [B, Tl, H, K], v [B, Tl, H, V], g [B, Tl, H, K] f32, beta [B, Tl, H] f32: the slice
        (the common KDA contract, kernels/kda/__init__.py).
      axis_name: the mesh axis the sequence is split over (the caller's; kernels never import
        sharding).
      scale: None -> K ** -0.5.
      initial_state: [B, H, K, V] or None: the state entering the WHOLE sequence, the same on
        every shard (replicated over the axis); shard 0 applies it.
      segment_ids: [B, Tl] int32 slice of the global ids, or None. A reset where the id changes
        inside the slice or between the previous shard's last token and this shard's first.
      strategy: "allgather" (gather all maps, compose locally) or "ring" (pass states along).
      kda_fn: the per-slice core with the common signature (default the chunked kernel);
        `kda_kwargs` go to it (e.g. chunk_size).

    Returns:
      o [B, Tl, H, V] in v.dtype (this slice's outputs), final_state [B, H, K, V] of the whole
      sequence in the compute dtype, the same value on every shard of the axis.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"context-parallel strategy must be one of {STRATEGIES}, got {strategy!r}")
    check_inputs(q, k, v, g, beta, initial_state, segment_ids)
    B, T, H, K = q.shape
    V = v.shape[-1]
    n = lax.axis_size(axis_name)
    i = lax.axis_index(axis_name)
    dt = compute_dtype(q, k, v, g, beta, initial_state)
    scale = float(K ** -0.5 if scale is None else scale)
    o0, qphi, phi, psi = slice_maps(q, k, v, g, beta, scale=scale, segment_ids=segment_ids,
                                    kda_fn=kda_fn, **kda_kwargs)
    if segment_ids is not None:
        # A document starting exactly at this slice's first token: S_in never reaches the slice.
        # Shard 0 keeps its (global) initial state: t = 0 never resets.
        prev_last = _shift_right(segment_ids[:, -1], axis_name, n)
        keep = ((i == 0) | (segment_ids[:, 0] == prev_last)).astype(dt)           # [B]
        phi = phi * keep[:, None, None, None]
        qphi = qphi * keep[:, None, None, None]
    h0 = jnp.zeros((B, H, K, V), dt) if initial_state is None else initial_state.astype(dt)

    if strategy == "allgather":
        # [n, B, H, K, K + V], identical on every shard (invariant over the axis).
        maps = lax.all_gather(jnp.concatenate([phi, psi], axis=-1), axis_name, to="invarying")

        def compose(S, m):
            return _apply(m[..., :K], m[..., K:], S), S

        final, s_ins = lax.scan(compose, match_vma(h0, maps), maps)
        s_in = lax.dynamic_index_in_dim(s_ins, i, keepdims=False)
    else:
        h0 = match_vma(h0, psi)

        def round_(_, s_in):
            # After r rounds shards 0..r hold their true incoming state.
            recv = _shift_right(_apply(phi, psi, s_in), axis_name, n)
            return jnp.where(i == 0, h0, recv)

        s_in = lax.fori_loop(0, n - 1, round_, h0)
        last = jnp.where(i == n - 1, _apply(phi, psi, s_in), 0.0)
        final = lax.psum(last, axis_name)
    o = o0 + mm("bthk,bhkv->bthv", qphi, s_in)
    return o.astype(v.dtype), final


def short_conv_context_parallel(x, weight, *, axis_name: str, segment_ids=None, initial_state=None):
    """`short_conv` (kda/decode.py) over a sequence split in contiguous slices along `axis_name`.

    Each shard receives the previous shard's last W - 1 inputs and their segment ids (one
    ppermute each); the taps reaching into them read 0 where the id differs from the tap's
    token (a document boundary inside the halo or exactly at the slice start), which is what
    `short_conv` does on the whole sequence. Shard 0 uses `initial_state` (the inputs before the
    whole sequence, replicated over the axis, belonging to the first token's document) or zeros.

    Args: x [B, Tl, C] this shard's slice (Tl >= W - 1), weight [C, W] (replicated over the
    axis), segment_ids [B, Tl] int32 or None, initial_state [B, C, W-1] or None.
    Returns: y [B, Tl, C] and the final conv state [B, C, W-1] of the whole sequence (the
    last shard's, the same on every shard of the axis).
    """
    B, T, C = x.shape
    W = weight.shape[-1]
    if T < W - 1:
        raise ValueError(f"short_conv_context_parallel needs at least {W - 1} tokens per shard "
                         f"(conv width {W}), got {T}: use fewer context shards")
    n = lax.axis_size(axis_name)
    i = lax.axis_index(axis_name)
    dt = jnp.result_type(x.dtype, weight.dtype,
                         *([] if initial_state is None else [initial_state.dtype]))
    halo = _shift_right(jnp.swapaxes(x[:, T - (W - 1):], 1, 2).astype(dt), axis_name, n)
    h0 = (jnp.zeros((B, C, W - 1), dt) if initial_state is None
          else match_vma(initial_state.astype(dt), halo))
    if segment_ids is not None:
        halo_seg = _shift_right(segment_ids[:, T - (W - 1):], axis_name, n)     # [B, W-1]
        # short_conv treats its initial state as the first token's document; a halo input of
        # another document must read 0, so it is zeroed here.
        halo = jnp.where((halo_seg == segment_ids[:, :1])[:, None, :], halo, 0.0)
    prev = jnp.where(i == 0, h0, halo)
    y, final = short_conv(x, weight, segment_ids=segment_ids, initial_state=prev)
    final = lax.psum(jnp.where(i == n - 1, final, 0.0), axis_name)
    return y, final
