"""Rotary position embedding on the MLA "rope" slice, with YaRN scaling (DeepSeek-V3 / Kimi K2).

K3 and Kimi Linear are NoPE (``mla_use_rope=false``): only ``softmax_scale`` is used there.
YaRN (Peng et al. 2023, as DeepSeek-V3 applies it): frequencies whose wavelength is short compared
to the original context keep their value, long ones are divided by ``factor``, with a linear ramp
between the dims set by beta_fast / beta_slow; the softmax scale is multiplied by mscale^2 where
mscale = 0.1 * mscale_all_dim * ln(factor) + 1.
"""
from __future__ import annotations

import math

import jax.numpy as jnp


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def softmax_scale(cfg) -> float:
    scale = cfg.qk_head_dim ** -0.5
    if cfg.mla_use_rope and cfg.rope_scaling_factor > 1 and cfg.rope_mscale_all_dim:
        scale *= _yarn_mscale(cfg.rope_scaling_factor, cfg.rope_mscale_all_dim) ** 2
    return scale


def inv_frequencies(cfg):
    """[Rr/2] f32 inverse frequencies, YaRN-blended when rope_scaling_factor > 1."""
    dim, base = cfg.qk_rope_head_dim, cfg.rope_theta
    pos_freqs = base ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)
    inv = 1.0 / pos_freqs
    factor = cfg.rope_scaling_factor
    if factor <= 1:
        return inv

    def correction_dim(n_rot):
        return dim * math.log(cfg.rope_original_max_position / (n_rot * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(cfg.rope_beta_fast)), 0)
    high = min(math.ceil(correction_dim(cfg.rope_beta_slow)), dim - 1)
    high = high + 0.001 if low == high else high
    ramp = jnp.clip((jnp.arange(dim // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
    extrapolation = 1.0 - ramp            # 1 keeps the original frequency
    return inv / factor * (1 - extrapolation) + inv * extrapolation


def apply_rope(x, positions, cfg):
    """x [B,T,H,Rr], positions [B,T] int -> rotated x.

    DeepSeek-V3 / Kimi K2 weights pair interleaved dims (x[2i], x[2i+1]) and emit the result
    de-interleaved: out[i] = x[2i] cos - x[2i+1] sin, out[i + Rr/2] = x[2i+1] cos + x[2i] sin.
    q and k get the same permutation, so q.k equals the interleaved complex rotation's.

    The cos/sin tables carry YaRN's attention factor mscale(factor, rope_mscale) /
    mscale(factor, rope_mscale_all_dim), as DeepSeek-V3 does.
    """
    inv = inv_frequencies(cfg)
    ang = positions[..., None].astype(jnp.float32) * inv                # [B,T,Rr/2]
    att = 1.0
    if cfg.rope_scaling_factor > 1:
        att = (_yarn_mscale(cfg.rope_scaling_factor, cfg.rope_mscale)
               / _yarn_mscale(cfg.rope_scaling_factor, cfg.rope_mscale_all_dim or 0.0))
    cos = (jnp.cos(ang) * att)[..., None, :]
    sin = (jnp.sin(ang) * att)[..., None, :]
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., 0::2], xf[..., 1::2]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)
