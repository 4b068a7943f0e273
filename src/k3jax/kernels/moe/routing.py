"""MoE router: scores -> (biased) top-k selection -> routing weights.

Implements the DeepSeek-V3 `noaux_tc` router used by Kimi Linear and Kimi K3
(`k3-architecture.md` §6, §9):

    s      = sigmoid(logits)                        # [N, E] f32
    choice = s + bias                               # bias steers SELECTION only
    (optional) grouped top-k: keep the `topk_group` best of `n_group` groups,
               group score = sum of the top-2 choice scores inside the group
    idx    = top_k(choice, k)                       # ties -> lowest expert index
    w      = s[idx]          (K3, native transformers)
           = choice[idx]     (Kimi Linear remote code: bias added in place)
    w      = w / (sum(w) + 1e-20) * scaling_factor  # if renormalize

Everything is f32: the router decides which experts run, so it stays out of bf16.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["route", "router_scores"]

# DeepSeek-V3 / Kimi remote code add this to the denominator so an all-zero row cannot divide by 0.
_RENORM_EPS = 1e-20


def router_scores(logits: jax.Array, score_fn: str = "sigmoid") -> jax.Array:
    """Per-expert affinity scores.

    Args:
      logits: [N, E] router logits (any float dtype; computed in f32).
      score_fn: "sigmoid" (DeepSeek-V3, Kimi) or "softmax" (over experts).
    Returns:
      [N, E] f32 scores.
    """
    logits = logits.astype(jnp.float32)
    if score_fn == "sigmoid":
        return jax.nn.sigmoid(logits)
    if score_fn == "softmax":
        return jax.nn.softmax(logits, axis=-1)
    raise ValueError(f"score_fn must be 'sigmoid' or 'softmax', got {score_fn!r}")


def _group_mask(choice: jax.Array, n_group: int, topk_group: int) -> jax.Array:
    """Boolean [N, E] mask of experts whose group is among the `topk_group` best groups.

    Group score = sum of the two largest choice scores in the group (DeepSeek-V3): robust to a
    single outlier expert, unlike max, and cheaper than a full sum over a large group.
    """
    n, e = choice.shape
    per_group = e // n_group
    grouped = choice.reshape(n, n_group, per_group)                      # [N, G, E/G]
    group_scores = jax.lax.top_k(grouped, 2)[0].sum(-1)                  # [N, G]
    _, top_groups = jax.lax.top_k(group_scores, topk_group)              # [N, topk_group]
    keep_group = jnp.zeros((n, n_group), bool).at[
        jnp.arange(n)[:, None], top_groups].set(True)                    # [N, G]
    return jnp.repeat(keep_group, per_group, axis=1)                     # [N, E]


def route(
    logits: jax.Array,
    bias: jax.Array | None,
    *,
    top_k: int,
    renormalize: bool = True,
    scaling_factor: float = 1.0,
    weights_from_biased: bool = False,
    n_group: int = 1,
    topk_group: int = 1,
    score_fn: str = "sigmoid",
) -> tuple[jax.Array, jax.Array]:
    """Select `top_k` experts per token and their combine weights.

    Args:
      logits: [N, E] router logits (f32; other dtypes are upcast).
      bias: [E] f32 `e_score_correction_bias`, or None. Added to the scores for the top-k
        choice only (aux-loss-free balancing); it never scales an expert output unless
        `weights_from_biased`.
      top_k: experts per token (k).
      renormalize: divide the k weights by their sum (+1e-20).
      scaling_factor: `routed_scaling_factor`, applied after renormalisation (K3 1.0, Kimi
        Linear 2.446).
      weights_from_biased: gather weights from `scores + bias` instead of `scores`. The Kimi
        Linear remote code (and NeMo with `router_weight_uses_score_correction_bias`) does this
        because the bias is added in place to a view of the scores; native transformers and K3
        do not. Only matters when bias is non-zero.
      n_group, topk_group: DeepSeek-V3 grouped top-k. Experts are split into `n_group`
        contiguous groups; only experts of the `topk_group` best groups may be chosen. Masked
        experts get -inf (HF fills 0.0, which differs only if a kept expert's biased score is
        negative; both Kimi models use n_group = 1, where no mask is applied).
      score_fn: "sigmoid" or "softmax".
    Returns:
      weights: [N, k] f32 combine weights.
      idx: [N, k] int32 expert ids, distinct within a row, ordered by decreasing choice score;
        ties go to the lowest expert index (`lax.top_k` is stable), so routing is deterministic.
    """
    n, e = logits.shape
    if not 1 <= top_k <= e:
        raise ValueError(f"top_k={top_k} must be in [1, num_experts={e}]")
    scores = router_scores(logits, score_fn)                              # [N, E]
    choice = scores if bias is None else scores + bias.astype(jnp.float32)[None, :]
    select = choice
    if n_group > 1:
        if e % n_group or e // n_group < 2:
            raise ValueError(f"num_experts={e} must split into n_group={n_group} groups of >= 2")
        if not 1 <= topk_group <= n_group:
            raise ValueError(f"topk_group={topk_group} must be in [1, n_group={n_group}]")
        if top_k > topk_group * (e // n_group):
            raise ValueError(f"top_k={top_k} exceeds the {topk_group} kept groups' experts")
        select = jnp.where(_group_mask(choice, n_group, topk_group), choice, -jnp.inf)
    _, idx = jax.lax.top_k(select, top_k)                                 # [N, k]
    source = choice if weights_from_biased else scores
    weights = jnp.take_along_axis(source, idx, axis=-1)                   # [N, k]
    if renormalize:
        weights = weights / (weights.sum(-1, keepdims=True) + _RENORM_EPS)
    weights = weights * jnp.float32(scaling_factor)
    return weights, idx.astype(jnp.int32)
