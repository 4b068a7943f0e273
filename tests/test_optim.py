"""Optimizer: metadata grouping, per-expert Muon, consistent RMS, schedules, freezing, sharding,
gradient accumulation and QK-clip, on the tiny K3 model's real parameter tree.

Parameters come from ``state.abstract_state`` (shapes + metadata, no init compile) filled with numpy noise:
the optimizer only needs paths, metadata and arrays. Compile budget: one full-model update step,
small sub-tree steps, one MLA forward.
"""
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from k3jax import config as C
from k3jax import model as M
from k3jax import sharding as S
from k3jax.layers.common import RouterBias
from k3jax.layers.mla import MLA
from k3jax.optim.muon import (dimension_number, dimension_numbers, frozen_mask, init_sharded, make_optimizer,
                              opt_state_shardings, param_labels, param_path)
from k3jax.optim.qk_clip import qk_clip
from k3jax.optim.schedule import make_schedule
from k3jax.optim.muon import variables_by_path
from k3jax.layout import Layout
from k3jax.state import abstract_state

MDN = optax.contrib.MuonDimensionNumbers
NS_COEFFS = (3.4445, -4.7750, 2.0315)   # Keller Jordan's quintic Newton-Schulz coefficients


def load(*args):
    return C.load(C.REPO_CONFIGS / "base.yml", ["model_name=tiny", *args])


@pytest.fixture(scope="module")
def tiny():
    cfg = load()
    gdef, st, _ = abstract_state(cfg)
    return cfg, gdef, nnx.merge_state(st["params"], st["rest"]), st["params"]


def fill(abstract, seed=0, std=0.02):
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda x: jnp.asarray(rng.normal(0.0, std, x.shape).astype(x.dtype)), abstract)


