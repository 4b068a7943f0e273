"""State-independent per-chunk KDA quantities (the "intra-chunk" half of the WY/UT algorithm).

Everything here acts on chunk-major tensors with arbitrary leading dims `...` (usually
[B, H, NT]) and a chunk of C rows: q, k [..., C, K], v [..., C, V], g [..., C, K], beta
[..., C], reset [..., C] (bool, True where the state is zeroed before that token). The
sequential state walk (chunked.py, or the Pallas kernels in pallas_tpu.py) consumes

    Aqk [..., C, C]  masked relation of scaled queries to keys (diagonal included)
    W   [..., C, K]  WY factor applied to the incoming state:  Vn = U - W @ S
    U   [..., C, V]  WY factor of the values
    QG  [..., C, K]  scaled queries times the decay from the chunk start (first document only)
    Kg  [..., C, K]  keys times the decay to the chunk end (last document only)
    dec [..., K]     decay of the incoming state across the whole chunk (0 if a reset occurs)

Numerics (kda.md §2.2-2.3), all in float32 (float64 if the inputs are):
  * G = chunk-local cumsum of g, monotone non-increasing, kept as a compensated (hi, lo) pair so
    that exponent differences G_i - G_j are accurate to |G_i - G_j| * 2^-24 rather than
    |G| * 2^-24 (this is what keeps dg at f32 accuracy with K3 gates at -5). Document resets
    are masks, never a restarted cumsum or a fake large gate.
  * rel(X, Y, G)[i, j] = sum_d X[i,d] Y[j,d] exp(G[i,d] - G[j,d]) is never factorised over a
    whole chunk (exp(-G) overflows). Blocks of 16 rows, then 4 rows inside each: an
    off-diagonal block (I, J) is a matmul of X_I exp(G_I - G_n) and Y_J exp(G_n - G_J) with
    the reference n in between, every factor <= 1; the 4 x 4 diagonal blocks are exact
    elementwise products of exp(g) down the rows. Masks go inside the exponent (-inf ->
    exactly 0), so no lane ever holds inf, in the forward or the backward.
    With gates bounded below (K3: g >= -5, `block` = midpoint_block(...)), each 16-row block
    is instead one matmul factorised at its middle row (kda.md §2.3 "midpoint reference"):
    every factor stays below e^40, with no elementwise diagonal blocks.
  * (I + L)^-1 by recursive block inversion over doubling block sizes (the "ladder" of kda.md
    §2.2, as accurate as forward substitution). Never Neumann doubling over a whole chunk.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from k3jax.kernels.kda.common import mm

SUB = 16  # chunk sizes are multiples of the first relation level (and powers of two)
LEVELS = (16, 4)  # block rows per level of the relation matrices (the last is elementwise)


def _blocks(x: jax.Array, bs: int) -> jax.Array:
    """[..., C, D] -> [..., C // bs, bs, D]."""
    return x.reshape(x.shape[:-2] + (x.shape[-2] // bs, bs, x.shape[-1]))


def compensated_cumsum(g: jax.Array):
    """Cumulative sum as an unevaluated pair (hi, lo) with hi + lo exact to ~2^-24 |lo|.

    Why: exp(G_i - G_j) with G a plain f32 cumsum carries an absolute exponent error of
    ~|G| * 2^-24 (1.5e-5 at the K3 gate's |G| = 320 per chunk); that error is invisible in the
    outputs but dominates dg, whose value comes from nearby token pairs deep into the chunk.
    With (hi, lo), a difference (hi_i - hi_j) + (lo_i - lo_j) is exact up to ~|G_i - G_j| * 2^-24.

    hi is the plain cumsum. Each step's rounding d_t = (hi_{t-1} + g_t) - hi_t is recovered
    exactly with Knuth's TwoSum (s + e = hi_{t-1} + g_t; s - hi_t is exact by Sterbenz, as both
    approximate the same prefix sum to a few ulps), so sum_{u<=t} g_u = hi_t + cumsum(d)_t.
    Two cumsums and a few elementwise ops, whatever order XLA sums hi in.
    """
    hi = cumsum_rows(g)
    prev = jnp.concatenate([jnp.zeros_like(g[..., :1, :]), hi[..., :-1, :]], axis=-2)
    s = prev + g
    bb = s - prev
    e = (prev - (s - bb)) + (g - bb)                       # TwoSum: prev + g = s + e exactly
    d = (s - hi) + e
    return hi, cumsum_rows(d)


def cumsum_rows(x: jax.Array, *, reverse: bool = False, exclusive: bool = False) -> jax.Array:
    """Cumulative sum over the rows of x [..., C, D] as a matmul with a 0/1 triangle.

    XLA lowers a short cumsum to a reduce-window (C^2 adds, poorly vectorised on CPU); the
    triangle matmul does the same adds on the matrix unit, each row summed in f32. The triangle
    is broadcast over x's leading dims so that the product is a batched matmul in x's own
    layout: with one unbatched triangle XLA:CPU folds the leading dims into the output columns,
    transposing x to [..., D, C] first and every consumer of the result back (~20% of the
    chunked fwd+bwd at T = 8192, docs/kernels.md).
    """
    C = x.shape[-2]
    i = jnp.arange(C)
    tri = (i[None, :] >= i[:, None]) if reverse else (i[None, :] <= i[:, None])
    if exclusive:
        tri = tri & (i[None, :] != i[:, None])
    return mm("...ij,...jd->...id", jnp.broadcast_to(tri.astype(x.dtype), x.shape[:-2] + (C, C)), x)


def _gdiff(a, b):
    """(a - b) for two (hi, lo) pairs, rounded once at the end."""
    return (a[0] - b[0]) + (a[1] - b[1])


def _gmap(fn, G):
    return tuple(fn(x) for x in G)


class _Factors(NamedTuple):
    """Exponential factors of one blocking level; every factor lies in [0, 1].

    Off-diagonal block (I, J), J < I, with n = first row of I and e = last row of J:
        exp(G_i - G_j) = exp(G_i - G_n) * exp(G_n - G_e) * exp(G_e - G_j), every exponent <= 0.
    """
    ex: jax.Array    # [..., NB, bs, D]  exp(G_i - G_n(I))
    eb: jax.Array    # [..., NB, bs, D]  exp(G_e(J) - G_j)
    ec: jax.Array    # [..., NB, NB, D]  exp(G_n(I) - G_e(J)) for J < I, else 0 (mask in exponent)


def _factors(Gb) -> _Factors:
    """Factors for Gb = (hi, lo, exp(g)) [..., NB, bs, D], blocked (see intra_forward)."""
    nb = Gb[0].shape[-3]
    Gn = _gmap(lambda x: x[..., :, 0, :], Gb)              # first row of each block [..., NB, D]
    Ge = _gmap(lambda x: x[..., :, -1, :], Gb)             # last row of each block
    ex = jnp.exp(_gdiff(Gb, _gmap(lambda x: x[..., :, None, :], Gn)))
    eb = jnp.exp(_gdiff(_gmap(lambda x: x[..., :, None, :], Ge), Gb))
    blk = jnp.arange(nb)
    below = (blk[None, :] < blk[:, None])[:, :, None]      # [I, J, 1]: J < I
    dc = _gdiff(_gmap(lambda x: x[..., :, None, :], Gn), _gmap(lambda x: x[..., None, :, :], Ge))
    ec = jnp.exp(jnp.where(below, dc, -jnp.inf))
    return _Factors(ex, eb, ec)


def _diag_exp(G) -> jax.Array:
    """[..., c, c, D]: exp(G_i - G_j) for j <= i inside a small block of c rows, else 0.

    Built as cumulative products of a = exp(g) down the rows (E_i = a_i * E_{i-1} + e_i): every
    factor is <= 1, nothing is masked after the fact, and the only exponentials are the C * D
    of a, computed once per chunk (G[2]) instead of c * C * D exponent differences.
    """
    a = G[2]
    c = a.shape[-2]
    eye = jnp.eye(c, dtype=a.dtype)[:, :, None]            # [i, j, 1]
    rows = [jnp.broadcast_to(eye[0], a.shape)]             # row i over columns j: [..., c, D]
    for i in range(1, c):
        rows.append(rows[-1] * a[..., i:i + 1, :] + eye[i])
    return jnp.stack(rows, axis=-3)


def rel_forward(Xs: jax.Array, Y: jax.Array, G, levels=LEVELS) -> jax.Array:
    """rel(X, Y, G) [n, ..., C, C] for a stack Xs [n, ..., C, D] of row operands sharing Y.

    G = (hi, lo, exp(g)) [..., C, D]. Entries j <= i are computed, entries above the diagonal are
    exactly 0. At each level in `levels` the chunk splits into blocks of that many rows: the
    off-diagonal blocks are one factorised matmul over all block pairs (pairs J >= I carry an
    exact 0 factor) and the diagonal blocks recurse; below the last level they are evaluated
    elementwise (C * bs * D multiply-adds, hence the small level).
    """
    C = Y.shape[-2]
    if not levels or levels[0] >= C:
        if levels:
            return rel_forward(Xs, Y, G, levels[1:])
        return jnp.sum(Xs[..., :, None, :] * (Y[..., None, :, :] * _diag_exp(G)), axis=-1)
    bs, nb = levels[0], C // levels[0]
    Gb = _gmap(lambda x: _blocks(x, bs), G)
    f = _factors(Gb)
    Xb, Yb = _blocks(Xs, bs), _blocks(Y, bs)
    diag = rel_forward(Xb, Yb, Gb, levels[1:])              # [n, ..., NB, bs, bs]
    ys = (Yb * f.eb)[..., None, :, :, :] * f.ec[..., :, :, None, :]    # [..., I, J, bs, D]
    R = mm("...Iid,...IJjd->...IiJj", Xb * f.ex, ys)
    R = R + diag[..., :, :, None, :] * jnp.eye(nb, dtype=R.dtype)[:, None, :, None]
    return R.reshape(R.shape[:-4] + (C, C))


def rel_backward(dR: jax.Array, Xs: jax.Array, Y: jax.Array, G, levels=LEVELS):
    """Cotangents of rel_forward: dXs [n, ..., C, D] and dY [..., C, D] (summed over the stack).

    dR [n, ..., C, C] must be 0 above the diagonal. dX_i = sum_j dR_ij Y_j exp(G_i - G_j) and
    dY_j = sum_i dR_ij X_i exp(G_i - G_j), through the same blocking as the forward; the gate
    cotangent is then sum_n X * dX - Y * dY (no new exponentials).
    """
    C = Y.shape[-2]
    if not levels or levels[0] >= C:
        if levels:
            return rel_backward(dR, Xs, Y, G, levels[1:])
        E = _diag_exp(G)
        dRe = dR[..., None]
        dX = jnp.sum(dRe * (Y[..., None, :, :] * E), axis=-2)
        dY = jnp.sum(dRe * Xs[..., :, None, :] * E, axis=(0, -3))
        return dX, dY
    bs, nb = levels[0], C // levels[0]
    Gb = _gmap(lambda x: _blocks(x, bs), G)
    f = _factors(Gb)
    Xb, Yb = _blocks(Xs, bs), _blocks(Y, bs)
    dRb = dR.reshape(dR.shape[:-2] + (nb, bs, nb, bs))
    dXd, dYd = rel_backward(jnp.einsum("...IiIj->...Iij", dRb), Xb, Yb, Gb, levels[1:])
    ys = (Yb * f.eb)[..., None, :, :, :] * f.ec[..., :, :, None, :]    # [..., I, J, bs, D]
    xs = (Xb * f.ex)[..., :, None, :, :] * f.ec[..., :, :, None, :]    # [n, ..., I, J, bs, D]
    dX = mm("...IiJj,...IJjd->...Iid", dRb, ys) * f.ex + dXd
    dY = mm("n...IiJj,n...IJid->...Jjd", dRb, xs) * f.eb + dYd     # one contraction over n, I, i
    return dX.reshape(Xs.shape), dY.reshape(Y.shape)


MID_EXPONENT = 40.0  # largest |exponent| of one factor of the bounded form (kda.md §2.3: K3, 16 rows)


def midpoint_block(lower_bound: float | None, chunk: int) -> int | None:
    """Rows per block of the bounded-gate relation form, or None for the general form.

    With every gate >= lower_bound, a block of bs rows factorised at its middle row has factor
    exponents of at most (bs / 2) |lower_bound|; the largest bs in {16, 8, 4} that keeps them
    <= MID_EXPONENT (e^40 ~ 2e17, far from f32's e^88) is used. K3's -5 gives 16.
    """
    if lower_bound is None:
        return None
    for bs in (16, 8, 4):
        if bs <= chunk and bs // 2 * abs(lower_bound) <= MID_EXPONENT:
            return bs
    return None


def _exp_pair(a, b, mask=None):
    """exp(a - b) for two (hi, lo) pairs, as exp(hi_a - hi_b) * exp(lo_a - lo_b).

    Why not exp of the rounded sum (_gdiff): rounding an exponent of size x costs a relative
    error of x 2^-24 in the factor; the hi difference is exact (Sterbenz) whenever the two
    cumsums are within a factor 2, and the lo difference is tiny (|d| < 1e-2, so 1 + d + d^2/2
    is exact to f32). `mask` (False -> exactly 0) goes inside the exponent.
    """
    x = a[0] - b[0]
    if mask is not None:
        x = jnp.where(mask, x, -jnp.inf)
    d = a[1] - b[1]
    return jnp.exp(x) * (1.0 + d * (1.0 + 0.5 * d))


def _mid_factors(G, bs: int):
    """Factors of the bounded form for G = (hi, lo, exp(g)) [..., C, D] and row blocks of bs.

    With m(I) the middle row of block I:  exp(G_i - G_j) = ex[I, i] * ey[I, j] for i in I,
        ex [..., NB, bs, D] = exp(G_i - G_m(I))      (|exponent| <= bs/2 |lower bound|)
        ey [..., NB, C, D]  = exp(G_m(I) - G_j) for j up to the end of block I, else 0.
    For j <= i the product is <= 1; above the diagonal inside a block it is large but finite
    in each factor, and the callers mask those entries (a select, so no inf reaches a sum).
    Columns far to the left underflow to 0 only where the true value is below e^-47.

    ey is assembled as exp(G_m(I) - G_m(J)) * exp(G_m(J) - G_j) for column j in block J <= I
    (the first factor <= 1, the second bounded like ex): C + NB^2 exponentials per channel
    instead of NB * C. That exponential (with its mask and compensation) was the largest
    elementwise op of the forward on CPU (~10% of it at C = 64); the extra rounding is one
    product, and the hi differences stay exact in the same cases as before.
    """
    nb = G[0].shape[-2] // bs
    Gm = _gmap(lambda x: x[..., bs // 2::bs, :], G)         # middle rows [..., NB, D]
    Gb = _gmap(lambda x: _blocks(x, bs), G)
    ex = _exp_pair(Gb, _gmap(lambda x: x[..., :, None, :], Gm))
    eo = _exp_pair(_gmap(lambda x: x[..., :, None, :], Gm), Gb)        # exp(G_m(J) - G_j)
    blk = jnp.arange(nb)
    em = _exp_pair(_gmap(lambda x: x[..., :, None, :], Gm), _gmap(lambda x: x[..., None, :, :], Gm),
                   (blk[None, :] <= blk[:, None])[:, :, None])      # [..., I, J, D], 0 for J > I
    ey = em[..., :, :, None, :] * eo[..., None, :, :, :]            # [..., I, J, bs, D]
    return ex, ey.reshape(ey.shape[:-4] + (nb, nb * bs, ey.shape[-1]))


def rel_forward_mid(Xs: jax.Array, Y: jax.Array, G, bs: int) -> jax.Array:
    """rel(X, Y, G) [n, ..., C, C] for gates bounded below (midpoint_block), one matmul per
    row block: entries j <= i are exact to rounding, entries above the diagonal are garbage
    (finite factors; the caller masks them).

    The n stacked row operands share each block's column factors, so they are folded into the
    block's rows ([..., NB, n * bs, D]): one matmul per block with n * bs rows, whose operands and
    result XLA:CPU keeps in place, instead of a product batched over n that it transposed on both
    sides (3-10% of the chunked fwd+bwd at T = 2048-8192, docs/kernels.md)."""
    ex, ey = _mid_factors(G, bs)
    xs = _fold_stack(_blocks(Xs, bs) * ex)                  # [..., NB, n * bs, D]
    ys = Y[..., None, :, :] * ey                            # [..., NB, C, D]
    R = mm("...Imd,...Ijd->...Imj", xs, ys)                 # [..., NB, n * bs, C]
    R = _unfold_stack(R, Xs.shape[0])                       # [n, ..., NB, bs, C]
    return R.reshape(R.shape[:-3] + (-1, R.shape[-1]))


def _fold_stack(x: jax.Array) -> jax.Array:
    """[n, ..., NB, bs, D] -> [..., NB, n * bs, D] (the stack moved into each block's rows)."""
    x = jnp.moveaxis(x, 0, -3)
    return x.reshape(x.shape[:-3] + (-1, x.shape[-1]))


def _unfold_stack(x: jax.Array, n: int) -> jax.Array:
    """[..., NB, n * bs, D] -> [n, ..., NB, bs, D]; the inverse of _fold_stack."""
    return jnp.moveaxis(x.reshape(x.shape[:-2] + (n, -1, x.shape[-1])), -3, 0)


def rel_backward_mid(dR: jax.Array, Xs: jax.Array, Y: jax.Array, G, bs: int):
    """Cotangents (dXs, dY) of rel_forward_mid; dR [n, ..., C, C] is 0 above the diagonal.
    The stack is folded into the block rows as in the forward: dY's contraction over the stack
    and the block's rows is then one contraction over n * bs rows."""
    ex, ey = _mid_factors(G, bs)
    C = Y.shape[-2]
    dRb = _fold_stack(dR.reshape(dR.shape[:-2] + (C // bs, bs, C)))   # [..., NB, n * bs, C]
    dX = _unfold_stack(mm("...Imj,...Ijd->...Imd", dRb, Y[..., None, :, :] * ey), Xs.shape[0]) * ex
    dys = mm("...Imj,...Imd->...Ijd", dRb, _fold_stack(_blocks(Xs, bs) * ex))   # summed over the stack
    return dX.reshape(Xs.shape), jnp.sum(dys * ey, axis=-3)


SMALL_BLOCK = 8  # the inverse's blocks up to this size multiply elementwise (_small_matmul)


def _small_matmul(a: jax.Array, b: jax.Array) -> jax.Array:
    """a @ b for tiny square blocks [..., s, s] as one elementwise product and sum (f32 products,
    f32 sums, like a HIGHEST dot). XLA:CPU runs a batched dot as one small matmul call per
    block, ~2 us each, so the ladder's levels of 1..8-row blocks cost more than all its FLOPs."""
    return jnp.sum(a[..., :, :, None] * b[..., None, :, :], axis=-2)


def unit_lower_inverse(L: jax.Array) -> jax.Array:
    """(I + L)^-1 for strictly lower triangular L [..., C, C], C a power of two.

    Recursive block inversion over doubling block sizes (kda.md §2.2's "ladder", f32 error
    ~1e-7): with the inverses A^-1, D^-1 of the two diagonal halves of a 2s-block,
        [[A, 0], [B, D]]^-1 = [[A^-1, 0], [-D^-1 B A^-1, D^-1]],
    all blocks of a level at once, so log2(C) levels of two batched matmuls each and no
    sequential row loop. Unlike Neumann doubling of the whole chunk nothing here grows like
    binomial coefficients: every product is of exact sub-inverses, as in block substitution.
    """
    C = L.shape[-1]
    X = jnp.ones(L.shape[:-2] + (C, 1, 1), L.dtype)       # inverses of the 1 x 1 diagonal blocks
    s = 1
    while s < C:
        nb = C // (2 * s)
        X = X.reshape(X.shape[:-3] + (nb, 2, s, s))
        Ainv, Dinv = X[..., 0, :, :], X[..., 1, :, :]
        Lb = L.reshape(L.shape[:-2] + (nb, 2 * s, nb, 2 * s))
        B = jnp.einsum("...IiIj->...Iij", Lb)[..., s:, :s]  # lower-left of each 2s-block
        if s <= SMALL_BLOCK:
            lower = -_small_matmul(_small_matmul(Dinv, B), Ainv)
        else:
            lower = -mm("...ij,...jk,...kl->...il", Dinv, B, Ainv)
        top = jnp.concatenate([Ainv, jnp.zeros_like(Ainv)], axis=-1)
        X = jnp.concatenate([top, jnp.concatenate([lower, Dinv], axis=-1)], axis=-2)
        s *= 2
    return X[..., 0, :, :]


class IntraOut(NamedTuple):
    """Per-chunk inputs of the state walk (shapes in the module docstring)."""
    aqk: jax.Array
    w: jax.Array
    u: jax.Array
    qg: jax.Array
    kg: jax.Array
    dec: jax.Array


class _Saved(NamedTuple):
    """Intermediates that the intra backward reuses (recomputed, never kept across the walk)."""
    qs: jax.Array
    m_qk: jax.Array
    m_kk: jax.Array
    G: tuple
    rkk: jax.Array
    A: jax.Array
    gam: jax.Array
    xw: jax.Array
    xu: jax.Array
    kdec: jax.Array   # exp(G_C - G) on the last document's rows, else 0


def intra_forward(q, k, v, g, beta, reset, *, scale: float, dtype,
                  block: int | None = None) -> tuple[IntraOut, _Saved]:
    """WY/UT factors of every chunk; see the module docstring for shapes.

    reset may broadcast against the leading dims of q (e.g. [B, 1, NT, C]). block: None for the
    general relation form (any gate <= 0), or midpoint_block(lower_bound, C) when every gate is
    >= lower_bound (rel_forward_mid: one matmul per row block, no elementwise diagonal blocks).
    """
    q, k, v, g, beta = (x.astype(dtype) for x in (q, k, v, g, beta))
    C = q.shape[-2]
    r = jnp.cumsum(reset.astype(jnp.int32), axis=-1)       # document index inside the chunk
    same = r[..., :, None] == r[..., None, :]
    conn = (r == 0)[..., None]                              # rows still in the incoming document
    last = (r == r[..., -1:])[..., None]                    # rows in the outgoing document
    i = jnp.arange(C)
    m_qk = same & (i[None, :] <= i[:, None])                # token t sees its own write
    m_kk = same & (i[None, :] < i[:, None])
    # (hi, lo) compensated cumsum, monotone, never restarted; plus exp(g) for diagonal blocks.
    G = (*compensated_cumsum(g), jnp.exp(g))
    qs = q * scale
    stack = jnp.stack([qs, k])                             # rel(q,k) and rel(k,k) in one pass
    rel = rel_forward(stack, k, G) if block is None else rel_forward_mid(stack, k, G, block)
    aqk = jnp.where(m_qk, rel[0], 0.0)
    rkk = jnp.where(m_kk, rel[1], 0.0)
    L = beta[..., :, None] * rkk
    A = unit_lower_inverse(L)
    gam = jnp.where(conn, jnp.exp(G[0] + G[1]), 0.0)       # decay since the chunk start, <= 1
    xw = beta[..., None] * gam * k
    xu = beta[..., None] * v
    wu = mm("...ij,...jd->...id", A, jnp.concatenate([xw, xu], axis=-1))   # one wider matmul
    w, u = wu[..., :k.shape[-1]], wu[..., k.shape[-1]:]
    GC = _gmap(lambda x: x[..., -1:, :], G)
    kdec = jnp.where(last, jnp.exp(_gdiff(GC, G)), 0.0)    # decay up to the chunk end, <= 1
    dec = jnp.where(conn[..., -1, :], jnp.exp(GC[0] + GC[1])[..., 0, :], 0.0)
    out = IntraOut(aqk, w, u, qs * gam, k * kdec, dec)
    saved = _Saved(qs, m_qk, m_kk, G, rkk, A, gam, xw, xu, kdec)
    return out, saved


def intra_backward(d: IntraOut, out: IntraOut, s: _Saved, k, v, beta, *, scale: float,
                   block: int | None = None):
    """Cotangents (dq, dk, dv, dg, dbeta) of intra_forward for output cotangents d (kda.md §3.1).

    out, s: what intra_forward returned for the same inputs and `block` (k, v, beta are its
    inputs, cast to the compute dtype here). dq, dk, dv, dg have the shapes of q, k, v, g; dbeta [..., C].

    dg is assembled without cancellation, because its true value is often tiny next to the
    terms it is made of (gates near -5 leave only neighbouring pairs):
      * diagonal entries of Aqk carry exp(0) and no gate dependence; they are kept out of dG
        (+x dx and -y dy would cancel only up to rounding, then the cumsum spreads the error);
      * the Kg terms depend on g_t for t > s, so they enter as an exclusive forward cumsum of
        shifted rows, not as (row sum at the end) - (reverse cumsum), nor cumsum - own row
        (the last row's term is O(1) and would swamp the e^-5-sized true value);
      * dec depends on every g_t of the chunk.
    """
    dtype = s.qs.dtype
    k, v, beta = (x.astype(dtype) for x in (k, v, beta))
    C = k.shape[-2]
    i = jnp.arange(C)
    daqk = jnp.where(s.m_qk, d.aqk, 0.0)
    dd = jnp.sum(jnp.where(i[:, None] == i[None, :], daqk, 0.0), axis=-1)[..., None]
    daqk = jnp.where(i[:, None] > i[None, :], daqk, 0.0)
    # Outputs QG = qs * gam, W = A xw, U = A xu.
    dqs = d.qg * s.gam + dd * k
    dgam = d.qg * s.qs
    dA = mm("...id,...jd->...ij", d.w, s.xw) + mm("...id,...jd->...ij", d.u, s.xu)
    dxw = mm("...ji,...jd->...id", s.A, d.w)
    dxu = mm("...ji,...jd->...id", s.A, d.u)
    # A = (I + L)^-1  =>  dL = -A^T dA A^T on the strictly lower, same-document entries.
    dL = -mm("...ki,...kl,...jl->...ij", s.A, dA, s.A)
    dL = jnp.where(s.m_kk, dL, 0.0)
    dbeta = jnp.sum(dL * s.rkk, axis=-1)
    drkk = beta[..., :, None] * dL
    dv = beta[..., None] * dxu
    dbeta = dbeta + jnp.sum(dxu * v, axis=-1) + jnp.sum(dxw * s.gam * k, axis=-1)
    dk = beta[..., None] * s.gam * dxw + dd * s.qs
    dgam = dgam + beta[..., None] * k * dxw
    # Strictly lower relation entries: d(rel)/dG = X * dX - Y * dY.
    dRs, Xs = jnp.stack([daqk, drkk]), jnp.stack([s.qs, k])
    dxs, dy = (rel_backward(dRs, Xs, k, s.G) if block is None
               else rel_backward_mid(dRs, Xs, k, s.G, block))
    dqs = dqs + dxs[0]
    dk = dk + dxs[1] + dy
    dG = s.qs * dxs[0] + k * (dxs[1] - dy) + dgam * s.gam
    # Kg = k * kdec: d/dg_t hits rows s < t.  dec = exp(G_C): every g_t.
    dk = dk + d.kg * s.kdec
    t = d.kg * out.kg
    dg = (cumsum_rows(dG, reverse=True) + cumsum_rows(t, exclusive=True)
          + (d.dec * out.dec)[..., None, :])
    return dqs * scale, dk, dv, dg, dbeta
