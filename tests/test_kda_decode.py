"""KDA decode: token-by-token steps equal the chunked prefill, including the short convolution.

Also pins the short convolution itself against a per-document numpy loop (so packed documents
never see each other's tokens) and its split-call continuity through the conv state.
"""
import jax
import jax.numpy as jnp
import numpy as np

from helpers import make_inputs, rel

from k3jax.kernels.kda.chunked import kda_chunked
from k3jax.kernels.kda.decode import kda_decode_step, short_conv, short_conv_step


def _f32(*xs):
    return [jnp.asarray(x, jnp.float32) for x in xs]


def test_decode_steps_equal_chunked_forward():
    B, T, H, K, V = 2, 20, 2, 16, 8
    (q, k, v, g, beta, h0), _, _ = make_inputs("decode", B, T, H, K, V, segs="none")
    q, k, v, g, beta, h0 = _f32(q, k, v, g, beta, h0)
    o_ref, S_ref = jax.jit(kda_chunked)(q, k, v, g, beta, initial_state=h0)
    step = jax.jit(kda_decode_step)
    S, outs = h0, []
    for t in range(T):
        o, S = step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], S)
        outs.append(o)
    assert rel(jnp.stack(outs, axis=1), o_ref) < 1e-5
    assert rel(S, S_ref) < 1e-5


def numpy_short_conv(x, w, seg):
    """y[b,t,c] = sum_j w[c,j] x[b, t-W+1+j, c] over taps inside t's document."""
    B, T, C = x.shape
    W = w.shape[1]
    y = np.zeros((B, T, C))
    for b in range(B):
        for t in range(T):
            for j in range(W):
                s = t - W + 1 + j
                if s >= 0 and seg[b, s] == seg[b, t]:
                    y[b, t] += w[:, j] * x[b, s]
    return y


def test_short_conv_matches_loop_and_steps():
    rng = np.random.default_rng(11)
    B, T, C, W = 2, 13, 6, 4
    x = rng.standard_normal((B, T, C)).astype(np.float32)
    w = rng.standard_normal((C, W)).astype(np.float32)
    seg = np.array([[1] * 5 + [2] + [3] * 7, [1] * 2 + [2] * 11], np.int32)
    y, state = short_conv(jnp.asarray(x), jnp.asarray(w), segment_ids=jnp.asarray(seg))
    np.testing.assert_allclose(y, numpy_short_conv(x, w, seg), rtol=1e-5, atol=1e-5)
    # The final state holds the last W-1 inputs of the last document (none from earlier ones).
    np.testing.assert_array_equal(state[0], np.swapaxes(x[0, -3:], 0, 1))
    # Rolled single steps equal the sequence conv (no segments, from a non-zero state).
    h = jnp.asarray(rng.standard_normal((B, C, W - 1)), jnp.float32)
    y_seq, s_seq = short_conv(jnp.asarray(x), jnp.asarray(w), initial_state=h)
    s, ys = h, []
    for t in range(T):
        yt, s = short_conv_step(jnp.asarray(x[:, t]), s, jnp.asarray(w))
        ys.append(yt)
    np.testing.assert_allclose(jnp.stack(ys, axis=1), y_seq, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(s, s_seq, rtol=0, atol=0)
    # Split calls through the conv state equal one call (the document spans the cut).
    a, sa = short_conv(jnp.asarray(x[:, :7]), jnp.asarray(w), segment_ids=jnp.asarray(seg[:, :7]))
    b, _ = short_conv(jnp.asarray(x[:, 7:]), jnp.asarray(w), segment_ids=jnp.asarray(seg[:, 7:]),
                      initial_state=sa)
    np.testing.assert_allclose(jnp.concatenate([a, b], axis=1), y, rtol=1e-6, atol=1e-6)


def test_prefill_then_decode_equals_longer_prefill_with_row_reset():
    """prefill(T) + N steps == prefill(T + N) for conv + KDA; row 1 starts a new sequence at
    the first decode token, so its KDA state and conv state are zeroed there."""
    B, T, N, H, K, V, W = 2, 24, 6, 2, 16, 16, 4
    rng = np.random.default_rng(5)
    Cq = H * K
    x = jnp.asarray(rng.standard_normal((B, T + N, Cq)), jnp.float32)   # pre-conv k features
    w = jnp.asarray(rng.standard_normal((Cq, W)) * 0.5, jnp.float32)
    (q, _, v, g, beta, _), _, _ = make_inputs("prefill", B, T + N, H, K, V, segs="none")
    q, v, g, beta = _f32(q, v, g, beta)
    seg = jnp.asarray(np.stack([np.zeros(T + N), np.arange(T + N) >= T]), jnp.int32)

    def keys(y):                                           # silu + l2norm, as the layer does
        y = jax.nn.silu(y).reshape(y.shape[:-1] + (H, K))
        return y / jnp.sqrt(jnp.sum(y * y, -1, keepdims=True) + 1e-6)

    prefill = jax.jit(lambda q, x, v, g, beta, seg: kda_chunked(
        q, keys(short_conv(x, w, segment_ids=seg)[0]), v, g, beta, segment_ids=seg))
    o_all, S_all = prefill(q, x, v, g, beta, seg)
    o_pre, S = prefill(q[:, :T], x[:, :T], v[:, :T], g[:, :T], beta[:, :T], seg[:, :T])
    _, conv = short_conv(x[:, :T], w, segment_ids=seg[:, :T])
    new_seq = jnp.array([False, True])
    conv = jnp.where(new_seq[:, None, None], 0.0, conv)
    S = jnp.where(new_seq[:, None, None, None], 0.0, S)
    @jax.jit
    def step(x_t, conv, q_t, v_t, g_t, beta_t, S):
        yt, conv = short_conv_step(x_t, conv, w)
        o, S = kda_decode_step(q_t, keys(yt), v_t, g_t, beta_t, S)
        return o, conv, S

    outs = []
    for t in range(T, T + N):
        o, conv, S = step(x[:, t], conv, q[:, t], v[:, t], g[:, t], beta[:, t], S)
        outs.append(o)
    assert rel(o_pre, o_all[:, :T]) < 1e-5
    assert rel(jnp.stack(outs, axis=1), o_all[:, T:]) < 1e-5
    assert rel(S, S_all) < 1e-5