def flat(tree):
    """{path: array} over array leaves (Variables' .value entries dropped from the path)."""
    return {param_path(kp): x for kp, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def subtree(tree, paths):
    """Nested pure dict holding only ``paths`` of ``tree``."""
    leaves = flat(tree)
    out = {}
    for p in paths:
        d = out
        for k in p[:-1]:
            d = d.setdefault(k, {})
        d[p[-1]] = leaves[p]
    return out


def newton_schulz(g, steps=5, eps=1e-8):
    """Muon's orthogonaliser for one [m, n] matrix, float64 numpy (independent of optax)."""
    a, b, c = NS_COEFFS
    x = np.asarray(g, np.float64)
    x = x / (np.linalg.norm(x) + eps)
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    for _ in range(steps):
        s = x @ x.T
        x = a * x + (b * s + c * s @ s) @ x
    return x.T if tall else x


def rms(x):
    return float(jnp.sqrt(jnp.mean(jnp.square(x.astype(jnp.float32)))))


def layer_ids(cfg):
    """(prefix layer ids, layers of one period, tail layer ids) from the model layout."""
    lay = M.layout(cfg.model)
    return lay.prefix, lay.period_layers(0), lay.tail


def layer_of(path, cfg):
    """The model layer id a parameter path belongs to (None for embed/head/final norm)."""
    pre, per, tail = layer_ids(cfg)
    if path[0] == "prefix":
        return pre[path[1]]
    if path[0] == "tail":
        return tail[path[1]]
    if path[0] == "periods":
        return per[path[2]]
    return None


# ---- grouping ---------------------------------------------------------------------------------

def test_grouping_by_metadata(tiny):
    cfg, _, state, params = tiny
    labels = param_labels(params, cfg.train)
    by_name = {}
    for p, lab in labels.items():
        by_name.setdefault(p[-1] if p[-1] != "weight" else p[-2], set()).add(lab)
    for name in ("embed_tokens", "lm_head", "norm", "input_layernorm", "post_attention_layernorm", "A_log",
                 "dt_bias", "o_norm", "q_conv", "q_a_layernorm", "kv_a_layernorm", "latent_norm",
                 "attn_res_proj", "output_attn_res_norm"):
        assert by_name[name] == {"adam"}, name
    for name in ("q_proj", "k_proj", "v_proj", "o_proj", "g_proj", "f_a_proj", "f_b_proj", "b_proj", "q_a_proj",
                 "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "router", "latent_down", "latent_up",
                 "w_gate", "w_up", "w_down", "gate_proj", "up_proj", "down_proj"):
        assert by_name[name] == {"muon"}, name
    # Muon exactly where metadata declares a matrix.
    for p, v in variables_by_path(params).items():
        assert (labels[p] == "muon") == (v.get_metadata()["matrix"] is not None), p
    assert set(param_labels(params, load("opt_type=adamw").train).values()) == {"adam"}


def test_moment_dtypes_and_adamw_trace(tiny):
    _, _, _, params = tiny
    tx = make_optimizer(load("mu_dtype=bfloat16").train, params)
    dtypes = {}
    for kp, x in jax.tree_util.tree_flatten_with_path(jax.eval_shape(tx.init, params))[0]:
        field = next((k.name for k in reversed(kp) if isinstance(k, jax.tree_util.GetAttrKey)
                      and k.name in ("mu", "nu")), None)
        if field and x.ndim:
            dtypes.setdefault(field, set()).add(jnp.dtype(x.dtype).name)
    assert dtypes == {"mu": {"bfloat16"}, "nu": {"float32"}}
    tx = make_optimizer(load("opt_type=adamw").train, params)
    u, _ = jax.eval_shape(tx.update, params, jax.eval_shape(tx.init, params), params)
    assert jax.tree.structure(u) == jax.tree.structure(params)


def test_router_bias_is_not_a_param(tiny):
    cfg, _, state, params = tiny
    bias = flat(nnx.filter_state(state, RouterBias))
    assert len(bias) == 8 and all(p[-1] == "e_score_correction_bias" for p in bias)
    assert not set(bias) & set(flat(params))
    with pytest.raises(TypeError, match="RouterBias is not an nnx.Param"):
        make_optimizer(cfg.train, state)


def test_dimension_numbers(tiny):
    _, _, _, params = tiny
    tree = dimension_numbers(params)
    assert tree["periods"]["layers"][1]["mlp"]["w_gate"] == MDN(2, 3)        # [n, E, in, out]
    assert tree["prefix"][2]["mlp"]["w_down"] == MDN(1, 2)                   # [E, in, out]
    assert tree["tail"][0]["self_attn"]["q_b_proj"] == MDN(0, 1)             # [in, out]
    assert tree["periods"]["layers"][3]["self_attn"]["kv_b_proj"] == MDN(1, 2)
    assert tree["embed_tokens"] is None and tree["lm_head"] is None and tree["norm"]["weight"] is None
    assert tree["periods"]["layers"][0]["self_attn"]["A_log"] is None


# ---- freezing ---------------------------------------------------------------------------------

def expected_frozen(group, path, cfg):
    """Independent statement of each group, from the layout and parameter names."""
    layer = layer_of(path, cfg)
    name = path[-1] if path[-1] != "weight" else path[-2]
    mixer = None if layer is None or "self_attn" not in path else cfg.model.mixer(layer)
    is_moe_ffn = layer is not None and "mlp" in path and cfg.model.ffn(layer) == "moe"
    return {
        "embed": path == ("embed_tokens",),
        "lm_head": path == ("lm_head",),
        "norms": name in ("norm", "input_layernorm", "post_attention_layernorm", "o_norm", "q_a_layernorm",
                          "kv_a_layernorm", "latent_norm", "A_log", "attn_res_proj", "attn_res_norm",
                          "mlp_res_proj", "mlp_res_norm", "output_attn_res_proj", "output_attn_res_norm"),
        "experts": name in ("w_gate", "w_up", "w_down"),
        "router": name == "router",
        "moe": is_moe_ffn,
        "attention": mixer is not None,
        "kda": mixer == "kda",
        "mla": mixer == "mla",
        "attn_res": "res" in path or name.startswith("output_attn_res"),
    }[group]


@pytest.mark.parametrize("group", ["embed", "lm_head", "norms", "experts", "router", "moe", "attention", "kda",
                                   "mla", "attn_res"])
def test_frozen_mask_groups(tiny, group):
    cfg, _, _, params = tiny
    mask = flat(frozen_mask(params, [group]))
    want = {p: expected_frozen(group, p, cfg) for p in mask}
    assert mask == want
    assert any(want.values())


def test_frozen_mask_unknown_group(tiny):
    with pytest.raises(C.ConfigError, match="unknown"):
        frozen_mask(tiny[3], ["embeddings"])


# ---- one full-model step: per-expert Muon, consistent RMS, Adam without Nesterov, freezing ---------

@pytest.fixture(scope="module")
def full_step(tiny):
    cfg, _, _, abstract = tiny
    train = load("warmup_steps_fraction=0", "muon_weight_decay=0", "adam_weight_decay=0",
                 "freeze=mla,router,norms", "gradient_clipping_threshold=0", "muon_ns_dtype=float32").train
    params, grads = fill(abstract, 0), fill(abstract, 1, std=1.0)
    tx = make_optimizer(train, abstract)

    @jax.jit
    def step(params, grads):
        u, s = tx.update(grads, tx.init(params), params)
        return u, optax.apply_updates(params, u)

    updates, new_params = step(params, grads)
    return train, params, grads, flat(updates), flat(new_params)


def test_experts_orthogonalised_per_expert(full_step):
    train, _, grads, updates, _ = full_step
    path = ("periods", "layers", 2, "mlp", "w_gate")                # [n=2, E=8, in=24, out=16]
    g, u = np.asarray(flat(grads)[path]), np.asarray(updates[path])
    lr = train.learning_rate
    for n, e in ((0, 0), (1, 5)):
        # Step 1 with Nesterov momentum: mu_hat is a positive multiple of g; NS is scale-free.
        want = -lr * 0.2 * math.sqrt(max(g.shape[-2:])) * newton_schulz(g[n, e])
        np.testing.assert_allclose(u[n, e], want, rtol=2e-4, atol=1e-4 * np.abs(want).max())
    # Orthogonalising the expert axis together would give a different update.
    joint = newton_schulz(g[1].reshape(-1, g.shape[-1])).reshape(g.shape[1:])
    assert not np.allclose(u[1, 5], -lr * 0.2 * math.sqrt(24) * joint[5], rtol=1e-2)


def test_bfloat16_newton_schulz(tiny):
    """muon_ns_dtype=bfloat16 iterates in bf16 from the f32-scaled matrix: an update
    close to the f32 iteration's, still orthogonal (singular values in NS's band), never identical."""
    _, _, _, abstract = tiny
    path = ("periods", "layers", 2, "mlp", "w_gate")
    args = ("warmup_steps_fraction=0", "muon_weight_decay=0", "gradient_clipping_threshold=0")
    grads = fill(abstract, 1, std=1.0)
    ups = []
    for dt in ("bfloat16", "float32"):
        tx = make_optimizer(load(*args, f"muon_ns_dtype={dt}").train, abstract)
        u = jax.jit(lambda g, p: tx.update(g, tx.init(p), p)[0])(grads, fill(abstract, 0))
        ups.append(np.asarray(flat(u)[path], np.float32))
    bf, f32 = ups
    assert bf.dtype == np.float32 and not np.array_equal(bf, f32)
    assert rms(bf - f32) < 0.1 * rms(f32)          # measured 5%: NS leaves the band, not a point
    sv = np.linalg.svd(bf[0, 0] / (bf[0, 0] ** 2).sum() ** 0.5 * min(bf.shape[-2:]) ** 0.5, compute_uv=False)
    assert 0.5 < sv.min() and sv.max() < 1.3


def test_newton_schulz_flops_match_the_compiled_count(tiny):
    """The per-step Newton-Schulz FLOPs (benchmarks/train_step.py's optimizer column) are the dots
    XLA's cost analysis counts for the same leaf (it adds the few elementwise FLOPs), per leaf and
    summed over the trainable Muon leaves of a model (frozen ones and AdamW runs count none)."""
    from k3jax.optim.muon import matrix_specs, newton_schulz_flops_per_step, param_labels
    from k3jax.optim.orthogonalize import MatrixSpec, newton_schulz_flops, orthogonalize
    spec = MatrixSpec(fan_in=1, fan_out=2)              # no loop axis: XLA counts a loop body once
    for shape in [(3, 48, 32), (2, 16, 40)]:
        x = jax.ShapeDtypeStruct(shape, jnp.float32)
        xla = jax.jit(lambda x: orthogonalize(x, spec)).lower(x).compile().cost_analysis()["flops"]
        ours = newton_schulz_flops(shape, spec)
        assert ours <= xla <= 1.06 * ours, (shape, ours, xla)
    _, _, _, abstract = tiny
    specs, paths = matrix_specs(abstract), variables_by_path(abstract)
    labels = param_labels(abstract, load().train)
    total = newton_schulz_flops_per_step(abstract, load().train)
    assert total == sum(newton_schulz_flops(paths[p].shape, specs[p]) for p, l in labels.items() if l == "muon") > 0
    assert newton_schulz_flops_per_step(abstract, load("opt_type=adamw").train) == 0
    assert 0 < newton_schulz_flops_per_step(abstract, load("freeze=[experts]").train) < total


def test_consistent_rms(full_step):
    train, params, _, updates, _ = full_step
    labels = param_labels(params, train)
    ratios = [rms(updates[p]) / train.learning_rate for p, lab in labels.items() if lab == "muon"]
    assert len(ratios) > 50
    # sqrt(max(fan_in, fan_out)) * 0.2 * NS(G): RMS 0.2 * rms(singular values ~ 0.7..1.1).
    assert 0.13 < min(ratios) and max(ratios) < 0.25
    assert abs(np.mean(ratios) - 0.2) < 0.03


def test_adamw_step1_is_sign_without_nesterov(full_step):
    train, _, grads, updates, _ = full_step
    # Plain AdamW step 1: -lr * m_hat / (sqrt(v_hat) + eps) = -lr * g / (|g| + eps), RMS ~ lr
    # (Nesterov would give 1 + b1 / (1 + b1) = 1.47 times that).
    for path in (("embed_tokens",), ("lm_head",), ("prefix", 0, "self_attn", "dt_bias"),
                 ("periods", "layers", 0, "self_attn", "q_conv")):
        g = np.asarray(flat(grads)[path], np.float64)
        np.testing.assert_allclose(updates[path], -train.learning_rate * g / (np.abs(g) + train.adam_eps), rtol=1e-5)
        assert rms(updates[path]) == pytest.approx(train.learning_rate, rel=1e-3)


def test_frozen_leaves_unchanged(full_step):
    train, params, _, updates, new = full_step
    old = flat(params)
    frozen = flat(frozen_mask(params, train.freeze))
    assert sum(frozen.values()) > 20 and sum(not f for f in frozen.values()) > 20
    for p, f in frozen.items():
        if f:
            assert np.array_equal(new[p], old[p]) and not np.any(updates[p]), p
        else:
            assert not np.array_equal(new[p], old[p]), p


# ---- gradient accumulation (sub-tree of real parameters: small compile) -----------------------------

SUB = [("embed_tokens",), ("periods", "layers", 3, "mlp", "w_up"), ("prefix", 3, "self_attn", "q_b_proj"),
       ("norm", "weight"), ("prefix", 1, "mlp", "router")]


def test_gradient_accumulation():
    """k micro-batches of B rows give the update of one batch of k x B rows (the scan in k3jax.step),
    with token weighting: the rows carry different numbers of loss tokens."""
    from k3jax.state import init_state
    from k3jax.step import make_train_step
    # Two layers (KDA with the dense FFN, MLA with MoE): every part of the step, a small compile.
    # adam_eps=1e-3: AdamW's first step is ~lr * sign(g), so a gradient entry near eps could flip with
    # summation-order rounding; a larger eps keeps the update a smooth function of the gradient.
    args = ["num_layers=2", "mla_extra_layers=[1]", "attn_res_block_size=1", "remat_policy=none",
            "warmup_steps_fraction=0", "adam_eps=1e-3", "muon_ns_dtype=float32"]
    one, acc = load(*args), load(*args, "gradient_accumulation_steps=2")
    mesh = S.make_mesh(one, jax.devices()[:1])
    gdef, state, tx = init_state(one, mesh, optimizer=True)
    rng = np.random.default_rng(0)
    b, t = 4, 16
    tokens = rng.integers(0, one.model.vocab_size, (b, t + 1)).astype(np.int32)
    mask = np.ones((b, t), np.float32)
    mask[0, 4:] = 0.0                                   # micro-batch 0 holds 20 loss tokens, 1 holds 32
    batch = {"tokens": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": np.ones((b, t), np.int32),
             "positions": np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)), "loss_mask": mask}
    with jax.set_mesh(mesh):
        s1, m1 = jax.jit(make_train_step(one, gdef, tx))(state, batch)
        s2, m2 = jax.jit(make_train_step(acc, gdef, tx))(state, batch)
    assert float(m1["loss_tokens"]) == float(m2["loss_tokens"]) == 52.0
    np.testing.assert_allclose(float(m2["loss"]), float(m1["loss"]), rtol=1e-6)
    np.testing.assert_allclose(float(m2["grad_norm"]), float(m1["grad_norm"]), rtol=1e-5)
    for (p, a), (_, c) in zip(flat(s1["params"]).items(), flat(s2["params"]).items()):
        # Summation order differs; Newton-Schulz amplifies the rounding a little.
        np.testing.assert_allclose(c, a, rtol=1e-4, atol=1e-6, err_msg=str(p))
    np.testing.assert_array_equal(jax.tree.leaves(s1["rest"]), jax.tree.leaves(s2["rest"]))


