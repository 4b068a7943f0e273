"""Chunked KDA (WY/UT + chunk walk, custom VJP) against the float64 token-serial reference.

Every case compares the output, the final state and the gradients of q, k, v, g, beta and the
initial state (random cotangents on both outputs) by relative RMS, rms(a - b) / rms(b):
float32 <= 1e-5, bf16 inputs <= 2e-2. Inputs follow kda.md §6: l2-normalised q, correlated
keys with beta near 1 (they expose unstable triangular inverses), K3 gates down to the -5 lower
bound (cumulative sums far below exp's f32 range over a chunk), unbounded softplus gates, packed
documents with resets inside 16-row sub-blocks, on consecutive tokens (single-token documents)
and exactly on chunk boundaries. Each case draws its inputs from a seed derived from its id.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import BF16_TOL, F32_TOL, assert_close, make_inputs, rel, run, run_reference

from k3jax.kernels.kda.chunked import kda_chunked
from k3jax.kernels.kda.chunked import chunked_flops_per_token
from k3jax.kernels.kda.intra import midpoint_block

# id, B, T, H, K, V, segments, initial state, gate, chunk, q/k/v dtype
# One object per chunk size, so that cases of equal shapes share one compiled function.
CHUNKED = {c: functools.partial(kda_chunked, chunk_size=c) for c in (32, 64, 128)}


CASES = [
    ("t1", 2, 1, 2, 32, 16, "none", True, "k3", 64, jnp.float32),
    ("t63_k16_v32", 1, 63, 1, 16, 32, "packed", True, "k3", 64, jnp.float32),
    ("t64_pinned_gates", 2, 64, 2, 32, 32, "packed", True, "pinned", 64, jnp.float32),
    ("t64_zero_gates", 2, 64, 2, 32, 32, "none", True, "zero", 64, jnp.float32),
    ("t65_reset_on_boundary", 1, 65, 2, 32, 16, "packed", True, "k3", 64, jnp.float32),
    ("t200_softplus_c32", 2, 200, 1, 16, 16, "packed", False, "softplus16", 32, jnp.float32),
    ("t150_c128", 1, 150, 1, 32, 32, "packed", True, "k3", 128, jnp.float32),
    ("t130_bf16", 2, 130, 2, 32, 16, "packed", True, "k3", 64, jnp.bfloat16),
    ("t1000", 1, 1000, 1, 16, 16, "packed", True, "k3", 64, jnp.float32),
    ("t1000_pinned_one_doc", 1, 1000, 1, 16, 16, "none", True, "pinned", 64, jnp.float32),
]
# The bounded relation form (lower_bound=-5, K3's gate): gates at and near the bound, resets in
# every 16-row block, C = 16 / 32 / 64 / 128 (midpoint blocks of 16, and a chunk of one block).
BOUNDED = {c: functools.partial(kda_chunked, chunk_size=c, lower_bound=-5.0) for c in (16, 32, 64, 128)}
BOUNDED_CASES = [
    ("b_t64_pinned", 2, 64, 2, 32, 32, "packed", True, "pinned", 64, jnp.float32),
    ("b_t200_k3_c32", 1, 200, 2, 16, 32, "packed", True, "k3", 32, jnp.float32),
    ("b_t150_pinned_c128", 1, 150, 1, 32, 16, "packed", True, "pinned", 128, jnp.float32),
    ("b_t70_k3_c16", 1, 70, 1, 16, 16, "packed", False, "k3", 16, jnp.float32),
    ("b_t130_bf16", 2, 130, 2, 32, 16, "packed", True, "k3", 64, jnp.bfloat16),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_chunked_matches_reference(case):
    got = _check_against_reference(CHUNKED, case)
    assert got[0].dtype == case[-1] and got[1].dtype == jnp.float32


def _check_against_reference(fns, case):
    """Outputs, state and every gradient of fns[chunk] against the reference on ``case``."""
    cid, B, T, H, K, V, segs, use_h0, gate, chunk, dtype = case
    inputs, seg, cots = make_inputs(cid, B, T, H, K, V, segs=segs, gate=gate, chunk=chunk)
    got = run(fns[chunk], inputs, seg, cots, dtype, use_h0)
    want = run_reference(inputs, seg, cots, dtype, use_h0)
    assert all(np.isfinite(np.asarray(x, np.float32)).all() for x in got)
    tol = F32_TOL if dtype == jnp.float32 else BF16_TOL
    assert_close(got, want, tol, skip=() if use_h0 else ("dh0",))
    return got


@pytest.mark.parametrize("case", BOUNDED_CASES, ids=[c[0] for c in BOUNDED_CASES])
def test_bounded_form_matches_reference(case):
    _check_against_reference(BOUNDED, case)


def test_bounded_form_choice_and_float64():
    """midpoint_block picks the largest block whose factors stay <= e^40, or the general form;
    in float64 the bounded form is exact like the general one."""
    assert [midpoint_block(lb, 64) for lb in (None, -5.0, -0.5, -8.0, -20.0, -21.0)] == [
        None, 16, 16, 8, 4, None]
    assert midpoint_block(-5.0, 16) == 16
    with pytest.raises(ValueError, match="lower_bound"):
        kda_chunked(*(jnp.zeros((1, 8, 1, 16)),) * 4, jnp.zeros((1, 8, 1)), lower_bound=0.0)
    inputs, seg, cots = make_inputs("f64_bounded", 2, 100, 2, 16, 8, gate="pinned", chunk=32)
    want = run_reference(inputs, seg, cots, jnp.float64)
    with jax.enable_x64(True):
        got = run(functools.partial(kda_chunked, chunk_size=32, lower_bound=-5.0), inputs, seg,
                  cots, jnp.float64)
    assert_close(got, want, 1e-11)


def test_chunked_float64_is_exact():
    """In float64 the chunked algorithm equals the recurrence to rounding (no approximation)."""
    inputs, seg, cots = make_inputs("f64", 2, 100, 2, 16, 8, gate="softplus16", chunk=32)
    want = run_reference(inputs, seg, cots, jnp.float64)
    with jax.enable_x64(True):
        got = run(functools.partial(kda_chunked, chunk_size=32), inputs, seg, cots, jnp.float64)
    assert_close(got, want, 1e-11)


def test_split_calls_carry_the_state():
    """T tokens in two calls, passing the final state on, equal one call (a document spans the
    mid-chunk cut; both halves also hold resets)."""
    inputs, _, _ = make_inputs("split", 2, 96, 2, 16, 16, segs="none")
    q, k, v, g, beta, h0 = (jnp.asarray(x, jnp.float32) for x in inputs)
    t = jnp.arange(96)
    seg = jnp.stack([(t >= 10) + (t >= 70), (t >= 47) + (t >= 49)]).astype(jnp.int32)
    f = jax.jit(kda_chunked)
    o, S = f(q, k, v, g, beta, initial_state=h0, segment_ids=seg)
    cut = 48
    a = f(q[:, :cut], k[:, :cut], v[:, :cut], g[:, :cut], beta[:, :cut], initial_state=h0,
          segment_ids=seg[:, :cut])
    b = f(q[:, cut:], k[:, cut:], v[:, cut:], g[:, cut:], beta[:, cut:], initial_state=a[1],
          segment_ids=seg[:, cut:])
    assert rel(jnp.concatenate([a[0], b[0]], axis=1), o) < F32_TOL
    assert rel(b[1], S) < F32_TOL


def test_causality_of_outputs_and_gradients():
    """Perturbing tokens t >= 70 changes neither o[:70] nor the gradients of o[:70]."""
    inputs, seg, _ = make_inputs("causal", 1, 130, 1, 16, 16)
    args = [jnp.asarray(x, jnp.float32) for x in inputs]
    pert = [a.at[:, 70:].multiply(1.5) if a.ndim >= 3 and i < 5 else a
            for i, a in enumerate(args)]

    @jax.jit
    def past(*a):
        o, _ = kda_chunked(*a[:5], initial_state=a[5], segment_ids=jnp.asarray(seg))
        return o[:, :70], jax.grad(lambda *b: jnp.sum(kda_chunked(
            *b[:5], initial_state=b[5], segment_ids=jnp.asarray(seg))[0][:, :70] ** 2),
            argnums=(0, 1, 2, 3, 4))(*a)

    o1, g1 = past(*args)
    o2, g2 = past(*pert)
    np.testing.assert_allclose(o1, o2, rtol=1e-6, atol=1e-6)
    for x, y in zip(g1, g2):
        np.testing.assert_allclose(x[:, :70], y[:, :70], rtol=1e-5, atol=1e-6)
        assert float(jnp.abs(x[:, 70:]).max()) == 0.0


def test_backward_memory_is_linear_in_length():
    """XLA's planned temp memory of fwd+bwd grows like T (chunk states), not T^2 / C."""
    def temp(T):
        x = jax.ShapeDtypeStruct((1, T, 1, 16), jnp.float32)
        beta = jax.ShapeDtypeStruct((1, T, 1), jnp.float32)
        f = jax.grad(lambda q, k, v, g, b: jnp.sum(kda_chunked(q, k, v, g, b)[0]),
                     argnums=(0, 1, 2, 3, 4))
        return jax.jit(f).lower(x, x, x, x, beta).compile().memory_analysis().temp_size_in_bytes
    small, large = temp(512), temp(4096)
    assert large < 8 * 1.25 * small, (small, large)       # x8 tokens: ~x8 memory, not x64


