"""Grouped matrix multiplication: rows of `lhs` sorted by group, each group times its own matrix.

    out[m] = lhs[m] @ rhs[g(m)]     g(m) = group whose row range [start_g, start_g + size_g)
                                    holds m; rows past sum(group_sizes) give 0

Three interchangeable implementations (same numbers and gradients, chosen by `impl`):

  "ragged_dot"  `jax.lax.ragged_dot`. XLA's native op; on TPU it lowers to a grouped kernel, on
                CPU to roughly G dense matmuls (ecosystem.md §4), so keep G small in CPU runs.
  "megablox"    the Pallas TPU kernel `jax.experimental.pallas.ops.tpu.megablox.gmm` with its
                custom VJP (gmm for d lhs, tgmm for d rhs). Needs M divisible by the row tile,
                handled here by zero padding. Off TPU it needs `interpret=True`; with
                `interpret=False` Pallas raises "Only interpret mode is supported on CPU
                backend" at lowering. There is no fallback to another impl.
  "blocked"     a scan over fixed-size row blocks, each one group's (blocked.py): the XLA:CPU
                path, 11-30x faster than "ragged_dot" there at MoE-layer shapes, fwd+bwd (docs/moe.md).
  "dense"       reference: every group on every row ([G, M, N] intermediate), then a row ->
                group one-hot mask. Obviously correct, O(G) too much work: tests only.
  "tokamax_ragged_dot"
                `tokamax.ragged_dot` with its own VJP: the Pallas Mosaic TPU kernel
                ("mosaic_tpu") when the devices are TPUs, its XLA op ("xla", i.e.
                `jax.lax.ragged_dot`) elsewhere, picked from the platform, never by fallback.
                The Mosaic kernel needs M, K, N >= 128 (it raises otherwise); its rows past
                sum(group_sizes) are zeroed here, so the contract above holds whatever the
                kernel leaves there (not checkable off TPU).

`rhs` may be an `MXFP4` (packed 4-bit experts, quantized.py). Then "megablox" runs our Pallas
kernel that decodes each [tk, tn] weight tile in VMEM (mxfp4_gmm.py; the packed stack never
exists in BF16/F32 in HBM), while "ragged_dot", "blocked" and "dense" are the XLA path: they dequantize the
stack to lhs.dtype first (CPU runs, tests; it materialises the dense experts).
"tokamax_ragged_dot" refuses it: tokamax takes quantized operands as qwix `QArray`s, and MXFP4
is not one (no conversion is built; config validation names the alternatives).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import megablox

from k3jax.kernels.moe.blocked import blocked_grouped_matmul
from k3jax.kernels.moe.mxfp4_gmm import mxfp4_grouped_matmul
from k3jax.kernels.moe.quantized import MXFP4, dequantize
from k3jax.kernels.platform import resolve, target_platform

__all__ = ["grouped_matmul", "IMPLS", "resolve_impl", "row_group_ids"]

IMPLS = ("ragged_dot", "megablox", "blocked", "dense", "tokamax_ragged_dot")


def row_group_ids(group_sizes: jax.Array, num_rows: int) -> jax.Array:
    """Group id of every row for rows sorted by group.

    Args:
      group_sizes: [G] int32, sum <= num_rows.
      num_rows: M.
    Returns:
      [M] int32 in [0, G]; G marks rows past sum(group_sizes) (no group).
    """
    ends = jnp.cumsum(group_sizes)                                        # [G] exclusive ends
    rows = jnp.arange(num_rows, dtype=ends.dtype)
    return jnp.searchsorted(ends, rows, side="right").astype(jnp.int32)


def _dense(lhs, rhs, group_sizes, preferred_element_type):
    g = rhs.shape[0]
    every = jnp.einsum("mk,gkn->gmn", lhs, rhs,
                       preferred_element_type=preferred_element_type)    # [G, M, N]
    member = jax.nn.one_hot(row_group_ids(group_sizes, lhs.shape[0]), g,
                            dtype=every.dtype)                            # [M, G]; 0-row if none
    return jnp.einsum("gmn,mg->mn", every, member)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _megablox(lhs, rhs, group_sizes, preferred_element_type, tiling, interpret):
    m, k = lhs.shape
    n = rhs.shape[2]
    tm, tk, tn = tiling
    # Row tile: never larger than the (16-row aligned; bf16 packs 16 rows per TPU sublane
    # tile) problem. K and N tiles may equal the full dim, which Mosaic always accepts.
    tm = min(tm, _round_up(m, 16))
    tk, tn = min(tk, k), min(tn, n)
    m_pad = _round_up(m, tm)
    lhs_p = jnp.pad(lhs, ((0, m_pad - m), (0, 0)))
    # Padding rows (and rows past sum(group_sizes)) go into one extra trailing group that has
    # no matrix: megablox then treats `rhs` as the first G of G+1 groups (its expert-sharding
    # path), skips the tail's tiles and zeroes its rows, forward and in d lhs; tgmm returns
    # d rhs for the G real groups only.
    tail = jnp.asarray(m_pad, jnp.int32) - jnp.sum(group_sizes)
    sizes = jnp.concatenate([group_sizes, tail[None]])                    # [G + 1]
    out = megablox.gmm(lhs_p, rhs, sizes, preferred_element_type, (tm, tk, tn),
                       None, None, False, interpret)
    return out[:m]


def resolve_impl(impl: str, platform: str | None = None) -> str:
    """``moe_impl=auto`` for devices of ``platform`` (None: the ambient mesh's, else the default
    backend's, so an AOT compile for a TPU topology on a CPU host resolves for TPU): ``blocked``
    on CPU, where XLA's ragged_dot runs every expert on every row (docs/moe.md: the small step
    49.3 -> 10.1 s), ``ragged_dot`` on TPU and GPU. Any other name is returned unchanged."""
    return resolve("moe_impl", impl, platform)


def _tokamax(lhs, rhs, group_sizes, preferred_element_type):
    import tokamax  # lazy: a slow import (seconds), paid only when a tokamax implementation runs
    impl = "mosaic_tpu" if target_platform() == "tpu" else "xla"
    m = lhs.shape[0]
    if impl == "mosaic_tpu":
        # The Mosaic kernel needs M divisible by its 128-row tile (NotImplementedError otherwise,
        # seen compiling for v5p): zero rows go after the last group, outside every group.
        lhs = jnp.pad(lhs, ((0, _round_up(m, 128) - m), (0, 0)))
    out = tokamax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=preferred_element_type,
                             implementation=impl)
    if impl == "mosaic_tpu":
        inside = row_group_ids(group_sizes, m) < rhs.shape[0]
        out = jnp.where(inside[:, None], out[:m], jnp.zeros((), out.dtype))
    return out


def grouped_matmul(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    impl: str,
    preferred_element_type=jnp.float32,
    interpret: bool = False,
    tiling: tuple[int, int, int] = (128, 128, 128),
) -> jax.Array:
    """Grouped matmul `out[m] = lhs[m] @ rhs[group(m)]`.

    Args:
      lhs: [M, K] rows sorted by group (bf16 or f32).
      rhs: [G, K, N] one matrix per group (same dtype as lhs), or an `MXFP4` of that shape.
      group_sizes: [G] int32 rows per group, sum(group_sizes) <= M. Rows past the sum are
        outside every group: their output is 0 and they receive no gradient.
      impl: "ragged_dot" | "megablox" | "blocked" | "dense" | "tokamax_ragged_dot" (module docstring).
      preferred_element_type: output / accumulation dtype (f32 by default).
      interpret: megablox only; run the Pallas kernel in interpret mode (required off TPU).
      tiling: megablox only; (tm, tk, tn) tiles, clipped to the problem size.
    Returns:
      [M, N] in `preferred_element_type`. Differentiable wrt lhs and rhs with every impl.
    """
    if isinstance(rhs, MXFP4):
        if impl == "tokamax_ragged_dot":
            raise ValueError("impl='tokamax_ragged_dot' takes no MXFP4 experts (tokamax wants a qwix QArray); "
                             "use 'megablox' (packed-weight kernel) or 'ragged_dot'")
        if impl == "megablox":
            return mxfp4_grouped_matmul(lhs, rhs, group_sizes, preferred_element_type=preferred_element_type,
                                        interpret=interpret, tiling=tuple(tiling))
        rhs = dequantize(rhs.check(), lhs.dtype)
    if lhs.ndim != 2 or rhs.ndim != 3 or lhs.shape[1] != rhs.shape[1]:
        raise ValueError(f"need lhs [M, K], rhs [G, K, N]; got {lhs.shape}, {rhs.shape}")
    if group_sizes.shape != (rhs.shape[0],):
        raise ValueError(f"group_sizes {group_sizes.shape} != [G={rhs.shape[0]}]")
    group_sizes = group_sizes.astype(jnp.int32)
    if impl == "ragged_dot":
        return jax.lax.ragged_dot(lhs, rhs, group_sizes,
                                  preferred_element_type=preferred_element_type)
    if impl == "megablox":
        return _megablox(lhs, rhs, group_sizes, preferred_element_type, tuple(tiling), interpret)
    if impl == "blocked":
        return blocked_grouped_matmul(lhs, rhs, group_sizes, preferred_element_type=preferred_element_type)
    if impl == "dense":
        return _dense(lhs, rhs, group_sizes, preferred_element_type)
    if impl == "tokamax_ragged_dot":
        return _tokamax(lhs, rhs, group_sizes, preferred_element_type)
    raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
