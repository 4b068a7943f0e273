"""Production MLA prefill/training attention: ``blocked`` (pure XLA, query blocks under remat)
and ``tokamax`` (splash/flash kernels on TPU).

Both keep the contract of the oracle ``reference.causal_attention`` (o [B,T,H,Dv] in v.dtype,
max_logit [H] f32 for QK-clip) and are tested against it in tests/test_loss_attention.py. They
live apart from the oracle so that reference.py stays the short obviously-correct version and
this file holds what trades clarity for memory or speed. The name table choosing among them
(ATTENTION_IMPLS, get_attention_fn) is in the package __init__, as KDA_IMPLS is for KDA, because
it picks between the oracle and these kernels and so belongs above both.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from k3jax.kernels.attention.common import NEG_INF, max_logits


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
    import tokamax  # lazy: a slow import (seconds), paid only when a tokamax implementation runs
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

