"""MLA causal attention under context parallelism: the sequence split in contiguous slices over one
mesh axis, called per shard inside a `jax.shard_map` that maps that axis.

Each shard all-gathers the compressed latent c [B, T, R] and the shared rope key k_r [B, T, Rr]
(576 values per token for K3, against H * (dn + dr + dv) = 96 * 320 for expanded keys and
values) and the segment ids, expands the keys and values of the whole sequence locally with the
up-projection W_kv (replicated; the expansion costs T * R * H * (dn + dv) multiply-adds per shard,
a few percent of the attention of a 16K-token slice against a 128K sequence), and attends its own
queries to every key at or before their global position (query t of shard j sits at j * Tl + t)
within their document. The per-head max logit for QK-clip is the max over shards (a pmax), so it
equals the unsharded statistic exactly.

The backward is plain autodiff: the all-gather's transpose is a reduce-scatter, so each shard's
latent receives the key/value gradients of every shard's queries, and W_kv's gradient is summed
over shards by shard_map (it enters replicated). Query blocks are rematerialised as in
prefill.blocked_attention, so temporaries are O(block x T) per shard.

Every shard computes its queries' logits against all T keys, the future ones masked rather than
skipped, so the shards do equal work, about twice the causal minimum on average. Skipping masked
key blocks would leave the contiguous layout unbalanced (the last shard needs n times the keys of
the first); that is what a zigzag `context_parallel_load_balance` would pair with (not done here).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from k3jax.kernels.attention.common import NEG_INF, max_logits


def _expand(lat, k_r, kv_b, num_heads: int, nope_dim: int):
    """lat [B,T,R], k_r [B,T,Rr], kv_b [R, H*(dn+dv)] -> k [B,T,H,dn+Rr], v [B,T,H,dv]."""
    kv = jnp.einsum("btr,rq->btq", lat, kv_b.astype(lat.dtype))
    kv = kv.reshape(*kv.shape[:-1], num_heads, -1)
    k_rope = jnp.broadcast_to(k_r[..., None, :], (*k_r.shape[:-1], num_heads, k_r.shape[-1]))
    return jnp.concatenate([kv[..., :nope_dim], k_rope.astype(kv.dtype)], -1), kv[..., nope_dim:]


def mla_context_parallel_attention(q, lat, k_r, kv_b, segment_ids, *, axis_name: str, scale: float,
                                   block: int = 512):
    """Causal document-masked MLA attention for this shard's queries over the whole sequence.

    Args (this shard's slice, Tl tokens of every row; shard j holds [j * Tl, (j + 1) * Tl)):
      q: [B, Tl, H, dn + Rr] queries (rope already applied to the last Rr).
      lat: [B, Tl, R] the normalised latent; k_r: [B, Tl, Rr] the rope key (rope applied).
      kv_b: [R, H * (dn + dv)] the key/value up-projection (replicated over the axis).
      segment_ids: [B, Tl] int32; a query sees keys of its own document only.
      axis_name: the mesh axis the sequence is split over; scale: the softmax scale.
      block: queries per rematerialised block.

    Returns:
      o [B, Tl, H, dv] in the expansion dtype (lat's), and max_logit [H] f32: the max of the
      valid pre-softmax logits over the whole sequence, the same on every shard (no gradient).
    """
    b, t, h, dqk = q.shape
    nope = dqk - k_r.shape[-1]
    gather = functools.partial(lax.all_gather, axis_name=axis_name, axis=1, tiled=True)
    lat_all, kr_all, seg_all = gather(lat), gather(k_r), gather(segment_ids)
    k, v = _expand(lat_all, kr_all, kv_b, h, nope)                      # [B, T_all, H, *]
    s = k.shape[1]
    offset = lax.axis_index(axis_name) * t                             # global position of query 0
    block = min(block, t)
    nb = -(-t // block)
    pad = nb * block - t
    qs = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0)))
    ss = jnp.pad(segment_ids, ((0, 0), (0, pad)), constant_values=-1)  # padded rows see no key
    qs = qs.reshape(b, nb, block, h, dqk).swapaxes(0, 1)               # [nb, B, block, H, dqk]
    ss = ss.reshape(b, nb, block).swapaxes(0, 1)

    @functools.partial(jax.checkpoint, policy=jax.checkpoint_policies.nothing_saveable)
    def one(qb, sb, j):
        logits = jnp.einsum("bthk,bshk->bhts", qb, k, preferred_element_type=jnp.float32) * scale
        pos = offset + j * block + jnp.arange(block)
        causal = jnp.arange(s)[None, :] <= pos[:, None]
        mask = (causal[None] & (sb[:, :, None] == seg_all[:, None, :]))[:, None]
        m = max_logits(lax.stop_gradient(logits), mask)
        p = jax.nn.softmax(jnp.where(mask, logits, NEG_INF), axis=-1)
        o = jnp.einsum("bhts,bshv->bthv", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return o.astype(v.dtype), m

    os, ms = lax.map(lambda xs: one(*xs), (qs, ss, jnp.arange(nb)))
    o = os.swapaxes(0, 1).reshape(b, nb * block, h, v.shape[-1])[:, :t]
    m = lax.pmax(jnp.max(ms, axis=0), axis_name)
    return o, lax.stop_gradient(m)
