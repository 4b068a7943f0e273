"""What continuous batching needs from the model, against the existing paths: chunked prefill
(``model.extend``: a chunk continuing a row's cache, padded to a fixed shape) and the decode step
with a position per row equal the full forward; the per-row sampler."""
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from helpers import randomize
from k3jax import config as C
from k3jax import model as M
from k3jax.inference.sampling import argmax_rows, ban_left, logprobs, pack_ban, sample_rows

CHUNK = 8


def _is_spec(x):
    return isinstance(x, tuple) and len(x) == 3 and isinstance(x[0], tuple)


def _zeros(spec):
    return jax.tree.map(lambda s: jnp.zeros(s[0], s[1]), spec, is_leaf=_is_spec)


def _rows(mask, ndim, axis):
    """A [B] row mask shaped to broadcast along a cache leaf's batch axis."""
    shape = [1] * ndim
    shape[axis] = -1
    return jnp.asarray(mask).reshape(shape)


def test_chunked_prefill_and_per_row_decode_equal_full_forward():
    # RoPE on, so a wrong position per row shows; weights O(1)-sensitive.
    cfg = C.load(C.REPO_CONFIGS / "base.yml", ["model_name=tiny", "mla_use_rope=true"])
    model = randomize(M.build(cfg, 0))
    rng = np.random.default_rng(0)
    n = 30
    seq = rng.integers(0, cfg.model.vocab_size, (2, n))
    full = np.asarray(nnx.jit(lambda m, t: m(t)[0])(model, jnp.asarray(seq)))
    extend = nnx.jit(lambda m, t, c, p, l: m.extend(t, c, p, l))
    step = nnx.jit(lambda m, t, c, p: m.decode_step(t, c, p, jnp.zeros((2,), jnp.int32)))

    # Row 0 prefills 20 tokens in chunks of 8, 5, 7; row 1 prefills 11 in 3, 8. Rows advance
    # together (both in every call, a row with nothing left re-sends its last chunk into slots it
    # owns later), so rows sit at different positions and chunks are padded.
    plans = [[8, 5, 7], [3, 8, 0]]
    spec = model.cache_spec(2, 40)
    cache = _zeros(spec)
    batch_axis = jax.tree.map(lambda s: s[2].index("batch"), spec, is_leaf=_is_spec)
    pos = np.zeros(2, np.int32)
    got = {}
    for k in range(3):
        toks = np.zeros((2, CHUNK), np.int32)
        lens = np.array([max(p[k], 1) for p in plans], np.int32)
        for b in range(2):
            toks[b, :lens[b]] = seq[b, pos[b]:pos[b] + lens[b]]
        logits, new = extend(model, jnp.asarray(toks), cache, jnp.asarray(pos), jnp.asarray(lens))
        done = np.array([p[k] > 0 for p in plans])
        # A finished row keeps its cache (what the server's programs do for idle rows).
        cache = jax.tree.map(lambda o, x, ax: jnp.where(_rows(done, x.ndim, ax), x, o), cache, new, batch_axis)
        for b in range(2):
            if done[b]:
                got[(b, pos[b] + lens[b] - 1)] = np.asarray(logits[b])
        pos = pos + np.where(done, lens, 0).astype(np.int32)
    assert list(pos) == [20, 11]
    # Then decode: each row at its own position (one step program for both).
    for _ in range(n - 20):
        toks = seq[np.arange(2), pos]
        logits, cache = step(model, jnp.asarray(toks), cache, jnp.asarray(pos))
        for b in range(2):
            got[(b, pos[b])] = np.asarray(logits[b])
        pos = pos + 1
    for (b, t), lg in sorted(got.items()):
        np.testing.assert_allclose(lg, full[b, t], rtol=1e-4, atol=1e-4, err_msg=f"row {b} position {t}")
    assert len(got) == 3 + 2 + 2 * (n - 20)