# ---- sharding ----------------------------------------------------------------------------------------

def test_sharded_step_keeps_shardings(tiny):
    _, _, _, abstract = tiny
    cfg = load("ici_fsdp_parallelism=2", "ici_expert_parallelism=4")
    mesh = S.make_mesh(cfg)
    shardings = flat(abstract_state(cfg, mesh)[1]["params"])
    shardings = {p: x.sharding for p, x in shardings.items()}
    paths = SUB + [("periods", "layers", 1, "self_attn", "A_log")]
    host = subtree(fill(abstract, 0), paths)
    params = jax.tree_util.tree_map_with_path(lambda kp, x: jax.device_put(x, shardings[param_path(kp)]), host)
    assert "expert" in str(flat(params)[paths[1]].sharding.spec)
    tx = make_optimizer(cfg.train, abstract)
    state = init_sharded(tx, params)

    def moments(state):
        """{param path: [state leaves (mu, nu) of that parameter]} by path suffix and shape."""
        out = {}
        for kp, x in jax.tree_util.tree_flatten_with_path(state)[0]:
            sp = param_path(kp)
            for p in paths:
                if sp[-len(p):] == p and x.shape == flat(params)[p].shape:
                    out.setdefault(p, []).append(x)
        return out

    def check(params, state):
        ps = flat(params)
        got = moments(state)
        assert set(got) == set(paths)
        for p, xs in got.items():
            for x in xs:
                assert x.sharding.is_equivalent_to(shardings[p], x.ndim), (p, x.sharding)
            assert ps[p].sharding.is_equivalent_to(shardings[p], ps[p].ndim), p

    check(params, state)
    grads = jax.tree.map(lambda x: x * 0.5 + 0.01, params)

    @jax.jit
    def step(params, state, grads):
        u, state = tx.update(grads, state, params)
        return optax.apply_updates(params, u), state

    new_params, new_state = step(params, state, grads)
    check(new_params, new_state)
    # The helper gives the same placement abstractly (restore target / AOT).
    abs_params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), params)
    for a, b in zip(jax.tree.leaves(opt_state_shardings(tx, abs_params)), jax.tree.leaves(state)):
        assert a == b.sharding or a.is_equivalent_to(b.sharding, b.ndim)


