"""Plain jnp causal attention for MLA prefill/training: the oracle every prefill path is tested
against, and itself ``attention_impl="jnp"`` (what ``auto`` picks on CPU up to one query block).

It returns what QK-clip needs explicitly: the per-head maximum pre-softmax logit
``max_{b,t,s valid} (q_t . k_s) * scale`` (f32, [H]), never fished out by name.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from k3jax.kernels.attention.common import NEG_INF, max_logits


def _mask(segment_ids_q, segment_ids_k, t: int, s: int, offset: int = 0):
    """[B,1,T,S] bool: causal (query t sees keys <= t + offset) and same document."""
    causal = (jnp.arange(s)[None, :] <= jnp.arange(t)[:, None] + offset)
    same = segment_ids_q[:, :, None] == segment_ids_k[:, None, :]
    return (causal[None] & same)[:, None]


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
