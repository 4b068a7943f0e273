"""KDA decoding: one recurrent step per token, and the causal depthwise short convolution.

Both are plain f32 JAX (kda.md §4): decode is HBM-bound (one read and one write of the
[B, H, K, V] state per token), so a vectorised step is what the hardware can do anyway.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from k3jax.kernels.kda.common import compute_dtype

_HI = lax.Precision.HIGHEST


def kda_decode_step(q, k, v, g, beta, state, *, scale: float | None = None):
    """One KDA token for every row: decay, delta write, read (kda.md §1.2, §4.1).

    Args:
      q, k: [B, H, K] (already l2-normalised).  v: [B, H, V].
      g: [B, H, K] f32 log-decay (<= 0).  beta: [B, H] f32.
      state: [B, H, K, V] f32 (zero it for a row that starts a new sequence).
      scale: multiplies q; None -> K ** -0.5.

    Returns:
      o [B, H, V] in v.dtype and the new state [B, H, K, V] in the state's compute dtype.

    Reads the state twice and writes it once: S_bar = exp(g) S is never formed, since
    S_bar^T k = S^T (exp(g) k) and likewise for q, so one batched product S^T [exp(g) k, exp(g) q]
    gives both reads, and with u = beta (v - S_bar^T k) the new state S_bar + k u^T is one fused
    elementwise pass; o = S'^T q = S_bar^T q + (q . k) u. (Forming S_bar first cost two more
    passes over the [B, H, K, V] state: 1.8 -> 1.0 ms at B=32, H=4, K=V=128 on 2 CPU cores.)
    """
    dt = compute_dtype(q, k, v, g, beta, state)
    K = q.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    q, k, v, g, beta, S = (x.astype(dt) for x in (q, k, v, g, beta, state))
    q = q * scale
    decay = jnp.exp(g)                                                    # [B, H, K]
    r = jnp.einsum("bhkv,bhkj->bhjv", S, jnp.stack([decay * k, decay * q], axis=-1), precision=_HI)
    u = beta[..., None] * (v - r[..., 0, :])
    o = r[..., 1, :] + jnp.sum(q * k, axis=-1, keepdims=True) * u
    S_new = decay[..., None] * S + k[..., :, None] * u[..., None, :]
    return o.astype(v.dtype), S_new


def short_conv_step(x, conv_state, weight):
    """One token of the causal depthwise convolution (pre-activation: no SiLU here).

    Args:
      x: [B, C] the new pre-conv input.
      conv_state: [B, C, W-1] the last W-1 pre-conv inputs, oldest first.
      weight: [C, W]; y_t = sum_j weight[c, j] * x_{t-W+1+j}, so weight[:, -1] hits x_t.

    Returns:
      y [B, C] and the new conv state [B, C, W-1], in result_type(x, weight) (f32 for K3's
      f32 conv weights).
    """
    dt = jnp.result_type(x.dtype, weight.dtype, conv_state.dtype)
    window = jnp.concatenate([conv_state.astype(dt), x.astype(dt)[..., None]], axis=-1)
    y = jnp.einsum("bcw,cw->bc", window, weight.astype(dt), precision=_HI)
    return y, window[..., 1:]


def short_conv(x, weight, *, segment_ids=None, initial_state=None):
    """Causal depthwise convolution over a sequence, with document resets (pre-activation).

    Args:
      x: [B, T, C] pre-conv inputs.  weight: [C, W].
      segment_ids: [B, T] int32 or None. A token never sees inputs of another document: taps
        that reach across an id change (or into the left padding) read 0.
      initial_state: [B, C, W-1] or None (zeros); the last W-1 inputs before x, oldest first.
        Like the KDA state it belongs to the first token's document.

    Returns:
      y [B, T, C] and final_conv_state [B, C, W-1] (the last W-1 inputs of the last token's
      document, zeros where that document is shorter), both in result_type(x, weight). Passing
      final_conv_state to the next call reproduces a single call over the concatenation when
      the next call starts in that document.
    """
    B, T, C = x.shape
    W = weight.shape[-1]
    dt = jnp.result_type(x.dtype, weight.dtype,
                         *([] if initial_state is None else [initial_state.dtype]))
    prev = (jnp.zeros((B, W - 1, C), dt) if initial_state is None
            else jnp.swapaxes(initial_state, 1, 2).astype(dt))
    xp = jnp.concatenate([prev, x.astype(dt)], axis=1)                   # [B, W-1+T, C]
    seg = jnp.zeros((B, T), jnp.int32) if segment_ids is None else segment_ids
    # The carried inputs belong to the first token's document.
    segp = jnp.concatenate([jnp.repeat(seg[:, :1], W - 1, axis=1), seg], axis=1)
    y = jnp.zeros((B, T, C), dt)
    for j in range(W):
        same = (segp[:, j:j + T] == seg)[..., None]                       # tap j sees x_{t-W+1+j}
        y = y + jnp.where(same, xp[:, j:j + T], 0.0) * weight[:, j].astype(dt)
    n = xp.shape[1] - (W - 1)
    tail = xp[:, n:]                                                      # [B, W-1, C]
    keep = (segp[:, n:] == seg[:, -1:])[..., None]
    final = jnp.swapaxes(jnp.where(keep, tail, 0.0), 1, 2)
    return y, final