# ---- schedules ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind,expected", [
    # steps=100, peak 1.0, warmup 10, WSD decay over the last 20 steps to 0.1.
    ("wsd", {0: 0.0, 5: 0.5, 10: 1.0, 50: 1.0, 80: 1.0, 90: 0.55, 100: 0.1, 150: 0.1}),
    ("cosine", {0: 0.0, 5: 0.5, 10: 1.0, 55: 0.55, 100: 0.1, 150: 0.1,
                32: 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 22 / 90))}),
    ("constant", {0: 0.0, 5: 0.5, 10: 1.0, 99: 1.0, 150: 1.0}),
])
def test_schedules(kind, expected):
    t = C.load(C.REPO_CONFIGS / "base.yml", [f"lr_schedule={kind}", "steps=100", "learning_rate=1.0",
                                             "warmup_steps_fraction=0.1", "lr_decay_fraction=0.2",
                                             "lr_final_fraction=0.1"]).train
    f = make_schedule(t)
    for step, want in expected.items():
        assert float(f(step)) == pytest.approx(want, rel=1e-5, abs=1e-7), (kind, step)


def test_schedule_without_warmup_and_bad_fractions():
    t = load("steps=10", "learning_rate=2.0", "warmup_steps_fraction=0", "lr_decay_fraction=0").train
    assert float(make_schedule(t)(0)) == 2.0 and float(make_schedule(t)(10)) == 2.0
    with pytest.raises(C.ConfigError, match="exceed"):
        make_schedule(load("warmup_steps_fraction=0.6", "lr_decay_fraction=0.5").train)


