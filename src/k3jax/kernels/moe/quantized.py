"""MXFP4 routed-expert weights kept packed (formats.md §1): the operand type and its decode math.

An ``MXFP4`` holds one stack of expert matrices ``W [E, K, N]`` (K = contraction, "in") as

    codes  uint8 [E, K/2, N]   byte (j, n) = E2M1 code of W[2j, n] (low nibble) | W[2j+1, n] << 4
    scales uint8 [E, K/32, N]  E8M0 byte s of the 32-block k // 32: factor 2^(s - 127)

i.e. 4 + 8/32 = 4.25 bits per weight. This is the compressed-tensors ``mxfp4-pack-quantized``
layout of the checkpoint (``weight_packed [out, in/2]``, ``weight_scale [out, in/32]``) with its
last two axes swapped (``from_checkpoint_layout``): K-major like the dense ``[E, K, N]`` experts,
so the packed arrays take the dense weights' logical axes, and a [K/2, N] tile has N on lanes.

The decode is pure arithmetic on the code bits (no table gather), so the same function runs in
XLA and inside a Pallas kernel on a VMEM tile:

    E2M1 code c: sign = c & 8, exponent e = (c >> 1) & 3, mantissa m = c & 1
    value = (-1)^sign * (e == 0 ? 0.5 * m : (1 + 0.5 * m) * 2^(e - 1))

Every value of an E2M1 code times a power of two is exact in float32 and bfloat16 (2 significant
bits), so ``dequantize`` equals the converter's numpy decoder (conversion/quant.py) bit for bit,
except that XLA flushes float32 subnormals (and, measured on XLA:CPU, 2^-126) to zero: only
scale bytes 0 and 1 (|w| <= 2^-124) reach them; real checkpoints do not.

Quantization-aware training (``experts_qat=mxfp4``): ``fake_mxfp4`` rounds dense master weights to
the values the converter's encoder (``conversion/quant.quant_mxfp4``: OCP shared exponent
floor(log2(amax)) - 2 per 32-block, E2M1 round to nearest with ties to the even code, saturation
at +-6) and this module's decoder give, in float32, so a forward on them equals a forward on the
packed export bit for bit; its gradient passes straight through to the master weights.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

__all__ = ["MXFP4", "MX_BLOCK", "e2m1_value", "e8m0_factor", "dequantize", "as_dense",
           "from_checkpoint_layout", "bits_per_weight", "mxfp4_round", "fake_mxfp4"]

MX_BLOCK = 32   # one E8M0 scale per 32 consecutive K elements (OCP MX)
# E2M1 magnitudes by code 0..7 and the midpoints between neighbours (round to nearest).
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MXFP4:
    """Packed experts; a pytree (codes, scales), so it passes through jit, shard_map and scans.

    ``shape`` is the logical dense shape [..., E, K, N]; ``ndim`` likewise."""
    codes: jax.Array
    scales: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        *lead, k2, n = self.codes.shape
        return (*lead, 2 * k2, n)

    @property
    def ndim(self) -> int:
        return self.codes.ndim

    def check(self, name: str = "MXFP4 weight") -> "MXFP4":
        *lead, k2, n = self.codes.shape
        want = (*lead, 2 * k2 // MX_BLOCK, n)
        if self.codes.dtype != jnp.uint8 or self.scales.dtype != jnp.uint8:
            raise ValueError(f"{name}: codes and scales must be uint8, got {self.codes.dtype}, "
                             f"{self.scales.dtype}")
        if (2 * k2) % MX_BLOCK or tuple(self.scales.shape) != want:
            raise ValueError(f"{name}: codes {self.codes.shape} (K = {2 * k2}, a multiple of 32) need "
                             f"scales {want}, got {self.scales.shape}")
        return self


def e2m1_value(code: jax.Array) -> jax.Array:
    """uint8/int32 codes 0..15 (only the low 4 bits are read) -> float32 E2M1 values."""
    c = code.astype(jnp.int32)
    e = (c >> 1) & 3
    m = (c & 1).astype(jnp.float32)
    # 2^(e-1) for e = 1, 2, 3 as 1, 2, 4; e = 0 is the subnormal 0.5 * m.
    pow2 = jnp.where(e == 3, 4.0, jnp.where(e == 2, 2.0, 1.0))
    mag = jnp.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * pow2)
    return jnp.where((c & 8) != 0, -mag, mag)


def e8m0_factor(scale: jax.Array) -> jax.Array:
    """uint8 E8M0 bytes -> float32 2^(s - 127), exactly (s = 0 is the subnormal 2^-127; s = 255,
    E8M0's NaN, decodes as inf: the converter refuses such checkpoints)."""
    s = scale.astype(jnp.int32)
    normal = jax.lax.bitcast_convert_type(s << 23, jnp.float32)
    return jnp.where(s == 0, jnp.float32(2.0 ** -127), normal)


def dequantize(w: MXFP4, dtype=jnp.float32) -> jax.Array:
    """The dense [..., E, K, N] weights in ``dtype`` (reference and the XLA path; this DOES
    materialise the whole stack: the Pallas kernel decodes tile by tile instead)."""
    *lead, k2, n = w.codes.shape
    lo = e2m1_value(w.codes & 15)
    hi = e2m1_value(w.codes >> 4)
    vals = jnp.stack([lo, hi], axis=-2).reshape(*lead, 2 * k2, n)          # row 2j, 2j+1
    blocks = vals.reshape(*lead, 2 * k2 // MX_BLOCK, MX_BLOCK, n)
    out = blocks * e8m0_factor(w.scales)[..., :, None, :]
    return out.reshape(*lead, 2 * k2, n).astype(dtype)


def as_dense(w, dtype) -> jax.Array:
    """Dense experts in ``dtype`` from either a dense array or an ``MXFP4``."""
    return dequantize(w, dtype) if isinstance(w, MXFP4) else w.astype(dtype)


def from_checkpoint_layout(weight_packed, weight_scale) -> MXFP4:
    """compressed-tensors arrays [..., N(out), K/2] / [..., N, K/32] (as the converter's
    ``experts_mxfp4`` item stores them) -> the K-major ``MXFP4`` (a uint8 transpose)."""
    return MXFP4(jnp.swapaxes(weight_packed, -1, -2), jnp.swapaxes(weight_scale, -1, -2))


def bits_per_weight(w: MXFP4) -> float:
    """Stored bits per logical weight, from the arrays themselves."""
    nbytes = w.codes.size * w.codes.dtype.itemsize + w.scales.size * w.scales.dtype.itemsize
    n = 1
    for s in w.shape:
        n *= s
    return 8.0 * nbytes / n


def mxfp4_round(w: jax.Array) -> jax.Array:
    """Dense [..., K, N] (K % 32 == 0) -> float32 [..., K, N]: ``dequantize`` of what the
    converter's ``quant_mxfp4`` packs from ``w`` (blocks of 32 along K), computed without packing.

    Per block: E8M0 byte s = clip(floor(log2(amax)) - 2 + 127, 0, 254) (127 for an all-zero block);
    w / 2^(s - 127) rounded to the nearest E2M1 magnitude (a tie goes to the even code), saturating
    at 6, the sign kept (a negative weight that rounds to 0 gives -0, as its code does)."""
    *lead, k, n = w.shape
    if k % MX_BLOCK:
        raise ValueError(f"MXFP4 rounding needs K (axis -2) a multiple of {MX_BLOCK}, got {w.shape}")
    blocks = w.astype(jnp.float32).reshape(*lead, k // MX_BLOCK, MX_BLOCK, n)
    amax = jnp.max(jnp.abs(blocks), axis=-2, keepdims=True)
    _, e = jnp.frexp(amax)                            # amax = m * 2^e, m in [0.5, 1): floor(log2) = e - 1
    scale = jnp.where(amax > 0, jnp.clip(e.astype(jnp.int32) - 1 - 2 + 127, 0, 254), 127)
    mag = jnp.abs(blocks * e8m0_factor(254 - scale))  # w / 2^(s - 127), exact (a power of two)
    code = sum((mag > m).astype(jnp.int32) for m in _E2M1_MIDPOINTS)     # at a midpoint: the lower code
    tie = (code < 7) & (mag == jnp.asarray(_E2M1_MIDPOINTS + (0.0,), jnp.float32)[code])
    code = code + (tie & (code % 2 == 1)).astype(jnp.int32)            # ... or the even one of the two
    val = jnp.asarray(_E2M1, jnp.float32)[code]
    val = jnp.where(jnp.signbit(blocks), -val, val)
    return (val * e8m0_factor(scale)).reshape(w.shape)


@jax.custom_vjp
def _fake_mxfp4_f32(w):
    return mxfp4_round(w)


_fake_mxfp4_f32.defvjp(lambda w: (mxfp4_round(w), None), lambda _, g: (g,))


def fake_mxfp4(w: jax.Array) -> jax.Array:
    """``mxfp4_round(w)`` (float32) with a straight-through gradient: d/dw is the identity, so the
    optimizer updates the dense master weights as if the rounding were not there."""
    return _fake_mxfp4_f32(w.astype(jnp.float32))
