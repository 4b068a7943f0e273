"""Absorbed MLA attention over the latent cache, for decode (one new token per row) and chunked
prefill (a few new tokens per row continuing a cache).

A file of its own because it is a different computation from prefill, not another way of doing
the same one: it reads the compressed cache [B,S,R] with the key up-projection folded into the
query, and returns the attended latent, not heads. Prefill and decode stay separate functions
(house style), and layers/mla.py calls it directly, not through ATTENTION_IMPLS. Its check is
tests/test_loss_attention.py: it equals attention over the expanded keys and values.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from k3jax.kernels.attention.common import NEG_INF


def latent_attention(q_lat, q_rope, c_cache, kr_cache, valid, *, scale: float):
    """Absorbed MLA attention for T new tokens per row over the compressed cache (chunked prefill,
    and decode with T = 1).

    q_lat [B,T,H,R] (= q_nope @ W_UK per head), q_rope [B,T,H,Rr], c_cache [B,S,R] (normalised
    latent), kr_cache [B,S,Rr] (shared key slice), valid [B,T,S] bool (which cache slots query t of
    row b sees: its causal prefix, already written into the cache). Returns o_lat [B,T,H,R] f32:
    softmax_s((q_lat . c_s + q_rope . kr_s) * scale) weighted sum of c_s. A query with no valid
    slot gets a uniform average (finite), never NaN.
    """
    logits = (jnp.einsum("bthr,bsr->bths", q_lat, c_cache, preferred_element_type=jnp.float32)
              + jnp.einsum("bthr,bsr->bths", q_rope, kr_cache, preferred_element_type=jnp.float32)) * scale
    p = jax.nn.softmax(jnp.where(valid[:, :, None, :], logits, NEG_INF), axis=-1)
    return jnp.einsum("bths,bsr->bthr", p, c_cache.astype(jnp.float32))


def latent_decode_attention(q_lat, q_rope, c_cache, kr_cache, valid, *, scale: float):
    """``latent_attention`` for one new token per row: q_lat [B,H,R], q_rope [B,H,Rr], c_cache
    [B,S,R], kr_cache [B,S,Rr], valid [B,S] bool -> o_lat [B,H,R] f32."""
    return latent_attention(q_lat[:, None], q_rope[:, None], c_cache, kr_cache, valid[:, None], scale=scale)[:, 0]