# ---- QK-clip -----------------------------------------------------------------------------------------

# (self_attn path, stacked slice) of the tiny model's MLA layers: layer 3 (prefix), layers 7 and 11
# (slices 0 and 1 of the scanned period), layer 12 (tail).
MLA_SITES = [(("prefix", 3, "self_attn"), None), (("periods", "layers", 3, "self_attn"), 0),
             (("periods", "layers", 3, "self_attn"), 1), (("tail", 0, "self_attn"), None)]


def test_mla_sites_match_layout(tiny):
    cfg = tiny[0]
    pre, per, tail = layer_ids(cfg)
    mla = lambda l: cfg.model.mixer(l) == "mla"  # noqa: E731
    sites = ([(("prefix", i, "self_attn"), None) for i, l in enumerate(pre) if mla(l)]
             + [(("periods", "layers", j, "self_attn"), s) for j, l in enumerate(per) if mla(l)
                for s in range(M.layout(cfg.model).num_periods)]
             + [(("tail", i, "self_attn"), None) for i, l in enumerate(tail) if mla(l)])
    assert sites == MLA_SITES


@pytest.fixture(scope="module")
def mla_logits(tiny):
    """site params -> max logits [H], through the real MLA layer on a fixed input."""
    cfg = tiny[0]
    gdef, template = nnx.split(MLA(cfg.model, cfg.kernel, nnx.Rngs(0)))
    x = jnp.asarray(np.random.default_rng(7).normal(size=(2, 16, cfg.model.hidden_size)), jnp.float32)
    seg = jnp.ones((2, 16), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(16), (2, 16))
    fwd = jax.jit(lambda st: nnx.merge(gdef, st)(x, seg, pos)[1]["max_logits"])

    def logits(params, site, j):
        leaves = {p[-1]: v if j is None else v[j] for p, v in flat(params).items() if p[:len(site)] == site}
        st = jax.tree_util.tree_map_with_path(lambda kp, _: leaves[param_path(kp)[-1]], template)
        return np.asarray(fwd(st))
    return logits


