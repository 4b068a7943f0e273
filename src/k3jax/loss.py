"""Memory-light cross-entropy over a large vocabulary (K3: 163840).

Logits are produced ``chunk`` tokens at a time inside a rematerialised scan, so neither the forward
nor the backward ever holds [B*T, V] logits: peak extra memory is [chunk, V] f32.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def chunked_cross_entropy(h, w, targets, mask, *, chunk: int = 1024, z_loss_weight: float = 0.0):
    """h [B,T,D], w [D,V], targets [B,T] int, mask [B,T] f32 ->
    (sum of masked token losses incl. z-loss, sum of mask, number of correct argmax predictions).

    Loss per token: logsumexp(z) - z[target] (+ z_loss_weight * logsumexp(z)^2), z in f32.
    """
    b, t, d = h.shape
    n = b * t
    c = min(chunk, n)
    pad = (-n) % c
    hf = jnp.pad(h.reshape(n, d), ((0, pad), (0, 0)))
    tf = jnp.pad(targets.reshape(n), (0, pad))
    mf = jnp.pad(mask.reshape(n).astype(jnp.float32), (0, pad))
    nc = (n + pad) // c

    @jax.checkpoint
    def one(hc, tc, mc):
        z = jnp.einsum("nd,dv->nv", hc, w.astype(hc.dtype), preferred_element_type=jnp.float32)
        lse = jax.nn.logsumexp(z, axis=-1)
        tgt = jnp.take_along_axis(z, tc[:, None], axis=-1)[:, 0]
        loss = lse - tgt + z_loss_weight * lse ** 2
        correct = (jnp.argmax(z, axis=-1) == tc).astype(jnp.float32)
        return jnp.sum(loss * mc), jnp.sum(correct * mc)

    def body(acc, xs):
        l, k = one(*xs)
        return (acc[0] + l, acc[1] + k), None

    (loss, correct), _ = jax.lax.scan(
        body, (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32)),
        (hf.reshape(nc, c, d), tf.reshape(nc, c), mf.reshape(nc, c)))
    return loss, jnp.sum(mf), correct
