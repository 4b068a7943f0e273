"""Causal attention for MLA prefill/training and latent-cache attention for decode.

Both return what QK-clip needs explicitly: the per-head maximum pre-softmax logit
``max_{b,t,s valid} (q_t . k_s) * scale`` (f32, [H]), never fished out by name.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

NEG_INF = -1e30  # large finite: fully masked rows (padding) stay NaN-free


def _mask(segment_ids_q, segment_ids_k, t: int, s: int, offset: int = 0):
    """[B,1,T,S] bool: causal (query t sees keys <= t + offset) and same document."""
    causal = (jnp.arange(s)[None, :] <= jnp.arange(t)[:, None] + offset)
    same = segment_ids_q[:, :, None] == segment_ids_k[:, None, :]
    return (causal[None] & same)[:, None]


def max_logits(logits, mask):
    """Per-head max of valid logits: logits [B,H,T,S] f32, mask [B,1,T,S] -> [H] f32."""
    return jnp.max(jnp.where(mask, logits, -jnp.inf), axis=(0, 2, 3))


def causal_attention(q, k, v, segment_ids, *, scale: float):
    """Plain jnp attention. q,k [B,T,H,Dqk], v [B,T,H,Dv], segment_ids [B,T] int32.

    Returns (o [B,T,H,Dv] in v.dtype, max_logit [H] f32). Softmax in f32.
    """
    t = q.shape[1]
    logits = jnp.einsum("bthk,bshk->bhts", q, k, preferred_element_type=jnp.float32) * scale
    mask = _mask(segment_ids, segment_ids, t, t)
    m = max_logits(jax.lax.stop_gradient(logits), mask)
    p = jax.nn.softmax(jnp.where(mask, logits, NEG_INF), axis=-1)
    o = jnp.einsum("bhts,bshv->bthv", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return o.astype(v.dtype), m


def _max_logits_blockwise(q, k, segment_ids, scale: float, block: int = 512):
    """The [H] max-logit statistic without materialising [B,H,T,T] (query blocks in a scan)."""
    b, t, h, _ = q.shape
    nb = -(-t // block)
    pad = nb * block - t
    qp = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0)))
    sp = jnp.pad(segment_ids, ((0, 0), (0, pad)), constant_values=-1)

    def body(m, i):
        qb = jax.lax.dynamic_slice_in_dim(qp, i * block, block, axis=1)
        sb = jax.lax.dynamic_slice_in_dim(sp, i * block, block, axis=1)
        logits = jnp.einsum("bthk,bshk->bhts", qb, k, preferred_element_type=jnp.float32) * scale
        causal = jnp.arange(t)[None, :] <= (i * block + jnp.arange(block))[:, None]
        mask = (causal[None] & (sb[:, :, None] == segment_ids[:, None, :]))[:, None]
        return jnp.maximum(m, max_logits(logits, mask)), None

    m, _ = jax.lax.scan(body, jnp.full((h,), -jnp.inf, jnp.float32), jnp.arange(nb))
    return jax.lax.stop_gradient(m)


def tokamax_attention(q, k, v, segment_ids, *, scale: float):
    """tokamax ``dot_product_attention`` (splash/flash kernels on TPU, XLA elsewhere) with a
    document mask; the max-logit statistic comes from a blockwise pass without gradients."""
    import tokamax
    mask = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]
    o = tokamax.dot_product_attention(q, k, v, mask=mask, scale=scale, is_causal=True)
    return o.astype(v.dtype), _max_logits_blockwise(q, k, segment_ids, scale)


QUERY_BLOCK = 512


def blocked_attention(q, k, v, segment_ids, *, scale: float, block: int = QUERY_BLOCK):
    """``causal_attention`` one query block at a time, each block rematerialised in the backward.

    Same contract and arithmetic as ``causal_attention`` (row-wise softmax is independent per query),
    but the [B,H,T,T] f32 logits and probabilities are never whole: a ``lax.map`` over query blocks
    builds [B,H,block,T] and ``jax.checkpoint`` keeps only the block's queries for the backward, so
    attention temporaries are O(block x T) instead of O(T^2). At K3's shape (96 heads, T = 4096)
    the plain path holds 6.4 GB of f32 logits per MLA layer, plus probabilities and their gradient;
    blocks of 512 hold 0.8 GB. Pure XLA, so GSPMD partitions it like any einsum (no shard_map).
    Costs the same FLOPs as the plain path plus one recomputed forward of the logits.
    """
    b, t, h, _ = q.shape
    block = min(block, t)
    nb = -(-t // block)
    pad = nb * block - t
    qp = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0)))
    sp = jnp.pad(segment_ids, ((0, 0), (0, pad)), constant_values=-1)   # padded rows see no key
    qs = qp.reshape(b, nb, block, *q.shape[2:]).swapaxes(0, 1)           # [nb, B, block, H, K]
    ss = sp.reshape(b, nb, block).swapaxes(0, 1)                          # [nb, B, block]

    @functools.partial(jax.checkpoint, policy=jax.checkpoint_policies.nothing_saveable)
    def one(qb, sb, i):
        logits = jnp.einsum("bthk,bshk->bhts", qb, k, preferred_element_type=jnp.float32) * scale
        causal = jnp.arange(t)[None, :] <= (i * block + jnp.arange(block))[:, None]
        mask = (causal[None] & (sb[:, :, None] == segment_ids[:, None, :]))[:, None]
        m = max_logits(jax.lax.stop_gradient(logits), mask)
        p = jax.nn.softmax(jnp.where(mask, logits, NEG_INF), axis=-1)
        o = jnp.einsum("bhts,bshv->bthv", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return o.astype(v.dtype), m

    os, ms = jax.lax.map(lambda xs: one(*xs), (qs, ss, jnp.arange(nb)))
    o = os.swapaxes(0, 1).reshape(b, nb * block, *v.shape[2:])[:, :t]
    return o, jnp.max(ms, axis=0)


ATTENTION_IMPLS = {"jnp": causal_attention, "blocked": blocked_attention, "tokamax": tokamax_attention}


def get_attention_fn(name: str):
    if name not in ATTENTION_IMPLS:
        raise ValueError(f"unknown attention_impl '{name}'; choose from {', '.join(ATTENTION_IMPLS)}")
    return ATTENTION_IMPLS[name]


def latent_decode_attention(q_lat, q_rope, c_cache, kr_cache, valid, *, scale: float):
    """Absorbed MLA attention for one new token per row, over the compressed cache.

    q_lat [B,H,R] (= q_nope @ W_UK per head), q_rope [B,H,Rr], c_cache [B,S,R] (normalised latent),
    kr_cache [B,S,Rr] (shared key slice), valid [B,S] bool. Returns o_lat [B,H,R] f32:
    softmax_s((q_lat . c_s + q_rope . kr_s) * scale) weighted sum of c_s.
    """
    logits = (jnp.einsum("bhr,bsr->bhs", q_lat, c_cache, preferred_element_type=jnp.float32)
              + jnp.einsum("bhr,bsr->bhs", q_rope, kr_cache, preferred_element_type=jnp.float32)) * scale
    p = jax.nn.softmax(jnp.where(valid[:, None, :], logits, NEG_INF), axis=-1)
    return jnp.einsum("bhs,bsr->bhr", p, c_cache.astype(jnp.float32))