def aux_for(cfg, per_site):
    """An aux tree shaped like the model's: max logits where MLA layers sit, {} elsewhere."""
    pre, per, tail = layer_ids(cfg)
    mla = lambda l: cfg.model.mixer(l) == "mla"  # noqa: E731
    aux = {"prefix": [{"max_logits": per_site[0]} if mla(l) else {} for l in pre],
           "periods": [{"max_logits": np.stack([per_site[1], per_site[2]])} if mla(l) else {} for l in per],
           "tail": [{"max_logits": per_site[3]} if mla(l) else {} for l in tail]}
    return jax.tree.map(jnp.asarray, aux)


def head_columns(cfg, h):
    m = cfg.model
    qk, kv = m.qk_head_dim, m.qk_nope_head_dim + m.v_head_dim
    return slice(h * qk, (h + 1) * qk), slice(h * kv, h * kv + m.qk_nope_head_dim)


def test_qk_clip_exact_threshold(tiny, mla_logits):
    cfg, _, _, abstract = tiny
    params = fill(abstract, 3, std=0.3)
    boosted = {0: 1, 2: 0, 3: 1}            # site index -> head pushed above tau (site 1 stays below)
    leaves = flat(params)
    for i, h in boosted.items():
        site, j = MLA_SITES[i]
        q_cols, k_cols = head_columns(cfg, h)
        for name, cols in (("q_b_proj", q_cols), ("kv_b_proj", k_cols)):
            w = np.array(leaves[site + (name,)])
            (w[j] if j is not None else w)[..., cols] *= 6.0
            leaves[site + (name,)] = jnp.asarray(w)
    params = jax.tree_util.tree_map_with_path(lambda kp, _: leaves[param_path(kp)], params)
    before = [mla_logits(params, s, j) for s, j in MLA_SITES]
    hot = [before[i][h] for i, h in boosted.items()]
    cold = [v for i, m in enumerate(before) for h, v in enumerate(m) if boosted.get(i) != h]
    assert max(cold) * 1.5 < min(hot), (cold, hot)
    tau = float(np.sqrt(max(cold) * min(hot)))

    new, stats = qk_clip(params, aux_for(cfg, before), M.layout(cfg.model), threshold=tau, cfg_model=cfg.model)
    assert int(stats["clipped_heads"]) == 3
    assert float(stats["max_logit"]) == pytest.approx(max(hot), rel=1e-6)
    after = [mla_logits(new, s, j) for s, j in MLA_SITES]
    old_f, new_f = flat(params), flat(new)
    for i, (site, j) in enumerate(MLA_SITES):
        for h in range(cfg.model.num_attention_heads):
            if boosted.get(i) == h:
                assert after[i][h] == pytest.approx(tau, rel=1e-5)
            else:
                assert after[i][h] == before[i][h]
        q_cols, k_cols = head_columns(cfg, 1 - boosted.get(i, 1))     # an unclipped head of this site
        for name, cols in (("q_b_proj", q_cols), ("kv_b_proj", k_cols)):
            sl = (j, Ellipsis, cols) if j is not None else (Ellipsis, cols)
            assert np.array_equal(new_f[site + (name,)][sl], old_f[site + (name,)][sl])
    # The shared rope key (kv_a_proj_with_mqa), q_a_proj, values and all other weights: bitwise unchanged.
    for p in old_f:
        if p[-1] not in ("q_b_proj", "kv_b_proj"):
            assert np.array_equal(new_f[p], old_f[p]), p
    for site, _ in MLA_SITES:
        kv_b_old, kv_b_new = old_f[site + ("kv_b_proj",)], new_f[site + ("kv_b_proj",)]
        v = np.ones(kv_b_old.shape[-1], bool)
        for h in range(cfg.model.num_attention_heads):
            v[head_columns(cfg, h)[1]] = False
        assert np.array_equal(kv_b_old[..., v], kv_b_new[..., v])
    assert isinstance(new, nnx.State) and jax.tree.structure(new) == jax.tree.structure(params)


