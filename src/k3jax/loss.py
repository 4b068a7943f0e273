"""Memory-light cross-entropy over a large vocabulary (K3: 163840).

Logits are produced ``chunk`` positions of every row at a time inside a rematerialised scan, so
neither the forward nor the backward ever holds [B, T, V] logits: peak extra memory is
[B, chunk, V] f32 (per device: its local rows).
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
    # Chunks run along the sequence inside each row, never across rows: the batch axis is the
    # one sharded over data/fsdp/expert, and a scan over a flattened B*T axis would slice the
    # sharded dimension, which GSPMD can only do by gathering every row of the global batch onto
    # every device (the K3 compile held bf16[T, global B, D] = 56 GB per device that way).
    c = min(chunk, t)
    pad = (-t) % c
    nc = (t + pad) // c
    hf = jnp.pad(h, ((0, 0), (0, pad), (0, 0))).reshape(b, nc, c, d).swapaxes(0, 1)    # [nc, B, c, D]
    tf = jnp.pad(targets, ((0, 0), (0, pad))).reshape(b, nc, c).swapaxes(0, 1)
    mf = jnp.pad(mask.astype(jnp.float32), ((0, 0), (0, pad))).reshape(b, nc, c).swapaxes(0, 1)

    @jax.checkpoint
    def one(hc, tc, mc):
        z = jnp.einsum("bnd,dv->bnv", hc, w.astype(hc.dtype), preferred_element_type=jnp.float32)
        lse = jax.nn.logsumexp(z, axis=-1)
        tgt = jnp.take_along_axis(z, tc[..., None], axis=-1)[..., 0]
        loss = lse - tgt + z_loss_weight * lse ** 2
        correct = (jnp.argmax(z, axis=-1) == tc).astype(jnp.float32)
        return jnp.sum(loss * mc), jnp.sum(correct * mc)

    def body(acc, xs):
        l, k = one(*xs)
        return (acc[0] + l, acc[1] + k), None

    (loss, correct), _ = jax.lax.scan(
        body, (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32)),
        (hf, tf, mf))
    return loss, jnp.sum(mf), correct


def chunked_row_losses(h, w, targets, mask, *, chunk: int = 1024):
    """Evaluation form of ``chunked_cross_entropy``: per row instead of summed, no z-loss, no
    gradient. h [B,T,D], w [D,V], targets [B,T] int, mask [B,T] f32 -> (masked loss sum [B], mask
    sum [B], correct argmax predictions [B]), all f32. Per row so that one row can hold one scored
    candidate (HellaSwag endings) and so that the totals are sums of a small replicated output."""
    b, t, d = h.shape
    c = min(chunk, t)
    pad = (-t) % c
    nc = (t + pad) // c
    hf = jnp.pad(h, ((0, 0), (0, pad), (0, 0))).reshape(b, nc, c, d).swapaxes(0, 1)    # [nc, B, c, D]
    tf = jnp.pad(targets, ((0, 0), (0, pad))).reshape(b, nc, c).swapaxes(0, 1)
    mf = jnp.pad(mask.astype(jnp.float32), ((0, 0), (0, pad))).reshape(b, nc, c).swapaxes(0, 1)

    def body(acc, xs):
        hc, tc, mc = xs
        z = jnp.einsum("bnd,dv->bnv", hc, w.astype(hc.dtype), preferred_element_type=jnp.float32)
        loss = jax.nn.logsumexp(z, axis=-1) - jnp.take_along_axis(z, tc[..., None], axis=-1)[..., 0]
        correct = (jnp.argmax(z, axis=-1) == tc).astype(jnp.float32)
        keep = mc > 0   # where, not a product: a padding position's loss may be inf and 0 * inf is nan
        return (acc[0] + jnp.sum(jnp.where(keep, loss, 0.0), -1), acc[1] + jnp.sum(jnp.where(keep, correct, 0.0), -1)), None

    zeros = jnp.zeros((b,), jnp.float32)
    (loss, correct), _ = jax.lax.scan(body, (zeros, zeros), (hf, tf, mf))
    return loss, jnp.sum(mf, (0, 2)), correct
