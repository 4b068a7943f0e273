"""Single-device MoE expert computation: dropless (grouped matmul), capacity (einsum), reference.

All three compute, for routing `(weights [N, k], idx [N, k])` from `routing.route`,

    h_e(x) = cast_x( act(x @ w_gate[e], x @ w_up[e]) )   # act in f32, cast to x.dtype
    y_e(x) = cast_x( h_e(x) @ w_down[e] )                # "expert out bf16" (k3-architecture §6)
    out[n] = sum_j weights[n, j] * f32(y_{idx[n, j]}(x[n]))   # f32 accumulation

with the same casts, so they agree to accumulation order in any dtype. Weights are [in, out]:
w_gate, w_up [E, D, F]; w_down [E, F, D]; each either a dense array (x dtype) or a packed
`quantized.MXFP4` of that logical shape (the grouped matmul takes it as is; the capacity and
reference paths decode it to x dtype / f32 first). `act(gate, up)` maps two f32 [..., F] arrays to
f32 [..., F] elementwise (SwiGLU `silu(g) * u`, SiTU, ...).

Letters: n tokens, k slots, e experts, c capacity, d model (latent) dim, f expert ffn dim,
m = n*k sorted (token, slot) rows.
"""
from __future__ import annotations

import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp

from k3jax.kernels.moe.blocked import expert_ffn_blocked
from k3jax.kernels.moe.gmm import grouped_matmul
from k3jax.kernels.moe.quantized import MXFP4, as_dense, dequantize

__all__ = [
    "Act", "moe_dropless", "moe_few_tokens", "few_token_path", "moe_capacity", "moe_dense_reference", "sort_by_expert",
    "expert_ffn_grouped", "expert_ffn_batched", "capacity_slots", "capacity_dispatch",
    "capacity_collect", "combine", "capacity_of",
]

Act = Callable[[jax.Array, jax.Array], jax.Array]


def _check(x, weights, idx, w_gate, w_up, w_down):
    n, d = x.shape
    e, d2, f = w_gate.shape
    if weights.shape != idx.shape or idx.shape[0] != n:
        raise ValueError(f"weights {weights.shape} / idx {idx.shape} must both be [N={n}, k]")
    if d2 != d or w_up.shape != (e, d, f) or w_down.shape != (e, f, d):
        raise ValueError(f"expert weights must be [E, D, F], [E, D, F], [E, F, D] with D={d}; got "
                         f"{w_gate.shape}, {w_up.shape}, {w_down.shape}")


def combine(weights: jax.Array, y: jax.Array) -> jax.Array:
    """Weighted sum over slots in f32: `einsum("nk,nkd->nd")`.

    Args:
      weights: [N, k] routing weights (f32).
      y: [N, k, D] expert outputs (x dtype).
    Returns:
      [N, D] f32.
    """
    return jnp.einsum("nk,nkd->nd", weights.astype(jnp.float32), y.astype(jnp.float32))