def test_argmax_rows_is_argmax():
    """Random rows, ties (the first index wins), -inf, a whole row of one value, NaN anywhere
    (argmax gives the first NaN) and V = 1: the same index as jnp.argmax, jitted."""
    rng = np.random.default_rng(1)
    x = np.round(rng.standard_normal((9, 37)), 1).astype(np.float32)        # many exact ties
    x[1, 5] = x[1, 30] = 9.0
    x[2] = -np.inf
    x[3] = 2.5
    x[4, [0, 7]] = np.nan
    x[5, 36] = np.nan
    x[6, [3, 4]] = np.inf
    x[7, :] = np.nan
    for a in (x, x[:, :1], x.astype(jnp.bfloat16)):
        got = np.asarray(jax.jit(argmax_rows)(jnp.asarray(a)))
        assert got.dtype == np.int32
        np.testing.assert_array_equal(got, np.asarray(jnp.argmax(jnp.asarray(a), -1)))


def test_sample_rows():
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.standard_normal((4, 50)).astype(np.float32))
    keys = jax.random.split(jax.random.key(0), 4)
    greedy = np.argmax(np.asarray(logits), -1)
    f = jax.jit(sample_rows)
    zero, one = jnp.zeros(4), jnp.ones(4)
    # Greedy rows, top_k = 1 and a tiny top_p all give the argmax, whatever the key.
    assert (np.asarray(f(logits, keys, zero, jnp.zeros(4, jnp.int32), one)) == greedy).all()
    assert (np.asarray(f(logits, keys, one, jnp.ones(4, jnp.int32), one)) == greedy).all()
    assert (np.asarray(f(logits, keys, one, jnp.zeros(4, jnp.int32), one * 1e-6)) == greedy).all()
    # A row's draw depends on its own key and logits only, not on its neighbours'.
    mixed = np.asarray(f(logits, keys, jnp.asarray([1.0, 0.0, 1.0, 0.0]), jnp.zeros(4, jnp.int32), one))
    alone = np.asarray(f(logits[:1], keys[:1], one[:1], jnp.zeros(1, jnp.int32), one[:1]))
    assert mixed[0] == alone[0] and mixed[1] == greedy[1] and mixed[3] == greedy[3]
    # top_k = 3: every draw is among the row's 3 most likely tokens.
    top3 = np.argsort(-np.asarray(logits), -1)[:, :3]
    for s in range(20):
        d = np.asarray(f(logits, jax.random.split(jax.random.key(s), 4), one * 2, jnp.full(4, 3, jnp.int32), one))
        assert all(d[b] in top3[b] for b in range(4))
    chosen, ids, lp = logprobs(logits, jnp.asarray(greedy, jnp.int32), 2)
    np.testing.assert_allclose(chosen, lp[:, 0], rtol=1e-6)
    assert (np.asarray(ids[:, 0]) == greedy).all()


def test_ban_keeps_a_token_out_after_its_allowance():
    """tool_choice="none": a row's banned token is never sampled once its allowance is used (greedy or
    not); other rows and other tokens are untouched; sampling it uses one of the times allowed."""
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.standard_normal((4, 50)).astype(np.float32))
    keys = jax.random.split(jax.random.key(0), 4)
    greedy = np.argmax(np.asarray(logits), -1)
    second = np.argsort(-np.asarray(logits), -1)[:, 1]
    f = jax.jit(sample_rows)
    zero, one, k0 = jnp.zeros(4), jnp.ones(4), jnp.zeros(4, jnp.int32)
    ban = jnp.asarray([pack_ban(int(greedy[0]), 0), pack_ban(int(greedy[1]), 1), -1, pack_ban(int(second[3]), 0)],
                      jnp.int32)
    got = np.asarray(f(logits, keys, zero, k0, one, ban))
    assert got[0] == second[0]                       # banned now: the next best
    assert got[1] == greedy[1] and got[2] == greedy[2] and got[3] == greedy[3]   # allowed once / none / another
    for s in range(30):                              # sampled rows never draw it either
        d = np.asarray(f(logits, jax.random.split(jax.random.key(s), 4), one * 5, k0, one, ban))
        assert d[0] != greedy[0]
    left = np.asarray(ban_left(ban, jnp.asarray(got)))
    assert list(left) == [int(ban[0]), pack_ban(int(greedy[1]), 0), -1, int(ban[3])]
    assert pack_ban(-1, 3) == pack_ban(7, -1) == -1
