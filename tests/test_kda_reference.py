"""The token-serial KDA reference against an independent float64 numpy loop, and its contract.

The numpy loop is written from the paper's equations (kda.md §1.2) without sharing code with
k3jax: decay the rows, delta-rule write with beta, read the updated state; zero the state where
the segment id changes. Everything else (chunked, Pallas, decode) is tested against
kda_reference, so this file pins the reference itself.
"""
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.kernels.kda.reference import kda_reference


def numpy_kda(q, k, v, g, beta, scale, h0, seg):
    """Per-row, per-head, per-token loop in float64."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    o = np.zeros((B, T, H, V))
    S_out = np.zeros((B, H, K, V))
    for b in range(B):
        for h in range(H):
            S = h0[b, h].copy()
            for t in range(T):
                if t > 0 and seg[b, t] != seg[b, t - 1]:
                    S = np.zeros((K, V))
                S = np.exp(g[b, t, h])[:, None] * S
                err = v[b, t, h] - S.T @ k[b, t, h]
                S = S + beta[b, t, h] * np.outer(k[b, t, h], err)
                o[b, t, h] = S.T @ (scale * q[b, t, h])
            S_out[b, h] = S
    return o, S_out


def _inputs(seed, B, T, H, K, V):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, T, H, K))
    k = rng.standard_normal((B, T, H, K))
    k /= np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    v = rng.standard_normal((B, T, H, V))
    g = -5.0 / (1.0 + np.exp(-2.0 * rng.standard_normal((B, T, H, K))))   # K3 range (-5, 0)
    beta = 1.0 / (1.0 + np.exp(-rng.standard_normal((B, T, H))))
    h0 = rng.standard_normal((B, H, K, V))
    return q, k, v, g, beta, h0


@pytest.mark.parametrize("B,T,H,K,V", [(1, 1, 1, 4, 4), (2, 9, 2, 8, 4), (1, 17, 1, 4, 8)],
                         ids=["t1", "t9_kv84", "t17_kv48"])
def test_reference_matches_numpy_loop(B, T, H, K, V):
    seed = zlib.crc32(f"{B}{T}{H}{K}{V}".encode())
    q, k, v, g, beta, h0 = _inputs(seed, B, T, H, K, V)
    rng = np.random.default_rng(seed + 1)
    seg = np.cumsum(rng.random((B, T)) < 0.3, axis=1).astype(np.int32)
    scale = 0.37
    o_np, S_np = numpy_kda(q, k, v, g, beta, scale, h0, seg)
    with jax.enable_x64(True):
        o, S = kda_reference(*map(jnp.asarray, (q, k, v, g, beta)), scale=scale,
                             initial_state=jnp.asarray(h0), segment_ids=jnp.asarray(seg))
        assert o.dtype == jnp.float64 and S.dtype == jnp.float64
        np.testing.assert_allclose(np.asarray(o), o_np, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(np.asarray(S), S_np, rtol=1e-12, atol=1e-12)


def test_segments_equal_separate_calls():
    """A packed row equals one call per document: h0 for the first, zeros for the others."""
    B, T, H, K, V = 1, 12, 2, 8, 4
    q, k, v, g, beta, h0 = (jnp.asarray(x, jnp.float32) for x in _inputs(7, B, T, H, K, V))
    bounds = [0, 5, 6, 12]                                 # documents [0,5), [5,6), [6,12)
    seg = jnp.asarray([[d for d in range(3) for _ in range(bounds[d + 1] - bounds[d])]])
    o, S = kda_reference(q, k, v, g, beta, initial_state=h0, segment_ids=seg)
    for d in range(3):
        sl = slice(bounds[d], bounds[d + 1])
        od, Sd = kda_reference(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl],
                               initial_state=h0 if d == 0 else None)
        np.testing.assert_allclose(o[:, sl], od, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(S, Sd, rtol=1e-6, atol=1e-6)


def test_contract_dtypes_scale_and_causality():
    B, T, H, K, V = 2, 6, 1, 16, 8
    q, k, v, g, beta, h0 = (jnp.asarray(x, jnp.float32) for x in _inputs(3, B, T, H, K, V))
    o, S = kda_reference(q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v.astype(jnp.bfloat16),
                         g, beta)
    assert o.dtype == jnp.bfloat16 and o.shape == (B, T, H, V)
    assert S.dtype == jnp.float32 and S.shape == (B, H, K, V)
    # scale=None means K ** -0.5; o is linear in the scale.
    o1, _ = kda_reference(q, k, v, g, beta, initial_state=h0)
    o2, _ = kda_reference(q, k, v, g, beta, initial_state=h0, scale=2 * K ** -0.5)
    np.testing.assert_allclose(2 * o1, o2, rtol=1e-6, atol=1e-6)
    # Changing tokens t >= 3 leaves outputs t < 3 untouched.
    o3, _ = kda_reference(q, k, v.at[:, 3:].add(1.0), g.at[:, 3:].add(-1.0), beta,
                          initial_state=h0)
    np.testing.assert_array_equal(o1[:, :3], o3[:, :3])
    assert not np.allclose(o1[:, 3:], o3[:, 3:])
