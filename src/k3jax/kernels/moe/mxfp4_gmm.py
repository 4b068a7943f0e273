"""Grouped matmul with MXFP4 (packed 4-bit) experts: a Pallas TPU kernel that decodes in VMEM.

    out[m] = lhs[m] @ W[g(m)]      W = dequantize(rhs) [G, K, N], never formed in HBM

Layout (quantized.py): codes uint8 [G, K/2, N] hold rows 2j (low nibble) and 2j+1 (high nibble)
of W, scales uint8 [G, K/32, N] one E8M0 byte per 32 rows. The kernel never interleaves the two
nibbles: it splits the contraction instead,

    lhs @ W = lhs[:, 0::2] @ W_lo + lhs[:, 1::2] @ W_hi       W_lo/W_hi [K/2, N] = the nibbles

so each grid step loads one [K/2, tn] code tile and its [K/32, tn] scales (4.25 bits per weight
moved from HBM), decodes both nibble planes in VMEM (exact in bf16/f32) and does two MXU matmuls.

Ragged rows: each group's rows are placed at a row-tile (``tm``) aligned offset of a padded
buffer, so every row tile belongs to one group; ``tile_group`` (scalar-prefetched) picks the
weight tile. There are at most ceil((M + min(G, M) * (tm - 1)) / tm) tiles; unused tail tiles
repeat the last group (no new weight DMA: the grid runs tiles innermost) and write zeros. Rows
past sum(group_sizes) give 0, as in gmm.py.

Gradient: d lhs only (the packed experts are not trainable). It is the XLA transposed product
with the experts decoded (gmm.py's XLA path), i.e. the backward materialises each layer's
decoded stack; training with frozen MXFP4 experts is supported, not optimised.

Off TPU, pass ``interpret=True`` (Pallas interpret mode): there is no silent switch of path.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from k3jax.kernels.moe.quantized import MX_BLOCK, MXFP4, dequantize, e2m1_value, e8m0_factor

__all__ = ["mxfp4_grouped_matmul", "tile_layout"]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def tile_layout(group_sizes: jax.Array, num_rows: int, tm: int):
    """Place each group's rows at a tm-aligned offset.

    Returns:
      dest: [M] int32 padded row of every sorted row (num_tiles * tm = dropped for rows past
        sum(group_sizes)); tile_group: [num_tiles] int32; tile_live: [num_tiles] int32 (0/1);
      num_tiles: the static bound.
    """
    g = group_sizes.shape[0]
    num_tiles = max(1, _cdiv(num_rows + min(g, num_rows) * (tm - 1), tm))
    sizes = group_sizes.astype(jnp.int32)
    tiles = (sizes + tm - 1) // tm                                        # [G]
    tile_end = jnp.cumsum(tiles)                                          # [G] exclusive ends
    tile_start = tile_end - tiles
    row_end = jnp.cumsum(sizes)
    row_start = row_end - sizes
    rows = jnp.arange(num_rows, dtype=jnp.int32)
    grp = jnp.searchsorted(row_end, rows, side="right").astype(jnp.int32)  # [M]; G = past the end
    live_row = grp < g
    gc = jnp.minimum(grp, g - 1)
    dest = jnp.where(live_row, tile_start[gc] * tm + rows - row_start[gc], num_tiles * tm)
    t = jnp.arange(num_tiles, dtype=jnp.int32)
    tgrp = jnp.searchsorted(tile_end, t, side="right").astype(jnp.int32)  # [T]; G = unused
    used = tile_end[-1]
    last = jnp.searchsorted(tile_end, jnp.maximum(used - 1, 0), side="right").astype(jnp.int32)
    tile_live = (t < used).astype(jnp.int32)
    tile_group = jnp.where(t < used, tgrp, jnp.minimum(last, g - 1)).astype(jnp.int32)
    return dest.astype(jnp.int32), tile_group, tile_live, num_tiles


def _kernel(tile_group_ref, tile_live_ref, xe_ref, xo_ref, codes_ref, scales_ref, out_ref):
    del tile_group_ref
    t = pl.program_id(1)
    k2, tn = codes_ref.shape[1], codes_ref.shape[2]
    c = codes_ref[0].astype(jnp.int32)                                    # [K/2, tn]
    f = e8m0_factor(scales_ref[0].astype(jnp.int32))                      # [K/32, tn]
    per = MX_BLOCK // 2                                                   # code rows per scale

    def plane(v):                                                         # decode, scale, cast
        v = e2m1_value(v).reshape(k2 // per, per, tn) * f[:, None, :]
        return v.reshape(k2, tn).astype(xe_ref.dtype)

    # Explicit precision: bf16 operands are exact products on the MXU at DEFAULT (Mosaic rejects
    # an fp32 contract precision for them, e.g. under jax_default_matmul_precision=highest).
    prec = jax.lax.Precision.HIGHEST if xe_ref.dtype == jnp.float32 else jax.lax.Precision.DEFAULT
    acc = jnp.dot(xe_ref[...], plane(c & 15), preferred_element_type=jnp.float32, precision=prec)
    acc += jnp.dot(xo_ref[...], plane(c >> 4), preferred_element_type=jnp.float32, precision=prec)
    live = tile_live_ref[t] > 0
    out_ref[...] = jnp.where(live, acc, 0.0).astype(out_ref.dtype)


def _forward(lhs, codes, scales, group_sizes, out_dtype, tiling, interpret):
    m, k = lhs.shape
    g, k2, n = codes.shape
    tm, _, tn = tiling
    # Row tile: at most the mean rows per group (decode: a few rows per expert, so a 16-row tile
    # wastes little), at least one sublane tile (8 rows f32, 16 packed bf16).
    least = 8 if lhs.dtype.itemsize >= 4 else 16
    tm = max(least, min(tm, -(-max(1, _cdiv(m, g)) // least) * least))
    tn = tn if n % tn == 0 else n
    dest, tile_group, tile_live, num_tiles = tile_layout(group_sizes, m, tm)
    rows = num_tiles * tm
    xp = jnp.zeros((rows, k), lhs.dtype).at[dest].set(lhs, mode="drop")    # [T*tm, K]
    xe, xo = xp[:, 0::2], xp[:, 1::2]
    spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(n // tn, num_tiles),          # tiles innermost: a group's weight tile is fetched once
        in_specs=[pl.BlockSpec((tm, k2), lambda j, t, tg, tl: (t, 0)),
                  pl.BlockSpec((tm, k2), lambda j, t, tg, tl: (t, 0)),
                  pl.BlockSpec((1, k2, tn), lambda j, t, tg, tl: (tg[t], 0, j)),
                  pl.BlockSpec((1, k2 * 2 // MX_BLOCK, tn), lambda j, t, tg, tl: (tg[t], 0, j))],
        out_specs=pl.BlockSpec((tm, tn), lambda j, t, tg, tl: (t, j)))
    # Inside shard_map (expert parallelism) the output varies over the mesh axes the rows do.
    out_shape = jax.ShapeDtypeStruct((rows, n), out_dtype, manual_axis_type=jax.typeof(xe).mat)
    out = pl.pallas_call(
        _kernel, grid_spec=spec, out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret, name="mxfp4_gmm")(tile_group, tile_live, xe, xo, codes, scales)
    got = jnp.concatenate([out, jnp.zeros((1, n), out.dtype)])
    return got[jnp.minimum(dest, rows)]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _gmm(lhs, codes, scales, group_sizes, out_dtype, tiling, interpret):
    return _forward(lhs, codes, scales, group_sizes, out_dtype, tiling, interpret)


def _gmm_fwd(lhs, codes, scales, group_sizes, out_dtype, tiling, interpret):
    return _forward(lhs, codes, scales, group_sizes, out_dtype, tiling, interpret), (lhs, codes, scales, group_sizes)


def _gmm_bwd(out_dtype, tiling, interpret, res, dout):
    lhs, codes, scales, group_sizes = res
    w = dequantize(MXFP4(codes, scales), lhs.dtype)
    _, vjp = jax.vjp(lambda a: jax.lax.ragged_dot(a, w, group_sizes, preferred_element_type=out_dtype), lhs)
    (dlhs,) = vjp(dout)
    zero = lambda a: jnp.zeros(a.shape, jax.dtypes.float0)  # noqa: E731 - integer inputs
    return dlhs.astype(lhs.dtype), zero(codes), zero(scales), zero(group_sizes)


_gmm.defvjp(_gmm_fwd, _gmm_bwd)


def mxfp4_grouped_matmul(lhs: jax.Array, rhs: MXFP4, group_sizes: jax.Array, *,
                         preferred_element_type=jnp.float32, interpret: bool = False,
                         tiling: tuple[int, int, int] = (128, 128, 128)) -> jax.Array:
    """``gmm.grouped_matmul`` with an MXFP4 right-hand side, decoded tile by tile in VMEM.

    Args:
      lhs: [M, K] rows sorted by group (bf16 or f32).
      rhs: MXFP4 of logical shape [G, K, N] (codes [G, K/2, N], scales [G, K/32, N]).
      group_sizes: [G] int32, sum <= M.
      preferred_element_type: output dtype (accumulation is f32).
      interpret: Pallas interpret mode (required off TPU).
      tiling: (tm, _, tn): the row tile and the output-column tile (tn must divide N, else N);
        K is not tiled (a whole [K/2, tn] code tile per step).
    Returns:
      [M, N] in ``preferred_element_type``; differentiable wrt lhs.
    """
    rhs.check("mxfp4_grouped_matmul rhs")
    if lhs.ndim != 2 or lhs.shape[1] != rhs.shape[1]:
        raise ValueError(f"need lhs [M, K={rhs.shape[1]}], got {lhs.shape}")
    if group_sizes.shape != (rhs.shape[0],):
        raise ValueError(f"group_sizes {group_sizes.shape} != [G={rhs.shape[0]}]")
    return _gmm(lhs, rhs.codes, rhs.scales, group_sizes.astype(jnp.int32), jnp.dtype(preferred_element_type),
                tuple(tiling), bool(interpret))
