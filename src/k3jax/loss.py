"""Memory-light cross-entropy over a large vocabulary (K3: 163840).

Implementations of one contract, chosen by ``loss_impl`` (``auto``: ``resolve_loss_impl``):

  chunked   ours: logits are produced ``chunk`` positions of every row at a time inside a
            rematerialised scan, so neither the forward nor the backward ever holds [B, T, V]
            logits: peak extra memory is [B, chunk, V] f32 (per device: its local rows).
  chunked_fused  the same chunks, with dh and the head's gradient computed in the forward and
            kept for the backward (``grad_in_forward``): three head matmuls per chunk instead
            of four, for heads small next to the device's memory (CPU's default).
  tokamax   ``tokamax.linear_softmax_cross_entropy_loss`` (lm head matmul + softmax CE fused, its
            own VJP): the Mosaic TPU kernel ("mosaic_tpu") on TPU devices, its blocked XLA loop
            ("chunked_xla") elsewhere, picked from the devices' platform, never by trying one and
            falling back. It has no z-loss (config validation rejects z_loss_weight > 0 with it)
            and returns no argmax, so it counts no correct predictions (the train step then logs
            no ``accuracy``; evaluation keeps its own chunked pass).
  vocab_parallel  ours, under ``shard_map``: the lm head's vocabulary is split over a group of
            mesh axes and never gathered; each device computes the logits of its group's tokens
            over its vocabulary slice and the softmax statistics are reduced over the group
            (``vocab_parallel_cross_entropy``). Peak extra memory: the head's [D, V/|A|] slice and
            its gradient instead of the whole [D, V] head and its gradient.
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from k3jax.kernels.platform import resolve

LOSS_IMPLS = ("auto", "chunked", "chunked_fused", "tokamax", "vocab_parallel")
# tokamax 0.0.17's chunked_xla pads the vocabulary to a multiple of its V block (2048) with zero
# weight columns and lets their logits (0, not -inf) into the logsumexp: with a vocabulary off
# that multiple its loss and gradients are wrong (measured: 7.84 vs 6.55 at V=384). Its Mosaic
# kernel masks the tail. So the XLA path is refused for such vocabularies.
TOKAMAX_XLA_VOCAB_MULTIPLE = 2048


def _position_chunks(h, targets, mask, c: int):
    """h [B,T,D], targets, mask [B,T] -> the same padded to a multiple of c positions and cut into
    chunks along each row: [nc, B, c, D], [nc, B, c], [nc, B, c] f32 (padding has mask 0)."""
    b, t, d = h.shape
    pad = (-t) % c
    nc = (t + pad) // c
    hf = jnp.pad(h, ((0, 0), (0, pad), (0, 0))).reshape(b, nc, c, d).swapaxes(0, 1)
    tf = jnp.pad(targets, ((0, 0), (0, pad))).reshape(b, nc, c).swapaxes(0, 1)
    mf = jnp.pad(mask.astype(jnp.float32), ((0, 0), (0, pad))).reshape(b, nc, c).swapaxes(0, 1)
    return hf, tf, mf


def resolve_loss_impl(impl: str, platform: str) -> str:
    """``loss_impl=auto`` for devices of ``platform``: chunked_fused on CPU (one host's memory, where
    the kept head gradient costs nothing next to a fourth head matmul), chunked on TPU and GPU
    (the pod's gathered K3 head gradient, 4.4 GiB, must not live through the backward)."""
    return resolve("loss_impl", impl, platform)


def _argmax_block(v: int) -> int | None:
    """Columns per block of ``lse_and_argmax``'s two-level argmax over a vocabulary of v: the
    largest divisor of v in [64, 512] (K3's 163840 and 32000 give 512 and 500), or None (plain
    argmax) when v has none."""
    return next((b for b in range(512, 63, -1) if v % b == 0), None)


def lse_and_argmax(z):
    """logsumexp(z) (differentiable) and argmax(z) (first index of the maximum, as jnp.argmax)
    over the last axis of logits z [..., V] f32.

    Why not ``jax.nn.logsumexp`` beside ``jnp.argmax``: XLA merges the two into one variadic
    (value, index) reduction over V, which XLA:CPU runs unvectorised; on a [2, 256, 32000] chunk
    that took 204 ms against 35 ms for this form (deepseek3-tiny's loss, docs/benchmarks.md).
    Here the only pass over V is a plain max per block of columns; the argmax is then the first
    block reaching the row maximum (an argmax over V/b block maxima) and the first column of it
    that does (an argmax over b), which is exactly jnp.argmax's first index of the maximum.
    """
    v = z.shape[-1]
    b = _argmax_block(v)
    if b is None:
        m, idx = jnp.max(z, axis=-1), jnp.argmax(z, axis=-1)
    else:
        zb = z.reshape(z.shape[:-1] + (v // b, b))
        block_max = jnp.max(zb, axis=-1)                                          # [..., V/b]
        m = jnp.max(block_max, axis=-1)
        blk = jnp.argmax(block_max, axis=-1)
        inner = jnp.take_along_axis(zb, blk[..., None, None], axis=-2)[..., 0, :]  # [..., b]
        idx = blk * b + jnp.argmax(inner, axis=-1)
    # The shift cancels in the gradient (as in jax.nn.logsumexp); a row of -inf stays -inf.
    m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
    lse = m + jnp.log(jnp.sum(jnp.exp(z - m[..., None]), axis=-1))
    return lse, jax.lax.stop_gradient(idx)


def chunked_cross_entropy(h, w, targets, mask, *, chunk: int = 1024, z_loss_weight: float = 0.0,
                          grad_in_forward: bool = False):
    """h [B,T,D], w [D,V], targets [B,T] int, mask [B,T] f32 ->
    (sum of masked token losses incl. z-loss, sum of mask, number of correct argmax predictions).

    Loss per token: logsumexp(z) - z[target] (+ z_loss_weight * logsumexp(z)^2), z in f32.

    grad_in_forward: when differentiated, compute dh and dw chunk by chunk in the forward pass
    (``_fused_loss``: three lm-head matmuls per chunk instead of four, one softmax instead of
    two) and keep them until the backward scales them by the loss's cotangent. That holds dh
    (h's size) and the head's gradient (f32, w's size) through the whole model backward, so it
    suits a small head per device (CPU, small models), not a pod's gathered K3 head (4.4 GiB).
    """
    t = h.shape[1]
    # Chunks run along the sequence inside each row, never across rows: the batch axis is the
    # one sharded over data/fsdp/expert, and a scan over a flattened B*T axis would slice the
    # sharded dimension, which GSPMD can only do by gathering every row of the global batch onto
    # every device (the K3 compile held bf16[T, global B, D] = 56 GB per device that way).
    c = min(chunk, t)
    if grad_in_forward:
        # No larger than the head: B x c <= D keeps a chunk's logits [B, c, V] within the head's
        # [D, V] (deepseek3-tiny, D = 64, B = 2, on CPU: 72 ms at 32 positions vs 100 at 256).
        c = min(c, max(16, h.shape[2] // h.shape[0]))
        return _fused_loss(h, w, targets, mask, c, z_loss_weight)
    hf, tf, mf = _position_chunks(h, targets, mask, c)    # [nc, B, c, D], [nc, B, c] x 2

    @jax.checkpoint
    def one(hc, tc, mc):
        loss, correct = _chunk_loss(hc, w, tc, z_loss_weight)[:2]
        return jnp.sum(loss * mc), jnp.sum(correct * mc)

    def body(acc, xs):
        l, k = one(*xs)
        return (acc[0] + l, acc[1] + k), None

    (loss, correct), _ = jax.lax.scan(
        body, (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32)),
        (hf, tf, mf))
    return loss, jnp.sum(mf), correct


def _chunk_loss(hc, w, tc, z_loss_weight):
    """Token losses [B, c], correct predictions [B, c] f32, logits z [B, c, V] f32 and their
    logsumexp [B, c] of one chunk hc [B, c, D]."""
    z = jnp.einsum("bnd,dv->bnv", hc, w.astype(hc.dtype), preferred_element_type=jnp.float32)
    lse, top = lse_and_argmax(z)
    tgt = jnp.take_along_axis(z, tc[..., None], axis=-1)[..., 0]
    return lse - tgt + z_loss_weight * lse ** 2, (top == tc).astype(jnp.float32), z, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _fused_loss(h, w, targets, mask, chunk, z_loss_weight):
    return _fused_forward(h, w, targets, mask, chunk, z_loss_weight, False)[0]


def _fused_forward(h, w, targets, mask, chunk, z_loss_weight, with_grad: bool):
    """The chunked loss; with_grad: also dh [B,T,D] (h.dtype) and dw [D,V] (f32) of the loss sum.

    d(loss)/dz = softmax(z) (1 + 2 z_loss_weight lse) - onehot(target), times the mask."""
    b, t, d = h.shape
    hf, tf, mf = _position_chunks(h, targets, mask, chunk)
    zero = jnp.zeros((), jnp.float32)

    def body(acc, xs):
        hc, tc, mc = xs
        loss, correct, z, lse = _chunk_loss(hc, w, tc, z_loss_weight)
        acc = (acc[0] + jnp.sum(loss * mc), acc[1] + jnp.sum(correct * mc), acc[2])
        if not with_grad:
            return acc, None
        hot = jax.lax.broadcasted_iota(jnp.int32, z.shape, 2) == tc[..., None]
        dz = (jnp.exp(z - lse[..., None]) * ((1 + 2 * z_loss_weight * lse) * mc)[..., None]
              - jnp.where(hot, mc[..., None], 0.0)).astype(hc.dtype)
        dh = jnp.einsum("bnv,dv->bnd", dz, w.astype(hc.dtype), preferred_element_type=jnp.float32)
        dw = acc[2] + jnp.einsum("bnd,bnv->dv", hc, dz, preferred_element_type=jnp.float32)
        return acc[:2] + (dw,), dh.astype(h.dtype)

    dw0 = jnp.zeros(w.shape, jnp.float32) if with_grad else zero
    (loss, correct, dw), dh = jax.lax.scan(body, (zero, zero, dw0), (hf, tf, mf))
    out = (loss, jnp.sum(mf), correct)
    if not with_grad:
        return out, None
    dh = dh.swapaxes(0, 1).reshape(b, -1, d)[:, :t]          # [nc, B, c, D] -> [B, T, D]
    return out, (dh, dw)


def _fused_fwd(h, w, targets, mask, chunk, z_loss_weight):
    out, (dh, dw) = _fused_forward(h, w, targets, mask, chunk, z_loss_weight, True)
    return out, (dh, dw.astype(w.dtype), targets, mask)


def _fused_bwd(chunk, z_loss_weight, res, cts):
    dh, dw, targets, mask = res
    g = cts[0]                          # only the loss sum depends on h and w
    return ((g * dh).astype(dh.dtype), (g * dw).astype(dw.dtype),
            np.zeros(targets.shape, jax.dtypes.float0), jnp.zeros_like(mask))


_fused_loss.defvjp(_fused_fwd, _fused_bwd)


def chunked_row_losses(h, w, targets, mask, *, chunk: int = 1024):
    """Evaluation form of ``chunked_cross_entropy``: per row instead of summed, no z-loss, no
    gradient. h [B,T,D], w [D,V], targets [B,T] int, mask [B,T] f32 -> (masked loss sum [B], mask
    sum [B], correct argmax predictions [B]), all f32. Per row so that one row can hold one scored
    candidate (HellaSwag endings) and so that the totals are sums of a small replicated output."""
    b, t, d = h.shape
    hf, tf, mf = _position_chunks(h, targets, mask, min(chunk, t))    # [nc, B, c, D], [nc, B, c] x 2

    def body(acc, xs):
        hc, tc, mc = xs
        z = jnp.einsum("bnd,dv->bnv", hc, w.astype(hc.dtype), preferred_element_type=jnp.float32)
        lse, top = lse_and_argmax(z)
        loss = lse - jnp.take_along_axis(z, tc[..., None], axis=-1)[..., 0]
        correct = (top == tc).astype(jnp.float32)
        keep = mc > 0   # where, not a product: a padding position's loss may be inf and 0 * inf is nan
        return (acc[0] + jnp.sum(jnp.where(keep, loss, 0.0), -1), acc[1] + jnp.sum(jnp.where(keep, correct, 0.0), -1)), None

    zeros = jnp.zeros((b,), jnp.float32)
    (loss, correct), _ = jax.lax.scan(body, (zeros, zeros), (hf, tf, mf))
    return loss, jnp.sum(mf, (0, 2)), correct


def tokamax_implementation(platform: str) -> str:
    """tokamax's implementation for devices of ``platform``: the Mosaic kernel on TPU, else the
    blocked XLA loop (both memory-light; its plain "xla" one materialises [N, V] logits)."""
    return "mosaic_tpu" if platform == "tpu" else "chunked_xla"


def tokamax_context(implementation: str):
    """Context for *tracing* (forward and backward) a step that holds a tokamax Mosaic kernel (this
    loss, or moe_impl=tokamax_ragged_dot, whose backward builds new ops that check again): tokamax
    checks the host's default device before it lowers a kernel, which refuses an AOT compile for
    a TPU topology from a CPU host; cross_compile turns that check off (the kernel choice is ours,
    from the mesh's platform). A no-op for the XLA implementation."""
    if implementation != "mosaic_tpu":
        return contextlib.nullcontext()
    import tokamax  # lazy: a slow import (seconds), paid only when a tokamax implementation runs
    return tokamax.config.cross_compile(True)


def _row_axes(n: int, mesh, axes) -> tuple[str, ...]:
    """The mesh axes (in order, size > 1) whose product still divides n: the flattened tokens are
    split over them, and replicated over the others (a tiny batch on a big mesh)."""
    out, size = [], 1
    for a in axes:
        k = mesh.shape.get(a, 1)
        if k > 1 and n % (size * k) == 0:
            out.append(a)
            size *= k
    return tuple(out)


def tokamax_cross_entropy(h, w, targets, mask, *, implementation: str, row_axes: tuple[str, ...] = ()):
    """``chunked_cross_entropy``'s contract through tokamax's fused lm head + CE: h [B,T,D], w [D,V],
    targets [B,T] int, mask [B,T] -> (sum of masked token losses, sum of mask, 0.0) in f32. No
    z-loss; the third value (correct argmax predictions) is always 0: the kernel never forms logits.

    The op reduces with ``reduction="none"`` (per-token losses, [N] f32) and the mask weights them
    here, so masked positions get no gradient. Their target is replaced by 0 first: the kernel
    indexes the vocabulary with every label, whatever its mask.

    Under a mesh the op runs inside ``shard_map``: a pallas_call has no sharding rule, so under
    GSPMD alone every device would gather the whole batch and compute all of it. Each device takes
    its slice of the N = B*T tokens (split over the ``row_axes`` that divide N: pass the batch,
    context and tensor axes, so tensor-parallel devices split rows instead of repeating them) and
    the whole lm head (w is gathered like ours gathers it; its gradient is summed back). Each
    device returns its partial sums as one entry of a vector summed outside, so there is no
    collective inside the map to transpose.
    """
    import tokamax  # lazy: a slow import (seconds), paid only when a tokamax implementation runs
    if implementation == "chunked_xla" and w.shape[1] % TOKAMAX_XLA_VOCAB_MULTIPLE:
        raise ValueError(f"tokamax's chunked_xla loss needs a vocabulary that is a multiple of "
                         f"{TOKAMAX_XLA_VOCAB_MULTIPLE}, got {w.shape[1]} (it lets padded logits into the softmax)")
    b, t, d = h.shape
    n = b * t
    x = h.reshape(n, d)
    keep = mask.reshape(n).astype(jnp.float32)
    labels = jnp.where(keep > 0, targets.reshape(n), 0).astype(jnp.int32)
    w = w.astype(h.dtype)
    mesh = jax.sharding.get_abstract_mesh()
    axes = () if mesh.empty else _row_axes(n, mesh, row_axes)
    # Mesh axes that do not split the rows hold replicas of the same rows: only replica 0 of each
    # counts, so that the sum outside (and the gradients summed over those axes) count rows once.
    extra = () if mesh.empty else tuple(a for a in mesh.axis_names if mesh.shape[a] > 1 and a not in axes)

    def local(x, labels, keep, w):
        per_token = tokamax.linear_softmax_cross_entropy_loss(x, labels, w, reduction="none",
                                                              implementation=implementation)
        # where, not a product: a masked row's loss never reaches the sum, inf or not
        part = jnp.sum(jnp.where(keep > 0, per_token.astype(jnp.float32) * keep, 0.0))
        for a in extra:
            part = jnp.where(jax.lax.axis_index(a) == 0, part, 0.0)
        return part[None]

    if not axes and not extra:
        loss = local(x, labels, keep, w)[0]
    else:
        rows = P(axes or None)
        # check_vma off: the Mosaic pallas_call declares no varying-manual-axes type for its
        # outputs. Without it shard_map transposes the classic way (w's cotangent summed over
        # every axis, x's over the axes its spec leaves out), which is right here: each device
        # differentiates its own rows (replicas other than 0 contribute zeros), and nothing
        # inside the map communicates.
        parts = jax.shard_map(local, mesh=mesh, in_specs=(P(axes or None, None), rows, rows, P()),
                              out_specs=P(axes + extra), check_vma=False)(x, labels, keep, w)
        loss = jnp.sum(parts)
    return loss, jnp.sum(keep), jnp.zeros((), jnp.float32)


def _prod(mesh, axes) -> int:
    return math.prod(mesh.shape[a] for a in axes)


def _entry(axes: Sequence[str]):
    """PartitionSpec entry for a dimension split over ``axes`` (None, a name or a tuple)."""
    return None if not axes else axes[0] if len(axes) == 1 else tuple(axes)


def _token_axes(mesh, b: int, t: int, batch_axes, seq_axis) -> tuple[tuple[str, ...], str | None]:
    """(axes splitting the B rows, axis splitting T or None): ``_row_axes`` for the rows (a tiny
    batch keeps the axes that divide it and is replicated over the rest, which is a local slice of
    however the activations were laid out), the sequence axis when it divides T."""
    rows = _row_axes(b, mesh, batch_axes)
    seq = seq_axis if seq_axis and mesh.shape.get(seq_axis, 1) > 1 and t % mesh.shape[seq_axis] == 0 else None
    return rows, seq


def choose_vocab_axes(mesh, b: int, t: int, vocab: int, *, batch_axes: Sequence[str], seq_axis: str | None,
                      candidates: Sequence[str]) -> tuple[str, ...]:
    """The group A of mesh axes ``vocab_parallel_cross_entropy`` splits the vocabulary over, for
    [B=b, T=t] tokens: the subset of ``candidates`` (sizes > 1, product dividing ``vocab``) that
    minimises what each device holds and moves per step, G * N + V / |A| elements of width D:

      G * N   the tokens whose hidden states it receives (N local tokens times G, the size of the
              axes of A that split the tokens; an axis that holds replicas of the rows, tensor,
              costs nothing), all-gathered chunk by chunk in the forward and its recomputation and
              reduce-scattered as dh in the backward;
      V/|A|   its slice of the head, held with its f32 gradient for the whole loss.

    Why not simply every parameter axis: with K3 on v5p-2048 (fsdp=8 x expert=128, one row of 4096
    tokens per device) A = fsdp x expert would leave a [7168, 160] slice but send each device the
    hidden states of 4M tokens (60 GB) three times a step; the head's own vocabulary axis (tensor,
    size 1 there) splits nothing. The minimum there is A = (fsdp,): a [7168, 20480] slice (0.55
    GiB in f32) and 8 x 4096 gathered tokens (0.47 GB in bf16). A is never empty while some
    candidate divides V (the point of this loss is not to hold the whole head); ties go to the
    larger group."""
    free = {a: s for a, s in mesh.shape.items() if a not in mesh.manual_axes}
    rows, seq = _token_axes(mesh, b, t, batch_axes, seq_axis)
    split = set(rows) | ({seq} if seq else set())
    n_local = b * t // _prod(mesh, (*rows, *([seq] if seq else [])))
    cand = [a for a in dict.fromkeys(candidates) if free.get(a, 1) > 1]
    best, best_key = (), None
    for k in range(1, len(cand) + 1):
        for group in itertools.combinations(cand, k):
            size = _prod(mesh, group)
            if vocab % size:
                continue
            key = (_prod(mesh, [a for a in group if a in split]) * n_local + vocab // size, -size)
            if best_key is None or key < best_key:
                best, best_key = group, key
    return best


def vocab_parallel_cross_entropy(h, w, targets, mask, *, chunk: int = 1024, z_loss_weight: float = 0.0,
                                 vocab_axes: Sequence[str], batch_axes: Sequence[str] = (),
                                 seq_axis: str | None = None):
    """``chunked_cross_entropy``'s contract with the lm head's vocabulary split over the mesh axes
    ``vocab_axes`` (A; ``choose_vocab_axes`` picks them for the train step): h [B,T,D], w [D,V],
    targets [B,T] int, mask [B,T] -> (sum of masked token losses incl. z-loss, sum of mask, number
    of correct argmax predictions), f32, the same values as ``chunked_cross_entropy``.

    Layout inside the ``shard_map`` (manual over every mesh axis): the rows are split over the
    ``batch_axes`` that divide B (as ``_row_axes``; replicated over the rest) and T over
    ``seq_axis`` when it divides T, as the model's activations are. Each device holds w[:, its
    V/|A| slice], whole along D: w enters split along D over the other token-splitting axes too
    and is all-gathered to that slice once, so its gradient leaves reduce-scattered; the gradient
    accumulated over the chunks is only the local [D, V/|A|] slice (in the head's dtype, as in
    ``chunked_cross_entropy``: f32 for f32 master weights; each chunk's product is formed in f32). Per chunk of
    ``chunk`` positions of the local rows (a rematerialised scan, like ``chunked_cross_entropy``)
    the hidden states, targets and mask of the group's devices are all-gathered over the axes of
    A that split the tokens, every device computes the logits of those tokens over its slice,
    and the logsumexp comes from a pmax and a psum over A, the target logit from a masked local
    lookup and a psum, the argmax from a pmax of the value and a pmin of the (global) index that
    reaches it: the first maximum, as jnp.argmax. The backward is JAX's transpose of that program
    (shard_map's varying-axes typing on): dh is reduce-scattered back to the rows' owners (then
    summed over the axes of A that hold replicas of the rows, tensor), dw stays local until the
    one reduce-scatter over the groups.

    Axes of A must be mesh axes whose sizes multiply to a divisor of V (ValueError otherwise);
    size-1 axes are dropped, and with no axis left (one device, no mesh) it is the chunked loss
    of the local rows."""
    b, t, d = h.shape
    v = w.shape[1]
    mesh = jax.sharding.get_abstract_mesh()
    free = {} if mesh.empty else {a: s for a, s in mesh.shape.items() if a not in mesh.manual_axes}
    if not mesh.empty:
        explicit = [a for a in free if mesh.axis_types[mesh.axis_names.index(a)] == jax.sharding.AxisType.Explicit]
        if explicit:
            raise ValueError(f"vocab_parallel_cross_entropy needs Auto mesh axes; {explicit} are Explicit")
    missing = [a for a in vocab_axes if a not in free]
    if missing:
        raise ValueError(f"vocab_axes {tuple(vocab_axes)}: {missing} are not (non-manual) axes of the mesh "
                         f"{dict(free)}")
    group = tuple(a for a in dict.fromkeys(vocab_axes) if free[a] > 1)
    if group and v % _prod(mesh, group):
        raise ValueError(f"vocab_axes {group} ({_prod(mesh, group)} devices) do not divide the vocabulary V={v}; "
                         f"choose axes whose sizes multiply to a divisor of {v}")
    if free:
        rows, seq = _token_axes(mesh, b, t, tuple(a for a in batch_axes if a in free), seq_axis)
    else:
        rows, seq = (), None
    split = (*rows, *([seq] if seq else []))
    gather = tuple(a for a in group if a in split)           # A's axes that split the tokens
    rep = tuple(a for a in group if a not in split)          # A's axes that hold replicas of them
    others = tuple(a for a in split if a not in group)       # the groups: different tokens, same slice
    w_d, size = [], 1                                        # of those, the ones that split w's D
    for a in others:
        if d % (size * free[a]) == 0:
            w_d.append(a)
            size *= free[a]
    w_d = tuple(w_d)
    w_sum = tuple(a for a in others if a not in w_d)
    vl = v // _prod(mesh, group) if group else v
    c = min(chunk, t // mesh.shape[seq] if seq else t)

    def _psum(x, op=jax.lax.psum):
        return op(x, group) if group else x

    def local(h, w, targets, mask):
        if w_d:
            w = jax.lax.all_gather(w, w_d, axis=0, tiled=True)
        if w_sum:   # varying from here on, so its gradient is summed over those axes once, not per chunk
            w = jax.lax.pcast(w, w_sum, to="varying")
        off = jax.lax.axis_index(group) * vl if group else 0
        hf, tf, mf = _position_chunks(h, targets, mask, c)                 # [nc, Bl, c, D], ...

        @jax.checkpoint
        def one(hc, tc, mc):
            if rep:     # dh from the other vocabulary slices is summed after the reduce-scatter, not before
                hc = jax.lax.pcast(hc, rep, to="varying")
            if gather:  # the group's tokens: [G*Bl, c, D]; targets and mask are the same on every device of A
                hc = jax.lax.all_gather(hc, gather, axis=0, tiled=True)
                tc = jax.lax.all_gather(tc, gather, axis=0, tiled=True, to="invarying")
                mc = jax.lax.all_gather(mc, gather, axis=0, tiled=True, to="invarying")
            z = jnp.einsum("bnd,dv->bnv", hc, w.astype(hc.dtype), preferred_element_type=jnp.float32)
            zmax = jax.lax.stop_gradient(jnp.max(z, axis=-1))
            m = _psum(zmax, jax.lax.pmax)   # the shift cancels in the gradient, as in jax.nn.logsumexp
            lse = m + jnp.log(_psum(jnp.sum(jnp.exp(z - m[..., None]), axis=-1)))
            lt = tc - off
            mine = (lt >= 0) & (lt < vl)
            picked = jnp.take_along_axis(z, jnp.clip(lt, 0, vl - 1)[..., None], axis=-1)[..., 0]
            tgt = _psum(jnp.where(mine, picked, 0.0))            # the one device holding the target
            loss = lse - tgt + z_loss_weight * lse ** 2
            first = jnp.argmax(jax.lax.stop_gradient(z), axis=-1).astype(jnp.int32) + off
            best = _psum(jnp.where(zmax == m, first, jnp.iinfo(jnp.int32).max), jax.lax.pmin)
            correct = (best == tc).astype(jnp.float32)
            return jnp.sum(loss * mc), jnp.sum(correct * mc)

        def body(acc, xs):
            l, k = one(*xs)
            return (acc[0] + l, acc[1] + k), None

        zero = jnp.zeros((), jnp.float32)
        if others:   # each group sums its own tokens; the carry varies over the groups like the sums
            zero = jax.lax.pcast(zero, others, to="varying")
        (loss, correct), _ = jax.lax.scan(body, (zero, zero), (hf, tf, mf))
        if others:
            loss, correct = jax.lax.psum((loss, correct), others)
        return loss, correct

    if not free or math.prod(free.values()) == 1:
        loss, correct = local(h, w, targets, mask)
    else:
        r, s = _entry(rows), seq
        loss, correct = jax.shard_map(
            local, mesh=mesh, in_specs=(P(r, s, None), P(_entry(w_d), _entry(group)), P(r, s), P(r, s)),
            out_specs=(P(), P()), axis_names=frozenset(free))(h, w, targets, mask)
    return loss, jnp.sum(mask.astype(jnp.float32)), correct
