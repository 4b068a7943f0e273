"""Shared building blocks: parameters with logical axes, RMSNorm, GLU activations.

Every weight is declared once through ``param``: shape, logical axes (sharding), which two axes form
its matrix (Muon orthogonalises over those; leading stacked axes are batch axes), dtype and init.
Layers built with ``stack=(n,)`` hold ``n`` copies along a leading ``layers`` axis for the scan.

Linear weights are stored ``[in, out]`` (``y = x @ W``); the converter transposes PyTorch's
``[out, in]``. Einsum letters: b batch, t/s time, d model, h heads, k/v head dims, r rank, e experts,
f ffn width, l routed (latent) width.
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx


class RouterBias(nnx.Variable):
    """e_score_correction_bias: updated by the balancing rule, never by the optimizer."""


class Packed(nnx.Variable):
    """Packed quantized weights (MXFP4 expert codes / scales, uint8): loaded, never trained."""


# Variables outside ``nnx.Param`` that the model state carries as its "rest" (state.py).
REST = (RouterBias, Packed)


def is_variable(x) -> bool:
    """``is_leaf`` for trees of nnx Variables: a Variable (with its metadata) is one leaf."""
    return isinstance(x, nnx.Variable)


class KeySampler:
    """Random draws with one key per parameter (split from nnx.Rngs): shardable at any size."""

    def __init__(self, rngs: nnx.Rngs):
        self.rngs = rngs

    def normal(self, shape):
        return jax.random.normal(self.rngs.params(), shape, jnp.float32)

    def uniform(self, shape, lo, hi):
        return jax.random.uniform(self.rngs.params(), shape, jnp.float32, lo, hi)


class CountingSampler:
    """Counts the draws a model's init makes (run under eval_shape), for ``FlatSampler``."""

    def __init__(self):
        self.n_normal = self.n_uniform = 0

    def normal(self, shape):
        self.n_normal += math.prod(shape)
        return jnp.zeros(shape, jnp.float32)

    def uniform(self, shape, lo, hi):
        self.n_uniform += math.prod(shape)
        return jnp.full(shape, lo, jnp.float32)


class FlatSampler:
    """All draws sliced from two flat buffers (one normal, one uniform RNG op).

    XLA:CPU compiles each RNG op slowly (hundreds of per-parameter threefry expansions took
    minutes), so small models draw everything at once; pod-scale models use KeySampler.
    """

    def __init__(self, key, n_normal: int, n_uniform: int):
        kn, ku = jax.random.split(key)
        self.nbuf = jax.random.normal(kn, (n_normal,), jnp.float32)
        self.ubuf = jax.random.uniform(ku, (n_uniform,), jnp.float32)
        self.i = self.j = 0

    def normal(self, shape):
        n = math.prod(shape)
        out = self.nbuf[self.i:self.i + n].reshape(shape)
        self.i += n
        return out

    def uniform(self, shape, lo, hi):
        n = math.prod(shape)
        out = lo + (hi - lo) * self.ubuf[self.j:self.j + n].reshape(shape)
        self.j += n
        return out


def _normal(std: float):
    return lambda sampler, shape, dtype: (std * sampler.normal(shape)).astype(dtype)


def ones(sampler, shape, dtype):
    del sampler
    return jnp.ones(shape, dtype)


def zeros(sampler, shape, dtype):
    del sampler
    return jnp.zeros(shape, dtype)


def param(rngs, stack: tuple[int, ...], shape: Sequence[int], axes: Sequence[str | None],
          *, init: Callable | None = None, std: float = 0.02, dtype=jnp.float32,
          matrix: tuple[int, int] | None = None, kind=nnx.Param) -> nnx.Variable:
    """Create a (possibly layer-stacked) variable with its sharding and optimizer metadata.

    ``matrix`` = (fan-in axis, fan-out axis) of the unstacked shape, or None for vectors and
    embeddings (which the optimizer sends to AdamW). ``rngs`` is an nnx.Rngs or a sampler
    (``KeySampler``, ``FlatSampler``, ``CountingSampler``); ``init(sampler, shape, dtype)``.
    """
    n = len(stack)
    full_shape = tuple(stack) + tuple(shape)
    full_axes = ("layers",) * n + tuple(axes)
    init = init or _normal(std)
    sampler = KeySampler(rngs) if isinstance(rngs, nnx.Rngs) else rngs
    value = init(sampler, full_shape, dtype)
    mat = None if matrix is None else (matrix[0] + n, matrix[1] + n)
    return kind(value, axes=full_axes, matrix=mat)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """HF convention: statistics in f32, cast back to the input dtype, then the weight."""
    xf = x.astype(jnp.float32)
    y = (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)
    return weight.astype(x.dtype) * y


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """x / sqrt(sum(x^2) + eps) over the last axis, in f32 (KDA q/k)."""
    xf = x.astype(jnp.float32)
    return xf * jax.lax.rsqrt(jnp.sum(xf * xf, axis=-1, keepdims=True) + eps)


def situ(gate: jax.Array, up: jax.Array, beta: float = 4.0, linear_beta: float = 25.0) -> jax.Array:
    """SiTU-GLU (K3): [beta*tanh(a/beta)*sigmoid(a)] * [beta_l*tanh(b/beta_l)], f32, cast back."""
    a, b = gate.astype(jnp.float32), up.astype(jnp.float32)
    y = beta * jnp.tanh(a / beta) * jax.nn.sigmoid(a) * (linear_beta * jnp.tanh(b / linear_beta))
    return y.astype(gate.dtype)


def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    return jax.nn.silu(gate) * up


def glu_activation(cfg) -> Callable[[jax.Array, jax.Array], jax.Array]:
    if cfg.ffn_activation == "situ":
        return lambda g, u: situ(g, u, cfg.situ_beta, cfg.situ_linear_beta)
    return swiglu



class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, rngs: nnx.Rngs, stack: tuple[int, ...] = (),
                 dtype=jnp.float32):
        self.eps = eps
        self.weight = param(rngs, stack, (dim,), ("norm",), init=ones, dtype=dtype)

    def __call__(self, x):
        return rms_norm(x, self.weight[...], self.eps)


class MLP(nnx.Module):
    """GLU MLP: act(x W_gate, x W_up) W_down. Dense layer 0 and the shared experts."""

    def __init__(self, cfg, width: int, rngs: nnx.Rngs, stack: tuple[int, ...] = (), dtype=jnp.float32):
        d = cfg.hidden_size
        std = cfg.initializer_range
        self.act = glu_activation(cfg)
        self.gate_proj = param(rngs, stack, (d, width), ("embed", "mlp"), std=std, dtype=dtype, matrix=(0, 1))
        self.up_proj = param(rngs, stack, (d, width), ("embed", "mlp"), std=std, dtype=dtype, matrix=(0, 1))
        self.down_proj = param(rngs, stack, (width, d), ("mlp", "embed"), std=std, dtype=dtype, matrix=(0, 1))

    def __call__(self, x):
        dt = x.dtype
        g = jnp.einsum("btd,df->btf", x, self.gate_proj[...].astype(dt))
        u = jnp.einsum("btd,df->btf", x, self.up_proj[...].astype(dt))
        return jnp.einsum("btf,fd->btd", self.act(g, u), self.down_proj[...].astype(dt))
