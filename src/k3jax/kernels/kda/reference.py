"""Token-serial Kimi Delta Attention: the ground truth every other KDA path is tested against.

Recurrence per batch row b and head h (kda.md §1.2; arXiv 2510.26692 Eq. 1), state S [K,V]:

    if reset_t: S <- 0
    S   <- exp(g_t)[:, None] * S            # decay the rows (key channels)
    e   <- v_t - S^T k_t                    # delta residual against the decayed state
    S   <- S + beta_t * k_t e^T             # beta scales the erase and the write together
    o_t <- S^T (scale * q_t)                # read the UPDATED state

No l2-normalisation happens here: the layer normalises q and k before calling the core.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from k3jax.kernels.kda.common import compute_dtype, match_vma, reset_flags

_HIGHEST = lax.Precision.HIGHEST


def kda_reference(q, k, v, g, beta, *, scale: float | None = None, initial_state=None,
                  segment_ids=None):
    """Token-serial KDA recurrence as a `lax.scan` over time.

    Args:
      q, k: [B, T, H, K] any float dtype (already l2-normalised by the caller).
      v: [B, T, H, V] any float dtype.
      g: [B, T, H, K] float32 log-decay, <= 0.
      beta: [B, T, H] float32 write strength.
      scale: multiplies q inside the core; None -> K ** -0.5.
      initial_state: [B, H, K, V] float32 or None (zeros).
      segment_ids: [B, T] int32 or None; the state resets where the id changes between t-1 and t.

    Returns:
      o [B, T, H, V] in v.dtype and the final state [B, H, K, V] in the compute dtype
      (float32, or float64 when the inputs are float64 with x64 enabled).
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    dt = compute_dtype(q, k, v, g, beta, initial_state)
    scale = K ** -0.5 if scale is None else scale
    if initial_state is None:
        initial_state = jnp.zeros((B, H, K, V), dt)
    reset = reset_flags(segment_ids, B, T)

    def step(S, xs):
        q_t, k_t, v_t, g_t, b_t, r_t = xs          # [B,H,K] x3 / [B,H,V] / [B,H] / [B]
        S = jnp.where(r_t[:, None, None, None], 0.0, S)
        S = jnp.exp(g_t)[..., None] * S
        e = v_t - jnp.einsum("bhkv,bhk->bhv", S, k_t, precision=_HIGHEST)
        S = S + jnp.einsum("bhk,bhv->bhkv", b_t[..., None] * k_t, e, precision=_HIGHEST)
        o_t = jnp.einsum("bhkv,bhk->bhv", S, q_t * scale, precision=_HIGHEST)
        return S, o_t

    # Time-major inputs for the scan, all in the compute dtype.
    xs = (q, k, v, g, beta)
    xs = tuple(jnp.moveaxis(x.astype(dt), 1, 0) for x in xs) + (jnp.moveaxis(reset, 1, 0),)
    S, o = lax.scan(step, match_vma(initial_state.astype(dt), xs[0]), xs)
    return jnp.moveaxis(o, 0, 1).astype(v.dtype), S