def test_qk_clip_accepts_model_aux(tiny):
    """The model's own aux tree (traced, not compiled) reaches every MLA weight with matching shapes."""
    cfg, gdef, state, params = tiny

    def clip(state):
        _, aux = nnx.merge(gdef, state)(jnp.zeros((1, 8), jnp.int32))
        return qk_clip(nnx.filter_state(state, nnx.Param), aux, M.layout(cfg.model), threshold=1.0, cfg_model=cfg.model)

    new, stats = jax.eval_shape(clip, state)
    assert jax.tree.structure(new) == jax.tree.structure(params)
    assert stats["clipped_heads"].shape == () and stats["max_logit"].dtype == jnp.float32


def test_qk_clip_noop_below_threshold(tiny, mla_logits):
    cfg, _, _, abstract = tiny
    params = fill(abstract, 4, std=0.3)
    before = [mla_logits(params, s, j) for s, j in MLA_SITES]
    tau = 1.01 * max(float(m.max()) for m in before)
    new, stats = jax.jit(lambda p, a: qk_clip(p, a, M.layout(cfg.model), threshold=tau, cfg_model=cfg.model))(params, aux_for(cfg, before))
    assert int(stats["clipped_heads"]) == 0
    assert float(stats["max_logit"]) == pytest.approx(tau / 1.01, rel=1e-6)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(new)):
        assert np.array_equal(a, b)


def test_qk_clip_direct_q_proj():
    """Without q LoRA the per-head query columns of q_proj are scaled (pure-dict params, [n] stack)."""
    cfg = load("q_lora_rank=null")
    m = cfg.model
    gdef, st = nnx.split(MLA(m, cfg.kernel, nnx.Rngs(1)))
    assert "q_proj" in st and "q_b_proj" not in st
    x = jnp.asarray(np.random.default_rng(0).normal(size=(1, 8, m.hidden_size)), jnp.float32)
    seg, pos = jnp.ones((1, 8), jnp.int32), jnp.broadcast_to(jnp.arange(8), (1, 8))

    def logits(weights):
        s = jax.tree_util.tree_map_with_path(lambda kp, _: weights[param_path(kp)[-1]], st)
        return np.asarray(nnx.merge(gdef, s)(x, seg, pos)[1]["max_logits"])

    base = nnx.to_pure_dict(st)
    s0 = logits(base)
    assert s0[0] > 0
    tau = 0.5 * float(s0[0])
    # One stacked site of depth 2 (both slices hold the same weights); only head 0 of slice 1 is hot.
    stacked = {k: jnp.stack([v, v]) for k, v in base.items()}
    params = {"periods": {"layers": {0: {"self_attn": stacked}}}}
    hot = jnp.asarray([[tau / 2, tau / 2], [s0[0], tau / 2]])
    new, stats = qk_clip(params, {"prefix": [], "periods": [{"max_logits": hot}], "tail": []},
                         Layout(prefix=(), period=1, num_periods=2, tail=()), threshold=tau, cfg_model=m)
    assert int(stats["clipped_heads"]) == 1
    out = new["periods"]["layers"][0]["self_attn"]
    s1 = logits({k: v[1] for k, v in out.items()})
    assert s1[0] == pytest.approx(tau, rel=1e-5) and s1[1] == s0[1]
    for k, v in out.items():
        assert np.array_equal(v[0], stacked[k][0]), k
    q_cols, k_cols = head_columns(cfg, 0)
    assert not np.array_equal(out["q_proj"][1][:, q_cols], stacked["q_proj"][1][:, q_cols])
    assert np.array_equal(out["kv_a_proj_with_mqa"], stacked["kv_a_proj_with_mqa"])


