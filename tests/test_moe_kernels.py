"""MoE kernels vs references: routing, grouped matmul, dropless / capacity dispatch, balancing.

Every MoE path is checked against `moe_dense_reference`, forward and the gradients wrt x, the
routing weights and the three expert weights, on one compiled function per impl (the routing
cases reuse it). E stays at 8: ragged_dot on XLA:CPU costs ~G dense matmuls.
"""
import functools
import importlib.util
import math
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.kernels.moe.balance import expert_load, load_stats, sequence_aux_loss, update_bias
from k3jax.kernels.moe.dispatch import moe_capacity, moe_dense_reference, moe_dropless
from k3jax.kernels.moe.gmm import grouped_matmul
from k3jax.kernels.moe.routing import route
from k3jax.kernels.moe.dispatch import few_token_path, moe_few_tokens

N, D, F, E, K = 24, 16, 24, 8, 2


def swiglu(g, u):
    return jax.nn.silu(g) * u


def situ(g, u, beta=4.0, beta_l=25.0):
    """K3 SiTU-GLU (k3-architecture.md §6)."""
    return beta * jnp.tanh(g / beta) * jax.nn.sigmoid(g) * (beta_l * jnp.tanh(u / beta_l))


def rel_rms(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.sqrt(np.mean((a - b) ** 2) / max(np.mean(b ** 2), 1e-30)))


TOL = {jnp.float32: 2e-6, jnp.bfloat16: 2e-2}


# ----------------------------------------------------------------------------- grouped matmul

def _gmm_numpy(lhs, rhs, sizes):
    out = np.zeros((lhs.shape[0], rhs.shape[2]))
    start = 0
    for g, s in enumerate(sizes):
        out[start:start + s] = lhs[start:start + s] @ rhs[g]
        start += s
    return out                                    # rows past sum(sizes) stay 0


@pytest.mark.parametrize("impl", ["ragged_dot", "megablox", "blocked", "dense", "tokamax_ragged_dot"])
@pytest.mark.parametrize("sizes", [[5, 0, 9, 3, 0], [0, 0, 20, 0, 0], [4, 4, 4, 4, 4]],
                         ids=["empty-groups+tail-rows", "one-group", "full"])
def test_grouped_matmul_matches_numpy(impl, sizes):
    m, kk, nn = 20, 12, 10
    k1, k2, k3 = jax.random.split(jax.random.key(1), 3)
    lhs = jax.random.normal(k1, (m, kk))
    rhs = jax.random.normal(k2, (len(sizes), kk, nn))
    ct = jax.random.normal(k3, (m, nn))
    gs = jnp.asarray(sizes, jnp.int32)

    def loss(a, b):
        out = grouped_matmul(a, b, gs, impl=impl, interpret=True, tiling=(8, 128, 128))
        return jnp.sum(out * ct), out

    (_, out), (dl, dr) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(lhs, rhs)
    l64, r64, c64 = (np.asarray(t, np.float64) for t in (lhs, rhs, ct))
    assert rel_rms(out, _gmm_numpy(l64, r64, sizes)) < 1e-6
    # d lhs[m] = ct[m] @ rhs[g(m)].T; d rhs[g] = lhs_g.T @ ct_g
    want_dl = _gmm_numpy(c64, r64.transpose(0, 2, 1), sizes)
    want_dr, start = np.zeros_like(r64), 0
    for g, s in enumerate(sizes):
        want_dr[g] = l64[start:start + s].T @ c64[start:start + s]
        start += s
    assert rel_rms(dl, want_dl) < 1e-6
    assert rel_rms(dr, want_dr) < 1e-6