def test_invalid_arguments_and_flops():
    q = jnp.zeros((1, 8, 1, 16))
    for bad in (24, 8, 48):                                # powers of two >= 16 only
        with pytest.raises(ValueError, match="chunk_size"):
            kda_chunked(q, q, q, q, jnp.zeros((1, 8, 1)), chunk_size=bad)
    with pytest.raises(ValueError, match="beta"):
        kda_chunked(q, q, q, q, jnp.zeros((1, 8, 2)))
    # 2 * (3 C^2 K + 2 C^2 V + 3 C K V) + 2 C^3 / 3 per chunk, per head, / C per token.
    assert chunked_flops_per_token(1, 128, 128, 64) == pytest.approx(
        (2 * (3 * 64 * 64 * 128 + 2 * 64 * 64 * 128 + 3 * 64 * 128 * 128) + 2 * 64 ** 3 / 3) / 64)
    per_head = chunked_flops_per_token(1, 128, 128, 64)
    assert chunked_flops_per_token(96, 128, 128, 64) == pytest.approx(96 * per_head)


def test_chunked_under_shard_map_matches_unsharded():
    """Batch-sharded over the fake CPU devices (as the layer calls it), zero initial state
    created inside the map: forward and gradients equal the unsharded call."""
    n = min(4, len(jax.devices()))
    mesh = jax.make_mesh((n,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    inputs, seg, cots = make_inputs("shard_map", n, 40, 1, 16, 16)
    args = [jnp.asarray(x, jnp.float32) for x in inputs[:5]]
    seg = jnp.asarray(seg)
    P = jax.sharding.PartitionSpec

    def loss(fn, *a):
        o, S = fn(*a, seg)
        return jnp.sum(o * cots[0]) + jnp.sum(S * cots[1])

    plain = lambda q, k, v, g, b, s: kda_chunked(q, k, v, g, b, segment_ids=s)  # noqa: E731
    sharded = jax.shard_map(plain, mesh=mesh, in_specs=(P("data"),) * 6,
                            out_specs=(P("data"), P("data")))
    want = jax.jit(jax.value_and_grad(functools.partial(loss, plain), argnums=(0, 1, 2, 3, 4)))(
        *args)
    with jax.set_mesh(mesh):
        put = [jax.device_put(a, jax.sharding.NamedSharding(mesh, P("data"))) for a in args]
        seg = jax.device_put(seg, jax.sharding.NamedSharding(mesh, P("data")))
        got = jax.jit(jax.value_and_grad(functools.partial(loss, sharded),
                                         argnums=(0, 1, 2, 3, 4)))(*put)
    assert rel(got[0], want[0]) < F32_TOL
    for a, b in zip(got[1], want[1]):
        assert rel(a, b) < F32_TOL


def test_kda_chunk_size_reaches_the_layer_and_the_flops():
    """kda_chunk_size is bound into the KDA layer's core (not a stored, unused value), two chunk
    sizes give the same layer output (T = 70 spans several chunks of either; same weights), and
    the FLOPs accounting (counts.forward_flops_per_token, used by train.py and compile.py) uses
    the value the layers run with."""
    from flax import nnx

    from k3jax import config as C
    from k3jax import counts
    from k3jax.layers.kda import KDA

    outs = {}
    for c in (16, 64):
        cfg = C.load(C.REPO_CONFIGS / "base.yml", ["model_name=tiny", f"kda_chunk_size={c}"])
        m = cfg.model
        layer = KDA(m, cfg.kernel, nnx.Rngs(0))
        assert layer.core.keywords["chunk_size"] == layer.chunk_size == c
        x = jax.random.normal(jax.random.key(2), (2, 70, m.hidden_size))
        seg = jnp.asarray(np.repeat([[1] * 40 + [2] * 30], 2, axis=0))
        outs[c] = np.asarray(nnx.jit(lambda l, x, s: l(x, s)[0])(layer, x, seg))
        n_kda = sum(mixer == "kda" for mixer, _ in m.schedule)
        per = lambda chunk: counts.kda_chunked_flops_per_token(  # noqa: E731
            m.kda_num_heads, m.kda_head_dim, m.kda_head_dim, chunk)
        want = counts.forward_flops_per_token(m, 70, 64) + n_kda * (per(c) - per(64))
        assert counts.forward_flops_per_token(m, 70, cfg.kernel.kda_chunk_size) == pytest.approx(want)
    assert rel(outs[16], outs[64]) <= 1e-5 and np.abs(outs[64]).max() > 0