def sort_by_expert(idx: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Order the N*k (token, slot) assignments by expert.

    Args:
      idx: [N, k] int expert ids.
      num_experts: E.
    Returns:
      order: [N*k] int32 permutation; `order[i]` = flat (n*k + j) index of the i-th sorted row.
        Stable argsort, so each expert's rows stay in token order.
      inverse: [N*k] int32, `inverse[order[i]] = i` (un-sorting is then a gather, not a scatter).
      group_sizes: [E] int32 rows per expert.
    """
    flat = idx.reshape(-1).astype(jnp.int32)
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.size, dtype=jnp.int32))
    group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    return order, inverse, group_sizes


def expert_ffn_grouped(xs: jax.Array, group_sizes: jax.Array, w_gate, w_up, w_down, act: Act, *,
                       impl: str, interpret: bool = False,
                       tiling: tuple[int, int, int] = (128, 128, 128), reduce=None) -> jax.Array:
    """Gated expert MLP on expert-sorted rows via grouped matmuls.

    Args:
      xs: [M, D] rows sorted by expert (x dtype).
      group_sizes: [E] int32, sum <= M; rows past the sum come out as 0.
      w_gate, w_up: [E, D, F]; w_down: [E, F, D].
      impl, interpret, tiling: see `gmm.grouped_matmul`.
      reduce: optional f32 [M, D] -> [M, D] applied to the down projection before the cast (the
        psum over a tensor axis when F is sharded: each shard holds a partial sum).
    Returns:
      [M, D] in xs.dtype.
    """
    gmm = lambda a, w, dt: grouped_matmul(a, w, group_sizes, impl=impl, interpret=interpret,  # noqa: E731
                                          preferred_element_type=dt, tiling=tiling)
    # Gate/up leave the matmul in the activation dtype (f32 accumulation inside it); the gating
    # math runs in f32. They are the backward's residuals, so this halves the largest per-layer
    # buffers at bf16 (K3: [E_local, ep*C, F] per matrix) at the cost of one bf16 rounding.
    g, u = gmm(xs, w_gate, xs.dtype), gmm(xs, w_up, xs.dtype)
    h = act(g.astype(jnp.float32), u.astype(jnp.float32)).astype(xs.dtype)  # [M, F]
    y = gmm(h, w_down, jnp.float32)                                       # [M, D]
    return (y if reduce is None else reduce(y)).astype(xs.dtype)


def expert_ffn_batched(buf: jax.Array, w_gate, w_up, w_down, act: Act, reduce=None) -> jax.Array:
    """Gated expert MLP on fixed-size per-expert buffers (capacity mode).

    Args:
      buf: [E, C, D] tokens per expert (x dtype; empty slots are zero rows).
      w_gate, w_up: [E, D, F]; w_down: [E, F, D].
    Returns:
      [E, C, D] in buf.dtype.
    """
    f32 = jnp.float32
    w_gate, w_up, w_down = (as_dense(w, buf.dtype) for w in (w_gate, w_up, w_down))
    # Gate/up in buf.dtype (f32 accumulation inside the matmul), gating in f32: see
    # expert_ffn_grouped.
    g = jnp.einsum("ecd,edf->ecf", buf, w_gate, preferred_element_type=buf.dtype)
    u = jnp.einsum("ecd,edf->ecf", buf, w_up, preferred_element_type=buf.dtype)
    h = act(g.astype(f32), u.astype(f32)).astype(buf.dtype)
    y = jnp.einsum("ecf,efd->ecd", h, w_down, preferred_element_type=f32)
    return (y if reduce is None else reduce(y)).astype(buf.dtype)


def moe_dropless(x, weights, idx, w_gate, w_up, w_down, act: Act, *, impl: str = "ragged_dot",
                 interpret: bool = False,
                 tiling: tuple[int, int, int] = (128, 128, 128)) -> jax.Array:
    """Dropless MoE: sort assignments by expert, grouped matmuls, unsort, f32 combine.

    Peak intermediates are [N*k, F] (gate/up) and [N*k, D]; no [N, E, D] tensor exists.

    Args:
      x: [N, D] tokens (bf16 or f32).
      weights: [N, k] f32 routing weights; idx: [N, k] int32 expert ids.
      w_gate, w_up: [E, D, F]; w_down: [E, F, D] (x dtype).
      act: f32 elementwise `act(gate, up)`.
      impl: grouped-matmul impl, "ragged_dot" | "megablox" | "dense" (see gmm.py).
      interpret: megablox interpret mode (required off TPU).
      tiling: megablox (tm, tk, tn) tiles; tune per shape on TPU.
    Returns:
      [N, D] f32.
    """
    _check(x, weights, idx, w_gate, w_up, w_down)
    n, k = idx.shape
    order, inverse, group_sizes = sort_by_expert(idx, w_gate.shape[0])
    xs = x[order // k]                                                    # [N*k, D] by expert
    ys = expert_ffn_grouped(xs, group_sizes, w_gate, w_up, w_down, act, impl=impl,
                            interpret=interpret, tiling=tiling)           # [N*k, D]
    y = ys[inverse].reshape(n, k, -1)                                     # back to (token, slot)
    return combine(weights, y)


def few_token_path(num_tokens: int, top_k: int, num_experts: int, max_tokens: int,
                   impl: str = "ragged_dot") -> str | None:
    """Which few-token dispatch `moe_few_tokens` runs for N tokens, or None for the dropless path.

    `max_tokens` is the config's `moe_gather_max_tokens` (0 = off). At or below it (decode steps,
    short prefills) sorting N*k rows and a ragged grouped matmul cost more than the experts' math:
      "gather"  4*N*k <= E: each (token, slot) gathers its expert's three matrices and runs its
                own small matmuls; computes exactly the N*k needed, but copies N*k matrices
                before reading them again.
      "onehot"  otherwise: every expert on every token as batched matmuls over E, combined with
                the [N, E] routing weights (zero off the chosen experts); reads each expert once
                in place, computes E/k times the needed FLOPs.
      "loop"    `impl="blocked"` (the XLA:CPU grouped matmul) while N*k <= 4*E: the rows
                sorted by expert in blocks (`blocked.expert_ffn_blocked`) and one loop step per
                used block running the whole expert FFN; reads only the experts hit, computes
                the needed rows plus block padding. Above 4 rows per expert on average the
                blocked dropless path (three scans over blocks) is as fast.
    A few-token step is bound by reading weights; a gathered matrix costs a read, a write and a
    read, and a gather of many small slices runs below memory speed, hence the factor 4.
    Measured at D=512, F=256, E=32, k=4 on 2 shared CPU cores (ms per call, dropless / gather /
    onehot): N=1 77 / 3.2 / 10; N=2 89 / 7.7 / 12; N=4 91 / 18 / 5.5; N=32 168 / 326 / 13.
    With `impl="blocked"` (same shapes, ms per call, blocked dropless / loop; load 7-8):
    N=1 17 / 0.71; N=8 16 / 3.9; N=32 19 / 6.1; N=64 18 / 20 (docs/moe.md).
    With `impl="blocked"` and E <= 2k (deepseek3-tiny: 16 experts, top-8) "onehot" serves any N,
    training batches included: every expert on every token is at most twice the needed FLOPs, in
    E large batched matmuls instead of a sort and block scans (N=512, D=F=64: 16.6 vs 22.5 ms per
    layer forward + backward, docs/moe.md).
    The choice depends only on static shapes, so one compiled program never switches path.
    """
    if max_tokens <= 0:
        return None
    if impl == "blocked" and num_experts <= 2 * top_k:
        return "onehot"
    if num_tokens > max_tokens:
        return None
    if impl == "blocked":
        return "loop" if num_tokens * top_k <= 4 * num_experts else None
    if 4 * num_tokens * top_k <= num_experts:
        return "gather"
    return "onehot"


def moe_few_tokens(x, weights, idx, w_gate, w_up, w_down, act: Act, *, path: str | None = None) -> jax.Array:
    """Dropless MoE for a few tokens without the ragged grouped matmul.

    Same arguments and result as `moe_dropless` (the same expert choices: `idx` comes from the
    router either way; the same casts), so the two agree to f32 summation order. `path` is
    "gather", "onehot" or "loop" (see `few_token_path`); None picks gather or onehot as it does
    (4*N*k <= E gathers). Expert weights are dense arrays of the [E, D, F] / [E, F, D] shapes or
    packed ``MXFP4`` operands: the gather and loop paths then decode only the chosen matrices, the
    one-hot path every expert.

    Returns:
      [N, D] f32.
    """
    _check(x, weights, idx, w_gate, w_up, w_down)
    n, k = idx.shape
    e = w_gate.shape[0]
    path = path or ("gather" if 4 * n * k <= e else "onehot")
    f32 = jnp.float32
    if path == "loop":
        order, inverse, group_sizes = sort_by_expert(idx, e)
        ys = expert_ffn_blocked(x[order // k], group_sizes, w_gate, w_up, w_down, act)   # [N*k, D] by expert
        return combine(weights, ys[inverse].reshape(n, k, -1))
    if path == "gather":
        # [N, k, D, F] / [N, k, F, D]: the chosen matrices, one per (token, slot).
        wg, wu, wd = (_chosen(w, idx, x.dtype) for w in (w_gate, w_up, w_down))
        g = jnp.einsum("nd,nkdf->nkf", x, wg, preferred_element_type=x.dtype)
        u = jnp.einsum("nd,nkdf->nkf", x, wu, preferred_element_type=x.dtype)
        h = act(g.astype(f32), u.astype(f32)).astype(x.dtype)
        y = jnp.einsum("nkf,nkfd->nkd", h, wd, preferred_element_type=f32).astype(x.dtype)
        return combine(weights, y)
    if path != "onehot":
        raise ValueError(f"few-token MoE path must be 'gather', 'onehot' or 'loop', got {path!r}")
    w_gate, w_up, w_down = (as_dense(w, x.dtype) for w in (w_gate, w_up, w_down))
    # A batched matmul per expert over x broadcast to [E, N, D]: written as "nd,edf->enf" XLA:CPU
    # folds E into the output dim and transposes every expert matrix into a [E*F, D] copy each
    # call (two weight reads and a write per step, the top ops of a decode profile).
    xe = jnp.broadcast_to(x, (e,) + x.shape)
    g = jnp.einsum("end,edf->enf", xe, w_gate, preferred_element_type=x.dtype)
    u = jnp.einsum("end,edf->enf", xe, w_up, preferred_element_type=x.dtype)
    h = act(g.astype(f32), u.astype(f32)).astype(x.dtype)
    y = jnp.einsum("enf,efd->end", h, w_down, preferred_element_type=f32).astype(x.dtype)
    gate = jnp.zeros((n, e), f32).at[jnp.arange(n)[:, None], idx].add(weights.astype(f32))
    return jnp.einsum("ne,end->nd", gate, y.astype(f32))


def _chosen(w, idx, dtype) -> jax.Array:
    """``w[idx]``: the [N, k, ...] matrices of the chosen experts; packed experts are gathered as
    codes and scales and only those are decoded."""
    if isinstance(w, MXFP4):
        return dequantize(MXFP4(w.codes[idx], w.scales[idx]), dtype)
    return w[idx]


def capacity_of(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """Per-expert capacity C = ceil(capacity_factor * N * k / E) (at least 1)."""
    return max(1, math.ceil(capacity_factor * num_tokens * top_k / num_experts))


def capacity_slots(idx: jax.Array, num_experts: int, capacity: int) -> tuple[jax.Array, jax.Array]:
    """Buffer slot of every assignment under a per-expert capacity, first come first served.

    An assignment's position is the number of earlier assignments (flat token-major order,
    i.e. token order) to the same expert; positions >= capacity are dropped.

    Args:
      idx: [N, k] int expert ids.
      num_experts: E.
      capacity: C.
    Returns:
      slot: [N*k] int32 flat index `e * C + pos` into an [E*C] buffer, or E*C when dropped.
      keep: [N*k] bool.
    """
    flat = idx.reshape(-1).astype(jnp.int32)
    order, _, counts = sort_by_expert(idx, num_experts)
    starts = jnp.cumsum(counts) - counts                                  # [E] first sorted row
    pos_sorted = jnp.arange(flat.size, dtype=jnp.int32) - starts[flat[order]]
    pos = jnp.zeros_like(pos_sorted).at[order].set(pos_sorted)            # [N*k] token order
    keep = pos < capacity
    slot = jnp.where(keep, flat * capacity + pos, num_experts * capacity)
    return slot.astype(jnp.int32), keep


def capacity_dispatch(x: jax.Array, slot: jax.Array, num_experts: int, capacity: int, top_k: int):
    """Gather tokens into [E, C, D] buffers (empty slots are zero rows).

    Args:
      x: [N, D]; slot: [N*k] from `capacity_slots`.
    Returns:
      [E, C, D] in x.dtype.
    """
    n, d = x.shape
    ec = num_experts * capacity
    # Table of source token per buffer slot; N points at an appended zero row. Dropped
    # assignments all write the dummy entry E*C, which is cut off.
    src = jnp.full((ec + 1,), n, jnp.int32).at[slot].set(
        jnp.arange(slot.size, dtype=jnp.int32) // top_k)[:ec]
    x_pad = jnp.concatenate([x, jnp.zeros((1, d), x.dtype)])
    return x_pad[src].reshape(num_experts, capacity, d)


def capacity_collect(y_buf: jax.Array, slot: jax.Array, n: int, top_k: int) -> jax.Array:
    """Read each assignment's output back from [E, C, D] buffers; dropped ones read 0.

    Returns:
      [N, k, D] in y_buf.dtype.
    """
    e, c, d = y_buf.shape
    y_pad = jnp.concatenate([y_buf.reshape(e * c, d), jnp.zeros((1, d), y_buf.dtype)])
    return y_pad[slot].reshape(n, top_k, d)


def moe_capacity(x, weights, idx, w_gate, w_up, w_down, act: Act, *,
                 capacity_factor: float) -> tuple[jax.Array, jax.Array]:
    """Capacity-limited MoE (GShard/Switch style) with einsums over [E, C, D] buffers.

    C = ceil(capacity_factor * N * k / E). Each expert serves its first C assignments in token
    order; later ones are dropped: they contribute 0 and the token keeps only its residual
    (and its other experts). Cost is fixed (E*C rows) whatever the routing.

    Args:
      x: [N, D]; weights: [N, k] f32; idx: [N, k] int32.
      w_gate, w_up: [E, D, F]; w_down: [E, F, D].
      act: f32 elementwise `act(gate, up)`.
      capacity_factor: > 0; E/k guarantees no drop.
    Returns:
      out: [N, D] f32.
      dropped_fraction: f32 scalar, dropped assignments / (N*k).
    """
    _check(x, weights, idx, w_gate, w_up, w_down)
    if capacity_factor <= 0:
        raise ValueError(f"capacity_factor must be > 0, got {capacity_factor}")
    n, k = idx.shape
    e = w_gate.shape[0]
    c = capacity_of(n, k, e, capacity_factor)
    slot, keep = capacity_slots(idx, e, c)
    buf = capacity_dispatch(x, slot, e, c, k)                             # [E, C, D]
    y_buf = expert_ffn_batched(buf, w_gate, w_up, w_down, act)            # [E, C, D]
    y = capacity_collect(y_buf, slot, n, k)                               # [N, k, D]
    dropped = 1.0 - jnp.mean(keep.astype(jnp.float32))
    return combine(weights, y), dropped


def moe_dense_reference(x, weights, idx, w_gate, w_up, w_down, act: Act) -> jax.Array:
    """Reference: every expert on every token, then a masked combine. Small configs only.

    Materialises [N, E, F] and [N, E, D]. Repeated experts in a row add their weights.

    Args / Returns: as `moe_dropless` ([N, D] f32).
    """
    _check(x, weights, idx, w_gate, w_up, w_down)
    n = x.shape[0]
    f32 = jnp.float32
    # Upcast operands and ask for exact f32 products: a bf16 x bf16 product is exact in f32,
    # so this equals the kernels' bf16-in / f32-accumulate matmuls up to summation order (and
    # XLA:CPU has no bf16 x bf16 -> f32 batched dot for the "nef,efd" layout).
    mm = functools.partial(jnp.einsum, precision=jax.lax.Precision.HIGHEST,
                           preferred_element_type=f32)
    w_gate, w_up, w_down = (as_dense(w, f32) for w in (w_gate, w_up, w_down))
    g = mm("nd,edf->nef", x.astype(f32), w_gate)
    u = mm("nd,edf->nef", x.astype(f32), w_up)
    h = act(g, u).astype(x.dtype)
    y = mm("nef,efd->ned", h.astype(f32), w_down).astype(x.dtype)
    gate = jnp.zeros((n, w_gate.shape[0]), f32).at[
        jnp.arange(n)[:, None], idx].add(weights.astype(f32))             # [N, E] sparse weights
    return jnp.einsum("ne,ned->nd", gate, y.astype(f32))
