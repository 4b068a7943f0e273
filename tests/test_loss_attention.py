"""The memory-light cross-entropy and the MLA attention cores against plain formulas."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.kernels.attention import get_attention_fn
from k3jax.kernels.attention.decode import latent_decode_attention
from k3jax.kernels.attention.reference import causal_attention
from k3jax.loss import chunked_cross_entropy, lse_and_argmax


@pytest.mark.parametrize("grad_in_forward", [False, True])
@pytest.mark.parametrize("chunk", [7, 64, 1000])
def test_chunked_cross_entropy_equals_dense(chunk, grad_in_forward):
    k1, k2, k3, k4 = jax.random.split(jax.random.key(0), 4)
    h = jax.random.normal(k1, (2, 13, 16))
    w = jax.random.normal(k2, (16, 50))
    t = jax.random.randint(k3, (2, 13), 0, 50)
    mask = (jax.random.uniform(k4, (2, 13)) > 0.3).astype(jnp.float32)

    def dense(h, w):
        z = jnp.einsum("btd,dv->btv", h, w)
        nll = jax.nn.logsumexp(z, -1) - jnp.take_along_axis(z, t[..., None], -1)[..., 0]
        zl = 1e-3 * jax.nn.logsumexp(z, -1) ** 2
        return jnp.sum((nll + zl) * mask)

    def chunked(h, w):
        return chunked_cross_entropy(h, w, t, mask, chunk=chunk, z_loss_weight=1e-3,
                                     grad_in_forward=grad_in_forward)[0]

    np.testing.assert_allclose(chunked(h, w), dense(h, w), rtol=1e-5)
    g1, g2 = jax.grad(chunked, (0, 1))(h, w), jax.grad(dense, (0, 1))(h, w)
    for a, b in zip(g1, g2):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    _, weight, correct = chunked_cross_entropy(h, w, t, mask, chunk=chunk, grad_in_forward=grad_in_forward)
    assert float(weight) == float(mask.sum())
    argmax = jnp.argmax(jnp.einsum("btd,dv->btv", h, w), -1) == t
    assert float(correct) == float(jnp.sum(argmax * mask))


@pytest.mark.parametrize("v", [640, 50])   # two-level argmax (blocks of 320) / plain argmax (no divisor)
def test_lse_and_argmax_equal_logsumexp_and_first_argmax(v):
    z = jax.random.normal(jax.random.key(3), (4, 6, v))
    z = z.at[0, 0].set(0.0)                              # all tied: the first index wins
    z = z.at[0, 1, v - 1].set(9.0).at[0, 1, 1].set(9.0)  # tie across blocks
    z = z.at[0, 2, 3].set(9.0).at[0, 2, 4].set(9.0)      # tie inside a block
    z = z.at[1, 0, :v // 2].set(-jnp.inf)                # -inf logits
    lse, top = jax.jit(lse_and_argmax)(z)
    np.testing.assert_allclose(lse, jax.nn.logsumexp(z, -1), rtol=1e-6)
    np.testing.assert_array_equal(top, jnp.argmax(z, -1))
    assert int(top[0, 1]) == 1 and int(top[0, 2]) == 3 and int(top[0, 0]) == 0
    c = jax.random.normal(jax.random.key(4), lse.shape)
    g1 = jax.grad(lambda z: jnp.sum(lse_and_argmax(z)[0] * c))(z)
    g2 = jax.grad(lambda z: jnp.sum(jax.nn.logsumexp(z, -1) * c))(z)
    np.testing.assert_allclose(g1, g2, rtol=1e-5, atol=1e-7)


def _qkv(seed=1, t=12, h=3):
    k = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(k[0], (2, t, h, 6)), jax.random.normal(k[1], (2, t, h, 6)),
            jax.random.normal(k[2], (2, t, h, 5)))


def test_causal_attention_masks_documents_and_reports_max_logit():
    q, k, v = _qkv()
    seg = jnp.array([[1] * 5 + [2] * 7, [1] * 12])
    o, m = causal_attention(q, k, v, seg, scale=0.4)
    qn, kn, vn, sn = map(np.asarray, (q, k, v, seg))
    want_o = np.zeros(o.shape)
    want_m = np.full(3, -np.inf)
    for b in range(2):
        for i in range(12):
            ok = [j for j in range(i + 1) if sn[b, j] == sn[b, i]]
            s = np.einsum("hk,jhk->hj", qn[b, i], kn[b, ok]) * 0.4
            want_m = np.maximum(want_m, s.max(-1))
            p = np.exp(s - s.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            want_o[b, i] = np.einsum("hj,jhv->hv", p, vn[b, ok])
    np.testing.assert_allclose(o, want_o, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(m, want_m, rtol=1e-6)


def test_tokamax_path_equals_jnp_path():
    q, k, v = _qkv(2, t=20)
    seg = jnp.array([[1] * 9 + [2] * 11, [1] * 20])
    o1, m1 = causal_attention(q, k, v, seg, scale=0.3)
    o2, m2 = get_attention_fn("tokamax")(q, k, v, seg, scale=0.3)
    np.testing.assert_allclose(o2, o1, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(m2, m1, rtol=1e-6)
    with pytest.raises(ValueError, match="unknown attention_impl"):
        get_attention_fn("flash9")


def test_latent_decode_attention_equals_expanded_attention():
    """Absorbed attention over the latent equals attention with per-head keys c @ W_UK."""
    r, rr, h, dn = 8, 4, 3, 5
    ks = jax.random.split(jax.random.key(3), 5)
    c = jax.random.normal(ks[0], (2, 7, r))
    kr = jax.random.normal(ks[1], (2, 7, rr))
    w_uk = jax.random.normal(ks[2], (r, h, dn))
    q_nope = jax.random.normal(ks[3], (2, h, dn))
    q_rope = jax.random.normal(ks[4], (2, h, rr))
    valid = jnp.array([[True] * 7, [False] * 2 + [True] * 5])
    o_lat = latent_decode_attention(jnp.einsum("bhn,rhn->bhr", q_nope, w_uk), q_rope, c, kr, valid, scale=0.2)
    k_nope = jnp.einsum("bsr,rhn->bshn", c, w_uk)
    s = (jnp.einsum("bhn,bshn->bhs", q_nope, k_nope) + jnp.einsum("bhr,bsr->bhs", q_rope, kr)) * 0.2
    p = jax.nn.softmax(jnp.where(valid[:, None], s, -jnp.inf), -1)
    np.testing.assert_allclose(o_lat, jnp.einsum("bhs,bsr->bhr", p, c), rtol=1e-5, atol=1e-6)


def test_blocked_attention_equals_plain_with_gradients():
    """Query blocks (T not a multiple of the block, documents crossing blocks) == the plain path,
    outputs, max logit and the gradients of q, k, v."""
    from k3jax.kernels.attention.prefill import blocked_attention
    q, k, v = _qkv(3, t=37)
    seg = jnp.array([[1] * 9 + [2] * 20 + [3] * 8, [1] * 37])
    w = jax.random.normal(jax.random.PRNGKey(7), (2, 37, 3, 5))

    def loss(fn, q, k, v):
        o, m = fn(q, k, v, seg, scale=0.3)
        return jnp.sum(o * w), (o, m)

    plain = jax.grad(lambda *a: loss(causal_attention, *a), argnums=(0, 1, 2), has_aux=True)
    blocked = jax.grad(lambda *a: loss(lambda *b, **kw: blocked_attention(*b, **kw, block=8), *a),
                       argnums=(0, 1, 2), has_aux=True)
    (g1, (o1, m1)), (g2, (o2, m2)) = jax.jit(plain)(q, k, v), jax.jit(blocked)(q, k, v)
    np.testing.assert_allclose(o2, o1, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(m2, m1, rtol=1e-6)
    for a, b in zip(g2, g1):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert get_attention_fn("blocked") is blocked_attention
