"""Grouped matmul as a scan over fixed-size row blocks: the XLA:CPU path.

XLA:CPU lowers `lax.ragged_dot` to about one masked dense matmul per group over all M rows, so a
dropless MoE layer does E times its work there (jax 0.12; 618 ms for the D=512, F=256, 32-expert
FFN of 256 tokens x top-4, against 38 ms here). This impl pads each group's rows to a multiple of
`block` rows, so every block belongs to one group, and scans over the blocks: block i computes
`lhs_block @ rhs[group(i)]`, a [block, K] x [K, N] matmul reading its matrix in place. Work is
M + G * (block - 1) rows at most, never G * M.

The gradient is a custom VJP of the same shape: d lhs is the blocked matmul with `rhs`
transposed; d rhs accumulates `lhs_block^T @ d out_block` into its group's [K, N] slot in the scan
carry (an in-place update), so no [blocks, K, N] stack exists.

`expert_ffn_blocked` is the few-token form (decode steps, short prefills): the whole gated expert
FFN (gate, up, activation, down) of one block per loop step, over only the blocks some group
uses, so each step reads its expert's three matrices once and no matmul runs on empty blocks.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from k3jax.kernels.kda.common import match_vma
from k3jax.kernels.moe.quantized import MXFP4, dequantize


def block_rows(num_rows: int, num_groups: int) -> int:
    """Rows per block from the static shapes: about half the mean group size, in [8, 64].

    Measured on 2 CPU cores (D=512, F=256, E=32, top-4; ms per FFN forward, block 4 / 8 / 16):
    32 tokens 14 / 13 / 19; 64 tokens 15 / 14 / 15; 256 tokens 57 / 38 / 74; 1024 tokens
    305 / 213 / 187. Small blocks waste less padding, large ones less per-step overhead."""
    mean = num_rows / max(num_groups, 1)
    b = 8
    while b < 64 and 4 * b <= mean:
        b *= 2
    return b


def _layout(group_sizes: jax.Array, num_rows: int, block: int):
    """Where each sorted row goes in the block-padded layout.

    Returns (dest [M] int32: padded row of every row, rows past sum(group_sizes) -> the last
    padded row, which no group owns; src [R] int32: the sorted row each padded row holds, M for
    none; block_group [NB] int32), with NB = ceil(M / block) + G blocks and R = NB * block + 1
    padded rows (the extra one is the sink of rows outside every group)."""
    g = group_sizes.shape[0]
    nb = -(-num_rows // block) + g
    sizes = group_sizes.astype(jnp.int32)
    padded = (sizes + block - 1) // block * block
    start = jnp.cumsum(sizes) - sizes
    pstart = jnp.cumsum(padded) - padded
    rows = jnp.arange(num_rows, dtype=jnp.int32)
    grp = jnp.searchsorted(jnp.cumsum(sizes), rows, side="right").astype(jnp.int32)    # G = none
    inside = grp < g
    grp_c = jnp.minimum(grp, g - 1)
    sink = nb * block
    dest = jnp.where(inside, pstart[grp_c] + rows - start[grp_c], sink).astype(jnp.int32)
    src = jnp.full((sink + 1,), num_rows, jnp.int32).at[dest].set(rows)   # slot `sink` is cut off below
    block_group = jnp.searchsorted(jnp.cumsum(padded), jnp.arange(nb, dtype=jnp.int32) * block, side="right")
    return dest, src[:sink], jnp.minimum(block_group, g - 1).astype(jnp.int32)


def _to_blocks(x, src, nb, block):
    xp = jnp.concatenate([x, jnp.zeros((1,) + x.shape[1:], x.dtype)])   # row M: zeros
    return xp[src].reshape(nb, block, x.shape[-1])


def _from_blocks(yb, dest):
    y = yb.reshape(-1, yb.shape[-1])
    y = jnp.concatenate([y, jnp.zeros((1, y.shape[-1]), y.dtype)])     # the sink row: zeros
    return y[dest]


def _scan_matmul(xb, rhs, block_group, out_dtype):
    def step(_, a):
        xi, gi = a
        return None, jnp.dot(xi, rhs[gi], preferred_element_type=out_dtype)

    return lax.scan(step, None, (xb, block_group))[1]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _blocked(lhs, rhs, group_sizes, block, out_dtype):
    return _fwd(lhs, rhs, group_sizes, block, out_dtype)[0]


def _fwd(lhs, rhs, group_sizes, block, out_dtype):
    m = lhs.shape[0]
    dest, src, bg = _layout(group_sizes, m, block)
    nb = bg.shape[0]
    yb = _scan_matmul(_to_blocks(lhs, src, nb, block), rhs, bg, out_dtype)
    return _from_blocks(yb, dest), (lhs, rhs, group_sizes)


def _bwd(block, out_dtype, res, ct):
    lhs, rhs, group_sizes = res
    m = lhs.shape[0]
    dest, src, bg = _layout(group_sizes, m, block)
    nb = bg.shape[0]
    xb = _to_blocks(lhs, src, nb, block)
    db = _to_blocks(ct, src, nb, block)                                    # [NB, b, N]
    f32 = jnp.float32

    def step(drhs, a):
        xi, di, gi = a
        dx = jnp.dot(di, rhs[gi].T, preferred_element_type=f32)           # [b, K]
        return drhs.at[gi].add(jnp.dot(xi.T, di, preferred_element_type=f32)), dx

    # Inside a shard_map the carry must vary over the axes its updates do (those of lhs and ct).
    zero = match_vma(match_vma(jnp.zeros(rhs.shape, f32), lhs), ct)
    drhs, dxb = lax.scan(step, zero, (xb, db, bg))
    dlhs = _from_blocks(dxb, dest)
    return _sum_to(dlhs, lhs).astype(lhs.dtype), _sum_to(drhs, rhs).astype(rhs.dtype), None


def _sum_to(ct, x):
    """The cotangent of an input that is the same on every shard of some shard_map axes (the
    experts, replicated over the token shards) is the sum over them of what each shard computed;
    jax adds that psum for its own ops' transposes, a custom VJP must itself."""
    extra = tuple(sorted(jax.typeof(ct).mat.varying - jax.typeof(x).mat.varying))
    return lax.psum(ct, extra) if extra else ct


