"""GRPO-family policy objectives: group advantages, clipped ratios, aggregation, KL, TIS.

Pure jax functions over per-token log-probabilities of the sampled completion tokens (docs/rl.md).
Shapes: B completions (``B = prompts x G``, the G completions of a prompt on consecutive rows), T
token positions; every [B, T] array is aligned alike: position t holds the log-probability of row
b's token t given the tokens before it (the rows may hold only the completions or whole prompt +
completion sequences: the mask decides what counts).

    logp      f32 [B, T]  log pi_theta, the policy being trained (the only input with a gradient)
    old       f32 [B, T]  log pi_old: the ratio's reference (the trainer's forward of the rollout's
                          parameters); None = on-policy (rl_num_iterations=1): stop_gradient(logp)
    rollout   f32 [B, T]  log pi_rollout: what the inference engine computed while sampling
                          (under rl_temperature / rl_top_p); read only by truncated IS
    ref       f32 [B, T]  log pi_ref, a frozen reference; only with rl_beta > 0
    mask      [B, T]      1 on tokens the model generated; 0 on prompt, tool-result and template
                          tokens and on padding (a row of zeros is padding: it changes nothing)
    rewards   f32 [B]     one scalar per completion

Every aggregation counts only rows with at least one mask token, so padded rows (a pod's masked
batches) and dropped groups change neither the loss nor its gradient.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from k3jax.config import RLConfig

ADVANTAGES = ("grpo", "dr_grpo")
OBJECTIVES = ("grpo", "gspo", "gspo_token")
AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")
# GRPO's std guard: (r - mean) / (std + eps). 1e-4 as TRL and Tunix; a group of equal rewards is set
# to exactly 0 separately (its std is 0 and (r - mean) is float rounding, not signal).
STD_EPS = 1e-4

Array = jax.Array


def group_advantages(rewards: Array, num_generations: int, kind: str = "grpo",
                     eps: float = STD_EPS) -> tuple[Array, Array]:
    """Per-completion advantages from the rewards of its group (DeepSeekMath §4.1.2; Dr. GRPO §3.2).

    rewards f32 [B], B a multiple of G = ``num_generations``; rows g*G .. g*G+G-1 are group g.
    kind "grpo": A = (r - mean_g) / (std_g + eps), std the sample standard deviation (ddof=1, as
    TRL's torch.std); "dr_grpo": A = r - mean_g (no std: Dr. GRPO's unbiased form).
    -> (advantages f32 [B], informative bool [B]: the group's rewards are not all equal). A group
    whose rewards are all equal has A = 0 exactly (no signal).
    """
    if kind not in ADVANTAGES:
        raise ValueError(f"advantage kind {kind!r}: must be one of {ADVANTAGES}")
    (b,) = rewards.shape
    if num_generations < 1 or b % num_generations:
        raise ValueError(f"{b} rewards do not form groups of num_generations={num_generations}")
    r = rewards.astype(jnp.promote_types(rewards.dtype, jnp.float32)).reshape(-1, num_generations)
    centred = r - r.mean(-1, keepdims=True)
    if kind == "grpo":
        # ddof=1 needs G >= 2 (config validation); with G = 1 the group is uninformative anyway.
        std = jnp.std(r, axis=-1, ddof=1, keepdims=True) if num_generations > 1 else jnp.zeros_like(r[:, :1])
        centred = centred / (std + eps)
    informative = r.max(-1) > r.min(-1)                                       # [groups]
    adv = jnp.where(informative[:, None], centred, 0.0)
    return adv.reshape(b), jnp.repeat(informative, num_generations)


def k3_kl(logp: Array, ref: Array) -> Array:
    """Per-token k3 estimate of KL(pi_theta || pi_ref) (Schulman's "approximating KL"): with
    d = log pi_ref - log pi_theta, exp(d) - d - 1 >= 0; unbiased under samples from pi_theta."""
    d = ref - logp
    return jnp.exp(d) - d - 1.0


def tis_weight(old: Array, rollout: Array, cap: float) -> Array:
    """Truncated importance-sampling weight min(pi_old / pi_rollout, cap) per token (Yao et al. 2025),
    a constant (no gradient): corrects for sampling from the engine's pi_rollout instead of pi_old."""
    return jax.lax.stop_gradient(jnp.minimum(jnp.exp(old - rollout), cap))


def sequence_mean(x: Array, mask: Array) -> Array:
    """Masked mean over each row: [B, T] -> [B] (0 for a row without tokens)."""
    return (x * mask).sum(-1) / jnp.maximum(mask.sum(-1), 1.0)


def aggregate(per_token: Array, mask: Array, how: str) -> Array:
    """Per-token losses [B, T] -> the scalar loss, over the rows that have tokens (mask [B, T] 0/1):

    token_mean               sum_{b,t} m x / sum_{b,t} m            (DAPO: every token counts once)
    seq_mean_token_mean      mean_b [ sum_t m x / sum_t m ]         (GRPO as published, GSPO)
    seq_mean_token_sum_norm  mean_b [ sum_t m x / T ]               (Dr. GRPO: a constant normaliser,
                             T = the arrays' length, the rollout's fixed token budget per row)
    """
    if how not in AGGREGATIONS:
        raise ValueError(f"loss aggregation {how!r}: must be one of {AGGREGATIONS}")
    tokens = mask.sum(-1)                                                     # [B]
    rows = jnp.maximum((tokens > 0).sum(), 1)
    if how == "token_mean":
        return (per_token * mask).sum() / jnp.maximum(tokens.sum(), 1.0)
    if how == "seq_mean_token_mean":
        return sequence_mean(per_token, mask).sum() / rows
    return ((per_token * mask).sum(-1) / per_token.shape[-1]).sum() / rows


def clipped_surrogate(ratio: Array, adv: Array, eps_low: float, eps_high: float) -> tuple[Array, Array, Array]:
    """PPO's pessimistic term -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A), elementwise (DAPO's
    asymmetric clip-higher when eps_high > eps_low). ``adv`` broadcasts against ``ratio``.
    -> (loss, low_clipped, high_clipped): where the lower (A < 0, r < 1 - eps_low) or upper (A > 0,
    r > 1 + eps_high) bound is the active term, so the token gets no gradient."""
    clipped = jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)
    loss = -jnp.minimum(ratio * adv, clipped * adv)
    return loss, (adv < 0) & (ratio < 1.0 - eps_low), (adv > 0) & (ratio > 1.0 + eps_high)


def gspo_log_ratio(logp: Array, old: Array, mask: Array) -> Array:
    """GSPO's length-normalised sequence log-ratio (arXiv 2507.18071 eq. 7):
    log s_i = (1/|o_i|) sum_t (log pi_theta - log pi_old); [B, T] -> [B]."""
    return sequence_mean(logp - old, mask)


def gspo_token_ratio(logp: Array, old: Array, mask: Array) -> Array:
    """GSPO-token's per-token ratio s_{i,t} = sg[s_i] * pi_theta(o_t) / sg[pi_theta(o_t)] (eq. 13):
    the value of s_i on every token, the gradient s_i * d log pi_theta(o_t). [B, T]."""
    log_s = jax.lax.stop_gradient(gspo_log_ratio(logp, old, mask))
    return jnp.exp(log_s[:, None] + logp - jax.lax.stop_gradient(logp))


def rl_loss(cfg: RLConfig, logp: Array, mask: Array, rewards: Array, *, old: Array | None = None,
            rollout: Array | None = None, ref: Array | None = None) -> tuple[Array, dict[str, Array]]:
    """The GRPO-family loss of one batch of groups, and its metrics (see the module docstring for
    the arrays). ``cfg``: the rl section (rl_objective, rl_advantage, rl_loss_agg, rl_epsilon,
    rl_epsilon_high, rl_beta, rl_tis_cap, rl_drop_equal_groups, rl_num_generations,
    rl_num_iterations).

    loss = agg( w * -min(ratio A, clip(ratio) A) ) + rl_beta * agg(k3_kl(logp, ref))
      ratio  grpo: exp(logp - old) per token; gspo: s_i, the sequence's geometric-mean ratio, the
             sequence term given to each of its tokens; gspo_token: s_i's value, per-token gradient
             (gspo and gspo_token agree in value and gradient under every aggregation)
      w      truncated IS, min(exp(old - rollout), rl_tis_cap), per token (grpo) or of the
             sequence's mean log-ratio (gspo, gspo_token: the ratio's granularity); 1 when off
      agg    rl_loss_agg over the tokens kept: with rl_drop_equal_groups the rows of groups whose
             rewards are all equal are left out, terms and normaliser alike
    With old = None (on-policy) or old == logp the ratio is 1 and the gradient is the plain policy
    gradient -agg(w * A * d logp).

    Metrics (f32 scalars, token means over the tokens kept unless said): ``pg_loss``,
    ``kl`` (rl_beta > 0), ``ratio_mean``, ``clip_low_frac`` / ``clip_high_frac`` (tokens whose
    clipped term is active), ``tis_weight_mean`` / ``tis_capped_frac`` and ``rollout_logp_gap``
    (mean |old - rollout|, the mismatch; with rl_tis_cap > 0), ``reward_mean`` / ``reward_std``
    (all rows with tokens), ``advantage_abs_mean`` (kept rows), ``equal_groups_frac`` (groups
    with tokens but without signal), ``tokens`` (tokens kept).
    """
    if cfg.rl_objective not in OBJECTIVES:
        raise ValueError(f"rl_objective={cfg.rl_objective!r}: must be one of {OBJECTIVES}")
    if old is None and cfg.rl_num_iterations > 1:
        raise ValueError(f"rl_num_iterations={cfg.rl_num_iterations}: after the first optimizer step pi_old is "
                         "not the policy trained, so its log-probs (old=) must be given")
    if (ref is None) != (cfg.rl_beta == 0):
        raise ValueError(f"rl_beta={cfg.rl_beta}: reference log-probs (ref=) are needed exactly when rl_beta > 0")
    if rollout is None and cfg.rl_tis_cap > 0:
        raise ValueError(f"rl_tis_cap={cfg.rl_tis_cap}: truncated importance sampling needs the rollout's "
                         "log-probs (rollout=); set rl_tis_cap=0 to train without the correction")
    dt = jnp.promote_types(logp.dtype, jnp.float32)      # bf16 log-probs are summed in f32; f64 stays f64
    logp, mask = logp.astype(dt), mask.astype(dt)
    old = jax.lax.stop_gradient(logp if old is None else old.astype(dt))
    adv, informative = group_advantages(rewards, cfg.rl_num_generations, cfg.rl_advantage)
    has_tokens = mask.sum(-1) > 0
    if cfg.rl_drop_equal_groups:
        mask = mask * informative[:, None]

    if cfg.rl_objective == "grpo":
        ratio = jnp.exp(logp - old)
    elif cfg.rl_objective == "gspo":
        ratio = jnp.broadcast_to(jnp.exp(gspo_log_ratio(logp, old, mask))[:, None], logp.shape)
    else:
        ratio = gspo_token_ratio(logp, old, mask)
    pg, low, high = clipped_surrogate(ratio, adv[:, None], cfg.rl_epsilon, cfg.rl_epsilon_high)

    kept = jnp.maximum(mask.sum(), 1.0)
    mean = lambda x: (x * mask).sum() / kept  # noqa: E731 - token mean over the kept tokens
    metrics: dict[str, Array] = {}
    if cfg.rl_tis_cap > 0:
        rollout = jax.lax.stop_gradient(rollout.astype(dt))
        if cfg.rl_objective == "grpo":
            w = tis_weight(old, rollout, cfg.rl_tis_cap)
        else:
            w = jnp.broadcast_to(tis_weight(sequence_mean(old, mask), sequence_mean(rollout, mask),
                                            cfg.rl_tis_cap)[:, None], logp.shape)
        pg = pg * w
        metrics.update(tis_weight_mean=mean(w), tis_capped_frac=mean((w >= cfg.rl_tis_cap).astype(dt)),
                       rollout_logp_gap=mean(jnp.abs(old - rollout)))
    pg_loss = aggregate(pg, mask, cfg.rl_loss_agg)
    loss = pg_loss
    if cfg.rl_beta > 0:
        kl = aggregate(k3_kl(logp, jax.lax.stop_gradient(ref.astype(dt))), mask, cfg.rl_loss_agg)
        loss = loss + cfg.rl_beta * kl
        metrics["kl"] = kl

    r = rewards.astype(dt)
    rows = jnp.maximum(has_tokens.sum(), 1)
    r_mean = jnp.where(has_tokens, r, 0.0).sum() / rows
    kept_rows = mask.sum(-1) > 0
    live = has_tokens.reshape(-1, cfg.rl_num_generations).any(-1)           # groups that are not padding
    metrics.update(
        pg_loss=pg_loss, ratio_mean=mean(jax.lax.stop_gradient(ratio)),
        clip_low_frac=mean(low.astype(dt)), clip_high_frac=mean(high.astype(dt)),
        reward_mean=r_mean, reward_std=jnp.sqrt(jnp.where(has_tokens, (r - r_mean) ** 2, 0.0).sum() / rows),
        advantage_abs_mean=jnp.where(kept_rows, jnp.abs(adv), 0.0).sum() / jnp.maximum(kept_rows.sum(), 1),
        equal_groups_frac=(live & ~informative.reshape(live.shape[0], -1)[:, 0]).sum() / jnp.maximum(live.sum(), 1),
        tokens=mask.sum())
    return loss, metrics