def test_megablox_without_interpret_fails_loudly_off_tpu():
    lhs, rhs = jnp.ones((16, 8)), jnp.ones((2, 8, 8))
    with pytest.raises(ValueError, match="interpret"):
        grouped_matmul(lhs, rhs, jnp.array([8, 8], jnp.int32), impl="megablox")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_tokamax_ragged_dot_equals_ragged_dot(dtype):
    """Forward and both gradients of moe_impl=tokamax_ragged_dot equal jax.lax.ragged_dot's
    (moe_impl=ragged_dot) on the same problem, tail rows outside every group included."""
    k1, k2, k3 = jax.random.split(jax.random.key(4), 3)
    lhs = jax.random.normal(k1, (40, 24)).astype(dtype)
    rhs = jax.random.normal(k2, (5, 24, 16)).astype(dtype)
    ct = jax.random.normal(k3, (40, 16))
    gs = jnp.asarray([7, 0, 13, 9, 3], jnp.int32)       # 32 of 40 rows in a group

    def run(impl):
        def loss(a, b):
            out = grouped_matmul(a, b, gs, impl=impl)
            return jnp.sum(out * ct), out
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(lhs, rhs)

    (_, out), grads = run("tokamax_ragged_dot")
    (_, want), want_grads = run("ragged_dot")
    assert out.dtype == want.dtype == jnp.float32
    tol = TOL[dtype]
    assert rel_rms(out, want) < tol and not np.any(np.asarray(out)[32:])
    for g, w in zip(grads, want_grads):
        assert g.dtype == w.dtype and rel_rms(g, w) < tol


def test_tokamax_ragged_dot_refuses_mxfp4():
    from k3jax.kernels.moe.quantized import MXFP4
    packed = MXFP4(jnp.zeros((2, 16, 8), jnp.uint8), jnp.zeros((2, 1, 8), jnp.uint8))
    with pytest.raises(ValueError, match="QArray"):
        grouped_matmul(jnp.ones((4, 32)), packed, jnp.array([2, 2], jnp.int32), impl="tokamax_ragged_dot")
    from k3jax import config as C
    with pytest.raises(C.ConfigError, match="tokamax_ragged_dot"):
        C.load(C.REPO_CONFIGS / "base.yml", ["experts_format=mxfp4", "moe_latent_size=32", "moe_intermediate_size=32",
                                              "moe_impl=tokamax_ragged_dot"])


def test_unknown_impl_raises():
    with pytest.raises(ValueError, match="impl"):
        grouped_matmul(jnp.ones((4, 2)), jnp.ones((1, 2, 2)), jnp.array([4], jnp.int32),
                       impl="pallas")


# ----------------------------------------------------------------------------- MoE dispatch

def _moe_fn(path):
    if path == "reference":
        return lambda *a: moe_dense_reference(*a, situ)
    if path == "capacity-huge":        # capacity_factor = E / k: no assignment can be dropped
        return lambda *a: moe_capacity(*a, situ, capacity_factor=E / K)[0]
    if path.startswith("few-"):       # few-gather / few-onehot / few-loop
        return lambda *a: moe_few_tokens(*a, situ, path=path[4:])
    impl = path.split("-", 1)[1]
    return lambda *a: moe_dropless(*a, situ, impl=impl, interpret=True)


@functools.lru_cache(maxsize=None)
def _value_and_grads(path):
    """Jitted (x, weights, idx, wg, wu, wd, ct) -> (out, grads wrt x, weights, wg, wu, wd)."""
    fn = _moe_fn(path)

    def loss(x, w, wg, wu, wd, idx, ct):
        out = fn(x, w, idx, wg, wu, wd)
        return jnp.sum(out * ct), out

    grad = jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True)
    return jax.jit(lambda *a: (lambda r: (r[0][1], r[1]))(grad(*a)))


def _problem(dtype, routing):
    ks = jax.random.split(jax.random.key(7), 7)
    x = jax.random.normal(ks[0], (N, D)).astype(dtype)
    wg = (jax.random.normal(ks[1], (E, D, F)) / math.sqrt(D)).astype(dtype)
    wu = (jax.random.normal(ks[2], (E, D, F)) / math.sqrt(D)).astype(dtype)
    wd = (jax.random.normal(ks[3], (E, F, D)) / math.sqrt(F)).astype(dtype)
    ct = jax.random.normal(ks[4], (N, D))
    logits = jax.random.normal(ks[5], (N, E))
    if routing == "ties":
        # Quantised logits: many exact ties, broken toward the lowest expert index.
        logits = jnp.round(logits)
    weights, idx = route(logits, None, top_k=K)
    if routing == "one-expert":
        # Every token's first slot goes to expert 3, the second to expert 6: 6 experts empty.
        idx = jnp.tile(jnp.array([[3, 6]], jnp.int32), (N, 1))
    if routing == "empty-experts":
        idx = jnp.stack([idx[:, 0] % 3, 3 + idx[:, 1] % 2], axis=1).astype(jnp.int32)
    return x, weights, wg, wu, wd, idx, ct