# ---- the Muon branch: optax.contrib.muon's arithmetic, sharded layout --------------------------------

def test_muon_matches_optax_contrib(tiny):
    """Two steps of our Muon branch == optax.contrib.muon (the independent reference) on real leaves:
    stacked experts [n, E, in, out], stacked projections and unstacked ones."""
    _, _, _, abstract = tiny
    train = load("warmup_steps_fraction=0", "gradient_clipping_threshold=0", "freeze=[]",
                 "muon_ns_dtype=float32").train   # optax iterates in the leaves' dtype
    labels = param_labels(abstract, train)
    paths = [p for p in (("periods", "layers", 2, "mlp", "w_gate"), ("periods", "layers", 0, "self_attn", "q_proj"),
                         ("prefix", 3, "self_attn", "q_b_proj"), ("periods", "layers", 3, "mlp", "w_up"))]
    assert all(labels[p] == "muon" for p in paths)
    params = subtree(fill(abstract, 0), paths)
    grads = [subtree(fill(abstract, s, std=1.0), paths) for s in (1, 2)]
    dims = {p: dimension_number(v) for p, v in variables_by_path(abstract).items()}
    ref = optax.contrib.muon(train.learning_rate, beta=0.95, weight_decay=train.muon_weight_decay, nesterov=True,
                             consistent_rms=train.muon_consistent_rms,
                             muon_weight_dimension_numbers=lambda t: jax.tree_util.tree_map_with_path(
                                 lambda kp, _: dims[param_path(kp)], t))
    ours = make_optimizer(train, abstract)

    @jax.jit
    def two_steps(params, g1, g2):
        out = []
        for tx in (ours, ref):
            s = tx.init(params)
            u1, s = tx.update(g1, s, params)
            u2, _ = tx.update(g2, s, optax.apply_updates(params, u1))
            out.append((u1, u2))
        return out

    (a1, a2), (b1, b2) = two_steps(params, *grads)
    for a, b in ((a1, b1), (a2, b2)):
        for p in paths:
            x, y = np.asarray(flat(a)[p], np.float64), np.asarray(flat(b)[p], np.float64)
            # Same arithmetic in another order: f32 rounding, amplified a little by Newton-Schulz.
            assert rms(x - y) <= 1e-5 * rms(y), (p, rms(x - y) / rms(y))


def test_muon_update_stays_sharded():
    """A stacked expert weight [layers, E, D, F] with E on `expert` and D on `fsdp`: the update keeps
    the parameter's sharding and its temporaries stay near the local shard. optax.contrib.muon
    flattens (layers, E) and gathers the leaf (the 7 TB/device K3 compile); the comparison shows the
    measurement can tell the two apart."""
    from k3jax.optim.orthogonalize import MatrixSpec, scale_by_muon
    mesh = jax.make_mesh((2, 4), ("fsdp", "expert"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    shape = (4, 16, 128, 96)
    sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "expert", "fsdp", None))
    leaf_bytes = math.prod(shape) * 4
    x = {"w": jax.ShapeDtypeStruct(shape, jnp.float32, sharding=sh)}
    spec = MatrixSpec(fan_in=2, fan_out=3, loop_axis=0)
    ours = scale_by_muon(lambda t: jax.tree.map(lambda _: spec, t), beta=0.95, consistent_rms=0.2)
    ref = optax.contrib.muon(1.0, beta=0.95, consistent_rms=0.2, weight_decay=0.0, muon_weight_dimension_numbers=(
        lambda t: jax.tree.map(lambda _: MDN(2, 3), t)))

    def compiled(tx):
        st = jax.tree.map(lambda a: jax.ShapeDtypeStruct(
            a.shape, a.dtype, sharding=sh if a.shape == shape else jax.sharding.NamedSharding(
                mesh, jax.sharding.PartitionSpec())), jax.eval_shape(tx.init, x))
        with jax.set_mesh(mesh):
            return jax.jit(lambda g, s: tx.update(g, s, g)[0]).lower(x, st).compile()

    mine, theirs = compiled(ours), compiled(ref)
    assert mine.output_shardings["w"].is_equivalent_to(sh, 4)
    temp, ref_temp = mine.memory_analysis().temp_size_in_bytes, theirs.memory_analysis().temp_size_in_bytes
    assert temp < 0.5 * leaf_bytes, (temp, leaf_bytes)        # local shard is leaf / 8
    assert ref_temp > 2 * temp, (ref_temp, temp)
