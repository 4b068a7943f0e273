"""Codecs for the quantized weight layouts found in Kimi / DeepSeek Hugging Face checkpoints.

Pure numpy + ml_dtypes (no jax, no torch) so conversion runs on any host. Every decoder returns
the dense weight in the checkpoint's own row-major ``[out, in]`` orientation (``in`` is the
contraction dim, "K"); transposes to k3jax layouts belong to ``conversion/param_map.py``.

Formats (see docs/spec/formats.md §1-2):

* ``mxfp4``     compressed-tensors ``mxfp4-pack-quantized`` (Kimi K3 routed experts):
                ``weight_packed`` uint8 [out, in/2] + ``weight_scale`` E8M0 uint8 [out, in/32].
* ``int4_pack`` compressed-tensors ``pack-quantized`` int4 (Kimi K2-Thinking/K2.5/K2.6 routed
                experts): ``weight_packed`` int32 [out, in/8] + ``weight_scale`` [out, in/group]
                + ``weight_shape`` int32 [2] (+ optional packed ``weight_zero_point``).
* ``fp8_block`` DeepSeek-V3 / Kimi-K2-Instruct: ``weight`` float8_e4m3fn [out, in] +
                ``weight_scale_inv`` f32 [ceil(out/128), ceil(in/128)] (multiplied, not divided).
* ``bf16``      a plain ``weight`` tensor (any unquantized dtype).

The quantizers (``quant_*``) exist to build test checkpoints and for export; tests compare decoded
values, never packed bytes, because these encodings are not unique.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping

import ml_dtypes
import numpy as np

from conversion.errors import ConversionError

FORMATS = ("bf16", "mxfp4", "int4_pack", "fp8_block")
MX_BLOCK = 32  # OCP MX: one E8M0 scale per 32 consecutive elements along K.
E8M0_NAN = 255  # E8M0 has no zero/sign/Inf; the all-ones byte is NaN.
FP8_E4M3_MAX = 448.0

# E2M1 code -> value. Bits S EE M: bit 3 sign, exponent bias 1, exponent 0 is subnormal (0.5*M).
_E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float64)
# Round-to-nearest boundaries between consecutive E2M1 magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6.
_E2M1_MIDPOINTS = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)


def _byte_pair_table(values: np.ndarray, dtype) -> np.ndarray:
    """[256] lookup: byte b -> the pair (values[b & 0xF], values[b >> 4]) as ONE word.

    Decoding a packed matrix is then a single 1-D gather ``table[packed]`` -> [..., n] words,
    viewed as ``dtype`` [..., 2n] with the low nibble on the even column, as both packings
    require. The pair is stored bit-for-bit as a uint64 (float32 pairs) or complex128 (float64
    pairs) item: gathering 8/16-byte items is ~3x faster than indexing a [256, 2] table.
    """
    b = np.arange(256)
    pairs = np.ascontiguousarray(np.stack([values[b & 0xF], values[b >> 4]], -1).astype(dtype))
    return pairs.view(np.uint64 if np.dtype(dtype).itemsize == 4 else np.complex128)[:, 0]


_MXFP4_PAIRS = {np.dtype(t): _byte_pair_table(_E2M1, t) for t in (np.float32, np.float64)}
# compressed-tensors stores int4 q in [-8, 7] as the unsigned nibble u = q + 8.
_INT4_PAIRS = _byte_pair_table(np.arange(16, dtype=np.float64) - 8.0, np.float32)


def mxfp4_e2m1_table() -> np.ndarray:
    """float32 [16]: the value of each FP4 E2M1 code 0..15 (8..15 are the negatives; 8 = -0.0)."""
    return _E2M1.astype(np.float32)


def _fail(name: str, what: str) -> ConversionError:
    return ConversionError(f"tensor {name!r}: {what}")


def _is_float(dt: np.dtype) -> bool:
    # ml_dtypes types report kind 'V', so np.issubdtype(..., np.floating) is False for them.
    return dt.kind == "f" or dt in _ML_FLOATS


_ML_FLOATS = tuple(np.dtype(t) for t in (ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn,
                                         ml_dtypes.float8_e5m2))


def _e8m0_bytes(scale: np.ndarray, name: str, allow_nan: bool) -> np.ndarray:
    """uint8 view of an E8M0 scale stored as U8 or F8_E8M0 (tools write either); rejects 255."""
    scale = np.asarray(scale)
    if scale.dtype == np.dtype(ml_dtypes.float8_e8m0fnu):
        scale = scale.view(np.uint8)
    if scale.dtype != np.uint8:
        raise _fail(name, f"E8M0 scale must be uint8 or float8_e8m0fnu, got {scale.dtype}")
    if not allow_nan and scale.size and scale.max() == E8M0_NAN:
        where = tuple(int(i) for i in np.argwhere(scale == E8M0_NAN)[0])
        raise _fail(name, f"E8M0 scale byte 255 (NaN) at scale index {where}; pass "
                          "allow_nan=True to decode such blocks as NaN")
    return scale


def _blockwise(w: np.ndarray, values: np.ndarray, block: int, op=np.multiply) -> None:
    """In place: w[..., i] = op(w[..., i], values[..., i // block]).

    w [..., n], values [..., ceil(n/block)]. The divisible part is viewed as [..., n//block, block]
    so no repeat(values) the size of w is ever materialised; a ragged tail block is done apart.
    """
    n = w.shape[-1]
    full = n // block
    if full:
        body = w[..., : full * block].reshape(*w.shape[:-1], full, block)
        op(body, values[..., :full, None], out=body)
        if not np.may_share_memory(body, w):  # the slice could not be reshaped as a view
            w[..., : full * block] = body.reshape(*w.shape[:-1], full * block)
    if n % block:
        tail = w[..., full * block:]
        op(tail, values[..., full:full + 1], out=tail)


def dequant_mxfp4(packed: np.ndarray, scale: np.ndarray, *, dtype=np.float32,
                  allow_nan: bool = False, name: str = "<mxfp4 weight>") -> np.ndarray:
    """Decode compressed-tensors ``mxfp4-pack-quantized``: w[o, i] = E2M1(code[o, i]) * 2^(s - 127).

    Args:
      packed: uint8 [..., out, in/2]; byte j holds code[2j] in the LOW nibble, code[2j+1] high.
      scale: uint8 or float8_e8m0fnu [..., out, ceil(in/32)]; E8M0 exponent byte per 32 columns.
      dtype: float32 (default), bfloat16 or float64. Results are exact in all three (an E2M1
        value has 2 significant bits, the scale is a power of two) unless they exceed the range:
        at scales 253/254 large codes overflow float32/bfloat16, which raises rather than
        returning inf. float64 holds every code at every finite scale.
      allow_nan: decode scale 255 (E8M0 NaN) as NaN instead of raising. Reference decoders
        (transformers, MaxText) silently turn it into 2^128; a checkpoint holding it is corrupt.
      name: tensor name for error messages.
    Returns:
      dtype [..., out, in].
    """
    packed = np.asarray(packed)
    if packed.dtype != np.uint8 or packed.ndim < 2:
        raise _fail(name, f"weight_packed must be uint8 [out, in/2], got {packed.dtype} "
                          f"{list(packed.shape)}")
    s = _e8m0_bytes(scale, name, allow_nan)
    n_in = 2 * packed.shape[-1]
    want = (*packed.shape[:-1], -(-n_in // MX_BLOCK))
    if s.shape != want:
        raise _fail(name, f"weight_scale shape {list(s.shape)} does not match weight_packed "
                          f"{list(packed.shape)}: expected {list(want)}")
    out_dt = np.dtype(dtype)
    if out_dt not in (np.dtype(np.float32), np.dtype(np.float64), np.dtype(ml_dtypes.bfloat16)):
        raise _fail(name, f"unsupported output dtype {out_dt}; use float32, bfloat16 or float64")
    compute = np.dtype(np.float64) if out_dt == np.float64 else np.dtype(np.float32)
    # One gather decodes both nibbles of every byte: [o, i/2] words -> [o, i] values.
    w = _MXFP4_PAIRS[compute][packed].view(compute)
    # 2^(s-127) by exponent arithmetic: exact, including the float32 subnormal 2^-127 at s = 0.
    # Overflow is detected explicitly below (and s = 255 is replaced by NaN), so numpy's
    # overflow warnings would only be noise.
    with np.errstate(over="ignore"):
        factor = np.ldexp(compute.type(1), s.astype(np.int32) - 127)
        if allow_nan:
            factor[s == E8M0_NAN] = np.nan
        _blockwise(w, factor, MX_BLOCK)
    finite_scales = s[s != E8M0_NAN]
    if compute == np.float32 and finite_scales.size and finite_scales.max() >= 253:
        # 6 * 2^126 > float32 max (~2^128): only the top two scale bytes can overflow.
        if np.isinf(w).any():
            where = tuple(int(i) for i in np.argwhere(np.isinf(w))[0])
            raise _fail(name, f"MXFP4 value at {where} overflows {out_dt} (scale byte >= 253); "
                              "decode with dtype=np.float64")
    return w.astype(out_dt, copy=False)


def _round_to_e2m1(x: np.ndarray) -> np.ndarray:
    """float32 [...] -> uint8 E2M1 codes: round to nearest, ties to even code, saturate at +-6."""
    mag = np.abs(x)
    code = np.searchsorted(_E2M1_MIDPOINTS, mag, side="right").astype(np.uint8)  # 0..7
    # A value exactly on a midpoint landed on the upper neighbour; IEEE ties-to-even means the
    # code with mantissa bit 0, i.e. the even code, so step odd codes down by one.
    below = _E2M1_MIDPOINTS[np.maximum(code.astype(np.int64) - 1, 0)]
    tie = (code > 0) & (mag == below)
    code -= (tie & (code & 1).astype(bool)).astype(np.uint8)
    return code | (np.signbit(x).astype(np.uint8) << 3)


def quant_mxfp4(w: np.ndarray, *, name: str = "<mxfp4 weight>") -> tuple[np.ndarray, np.ndarray]:
    """Encode a dense weight as MXFP4 with the OCP MX shared-exponent rule.

    Per 32-block along ``in``: X = floor(log2(amax)) - 2 (2 = emax of E2M1, whose largest value
    is 1.5 * 2^2), stored as the E8M0 byte X + 127; elements w / 2^X are rounded to the nearest
    E2M1 value (ties to even) and saturate at +-6, as the spec prescribes. An all-zero block gets
    scale byte 127. Values already of the form E2M1 * 2^X with the block max in [4, 6] * 2^X
    round-trip exactly.

    Args:
      w: float [..., out, in] (float32/bfloat16/float64), finite, in % 32 == 0.
    Returns:
      (packed uint8 [..., out, in/2], scale uint8 [..., out, in/32]).
    """
    w = np.asarray(w)
    if w.ndim < 2 or w.shape[-1] % MX_BLOCK or not _is_float(w.dtype):
        raise _fail(name, f"quant_mxfp4 needs a float [out, in] array with in % 32 == 0, got "
                          f"{w.dtype} {list(w.shape)}")
    blocks = w.astype(np.float32).reshape(*w.shape[:-1], w.shape[-1] // MX_BLOCK, MX_BLOCK)
    if not np.isfinite(blocks).all():
        raise _fail(name, "cannot encode NaN/Inf as MXFP4")
    amax = np.abs(blocks).max(axis=-1)
    # frexp: amax = m * 2^e with m in [0.5, 1), so floor(log2(amax)) = e - 1, exactly.
    _, e = np.frexp(amax)
    scale = np.where(amax > 0, np.clip(e.astype(np.int32) - 1 - 2 + 127, 0, 254), 127)
    scale = scale.astype(np.uint8)
    codes = _round_to_e2m1(np.ldexp(blocks, (127 - scale.astype(np.int32))[..., None]))
    codes = codes.reshape(w.shape)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), scale


def _cast_scale(scale: np.ndarray, name: str, what: str) -> np.ndarray:
    scale = np.asarray(scale)
    if not _is_float(scale.dtype):
        raise _fail(name, f"{what} must be a float tensor (BF16/F16/F32), got {scale.dtype}")
    return scale.astype(np.float32)


def dequant_int4_pack(packed: np.ndarray, scale: np.ndarray, *, group_size: int = 32,
                      zero_point: np.ndarray | None = None, shape=None,
                      name: str = "<int4 weight>") -> np.ndarray:
    """Decode compressed-tensors ``pack-quantized`` int4: w[o, i] = (q[o, i] - z) * scale[o, i // g].

    Packing (``pack_to_int32``): q in [-8, 7] is stored as u = q + 8; 8 consecutive inputs form one
    int32 with element k in bits [4k, 4k+4), LSB first, so in the little-endian byte view the low
    nibble is the even element. Columns are zero-padded to a multiple of 8; ``shape`` crops.

    Args:
      packed: int32 [out, ceil(in/8)].
      scale: bf16/f16/f32 [out, ceil(in/group_size)].
      group_size: inputs per scale (32 in Kimi K2-Thinking/K2.5/K2.6).
      zero_point: None for the symmetric scheme Kimi uses; else the asymmetric zero point as
        compressed-tensors stores it, int32 [ceil(out/8), ceil(in/group_size)] packed the same
        way but along dim 0 (8 consecutive OUTPUT rows per int32).
      shape: the ``weight_shape`` tensor / tuple (out, in); None means in = 8 * packed columns.
    Returns:
      float32 [out, in].
    """
    packed = np.asarray(packed)
    if packed.dtype != np.int32 or packed.ndim != 2:
        raise _fail(name, f"weight_packed must be int32 [out, in/8], got {packed.dtype} "
                          f"{list(packed.shape)}")
    n_out, cols = packed.shape
    if shape is None:
        shape = (n_out, 8 * cols)
    shape = tuple(int(v) for v in np.asarray(shape).reshape(-1))
    if len(shape) != 2 or shape[0] != n_out or -(-shape[1] // 8) != cols:
        raise _fail(name, f"weight_shape {list(shape)} does not match weight_packed "
                          f"{list(packed.shape)} (expected [out, in] with ceil(in/8) == {cols})")
    n_in = shape[1]
    n_groups = -(-n_in // group_size)
    s = _cast_scale(scale, name, "weight_scale")
    if s.shape != (n_out, n_groups):
        raise _fail(name, f"weight_scale shape {list(s.shape)} != [{n_out}, {n_groups}] for "
                          f"in={n_in}, group_size={group_size}")
    # '<i4' pins the byte order so the byte view is LSB-first on any host (no-op on x86/ARM).
    as_bytes = packed.astype("<i4", copy=False).view(np.uint8)  # [out, 4 * cols]
    w = _INT4_PAIRS[as_bytes].view(np.float32)[:, :n_in]  # [out, 8 * cols] -> crop; q = u - 8
    if n_in != 8 * cols:
        w = np.ascontiguousarray(w)
    if zero_point is not None:
        zp = np.asarray(zero_point)
        want = (-(-n_out // 8), n_groups)
        if zp.dtype != np.int32 or zp.shape != want:
            raise _fail(name, f"weight_zero_point must be int32 {list(want)}, got {zp.dtype} "
                              f"{list(zp.shape)}")
        shifts = 4 * np.arange(8, dtype=np.uint32)
        # "rg -> r k g": nibble k of packed row r is output row 8r + k.
        u = (zp.view(np.uint32)[:, None, :] >> shifts[None, :, None]) & 0xF
        z = u.reshape(-1, n_groups)[:n_out].astype(np.float32) - 8.0
        _blockwise(w, z, group_size, np.subtract)
    _blockwise(w, s, group_size)
    return w


def _pack_nibbles_int32(u: np.ndarray, axis: int) -> np.ndarray:
    """uint [.. n ..] nibbles -> int32 with 8 consecutive entries along ``axis`` per word, LSB first."""
    u = np.moveaxis(u.astype(np.uint32), axis, -1)
    pad = -u.shape[-1] % 8
    u = np.pad(u, [(0, 0)] * (u.ndim - 1) + [(0, pad)])  # pad nibble 0, as compressed-tensors
    words = u.reshape(*u.shape[:-1], -1, 8) << (4 * np.arange(8, dtype=np.uint32))
    return np.moveaxis(np.bitwise_or.reduce(words, axis=-1).view(np.int32), -1, axis)


def quant_int4_pack(w: np.ndarray, *, group_size: int = 32, scale_dtype=ml_dtypes.bfloat16,
                    name: str = "<int4 weight>") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Encode a dense weight as symmetric compressed-tensors ``pack-quantized`` int4.

    scale = amax / 7 per group, rounded to ``scale_dtype`` (BF16 in Kimi checkpoints), and
    q = clip(rint(w / scale), -8, 7). The /7 rule keeps a group whose values are already
    q * s (s representable in ``scale_dtype``, max |q| = 7) exactly representable, so such
    weights round-trip bit for bit; the decoder accepts the full [-8, 7] range either way.

    Args:
      w: float [out, in], finite; in need not be a multiple of 8 or of group_size.
    Returns:
      (packed int32 [out, ceil(in/8)], scale scale_dtype [out, ceil(in/group_size)],
       weight_shape int32 [2] = (out, in)).
    """
    w = np.asarray(w)
    if w.ndim != 2 or not _is_float(w.dtype):
        raise _fail(name, f"quant_int4_pack needs a float [out, in] array, got {w.dtype} "
                          f"{list(w.shape)}")
    w = w.astype(np.float32)
    if not np.isfinite(w).all():
        raise _fail(name, "cannot encode NaN/Inf as int4")
    n_out, n_in = w.shape
    pad = -n_in % group_size
    groups = np.pad(np.abs(w), [(0, 0), (0, pad)]).reshape(n_out, -1, group_size)
    amax = groups.max(axis=-1)
    scale = np.where(amax > 0, amax / 7.0, 1.0).astype(scale_dtype)
    q = w.copy()
    _blockwise(q, scale.astype(np.float32), group_size, np.divide)
    q = np.clip(np.rint(q), -8, 7)
    packed = _pack_nibbles_int32((q + 8).astype(np.uint32), axis=1)
    return packed, scale, np.array([n_out, n_in], np.int32)


def _fp8_scale_f32(scale: np.ndarray, name: str) -> np.ndarray:
    """Block-FP8 scale grid as float32: f32 ``weight_scale_inv`` or E8M0 bytes (``scale_fmt: ue8m0``)."""
    scale = np.asarray(scale)
    if scale.dtype in (np.dtype(np.uint8), np.dtype(ml_dtypes.float8_e8m0fnu)):
        return np.ldexp(np.float32(1), _e8m0_bytes(scale, name, False).astype(np.int32) - 127)
    s = _cast_scale(scale, name, "weight_scale_inv")
    if not np.isfinite(s).all():
        raise _fail(name, "weight_scale_inv contains NaN/Inf")
    return s


def dequant_fp8_block(w: np.ndarray, scale_inv: np.ndarray, block=(128, 128), *,
                      name: str = "<fp8 weight>") -> np.ndarray:
    """Decode DeepSeek-V3 block FP8: w[i, j] = f32(fp8[i, j]) * s[i // bo, j // bi].

    Despite its name ``weight_scale_inv`` is MULTIPLIED (it is the inverse of the quantizer's
    scale). Edge blocks may be ragged: the grid is ceil(out/bo) x ceil(in/bi) and is cropped.

    Args:
      w: float8_e4m3fn [out, in].
      scale_inv: float32 [ceil(out/bo), ceil(in/bi)], or uint8/float8_e8m0fnu E8M0 bytes
        (newer DeepSeek ``scale_fmt: ue8m0``), value 2^(s - 127).
      block: (bo, bi) = ``weight_block_size`` from the config.
    Returns:
      float32 [out, in].
    """
    w = np.asarray(w)
    if w.dtype != np.dtype(ml_dtypes.float8_e4m3fn) or w.ndim != 2:
        raise _fail(name, f"weight must be float8_e4m3fn [out, in], got {w.dtype} {list(w.shape)}")
    bo, bi = (int(b) for b in block)
    s = _fp8_scale_f32(scale_inv, name)
    n_out, n_in = w.shape
    want = (-(-n_out // bo), -(-n_in // bi))
    if s.shape != want:
        raise _fail(name, f"weight_scale_inv shape {list(s.shape)} != {list(want)} for weight "
                          f"{[n_out, n_in]} and block {[bo, bi]}")
    # e4m3fn has no Inf; its NaN is S.1111.111. A NaN weight is a corrupt checkpoint, not data.
    if ((w.view(np.uint8) & 0x7F) == 0x7F).any():
        raise _fail(name, "float8_e4m3fn weight contains NaN")
    out = w.astype(np.float32)
    for r in range(want[0]):
        # One row band at a time: the expanded scale is [in] wide, never [out, in].
        out[r * bo:(r + 1) * bo] *= np.repeat(s[r], bi)[:n_in]
    return out


def quant_fp8_block(w: np.ndarray, block=(128, 128), *, scale_fmt: str = "f32",
                    name: str = "<fp8 weight>") -> tuple[np.ndarray, np.ndarray]:
    """Encode as DeepSeek-V3 block FP8: s = amax / 448 per block, fp8 = e4m3(w / s) (RNE).

    ``scale_fmt="ue8m0"`` rounds s up to a power of two and stores E8M0 bytes instead of f32.
    Values of the form e4m3 * s, with s the block's amax / 448, round-trip exactly.

    Args:
      w: float [out, in], finite.
    Returns:
      (float8_e4m3fn [out, in], scale_inv float32 or uint8 [ceil(out/bo), ceil(in/bi)]).
    """
    w = np.asarray(w)
    if w.ndim != 2 or not _is_float(w.dtype) or scale_fmt not in ("f32", "ue8m0"):
        raise _fail(name, f"quant_fp8_block needs a float [out, in] array and scale_fmt f32 or "
                          f"ue8m0, got {w.dtype} {list(w.shape)} scale_fmt={scale_fmt!r}")
    w = w.astype(np.float32)
    if not np.isfinite(w).all():
        raise _fail(name, "cannot encode NaN/Inf as FP8")
    bo, bi = (int(b) for b in block)
    n_out, n_in = w.shape
    padded = np.pad(np.abs(w), [(0, -n_out % bo), (0, -n_in % bi)])
    amax = padded.reshape(padded.shape[0] // bo, bo, padded.shape[1] // bi, bi).max(axis=(1, 3))
    if scale_fmt == "f32":
        scale = np.where(amax > 0, amax / FP8_E4M3_MAX, 1.0).astype(np.float32)
        stored, s = scale, scale
    else:
        # Smallest power of two with amax / 2^k <= 448: k = ceil(log2(amax / 448)).
        k = np.ceil(np.log2(np.where(amax > 0, amax, FP8_E4M3_MAX) / FP8_E4M3_MAX))
        stored = np.clip(k + 127, 0, 254).astype(np.uint8)
        s = np.ldexp(np.float32(1), stored.astype(np.int32) - 127)
    q = np.empty_like(w)
    for r in range(s.shape[0]):
        rows = slice(r * bo, (r + 1) * bo)
        q[rows] = w[rows] / np.repeat(s[r], bi)[:n_in]
    # Clip first: a quotient a rounding step above 448 would otherwise cast to NaN.
    q = np.clip(q, -FP8_E4M3_MAX, FP8_E4M3_MAX).astype(ml_dtypes.float8_e4m3fn)
    return q, stored


# ---------------------------------------------------------------------------------------------
# Which layout a weight is in.

@dataclasses.dataclass(frozen=True)
class QuantSpec:
    """What a ``quantization_config`` declares, reduced to what the decoders need.

    formats: subset of FORMATS the config says quantized weights use ({} when no config).
    int4_group_size: inputs per int4 scale. fp8_block: (bo, bi) FP8 scale block.
    """
    formats: frozenset = frozenset()
    int4_group_size: int = 32
    fp8_block: tuple = (128, 128)


_CT_FORMATS = {"mxfp4-pack-quantized": "mxfp4", "pack-quantized": "int4_pack"}
_SUPPORTED = ("compressed-tensors with format mxfp4-pack-quantized (Kimi K3) or pack-quantized "
              "int4 (Kimi K2-Thinking/K2.5/K2.6); fp8 with weight_block_size (DeepSeek-V3, "
              "Kimi-K2-Instruct); unquantized BF16/F32")


def parse_quantization_config(qc: Mapping | None) -> QuantSpec:
    """Validate a HF ``quantization_config`` and extract a QuantSpec.

    Raises ConversionError("unsupported quantization format X; supported: ...") for any method
    or compressed-tensors format this module cannot decode, so a conversion fails before it
    reads a byte rather than after writing half the output.
    """
    if qc is None:
        return QuantSpec()
    method = qc.get("quant_method")
    if method == "fp8":
        fmt = qc.get("fmt", "e4m3")
        block = qc.get("weight_block_size", [128, 128])
        if fmt != "e4m3" or not (isinstance(block, (list, tuple)) and len(block) == 2):
            raise ConversionError(f"unsupported quantization format fp8/{fmt} with "
                                  f"weight_block_size={block!r}; supported: {_SUPPORTED}")
        return QuantSpec(frozenset({"fp8_block"}), fp8_block=tuple(int(b) for b in block))
    if method != "compressed-tensors":
        raise ConversionError(f"unsupported quantization format {method!r}; supported: "
                              f"{_SUPPORTED}")
    groups = qc.get("config_groups") or {}
    formats, group_size = set(), 32
    for label, group in [("<top level>", qc)] + sorted(groups.items()):
        fmt = group.get("format")
        if fmt in (None, "mixed-precision", "dense"):
            continue  # mixed-precision defers to the groups; dense = stored unquantized
        if fmt not in _CT_FORMATS:
            raise ConversionError(f"unsupported quantization format compressed-tensors/{fmt} "
                                  f"(group {label}); supported: {_SUPPORTED}")
        formats.add(_CT_FORMATS[fmt])
    for label, group in sorted(groups.items()):
        weights = group.get("weights") or {}
        if weights.get("num_bits", 4) != 4:
            raise ConversionError(f"unsupported quantization format compressed-tensors with "
                                  f"{weights.get('num_bits')}-bit weights (group {label}); "
                                  f"supported: {_SUPPORTED}")
        if weights.get("type") == "int" and weights.get("group_size"):
            group_size = int(weights["group_size"])
    return QuantSpec(frozenset(formats), int4_group_size=group_size)


# Companion tensors per layout, as suffixes after the Linear's base name ("...experts.3.w1").
_LAYOUTS = {
    frozenset({"weight"}): "bf16",
    frozenset({"weight", "weight_scale_inv"}): "fp8_block",
    frozenset({"weight_packed", "weight_scale"}): "mxfp4",
    frozenset({"weight_packed", "weight_scale", "weight_shape"}): "int4_pack",
    frozenset({"weight_packed", "weight_scale", "weight_shape", "weight_zero_point"}): "int4_pack",
}
COMPANION_SUFFIXES = ("weight", "weight_packed", "weight_scale", "weight_shape",
                      "weight_scale_inv", "weight_zero_point", "weight_global_scale",
                      "weight_g_idx", "input_scale")


def detect_format(tensor_names_for_one_weight, quantization_config=None) -> str:
    """Decide one weight's layout from which companion tensors exist.

    Decided per tensor, NOT by the config's ``ignore`` regexes: K3's ignore list omits the
    router and latent projections although they are stored BF16, so only the presence of
    ``weight_packed`` / ``weight_scale`` / ``weight_shape`` / ``weight_scale_inv`` is reliable.
    The config (dict, QuantSpec or None) is still validated, and a quantized layout it does not
    declare (int4 tensors under an mxfp4 config) raises.

    Args:
      tensor_names_for_one_weight: full names or bare suffixes, e.g.
        {"m.experts.0.w1.weight_packed", "m.experts.0.w1.weight_scale"}.
    Returns:
      "bf16" | "mxfp4" | "int4_pack" | "fp8_block".
    """
    spec = (quantization_config if isinstance(quantization_config, QuantSpec)
            else parse_quantization_config(quantization_config))
    suffixes = frozenset(n.rsplit(".", 1)[-1] for n in tensor_names_for_one_weight)
    fmt = _LAYOUTS.get(suffixes)
    if fmt is None:
        raise ConversionError(f"unsupported quantization format with companion tensors "
                              f"{sorted(suffixes)}; supported: {_SUPPORTED}")
    if fmt != "bf16" and spec.formats and fmt not in spec.formats:
        raise ConversionError(f"tensors {sorted(suffixes)} are in layout {fmt} but "
                              f"quantization_config declares {sorted(spec.formats)}")
    return fmt


def decode_weight(fmt: str, tensors: Mapping[str, np.ndarray], spec: QuantSpec = QuantSpec(),
                  *, name: str = "<weight>") -> np.ndarray:
    """Dense float32 [out, in] from one weight's companions, keyed by suffix ("weight_packed")."""
    if fmt == "bf16":
        return np.asarray(tensors["weight"]).astype(np.float32)
    if fmt == "mxfp4":
        return dequant_mxfp4(tensors["weight_packed"], tensors["weight_scale"], name=name)
    if fmt == "int4_pack":
        return dequant_int4_pack(tensors["weight_packed"], tensors["weight_scale"],
                                 group_size=spec.int4_group_size,
                                 zero_point=tensors.get("weight_zero_point"),
                                 shape=tensors["weight_shape"], name=name)
    if fmt == "fp8_block":
        return dequant_fp8_block(tensors["weight"], tensors["weight_scale_inv"], spec.fp8_block,
                                 name=name)
    raise ConversionError(f"unsupported quantization format {fmt!r}; supported: {FORMATS}")


def encode_weight(w: np.ndarray, fmt: str, spec: QuantSpec = QuantSpec(), *,
                  name: str = "<weight>") -> dict[str, np.ndarray]:
    """Inverse of decode_weight: float [out, in] -> {suffix: stored array} for ``fmt``."""
    if fmt == "bf16":
        return {"weight": np.asarray(w).astype(ml_dtypes.bfloat16)}
    if fmt == "mxfp4":
        packed, scale = quant_mxfp4(w, name=name)
        return {"weight_packed": packed, "weight_scale": scale}
    if fmt == "int4_pack":
        packed, scale, shape = quant_int4_pack(w, group_size=spec.int4_group_size, name=name)
        return {"weight_packed": packed, "weight_scale": scale, "weight_shape": shape}
    if fmt == "fp8_block":
        q, s = quant_fp8_block(w, spec.fp8_block, name=name)
        return {"weight": q, "weight_scale_inv": s}
    raise ConversionError(f"unsupported quantization format {fmt!r}; supported: {FORMATS}")