PATHS = ["dropless-ragged_dot", "dropless-megablox", "dropless-blocked", "dropless-dense", "dropless-tokamax_ragged_dot",
         "capacity-huge"]


@pytest.mark.parametrize("routing", ["random", "ties", "one-expert", "empty-experts"])
@pytest.mark.parametrize("path", PATHS)
def test_moe_matches_dense_reference_f32(path, routing):
    args = _problem(jnp.float32, routing)
    out, grads = _value_and_grads(path)(*args)
    want_out, want_grads = _value_and_grads("reference")(*args)
    assert out.dtype == jnp.float32 and out.shape == (N, D)
    assert rel_rms(out, want_out) < TOL[jnp.float32]
    for name, g, w in zip(["x", "weights", "w_gate", "w_up", "w_down"], grads, want_grads):
        assert rel_rms(g, w) < TOL[jnp.float32], name
        assert np.any(np.asarray(w) != 0), name


@pytest.mark.parametrize("path", PATHS)
def test_moe_matches_dense_reference_bf16(path):
    args = _problem(jnp.bfloat16, "random")
    out, grads = _value_and_grads(path)(*args)
    want_out, want_grads = _value_and_grads("reference")(*args)
    assert out.dtype == jnp.float32
    assert rel_rms(out, want_out) < TOL[jnp.bfloat16]
    for name, g, w in zip(["x", "weights", "w_gate", "w_up", "w_down"], grads, want_grads):
        assert g.dtype == w.dtype, name
        assert rel_rms(g, w) < TOL[jnp.bfloat16], name


def test_few_token_path_rule():
    # 0 = off; above the limit: dropless; 4*N*k <= E gathers, else one-hot over all experts.
    assert few_token_path(1, 4, 32, 0) is None
    assert few_token_path(65, 4, 32, 64) is None
    assert few_token_path(2, 4, 32, 64) == "gather"
    assert few_token_path(3, 4, 32, 64) == "onehot"
    assert few_token_path(64, 4, 32, 64) == "onehot"
    assert few_token_path(2, 4, 32, 64, impl="blocked") == "loop"      # moe_impl=blocked: N*k <= 4*E
    assert few_token_path(32, 4, 32, 64, impl="blocked") == "loop"
    assert few_token_path(33, 4, 32, 64, impl="blocked") is None
    # moe_impl=blocked with E <= 2k (deepseek3-tiny): one-hot at any N, training batches too; 0 = off.
    assert few_token_path(512, 8, 16, 64, impl="blocked") == "onehot"
    assert few_token_path(512, 8, 17, 64, impl="blocked") is None
    assert few_token_path(512, 8, 16, 0, impl="blocked") is None
    assert few_token_path(512, 8, 16, 64) is None                      # ragged_dot: the rule is blocked's
    # The loop's block fits the typical group (m + 2 sqrt(m) rows, m = N*k/E), not the mean: an
    # expert split over two blocks is read twice. 1 / 8 / 16 / 32 tokens x top-4 over 32 experts.
    from k3jax.kernels.moe.blocked import few_block_rows
    assert [few_block_rows(n * 4, 32) for n in (1, 8, 16, 32)] == [1, 4, 8, 8]


def test_moe_impl_auto_resolves_by_platform():
    from k3jax.kernels.moe.blocked import blocked_grouped_matmul
    from k3jax.kernels.moe.gmm import resolve_impl
    assert resolve_impl("auto", "cpu") == "blocked"          # XLA:CPU's ragged_dot: every expert on every row
    assert resolve_impl("auto", "tpu") == "ragged_dot"
    assert resolve_impl("auto", "gpu") == "ragged_dot"
    assert resolve_impl("auto") == "blocked"                 # no mesh here: the default backend, CPU
    assert resolve_impl("megablox", "cpu") == "megablox"     # an explicit choice is kept
    # blocked (auto's CPU pick) takes numpy operands as ragged_dot does (an eager model whose
    # parameters came back from jax.device_get indexes its experts with a scan's tracer).
    lhs, rhs = np.ones((6, 3), np.float32), np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    sizes = jnp.array([2, 4], jnp.int32)
    np.testing.assert_allclose(blocked_grouped_matmul(lhs, rhs, sizes), jax.lax.ragged_dot(lhs, rhs, sizes))


