"""Context parallelism at kernel level: the sequence split in 8 contiguous slices over a 'context'
mesh axis (jax.shard_map on the 8 fake CPU devices) must give what the unsharded kernels give.

KDA (both combine strategies) against the unsharded chunked kernel and the float64 token-serial
reference: output, final state and the gradients of q, k, v, g, beta and the initial state, f32,
1e-5 relative RMS, with documents that start inside slices, exactly at slice starts (and on the
tokens around one), and span several slices, two chunks per slice. The short convolution against
the unsharded one, outputs and gradients, with boundaries inside the W - 1 token halo. MLA
attention over the all-gathered latent against the unsharded expansion + oracle attention: output,
the per-head max logit (QK-clip's statistic) and the gradients of q, latent, rope key and W_kv.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec as P

from helpers import F32_TOL, assert_close, make_inputs, rel, run, run_reference

from k3jax.kernels.attention.reference import causal_attention
from k3jax.kernels.attention.context_parallel import mla_context_parallel_attention
from k3jax.kernels.kda.chunked import kda_chunked
from k3jax.kernels.kda.decode import short_conv
from k3jax.kernels.kda.context_parallel import kda_context_parallel, short_conv_context_parallel

N = 8                                                  # context shards
ROW = P(None, "context", None, None)


def _mesh():
    return jax.make_mesh((N,), ("context",), axis_types=(AxisType.Auto,))


def _packed_segments(B, T):
    """Row 0: starts inside slices (5, 20, 37, 50, 100), at slice starts (32, 64, 192), on the
    tokens around one (31, 33) and a last-token document; the document from 100 spans slices
    3 to 5. Row 1: one document over slices 0-2 (with the initial state), starts at 96 and 225."""
    starts = np.zeros((B, T), bool)
    starts[0, [5, 20, 31, 32, 33, 37, 50, 64, 100, 192, T - 1]] = True
    starts[1, [96, 225]] = True
    return np.cumsum(starts, axis=1).astype(np.int32) + 1


def _map_optional(body, mesh, arrays, specs, out_specs):
    """shard_map over the arrays that are not None; body receives all of them (None kept)."""
    present = [i for i, a in enumerate(arrays) if a is not None]

    def local(*xs):
        full = [None] * len(arrays)
        for i, x in zip(present, xs):
            full[i] = x
        return body(*full)

    return jax.shard_map(local, mesh=mesh, in_specs=tuple(specs[i] for i in present),
                         out_specs=out_specs)(*(arrays[i] for i in present))


@functools.lru_cache(maxsize=None)
def cp_kda(strategy: str, chunk: int):
    """The context-parallel KDA with the common signature (global arrays in and out)."""
    mesh = _mesh()

    def fn(q, k, v, g, beta, *, initial_state=None, segment_ids=None):
        def body(q, k, v, g, beta, h0, seg):
            return kda_context_parallel(q, k, v, g, beta, axis_name="context", initial_state=h0,
                                        segment_ids=seg, strategy=strategy, chunk_size=chunk)
        specs = (ROW,) * 4 + (P(None, "context", None), P(), P(None, "context"))
        return _map_optional(body, mesh, (q, k, v, g, beta, initial_state, segment_ids), specs,
                             (ROW, P()))
    return fn


UNSHARDED_KDA = functools.partial(kda_chunked, chunk_size=16)

# id, strategy, segments. B = 2, T = 256 (32 tokens = 2 chunks of 16 per shard), with an initial
# state (the cases share the compiled reference and unsharded programs; ids are arguments).
KDA_CASES = [
    ("allgather_packed", "allgather", "packed"),
    ("ring_packed", "ring", "packed"),
    ("allgather_one_document", "allgather", "none"),
]


@pytest.mark.parametrize("case", KDA_CASES, ids=[c[0] for c in KDA_CASES])
def test_kda_context_parallel_matches_unsharded(case):
    cid, strategy, segs = case
    B, T, H, K, V, C = 2, 256, 2, 16, 16, 16
    inputs, _, cots = make_inputs("cp_" + cid, B, T, H, K, V, segs="none", chunk=C)
    seg = jnp.asarray(_packed_segments(B, T) if segs == "packed" else np.ones((B, T), np.int32))
    want = run_reference(inputs, seg, cots)
    got = run(cp_kda(strategy, C), inputs, seg, cots)
    assert_close(got, want, F32_TOL)
    assert_close(got, run(UNSHARDED_KDA, inputs, seg, cots), F32_TOL)


def test_bad_strategy_and_short_slices_are_rejected():
    x = jnp.zeros((1, 8, 1, 16))
    with pytest.raises(ValueError, match="strategy"):
        kda_context_parallel(x, x, x, x, x[..., 0], axis_name="context", strategy="tree")

    def conv(x):
        return short_conv_context_parallel(x, jnp.ones((4, 4)), axis_name="context")
    with pytest.raises(ValueError, match="at least 3 tokens per shard"):
        jax.shard_map(conv, mesh=_mesh(), in_specs=P(None, "context", None),
                      out_specs=(P(None, "context", None), P()))(jnp.zeros((1, 16, 4)))


@functools.lru_cache(maxsize=None)
def cp_conv():
    mesh = _mesh()

    def fn(x, w, h0, seg):
        def body(x, w, h0, seg):
            return short_conv_context_parallel(x, w, axis_name="context", segment_ids=seg,
                                               initial_state=h0)
        specs = (P(None, "context", None), P(), P(), P(None, "context"))
        return _map_optional(body, mesh, (x, w, h0, seg), specs, (P(None, "context", None), P()))
    return fn


@functools.partial(jax.jit, static_argnames=("fn",))
def _conv_out_and_grads(x, w, h0, seg, cots, fn):
    out, vjp = jax.vjp(lambda x, w, h0: fn(x, w, h0, seg), x, w, h0)
    return out + vjp(cots)


def _unsharded_conv(x, w, h0, seg):
    return short_conv(x, w, segment_ids=seg, initial_state=h0)


def test_short_conv_context_parallel_matches_unsharded():
    """8 tokens per shard, width 4: documents start 1 and 2 tokens before a slice start (inside
    the halo), exactly at one, 1 token after one, and one spans slices 4 to 7."""
    B, T, Ch, W = 2, 64, 8, 4
    rng = np.random.default_rng(20)
    x, w = rng.standard_normal((B, T, Ch)), rng.standard_normal((Ch, W))
    h0, cots = rng.standard_normal((B, Ch, W - 1)), (rng.standard_normal((B, T, Ch)),
                                                       rng.standard_normal((B, Ch, W - 1)))
    starts = np.zeros((B, T), bool)
    starts[0, [3, 7, 16, 25, 30, 40]] = True
    starts[1, [14, 24, 63]] = True
    seg = jnp.asarray(np.cumsum(starts, axis=1).astype(np.int32) + 1)
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    args = (f32(x), f32(w), f32(h0), seg, tuple(map(f32, cots)))
    got = _conv_out_and_grads(*args, fn=cp_conv())
    want = _conv_out_and_grads(*args, fn=_unsharded_conv)
    errs = {n: rel(a, b) for n, a, b in zip(("y", "state", "dx", "dw", "dh0"), got, want)}
    assert all(e <= F32_TOL for e in errs.values()), errs


@functools.lru_cache(maxsize=None)
def cp_mla(key_block: int, load_balance: bool):
    mesh = _mesh()

    def fn(q, lat, k_r, kv_b, seg):
        body = functools.partial(mla_context_parallel_attention, axis_name="context", scale=MLA_SCALE,
                                 key_block=key_block, load_balance=load_balance)
        return jax.shard_map(body, mesh=mesh, in_specs=(ROW, P(None, "context", None),
                                                        P(None, "context", None), P(), P(None, "context")),
                             out_specs=(ROW, P()))(q, lat, k_r, kv_b, seg)
    return fn


def _unsharded_mla(q, lat, k_r, kv_b, seg):
    """The model's unsharded path: expand the latent, then the oracle attention."""
    h, rr = q.shape[2], k_r.shape[-1]
    kv = jnp.einsum("btr,rq->btq", lat, kv_b).reshape(*lat.shape[:2], h, -1)
    nope = q.shape[-1] - rr
    k = jnp.concatenate([kv[..., :nope], jnp.broadcast_to(k_r[:, :, None], (*k_r.shape[:2], h, rr))], -1)
    return causal_attention(q, k, kv[..., nope:], seg, scale=MLA_SCALE)