_blocked.defvjp(_fwd, _bwd)


def blocked_grouped_matmul(lhs, rhs, group_sizes, *, preferred_element_type=jnp.float32, block: int | None = None):
    """`out[m] = lhs[m] @ rhs[group(m)]` (see gmm.py), as a scan over row blocks.

    Args:
      lhs: [M, K] rows sorted by group; rhs: [G, K, N]; group_sizes: [G] int32, sum <= M (rows
        past the sum give 0 and get no gradient).
      block: rows per block; None = `block_rows(M, G)`.
    Returns:
      [M, N] in preferred_element_type; differentiable wrt lhs and rhs (custom VJP).
    """
    block = block or block_rows(lhs.shape[0], rhs.shape[0])
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)       # numpy operands too, as ragged_dot takes them
    return _blocked(lhs, rhs, group_sizes.astype(jnp.int32), block, jnp.dtype(preferred_element_type))


def few_block_rows(num_rows: int, num_groups: int) -> int:
    """Rows per block of `expert_ffn_blocked`: the smallest power of two >= m + 2*sqrt(m), m the
    mean group size (M/G), so nearly every group fits one block. A loop step costs about one read
    of its expert's three matrices whatever the block's rows, so a group split over two blocks
    reads its expert twice; padded rows cost only FLOPs. Greedy decode step of the
    benchmarks/decode_vs_hf.py model (D=512, F=256, E=32, top-4, 7 MoE layers; one core, the
    same process alternating; ms, best of 8-10): 8 tokens (m=1) block 1 / 2 / 4 / 8 / 16: 21.5 /
    18.0 / 15.5 / 15.2 / 17.3; 32 tokens (m=4) block 4 / 8 / 16 / 32: 38.6 / 34.1 / 33.5 / 38.1;
    1 token block 1 / 2 / 4: 6.2 / 6.2 / 6.4 (docs/moe.md)."""
    m = num_rows / max(num_groups, 1)
    b = 1
    while b < m + 2 * m ** 0.5:
        b *= 2
    return b


def _expert(w, g, dtype):
    """Expert ``g``'s matrix of a dense [G, K, N] stack or a packed ``MXFP4`` one (only that
    expert's codes and scales are decoded)."""
    if isinstance(w, MXFP4):
        return dequantize(MXFP4(w.codes[g], w.scales[g]), dtype)
    return w[g].astype(dtype)


def expert_ffn_blocked(xs, group_sizes, w_gate, w_up, w_down, act, *, block: int | None = None):
    """Gated expert MLP on group-sorted rows, one loop step per used row block.

    Args:
      xs: [M, D] rows sorted by expert (x dtype); group_sizes: [G] int32, sum <= M (rows past the
        sum come out as 0).
      w_gate, w_up: [G, D, F]; w_down: [G, F, D] (dense arrays or ``MXFP4``).
      act: f32 elementwise ``act(gate, up)``.
      block: rows per block; None = `few_block_rows(M, G)`.
    Returns:
      [M, D] in xs.dtype, with `expert_ffn_grouped`'s casts (gate/up in xs.dtype with f32
      accumulation, act in f32, down accumulated in f32).

    The loop runs a static bound of blocks (the most the groups can use: M/block plus one partial
    block per non-empty group) and skips those past the used ones with a `lax.cond`, so it is an
    ordinary differentiable `fori_loop`; with block 1 and every row in a group none is skipped.
    """
    m, d = xs.shape
    g = w_gate.shape[0]
    block = block or few_block_rows(m, g)
    dest, src, bg = _layout(group_sizes, m, block)
    nb = min(bg.shape[0], (m + min(g, m) * (block - 1)) // block)
    sizes = group_sizes.astype(jnp.int32)
    used = jnp.sum((sizes + block - 1) // block)
    xb = _to_blocks(xs, src[:nb * block], nb, block)                      # [nb, block, D]
    dest = jnp.minimum(dest, nb * block)                                  # rows outside every group -> sink
    f32, dt = jnp.float32, xs.dtype

    def ffn(i):
        e, xi = bg[i], xb[i]
        gate = jnp.dot(xi, _expert(w_gate, e, dt), preferred_element_type=dt)
        up = jnp.dot(xi, _expert(w_up, e, dt), preferred_element_type=dt)
        h = act(gate.astype(f32), up.astype(f32)).astype(dt)
        return jnp.dot(h, _expert(w_down, e, dt), preferred_element_type=f32).astype(dt)

    def step(i, yb):
        y = lax.cond(i < used, ffn, lambda i: jnp.zeros((block, d), dt), i)
        return lax.dynamic_update_index_in_dim(yb, y, i, 0)

    yb = lax.fori_loop(0, nb, step, jnp.zeros((nb, block, d), dt))
    return _from_blocks(yb, dest)