@pytest.mark.parametrize("block", [1, 4, 16])
def test_blocked_grouped_matmul_any_block_size(block):
    """Groups spanning several blocks, empty groups, rows past the groups, and one block per
    row or one for all: the same as ragged_dot, output and both gradients."""
    from k3jax.kernels.moe.blocked import blocked_grouped_matmul
    k1, k2, k3 = jax.random.split(jax.random.key(3), 3)
    sizes = jnp.asarray([7, 0, 13, 1, 0, 9], jnp.int32)            # 30 of 33 rows
    lhs, rhs = jax.random.normal(k1, (33, 12)), jax.random.normal(k2, (6, 12, 10))
    ct = jax.random.normal(k3, (33, 10))

    def run(f):
        return jax.value_and_grad(lambda a, b: jnp.sum(f(a, b) * ct), argnums=(0, 1))(lhs, rhs)

    got = run(lambda a, b: blocked_grouped_matmul(a, b, sizes, block=block))
    want = run(lambda a, b: jax.lax.ragged_dot(a, b, sizes))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert rel_rms(g, w) < 1e-6
    assert not np.any(np.asarray(jax.grad(lambda a: jnp.sum(blocked_grouped_matmul(a, rhs, sizes, block=block)
                                                           * ct))(lhs))[30:])   # no gradient past the groups


@pytest.mark.parametrize("path,n", [("few-gather", 3), ("few-onehot", N), ("few-loop", N)])
def test_few_token_dispatch_matches_dropless(path, n):
    """Outputs and every gradient within 1e-6 relative of the dropless ragged_dot path (f32),
    with the same routing (idx, weights) fed to both; bf16 to bf16 tolerance."""
    for dtype, tol in ((jnp.float32, 1e-6), (jnp.bfloat16, TOL[jnp.bfloat16])):
        x, w, wg, wu, wd, idx, ct = _problem(dtype, "random")
        args = (x[:n], w[:n], wg, wu, wd, idx[:n], ct[:n])
        out, grads = _value_and_grads(path)(*args)
        want_out, want_grads = _value_and_grads("dropless-ragged_dot")(*args)
        assert out.dtype == jnp.float32 and out.shape == (n, D)
        assert rel_rms(out, want_out) < tol, dtype
        for name, g, ref in zip(["x", "weights", "w_gate", "w_up", "w_down"], grads, want_grads):
            assert g.dtype == ref.dtype and rel_rms(g, ref) < tol, (name, dtype)
            assert np.any(np.asarray(ref) != 0), name


@pytest.mark.parametrize("block", [1, 2, 8])
def test_expert_ffn_blocked_skips_only_unused_blocks(block):
    """One expert taking every row (a group over many blocks), empty experts, and rows past the
    groups (which come out as 0): the same as the grouped-matmul FFN."""
    from k3jax.kernels.moe.blocked import expert_ffn_blocked
    from k3jax.kernels.moe.dispatch import expert_ffn_grouped
    x, _, wg, wu, wd, _, _ = _problem(jnp.float32, "random")
    sizes = jnp.asarray([0, 19, 0, 1, 0, 0, 2, 0], jnp.int32)           # 22 of N=24 rows
    got = jax.jit(lambda s: expert_ffn_blocked(x, s, wg, wu, wd, situ, block=block))(sizes)
    want = expert_ffn_grouped(x, sizes, wg, wu, wd, situ, impl="ragged_dot")
    assert rel_rms(got, want) < 1e-6
    assert not np.any(np.asarray(got[22:]))


def test_moe_layer_picks_few_token_dispatch_below_the_limit():
    """The layer routes once and gives dropless's result with the few-token path on or off; the
    dispatch it ran is visible in the jaxpr (no ragged_dot below the limit, ragged_dot above)."""
    from flax import nnx

    from k3jax import config as C
    from k3jax.layers.moe import MoE

    def layer(limit):
        cfg = C.load(C.REPO_CONFIGS / "base.yml", ["model_name=tiny", "moe_impl=ragged_dot",
                                                   f"moe_gather_max_tokens={limit}"])
        return MoE(cfg.model, cfg.kernel, nnx.Rngs(0))
    on, off = layer(64), layer(0)
    x = jax.random.normal(jax.random.key(1), (1, 5, on.cfg.hidden_size))
    run = nnx.jit(lambda m, x: m(x)[0])
    assert rel_rms(run(on, x), run(off, x)) < 1e-6
    ragged = lambda m: "ragged_dot" in str(jax.make_jaxpr(lambda x: m(x)[0])(x))  # noqa: E731
    assert not ragged(on) and ragged(off)


