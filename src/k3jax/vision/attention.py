"""Bidirectional attention within each media item of a packed patch sequence (docs/vision.md §3.2).

All media of a batch are packed into one sequence; ``segment_ids`` (media + 1, 0 = padding) keep
attention inside a media item. Neither path builds the full [N, N] mask: a K3 image alone can be
65,536 patches.

- ``blocked_segment_attention``: query blocks against all keys, the [H, block, N] segment mask of a
  block built from the ids, each block rematerialised in the backward. Pure XLA, any platform; the
  CPU path and the tests' path.
- ``splash_segment_attention``: TPU splash attention with ``SegmentIds`` and a full (non-causal)
  static mask; head dims are zero-padded to a multiple of 128 and the scale applied to q first.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

NEG_INF = -1e30


def blocked_segment_attention(q, k, v, segment_ids, *, scale: float, block: int = 512):
    """q, k, v [N, H, Dh], segment_ids [N] int -> o [N, H, Dh] in v.dtype. Softmax in f32. A row
    sees exactly the rows of its own segment (padding rows, segment 0, see each other: finite,
    dropped by the caller)."""
    n = q.shape[0]
    block = min(block, n)
    nb = -(-n // block)
    pad = nb * block - n
    qp = jnp.pad(q, ((0, pad), (0, 0), (0, 0))).reshape(nb, block, *q.shape[1:])
    sp = jnp.pad(segment_ids, (0, pad), constant_values=-1).reshape(nb, block)

    @functools.partial(jax.checkpoint, policy=jax.checkpoint_policies.nothing_saveable)
    def one(qb, sb):
        logits = jnp.einsum("thk,shk->hts", qb, k, preferred_element_type=jnp.float32) * scale
        mask = (sb[:, None] == segment_ids[None, :])[None]
        p = jax.nn.softmax(jnp.where(mask, logits, NEG_INF), axis=-1)
        return jnp.einsum("hts,shv->thv", p.astype(v.dtype), v, preferred_element_type=jnp.float32).astype(v.dtype)

    o = jax.lax.map(lambda xs: one(*xs), (qp, sp))
    return o.reshape(nb * block, *v.shape[1:])[:n]


SPLASH_BLOCK = 128   # splash's default block sizes; the sequence is padded to a multiple of it


def splash_segment_attention(q, k, v, segment_ids, *, scale: float, interpret: bool = False):
    """Same contract as ``blocked_segment_attention`` on TPU splash attention (``interpret`` runs the
    Pallas kernel in the interpreter, for CPU tests)."""
    # lazy: the Pallas TPU kernel modules cost about a second to import; only the splash path needs them
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm
    n, h, dh = q.shape
    npad = -n % SPLASH_BLOCK
    dpad = -dh % 128
    seg = jnp.pad(segment_ids.astype(jnp.int32), (0, npad), constant_values=-1)

    def prep(x, s=1.0):
        x = jnp.pad(x * s if s != 1.0 else x, ((0, npad), (0, 0), (0, dpad)))
        return x.transpose(1, 0, 2)                                       # [H, N', Dh']

    mask = sm.MultiHeadMask([sm.FullMask((n + npad, n + npad)) for _ in range(h)])
    kernel = sk.make_splash_mha(mask, head_shards=1, q_seq_shards=1, interpret=interpret)
    o = kernel(prep(q, scale), prep(k), prep(v), segment_ids=sk.SegmentIds(q=seg, kv=seg))
    return o.transpose(1, 0, 2)[:n, :, :dh].astype(v.dtype)


def segment_attention(vcfg, interpret: bool = False):
    """The attention core ``vision_attention_impl`` names, as f(q, k, v, segment_ids, scale=)."""
    if vcfg.vision_attention_impl == "splash":
        return functools.partial(splash_segment_attention, interpret=interpret)
    return functools.partial(blocked_segment_attention, block=vcfg.vision_attention_block)
