"""Expert load balancing: load counts, aux-loss-free bias updates, sequence-wise balance loss.

DeepSeek-V3 (arXiv:2412.19437 §2.1.2) balances experts without an auxiliary loss: after each
step the per-expert selection bias moves by a fixed `rate` toward balance,

    b_i <- b_i + rate * sign(mean_load - load_i)

so overloaded experts become less likely to be picked (the bias only affects selection, see
`routing.route`). A tiny complementary sequence-wise loss (eq. 17-20) keeps single sequences
from collapsing onto few experts.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["expert_load", "update_bias", "sequence_aux_loss", "load_stats"]


def expert_load(idx: jax.Array, num_experts: int) -> jax.Array:
    """Number of (token, slot) assignments per expert.

    Args:
      idx: [..., k] int expert ids (any leading shape).
      num_experts: E.
    Returns:
      [E] f32 counts (f32 so they can be averaged across data-parallel replicas with a psum).
    """
    return jnp.bincount(idx.reshape(-1), length=num_experts).astype(jnp.float32)


def update_bias(bias: jax.Array, counts: jax.Array, rate: float) -> jax.Array:
    """Aux-loss-free bias step: `bias + rate * sign(mean(counts) - counts)`.

    Args:
      bias: [..., E] f32 selection bias (`e_score_correction_bias`; leading axes = stacked layers).
      counts: [..., E] load of the last step(s), e.g. `expert_load` summed over the global batch.
      rate: bias update speed (DeepSeek-V3 used 1e-3).
    Returns:
      [..., E] new bias, dtype of `bias`. Not differentiated: call outside the gradient.
    """
    counts = counts.astype(jnp.float32)
    step = jnp.sign(counts.mean(-1, keepdims=True) - counts)             # +1 underloaded, -1 over
    return (bias.astype(jnp.float32) + rate * step).astype(bias.dtype)


def sequence_aux_loss(scores: jax.Array, idx: jax.Array, top_k: int) -> jax.Array:
    """DeepSeek-V3 sequence-wise balance loss (eq. 17-20), without the alpha factor.

        s'_{t,i} = s_{t,i} / sum_j s_{t,j}                 # normalised affinities
        f_i      = E / (k T) * sum_t 1[i in topk_t]        # 1.0 for a perfectly balanced sequence
        P_i      = 1/T * sum_t s'_{t,i}
        L        = mean_b sum_i f_i P_i                    # 1.0 at uniform load and scores

    Args:
      scores: [B, T, E] f32 router scores (unbiased sigmoid outputs).
      idx: [B, T, k] int32 selected experts.
      top_k: k.
    Returns:
      scalar f32 loss; multiply by the balance coefficient alpha in the caller. Gradients flow
      through `scores` only (selection counts are constants).
    """
    b, t, e = scores.shape
    scores = scores.astype(jnp.float32)
    norm = scores / (scores.sum(-1, keepdims=True) + 1e-20)                # [B, T, E]
    p = norm.mean(axis=1)                                                 # [B, E]
    hits = jax.nn.one_hot(idx, e, dtype=jnp.float32).sum(axis=(1, 2))     # [B, E]
    f = hits * (e / (top_k * t))                                          # [B, E]
    return jnp.mean(jnp.sum(jax.lax.stop_gradient(f) * p, axis=-1))


def load_stats(counts: jax.Array) -> dict[str, jax.Array]:
    """Imbalance summaries of a load vector.

    Args:
      counts: [E] loads.
    Returns:
      dict with f32 scalars `max_min_ratio` (inf when an expert got nothing) and
      `max_over_mean` (1.0 = perfectly balanced; the EP straggler factor).
    """
    counts = counts.astype(jnp.float32)
    mx, mn = counts.max(), counts.min()
    ratio = jnp.where(mn > 0, mx / jnp.where(mn > 0, mn, 1.0), jnp.inf)
    return {"max_min_ratio": ratio, "max_over_mean": mx / counts.mean()}