def test_capacity_drops_exactly_the_overflow():
    # N=6, E=4, k=2, capacity_factor 0.5 -> C = ceil(0.5 * 6 * 2 / 4) = 2 per expert.
    idx = jnp.array([[0, 1], [0, 2], [0, 1], [1, 0], [3, 2], [0, 3]], jnp.int32)
    # expert 0 sees tokens 0,1,2,3,5 -> keeps 0,1; expert 1 sees 0,2,3 -> keeps 0,2;
    # experts 2 (tokens 1,4) and 3 (tokens 4,5) fit. Dropped: (2,e0) (3,e0) (5,e0) (3,e1).
    kept = np.array([[1, 1], [1, 1], [0, 1], [0, 0], [1, 1], [0, 1]], np.float32)
    ks = jax.random.split(jax.random.key(3), 5)
    x = jax.random.normal(ks[0], (6, D))
    w = jax.random.uniform(ks[1], (6, 2), minval=0.1, maxval=1.0)
    wg, wu = (jax.random.normal(k, (4, D, F)) / 4 for k in ks[2:4])
    wd = jax.random.normal(ks[4], (4, F, D)) / 5
    capacity = jax.jit(lambda *a: moe_capacity(*a, swiglu, capacity_factor=0.5))
    reference = jax.jit(lambda *a: moe_dense_reference(*a, swiglu))
    out, dropped = capacity(x, w, idx, wg, wu, wd)
    want = reference(x, w * kept, idx, wg, wu, wd)
    assert float(dropped) == pytest.approx(4 / 12)
    assert rel_rms(out, want) < 1e-6
    np.testing.assert_array_equal(np.asarray(out[3]), 0.0)   # lost both experts: residual only
    assert rel_rms(out[2], reference(x, w, idx, wg, wu, wd)[2]) > 1e-3


def test_dropless_never_builds_token_expert_dim_tensor():
    x, w, wg, wu, wd, idx, _ = _problem(jnp.float32, "random")
    jaxpr = jax.make_jaxpr(lambda *a: moe_dropless(*a, situ))(x, w, idx, wg, wu, wd)
    shapes = {tuple(v.aval.shape) for eq in jaxpr.eqns for v in eq.outvars}
    assert not any(len(s) == 3 and s[:2] == (N, E) for s in shapes)


# ----------------------------------------------------------------------------- routing

def _logit(p):
    p = np.asarray(p, np.float64)
    return jnp.asarray(np.log(p / (1 - p)), jnp.float32)


def test_route_bias_changes_selection_not_weights():
    logits = _logit([[0.9, 0.8, 0.3, 0.2]])
    w, idx = route(logits, None, top_k=2)
    np.testing.assert_array_equal(idx, [[0, 1]])
    np.testing.assert_allclose(w, [[0.9 / 1.7, 0.8 / 1.7]], rtol=1e-6)
    bias = jnp.array([0.0, 0.0, 1.0, 0.0])                 # choice = [0.9, 0.8, 1.3, 0.2]
    w, idx = route(logits, bias, top_k=2)
    np.testing.assert_array_equal(idx, [[2, 0]])
    np.testing.assert_allclose(w, [[0.3 / 1.2, 0.9 / 1.2]], rtol=1e-6)   # unbiased scores
    # Kimi Linear remote-code quirk: weights from the biased scores.
    w, idx = route(logits, bias, top_k=2, weights_from_biased=True)
    np.testing.assert_array_equal(idx, [[2, 0]])
    np.testing.assert_allclose(w, [[1.3 / 2.2, 0.9 / 2.2]], rtol=1e-6)


def test_route_renormalise_and_scaling():
    logits = _logit([[0.6, 0.1, 0.5]])
    w, idx = route(logits, None, top_k=2, scaling_factor=2.446)
    np.testing.assert_allclose(w, [[0.6 / 1.1 * 2.446, 0.5 / 1.1 * 2.446]], rtol=1e-6)
    w, _ = route(logits, None, top_k=2, renormalize=False, scaling_factor=2.446)
    np.testing.assert_allclose(w, [[0.6 * 2.446, 0.5 * 2.446]], rtol=1e-6)
    assert w.dtype == jnp.float32 and idx.dtype == jnp.int32