@functools.partial(jax.jit, static_argnames=("fn",))
def _mla_out_and_grads(args, seg, cot, fn):
    (o, m), vjp = jax.vjp(lambda *a: fn(*a, seg), *args)
    return (o, m) + vjp((cot, jnp.zeros_like(m)))


MLA_SCALE = 0.3


# id, key_block, load_balance, T: T = 64 gives 8 tokens per shard (two half chunks of 4: key
# block 4 = one per half, 3 -> 2 = two per half); T = 40 gives 5 (odd: one chunk, unbalanced).
MLA_CASES = [
    ("balanced", 4, True, 64),
    ("balanced_two_key_blocks", 3, True, 64),
    ("unbalanced", 4, False, 64),
    ("odd_slice", 8, True, 40),
]


@pytest.mark.parametrize("case", MLA_CASES, ids=[c[0] for c in MLA_CASES])
def test_mla_context_parallel_matches_unsharded(case):
    """B = 2, 2 heads, dn 8, Rr 4, dv 8, R 16; documents start inside slices, exactly at slice
    starts, and span slices; max logits equal the unsharded ones."""
    _, key_block, balance, T = case
    B, H, dn, rr, dv, R = 2, 2, 8, 4, 8, 16
    rng = np.random.default_rng(3)
    f32 = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
    args = (f32(B, T, H, dn + rr), f32(B, T, R), f32(B, T, rr), f32(R, H * (dn + dv)))
    starts = np.zeros((B, T), bool)
    starts[0, [3, 8, 16, 21, T - 24]] = True
    starts[1, [9, T - 8, T - 1]] = True
    seg = jnp.asarray(np.cumsum(starts, axis=1).astype(np.int32) + 1)
    cot = f32(B, T, H, dv)
    got = _mla_out_and_grads(args, seg, cot, fn=cp_mla(key_block, balance))
    want = _mla_out_and_grads(args, seg, cot, fn=_unsharded_mla)
    errs = {n: rel(a, b) for n, a, b in zip(("o", "max_logit", "dq", "dlat", "dk_r", "dkv_b"), got, want)}
    assert all(e <= F32_TOL for e in errs.values()), errs
    np.testing.assert_allclose(got[1], want[1], rtol=1e-6)


def test_zigzag_assignment_covers_every_half_once_with_equal_work():
    """Shard j computes half chunks j and 2n - 1 - j; together the shards cover all 2n halves
    once, and each visits (2n + 1) half-chunks of keys."""
    from k3jax.kernels.attention.context_parallel import zigzag_chunks
    for n in (1, 2, 3, 8, 32):
        got = np.array([np.asarray(zigzag_chunks(j, n)) for j in range(n)])
        assert sorted(got.ravel().tolist()) == list(range(2 * n))
        assert all(int(c[0]) % 2 == 0 and int(c[1]) % 2 == 1 for c in got)
        assert set((got + 1).sum(axis=1).tolist()) == {2 * n + 1}
