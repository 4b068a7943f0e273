"""Memory-light cross-entropy over a large vocabulary (K3: 163840).

Two implementations of one contract, chosen by ``loss_impl``:

  chunked   ours: logits are produced ``chunk`` positions of every row at a time inside a
            rematerialised scan, so neither the forward nor the backward ever holds [B, T, V]
            logits: peak extra memory is [B, chunk, V] f32 (per device: its local rows).
  tokamax   ``tokamax.linear_softmax_cross_entropy_loss`` (lm head matmul + softmax CE fused, its
            own VJP): the Mosaic TPU kernel ("mosaic_tpu") on TPU devices, its blocked XLA loop
            ("chunked_xla") elsewhere, picked from the devices' platform, never by trying one and
            falling back. It has no z-loss (config validation rejects z_loss_weight > 0 with it)
            and returns no argmax, so it counts no correct predictions (the train step then logs
            no ``accuracy``; evaluation keeps its own chunked pass).
"""
from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

LOSS_IMPLS = ("chunked", "tokamax")
# tokamax 0.0.17's chunked_xla pads the vocabulary to a multiple of its V block (2048) with zero
# weight columns and lets their logits (0, not -inf) into the logsumexp: with a vocabulary off
# that multiple its loss and gradients are wrong (measured: 7.84 vs 6.55 at V=384). Its Mosaic
# kernel masks the tail. So the XLA path is refused for such vocabularies.
TOKAMAX_XLA_VOCAB_MULTIPLE = 2048


def chunked_cross_entropy(h, w, targets, mask, *, chunk: int = 1024, z_loss_weight: float = 0.0):
    """h [B,T,D], w [D,V], targets [B,T] int, mask [B,T] f32 ->
    (sum of masked token losses incl. z-loss, sum of mask, number of correct argmax predictions).

    Loss per token: logsumexp(z) - z[target] (+ z_loss_weight * logsumexp(z)^2), z in f32.
    """
    b, t, d = h.shape
    # Chunks run along the sequence inside each row, never across rows: the batch axis is the
    # one sharded over data/fsdp/expert, and a scan over a flattened B*T axis would slice the
    # sharded dimension, which GSPMD can only do by gathering every row of the global batch onto
    # every device (the K3 compile held bf16[T, global B, D] = 56 GB per device that way).
    c = min(chunk, t)
    pad = (-t) % c
    nc = (t + pad) // c
    hf = jnp.pad(h, ((0, 0), (0, pad), (0, 0))).reshape(b, nc, c, d).swapaxes(0, 1)    # [nc, B, c, D]
    tf = jnp.pad(targets, ((0, 0), (0, pad))).reshape(b, nc, c).swapaxes(0, 1)
    mf = jnp.pad(mask.astype(jnp.float32), ((0, 0), (0, pad))).reshape(b, nc, c).swapaxes(0, 1)

    @jax.checkpoint
    def one(hc, tc, mc):
        z = jnp.einsum("bnd,dv->bnv", hc, w.astype(hc.dtype), preferred_element_type=jnp.float32)
        lse = jax.nn.logsumexp(z, axis=-1)
        tgt = jnp.take_along_axis(z, tc[..., None], axis=-1)[..., 0]
        loss = lse - tgt + z_loss_weight * lse ** 2
        correct = (jnp.argmax(z, axis=-1) == tc).astype(jnp.float32)
        return jnp.sum(loss * mc), jnp.sum(correct * mc)

    def body(acc, xs):
        l, k = one(*xs)
        return (acc[0] + l, acc[1] + k), None

    (loss, correct), _ = jax.lax.scan(
        body, (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32)),
        (hf, tf, mf))
    return loss, jnp.sum(mf), correct


def chunked_row_losses(h, w, targets, mask, *, chunk: int = 1024):
    """Evaluation form of ``chunked_cross_entropy``: per row instead of summed, no z-loss, no
    gradient. h [B,T,D], w [D,V], targets [B,T] int, mask [B,T] f32 -> (masked loss sum [B], mask
    sum [B], correct argmax predictions [B]), all f32. Per row so that one row can hold one scored
    candidate (HellaSwag endings) and so that the totals are sums of a small replicated output."""
    b, t, d = h.shape
    c = min(chunk, t)
    pad = (-t) % c
    nc = (t + pad) // c
    hf = jnp.pad(h, ((0, 0), (0, pad), (0, 0))).reshape(b, nc, c, d).swapaxes(0, 1)    # [nc, B, c, D]
    tf = jnp.pad(targets, ((0, 0), (0, pad))).reshape(b, nc, c).swapaxes(0, 1)
    mf = jnp.pad(mask.astype(jnp.float32), ((0, 0), (0, pad))).reshape(b, nc, c).swapaxes(0, 1)

    def body(acc, xs):
        hc, tc, mc = xs
        z = jnp.einsum("bnd,dv->bnv", hc, w.astype(hc.dtype), preferred_element_type=jnp.float32)
        loss = jax.nn.logsumexp(z, axis=-1) - jnp.take_along_axis(z, tc[..., None], axis=-1)[..., 0]
        correct = (jnp.argmax(z, axis=-1) == tc).astype(jnp.float32)
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
    import tokamax
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
    import tokamax
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