def test_route_grouped_topk_masks_groups():
    # 4 groups of 2. Group score = sum of its top-2: [1.05, 1.4, 1.2, 0.4] -> keep groups 1, 2.
    p = [[0.95, 0.1, 0.7, 0.7, 0.6, 0.6, 0.2, 0.2]]
    _, idx = route(_logit(p), None, top_k=2)
    np.testing.assert_array_equal(idx, [[0, 2]])           # ungrouped: the 0.95 outlier wins
    w, idx = route(_logit(p), None, top_k=2, n_group=4, topk_group=2)
    np.testing.assert_array_equal(idx, [[2, 3]])           # tie 0.7 / 0.7 -> lower index first
    np.testing.assert_allclose(w, [[0.5, 0.5]], rtol=1e-6)
    _, idx = route(_logit(p), None, top_k=4, n_group=4, topk_group=2)
    np.testing.assert_array_equal(idx, [[2, 3, 4, 5]])
    # The bias enters the group scores: +0.45 lifts group 3 to 1.3, above group 2 (1.2).
    w, idx = route(_logit(p), jnp.array([0, 0, 0, 0, 0, 0, 0.45, 0.45]), top_k=3, n_group=4,
                   topk_group=2)
    np.testing.assert_array_equal(idx, [[2, 3, 6]])
    np.testing.assert_allclose(w, [[0.7 / 1.6, 0.7 / 1.6, 0.2 / 1.6]], rtol=1e-5)
    _, idx = route(_logit(p), jnp.array([0, 0, 0, 0, 0, 0, 0.6, 0.6]), top_k=3, n_group=4,
                   topk_group=2)
    np.testing.assert_array_equal(idx, [[6, 7, 2]])        # groups 3 (1.6) and 1 (1.4)


def test_route_ties_pick_lowest_index():
    w, idx = route(jnp.zeros((3, 6)), None, top_k=3)
    np.testing.assert_array_equal(idx, [[0, 1, 2]] * 3)
    np.testing.assert_allclose(w, np.full((3, 3), 1 / 3), rtol=1e-6)


def test_route_rejects_bad_arguments():
    with pytest.raises(ValueError):
        route(jnp.zeros((2, 6)), None, top_k=7)
    with pytest.raises(ValueError):
        route(jnp.zeros((2, 6)), None, top_k=2, n_group=4)
    with pytest.raises(ValueError):
        route(jnp.zeros((2, 6)), None, top_k=2, score_fn="relu")


def test_route_softmax_scores():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.2]]))
    w, idx = route(logits, None, top_k=2, renormalize=False, score_fn="softmax")
    np.testing.assert_array_equal(idx, [[0, 1]])
    np.testing.assert_allclose(w, [[0.5, 0.3]], rtol=1e-6)


# ----------------------------------------------------------------------------- balancing

def test_expert_load_and_stats():
    counts = expert_load(jnp.array([[0, 1], [0, 2], [0, 1]]), 4)
    np.testing.assert_array_equal(counts, [3, 2, 1, 0])
    stats = load_stats(counts)
    assert float(stats["max_over_mean"]) == pytest.approx(2.0)
    assert np.isinf(float(stats["max_min_ratio"]))
    assert float(load_stats(jnp.array([2.0, 4.0]))["max_min_ratio"]) == pytest.approx(2.0)


def test_update_bias_sign_rule():
    new = update_bias(jnp.array([0.0, 0.5, -0.5]), jnp.array([1.0, 3.0, 2.0]), 0.1)
    np.testing.assert_allclose(new, [0.1, 0.4, -0.5], rtol=1e-6)   # mean 2: up, down, stay


