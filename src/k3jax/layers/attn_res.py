"""Block Attention Residuals (k3-architecture.md §3).

State between layers: ``blocks`` [NB, B, T, D] (finished block sums; slot 0 = token embedding) with
``n_blocks`` of them valid, and ``partial`` [B, T, D] (running sum of sub-layer outputs in the current
block). Each site mixes ``blocks[:n] + [partial]`` with a softmax over depth; the keys are RMS-
normalised and γ is folded into the pseudo-query: ``dot(RMSNorm_γ(v), w) = dot(v, γ⊙w) / rms(v)``.
A fixed-size block buffer with a validity count keeps the scan carry shape static.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.layers.common import ones, param, zeros


def depth_weights(blocks, n_blocks, partial, w, gamma, eps: float):
    """The depth softmax of ``attn_res_mix``: weights [S,B,T] f32 over the S = NB + 1 sources
    (invalid block slots 0), all in f32 (NeMo's K3 ``_apply_attn_res`` upcasts the sources, the
    RMS and the score weight alike)."""
    return _depth_softmax(jnp.concatenate([blocks, partial[None]], 0).astype(jnp.float32), n_blocks, w, gamma, eps)


def _depth_softmax(src, n_blocks, w, gamma, eps: float):
    q = gamma.astype(jnp.float32) * w.astype(jnp.float32)
    inv_rms = jax.lax.rsqrt(jnp.mean(src * src, axis=-1) + eps)               # [S,B,T]
    s = jnp.einsum("sbtd,d->sbt", src, q) * inv_rms
    valid = jnp.concatenate([jnp.arange(src.shape[0] - 1) < n_blocks, jnp.ones((1,), bool)])
    s = jnp.where(valid[:, None, None], s, -jnp.inf)
    return jax.nn.softmax(s, axis=0)


def attn_res_mix(blocks, n_blocks, partial, w, gamma, eps: float):
    """Depth-softmax mix of the valid sources.

    blocks [NB,B,T,D], n_blocks int (traced ok), partial [B,T,D], w/gamma [D] -> [B,T,D] in
    partial.dtype. All arithmetic in f32; no 1/sqrt(D) temperature.
    """
    src = jnp.concatenate([blocks, partial[None]], 0).astype(jnp.float32)      # [S,B,T,D]
    a = _depth_softmax(src, n_blocks, w, gamma, eps)
    return jnp.einsum("sbt,sbtd->btd", a, src).astype(partial.dtype)


class AttnResSites(nnx.Module):
    """The two per-layer sites (before the mixer, before the FFN): pseudo-query w and key-norm γ.

    Pseudo-queries start at zero (uniform mixing, as the paper initialises them)."""

    def __init__(self, dim: int, rngs: nnx.Rngs, stack: tuple[int, ...] = (), dtype=jnp.float32):
        self.attn_res_proj = param(rngs, stack, (dim,), ("norm",), init=zeros, dtype=dtype)
        self.attn_res_norm = param(rngs, stack, (dim,), ("norm",), init=ones, dtype=dtype)
        self.mlp_res_proj = param(rngs, stack, (dim,), ("norm",), init=zeros, dtype=dtype)
        self.mlp_res_norm = param(rngs, stack, (dim,), ("norm",), init=ones, dtype=dtype)
