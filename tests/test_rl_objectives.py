"""GRPO-family objectives (k3jax.rl.objectives) against a float64 numpy reference written here, row
by row from the papers' formulas: advantages, every ratio kind x every aggregation with truncated IS
and the KL term, value and gradient (central finite differences of the reference); the step-0
policy gradient; beta's exact k3 term; padding rows; metrics; misuse errors. Small shapes, CPU."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.config import RLConfig
from k3jax.rl import objectives as O

B, T, G = 12, 7, 4      # 3 groups of 4 completions, 7 token positions


# -- the reference (float64, loops, no jax) -----------------------------------------------------------
def np_advantages(r, g, kind, eps=1e-4):
    adv, info = np.zeros(len(r)), np.zeros(len(r), bool)
    for s in range(0, len(r), g):
        x = np.asarray(r[s:s + g], np.float64)
        if np.all(x == x[0]):
            continue                        # no signal: 0
        a = x - x.mean()
        if kind == "grpo":
            a = a / (np.sqrt(((x - x.mean()) ** 2).sum() / (g - 1)) + eps)
        adv[s:s + g], info[s:s + g] = a, True
    return adv, info


def np_aggregate(x, m, how):
    rows = [b for b in range(x.shape[0]) if m[b].sum() > 0]
    if not rows:
        return 0.0
    if how == "token_mean":
        return sum((x[b] * m[b]).sum() for b in rows) / sum(m[b].sum() for b in rows)
    if how == "seq_mean_token_mean":
        return sum((x[b] * m[b]).sum() / m[b].sum() for b in rows) / len(rows)
    return sum((x[b] * m[b]).sum() / x.shape[1] for b in rows) / len(rows)


def np_loss(cfg, logp, mask, r, old, rollout, ref):
    adv, info = np_advantages(r, cfg.rl_num_generations, cfg.rl_advantage)
    m = mask * (info[:, None] if cfg.rl_drop_equal_groups else 1.0)
    terms = np.zeros(logp.shape)
    lo, hi = 1 - cfg.rl_epsilon, 1 + cfg.rl_epsilon_high
    for b in range(logp.shape[0]):
        n = m[b].sum()
        if n == 0:
            continue
        if cfg.rl_objective == "grpo":
            for t in range(logp.shape[1]):
                rho = np.exp(logp[b, t] - old[b, t])
                w = min(np.exp(old[b, t] - rollout[b, t]), cfg.rl_tis_cap) if cfg.rl_tis_cap else 1.0
                terms[b, t] = -w * min(rho * adv[b], min(max(rho, lo), hi) * adv[b])
        else:   # GSPO: the sequence's length-normalised ratio and IS weight, on each of its tokens
            s = np.exp((m[b] * (logp[b] - old[b])).sum() / n)
            w = min(np.exp((m[b] * (old[b] - rollout[b])).sum() / n), cfg.rl_tis_cap) if cfg.rl_tis_cap else 1.0
            terms[b, :] = -w * min(s * adv[b], min(max(s, lo), hi) * adv[b])
    loss = np_aggregate(terms, m, cfg.rl_loss_agg)
    if cfg.rl_beta:
        d = ref - logp
        loss += cfg.rl_beta * np_aggregate(np.exp(d) - d - 1, m, cfg.rl_loss_agg)
    return loss


def np_grad(f, x, h=1e-6):
    g = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        e = np.zeros_like(x)
        e[i] = h
        g[i] = (f(x + e) - f(x - e)) / (2 * h)
    return g


# -- inputs ---------------------------------------------------------------------------------------------
def make(seed=0, clip=(0.2, 0.28)):
    """Log-probs with ratios both inside and well outside the clip range, never within 2e-3 of a
    bound (a kink the finite differences would straddle); groups of mixed, all-equal (1st group)
    and two-valued rewards; ragged masks with a middle gap (a tool result) and one empty row."""
    rng = np.random.default_rng(seed)
    logp = -rng.uniform(0.1, 3.0, (B, T))
    while True:
        d = rng.uniform(-0.6, 0.6, (B, T))
        far = np.minimum(np.abs(np.exp(-d) - (1 - clip[0])), np.abs(np.exp(-d) - (1 + clip[1])))
        if far.min() > 2e-3:
            break
    old = logp + d                       # ratio exp(logp - old) = exp(-d)
    rollout = old + rng.normal(0, 0.5, (B, T))      # some weights reach the cap of 2
    ref = logp + rng.normal(0, 0.3, (B, T))
    lengths = rng.integers(2, T + 1, B)
    mask = (np.arange(T)[None] < lengths[:, None]).astype(np.float64)
    mask[3, 1:3] = 0                     # a tool result inside a completion
    mask[7] = 0                          # a padded row
    r = np.concatenate([[1.0] * 4, rng.choice([0.0, 0.5, 1.0], 4), [0.0, 1.0, 1.0, 0.0]])
    return logp, mask, r, old, rollout, ref


def cfg_of(**kw):
    return dataclasses.replace(RLConfig(), rl_num_generations=G, **kw)


def jax_loss(cfg, logp, mask, r, old=None, rollout=None, ref=None):
    f = lambda lp: O.rl_loss(cfg, lp, jnp.asarray(mask), jnp.asarray(r),  # noqa: E731
                             old=None if old is None else jnp.asarray(old),
                             rollout=None if rollout is None else jnp.asarray(rollout),
                             ref=None if ref is None else jnp.asarray(ref))
    # eager, not jitted: the op programs are shared by every case (a jit per case compiles 50 programs)
    (loss, metrics), grad = jax.value_and_grad(f, has_aux=True)(jnp.asarray(logp))
    return float(loss), np.asarray(grad), {k: float(v) for k, v in metrics.items()}


# -- tests ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", O.ADVANTAGES)
def test_group_advantages_match_reference(kind):
    r = np.array([1, 1, 1, 1, 0, 1, 0, 0, 0.3, 0.9, 0.1, 0.7, 0.1, 0.1, 0.1, 0.1])
    adv, info = O.group_advantages(jnp.asarray(r, jnp.float32), 4, kind)
    want, want_info = np_advantages(r, 4, kind)
    np.testing.assert_allclose(np.asarray(adv), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(info), want_info)
    # groups of equal rewards are exactly 0, even where f32 rounding makes r - mean nonzero (0.1 * 4 / 4)
    assert not np.asarray(adv)[:4].any() and not np.asarray(adv)[12:].any()
    assert abs(float(adv[8:12].sum())) < 1e-5        # centred within each group
    if kind == "grpo":                               # unit sample std (up to eps) within a group
        assert abs(np.std(np.asarray(adv[8:12]), ddof=1) - 1) < 1e-3


CASES = [dict(rl_objective=o, rl_loss_agg=a) for o in O.OBJECTIVES for a in O.AGGREGATIONS] + [
    dict(rl_objective="grpo", rl_tis_cap=0.0, rl_beta=0.0),
    dict(rl_objective="grpo", rl_advantage="dr_grpo", rl_drop_equal_groups=False),
    dict(rl_objective="gspo", rl_epsilon=3e-4, rl_epsilon_high=4e-4, rl_loss_agg="seq_mean_token_mean"),
    dict(rl_objective="grpo", rl_epsilon=0.2, rl_epsilon_high=0.2, rl_beta=0.0),
]


@pytest.mark.parametrize("kw", CASES, ids=lambda kw: "-".join(f"{k[3:]}={v}" for k, v in kw.items()))
def test_loss_and_gradient_match_float64_reference(kw):
    kw = {"rl_beta": 0.05, "rl_tis_cap": 2.0, **kw}
    cfg = cfg_of(**kw)
    clip = (cfg.rl_epsilon, cfg.rl_epsilon_high)
    logp, mask, r, old, rollout, ref = make(seed=len(str(kw)), clip=clip)
    if cfg.rl_objective != "grpo":     # keep every sequence ratio clear of the clip bounds too
        s = np.exp((mask * (logp - old)).sum(-1) / np.maximum(mask.sum(-1), 1))
        for b in np.flatnonzero(np.minimum(np.abs(s - 1 + clip[0]), np.abs(s - 1 - clip[1])) < 2e-3):
            old[b] += 0.01
    ref_arg = ref if cfg.rl_beta else None
    roll_arg = rollout if cfg.rl_tis_cap else None
    want = np_loss(cfg, logp, mask, r, old, rollout, ref)
    want_grad = np_grad(lambda lp: np_loss(cfg, lp, mask, r, old, rollout, ref), logp)
    with jax.enable_x64(True):
        got, grad, _ = jax_loss(cfg, logp, mask, r, old, roll_arg, ref_arg)
    assert got == pytest.approx(want, rel=1e-10, abs=1e-12)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-6, atol=1e-9)
    assert np.abs(want_grad).max() > 1e-3           # the case has signal
    got32, grad32, _ = jax_loss(cfg, logp.astype(np.float32), mask, r, old, roll_arg, ref_arg)
    assert got32 == pytest.approx(want, rel=1e-5, abs=1e-6)
    np.testing.assert_allclose(grad32, want_grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("objective", O.OBJECTIVES)
@pytest.mark.parametrize("agg", O.AGGREGATIONS)
def test_step0_is_the_plain_policy_gradient(objective, agg):
    """pi_old == pi_theta (old omitted, or equal): ratio 1, no clipping, and the gradient is
    -agg(w * A * d logp): per token -w A m / N (token mean), -w A m / (|o_b| rows) (sequence mean),
    -w A m / (T rows) (Dr. GRPO); GSPO's and GRPO's agree there."""
    cfg = cfg_of(rl_objective=objective, rl_loss_agg=agg, rl_beta=0.0, rl_tis_cap=2.0)
    logp, mask, r, _, rollout, _ = make(seed=3)
    adv, info = np_advantages(r, G, "grpo")
    m = mask * info[:, None]
    rows = (m.sum(-1) > 0).sum()
    if objective == "grpo":
        w = np.minimum(np.exp(logp - rollout), 2.0)
    else:
        n = np.maximum(m.sum(-1, keepdims=True), 1)
        w = np.minimum(np.exp((m * (logp - rollout)).sum(-1, keepdims=True) / n), 2.0) * np.ones_like(logp)
    denom = {"token_mean": m.sum(), "seq_mean_token_mean": np.maximum(m.sum(-1, keepdims=True), 1) * rows,
             "seq_mean_token_sum_norm": T * rows}[agg]
    want = -w * adv[:, None] * m / denom
    for old in (None, logp.astype(np.float32)):
        loss, grad, metrics = jax_loss(cfg, logp.astype(np.float32), mask, r, old, rollout)
        np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-7)
        assert loss == pytest.approx(float(want.sum()), rel=1e-5, abs=1e-7)   # ratio 1: the same sum
        assert metrics["ratio_mean"] == pytest.approx(1.0)
        assert metrics["clip_low_frac"] == 0 == metrics["clip_high_frac"]


@pytest.mark.parametrize("agg", O.AGGREGATIONS)
def test_beta_adds_exactly_the_k3_term(agg):
    cfg0 = cfg_of(rl_loss_agg=agg, rl_beta=0.0)
    logp, mask, r, old, rollout, ref = make(seed=5)
    beta = 0.1
    with jax.enable_x64(True):
        l0, g0, m0 = jax_loss(cfg0, logp, mask, r, old, rollout)
        l1, g1, m1 = jax_loss(dataclasses.replace(cfg0, rl_beta=beta), logp, mask, r, old, rollout, ref)
    _, info = np_advantages(r, G, "grpo")
    m = mask * info[:, None]
    d = ref - logp
    kl = np_aggregate(np.exp(d) - d - 1, m, agg)
    assert l1 - l0 == pytest.approx(beta * kl, rel=1e-10)
    assert m1["kl"] == pytest.approx(kl, rel=1e-10) and "kl" not in m0
    # d/dlogp of exp(ref - logp) - (ref - logp) - 1 is 1 - exp(ref - logp), through the same normaliser
    g_kl = np_grad(lambda lp: np_aggregate(np.exp(ref - lp) - (ref - lp) - 1, m, agg), logp)
    np.testing.assert_allclose(g1 - g0, beta * g_kl, rtol=1e-6, atol=1e-10)
    assert m1["pg_loss"] == pytest.approx(m0["pg_loss"], rel=1e-12)


@pytest.mark.parametrize("agg", O.AGGREGATIONS)
def test_padding_rows_and_masked_tokens_change_nothing(agg):
    """A group of empty rows (a pod's padded batch) and garbage under mask 0 leave loss and gradient."""
    cfg = cfg_of(rl_loss_agg=agg, rl_beta=0.02)
    logp, mask, r, old, rollout, ref = make(seed=7)
    base = jax_loss(cfg, logp, mask, r, old, rollout, ref)
    pad = lambda x, v: np.concatenate([x, np.full((G,) + x.shape[1:], v)])  # noqa: E731
    noisy = lambda x: np.where(mask > 0, x, -30.0)                         # noqa: E731
    padded = jax_loss(cfg, pad(noisy(logp), -5.0), pad(mask, 0.0), pad(r, 0.0) + np.r_[np.zeros(B), [0, 1, 0, 1]],
                      pad(noisy(old), 2.0), pad(rollout, 9.0), pad(ref, -9.0))
    assert padded[0] == pytest.approx(base[0], rel=1e-5)
    np.testing.assert_allclose(padded[1][:B], base[1], rtol=1e-5, atol=1e-8)
    assert not padded[1][B:].any()
    for k in ("pg_loss", "kl", "ratio_mean", "clip_low_frac", "clip_high_frac", "tis_weight_mean", "tokens",
              "reward_mean", "reward_std", "advantage_abs_mean", "equal_groups_frac"):
        assert padded[2][k] == pytest.approx(base[2][k], rel=1e-5), k


def test_metrics_match_reference():
    cfg = cfg_of(rl_beta=0.0)
    logp, mask, r, old, rollout, _ = make(seed=11)
    _, _, met = jax_loss(cfg, logp.astype(np.float32), mask, r, old, rollout)
    adv, info = np_advantages(r, G, "grpo")
    m = (mask * info[:, None]) > 0
    rho = np.exp(logp - old)
    a = np.broadcast_to(adv[:, None], rho.shape)
    w = np.minimum(np.exp(old - rollout), 2.0)
    rows = mask.sum(-1) > 0
    want = {"clip_low_frac": ((a < 0) & (rho < 0.8))[m].mean(), "clip_high_frac": ((a > 0) & (rho > 1.28))[m].mean(),
            "ratio_mean": rho[m].mean(), "tis_weight_mean": w[m].mean(), "tis_capped_frac": (w >= 2.0)[m].mean(),
            "rollout_logp_gap": np.abs(old - rollout)[m].mean(), "tokens": m.sum(),
            "reward_mean": r[rows].mean(), "reward_std": r[rows].std(),
            "advantage_abs_mean": np.abs(adv)[m.any(-1)].mean(), "equal_groups_frac": 1 / 3}
    assert want["clip_low_frac"] > 0 and want["clip_high_frac"] > 0 and 0 < want["tis_capped_frac"] < 1
    for k, v in want.items():
        assert met[k] == pytest.approx(v, rel=1e-5, abs=1e-7), k


def test_drop_equal_groups_changes_only_the_normaliser():
    """Equal-reward groups carry A = 0: dropping them changes token_mean's normaliser only."""
    logp, mask, r, old, rollout, _ = make(seed=13)
    keep = jax_loss(cfg_of(rl_beta=0.0, rl_drop_equal_groups=False), logp, mask, r, old, rollout)
    drop = jax_loss(cfg_of(rl_beta=0.0, rl_drop_equal_groups=True), logp, mask, r, old, rollout)
    _, info = np_advantages(r, G, "grpo")
    ratio = mask.sum() / (mask * info[:, None]).sum()
    assert drop[0] == pytest.approx(keep[0] * ratio, rel=1e-5)
    np.testing.assert_allclose(drop[1], keep[1] * ratio, rtol=1e-5, atol=1e-8)


def test_misuse_is_an_error():
    logp, mask, r, old, rollout, ref = (jnp.asarray(x, jnp.float32) for x in make())
    with pytest.raises(ValueError, match="rl_num_iterations=2"):
        O.rl_loss(cfg_of(rl_num_iterations=2), logp, mask, r, rollout=rollout)
    with pytest.raises(ValueError, match="rl_beta=0.1"):
        O.rl_loss(cfg_of(rl_beta=0.1), logp, mask, r, rollout=rollout)
    with pytest.raises(ValueError, match="rl_beta=0.0"):
        O.rl_loss(cfg_of(), logp, mask, r, rollout=rollout, ref=ref)
    with pytest.raises(ValueError, match="rl_tis_cap=2.0"):
        O.rl_loss(cfg_of(), logp, mask, r)
    with pytest.raises(ValueError, match="groups of num_generations=5"):
        O.group_advantages(r, 5)


def test_jitted_equals_eager():
    """The trainer jits the loss with the config closed over (RLConfig holds a list: not hashable)."""
    cfg = cfg_of(rl_objective="gspo_token", rl_beta=0.01)
    logp, mask, r, old, rollout, ref = (jnp.asarray(x, jnp.float32) for x in make(seed=17))
    f = lambda lp: O.rl_loss(cfg, lp, mask, r, old=old, rollout=rollout, ref=ref)[0]  # noqa: E731
    eager, jitted = jax.value_and_grad(f)(logp), jax.jit(jax.value_and_grad(f))(logp)
    np.testing.assert_allclose(float(jitted[0]), float(eager[0]), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(jitted[1]), np.asarray(eager[1]), rtol=1e-5, atol=1e-8)