def test_bias_updates_balance_a_skewed_router():
    n, e, k = 512, 8, 2
    kx, kw = jax.random.split(jax.random.key(11))
    w_router = jax.random.normal(kw, (D, e)) * 0.3
    skew = jnp.linspace(1.5, -1.5, e)                      # expert 0 favoured, 7 starved

    def load(bias, key, tokens):
        x = jax.random.normal(key, (tokens, D))
        _, idx = route(x @ w_router + skew, bias, top_k=k)
        return expert_load(idx, e)

    step = jax.jit(lambda bias, key: update_bias(bias, load(bias, key, n), 0.02))
    # Judge balance on one large fixed batch so sampling noise does not blur the trend.
    evaluate = jax.jit(lambda bias: load_stats(load(bias, jax.random.key(99), 4096)))
    bias = jnp.zeros(e)
    ratios = [float(evaluate(bias)["max_min_ratio"])]
    for i, key in enumerate(jax.random.split(kx, 30)):
        bias = step(bias, key)
        if i % 10 == 9:
            ratios.append(float(evaluate(bias)["max_min_ratio"]))
    start, end = evaluate(jnp.zeros(e)), evaluate(bias)
    assert ratios[0] > 20 and ratios[1] < ratios[0] / 5 and max(ratios[1:]) < 4, ratios
    assert float(end["max_over_mean"]) < 1.35 < float(start["max_over_mean"])
    assert float(bias[0]) < 0 < float(bias[-1])            # favoured expert pushed down


def test_sequence_aux_loss():
    b, t, e, k = 2, 4, 4, 2
    uniform = jnp.full((b, t, e), 0.3)
    balanced = jnp.tile(jnp.array([[0, 1], [2, 3]]), (b, 2, 1))     # every expert twice
    assert float(sequence_aux_loss(uniform, balanced, k)) == pytest.approx(1.0, rel=1e-6)
    # Hand case: one sequence, T=2, E=2, k=1, both tokens pick expert 0.
    scores = jnp.array([[[0.6, 0.2], [0.3, 0.1]]])
    idx = jnp.array([[[0], [0]]])
    # f = [2/(1*2) * 2, 0] = [2, 0]; P_0 = mean(0.75, 0.75) -> loss = 1.5
    assert float(sequence_aux_loss(scores, idx, 1)) == pytest.approx(1.5, rel=1e-6)
    g = jax.grad(sequence_aux_loss)(scores, idx, 1)
    assert np.all(np.isfinite(np.asarray(g))) and np.any(np.asarray(g) != 0)


# ----------------------------------------------------------------------------- TPU AOT

_AOT_SCRIPT = textwrap.dedent("""
    import os
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax, jax.numpy as jnp
    from jax.experimental import topologies
    from jax.sharding import SingleDeviceSharding
    from k3jax.kernels.moe import grouped_matmul
    topo = topologies.get_topology_desc(topology_name="v5p:2x2x1", platform="tpu")
    s = SingleDeviceSharding(topo.devices[0])
    m, k, n, g = 1000, 256, 384, 8          # M not a tile multiple: exercises the padding
    args = (jax.ShapeDtypeStruct((m, k), jnp.bfloat16, sharding=s),
            jax.ShapeDtypeStruct((g, k, n), jnp.bfloat16, sharding=s),
            jax.ShapeDtypeStruct((g,), jnp.int32, sharding=s))
    def loss(lhs, rhs, sizes):
        out = grouped_matmul(lhs, rhs, sizes, impl="megablox", interpret=False)
        return jnp.sum(out * out)
    lowered = jax.jit(jax.grad(loss, argnums=(0, 1))).trace(*args).lower()
    assert "tpu_custom_call" in lowered.as_text()
    lowered.compile()
    # tokamax's Mosaic ragged_dot, fwd + both gradients: it reads the TPU generation from the
    # ambient mesh, its backward builds ops that check the host device (cross_compile), and M is
    # padded to its 128-row tile here.
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from k3jax.loss import tokamax_context
    mesh = Mesh(topo.devices[:1], ("data",))
    s = NamedSharding(mesh, P())
    args = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s) for a in args)
    def loss(lhs, rhs, sizes):
        out = grouped_matmul(lhs, rhs, sizes, impl="tokamax_ragged_dot")
        return jnp.sum(out * out)
    with jax.set_mesh(mesh), tokamax_context("mosaic_tpu"):
        lowered = jax.jit(jax.grad(loss, argnums=(0, 1))).trace(*args).lower()
    assert lowered.as_text().count("tpu_custom_call") >= 3   # forward, d lhs, d rhs
    lowered.compile()
    print("AOT-OK")
""")


def test_megablox_and_tokamax_ragged_dot_compile_for_tpu_topology():
    if importlib.util.find_spec("libtpu") is None:
        pytest.skip("libtpu not importable")
    proc = subprocess.run([sys.executable, "-c", _AOT_SCRIPT], capture_output=True, text=True,
                          timeout=300)
    assert "AOT-OK" in proc.stdout, proc.stderr[-3000:]
