"""Quantized weight codecs (conversion/quant.py) against hand-computed values and ml_dtypes."""
import ml_dtypes
import numpy as np
import pytest

from conversion import quant
from conversion.errors import ConversionError

# FP4 E2M1, written out by hand from the OCP MX spec (formats.md §1.1): codes 0..15.
E2M1_BY_HAND = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def _pack_codes(codes):
    """uint8 codes [out, in] -> bytes [out, in/2], low nibble = even column (written naively)."""
    codes = np.asarray(codes, np.uint8)
    out = np.zeros((codes.shape[0], codes.shape[1] // 2), np.uint8)
    for j in range(out.shape[1]):
        out[:, j] = codes[:, 2 * j] + 16 * codes[:, 2 * j + 1]
    return out


def test_e2m1_table_matches_hand_values_and_ml_dtypes():
    table = quant.mxfp4_e2m1_table()
    assert table.dtype == np.float32 and table.shape == (16,)
    np.testing.assert_array_equal(table, np.array(E2M1_BY_HAND, np.float32))
    np.testing.assert_array_equal(np.signbit(table), np.signbit(np.array(E2M1_BY_HAND)))
    as_ml = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    np.testing.assert_array_equal(table, as_ml)


@pytest.mark.parametrize("scale_byte", [0, 1, 100, 126, 127, 128, 200, 252, 254])
def test_mxfp4_every_code_at_every_scale(scale_byte):
    # One 32-block per row: codes 0..15 then 15..0, so every code appears at an even and odd column.
    codes = np.array([list(range(16)) + list(range(15, -1, -1))])
    packed = _pack_codes(codes)
    scale = np.array([[scale_byte]], np.uint8)
    expected = np.array([[E2M1_BY_HAND[c] * 2.0 ** (scale_byte - 127) for c in codes[0]]])
    np.testing.assert_array_equal(quant.dequant_mxfp4(packed, scale, dtype=np.float64), expected)
    if scale_byte <= 252:
        got = quant.dequant_mxfp4(packed, scale)
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, expected.astype(np.float32))  # 2^-127 is exact too
        got_bf16 = quant.dequant_mxfp4(packed, scale, dtype=ml_dtypes.bfloat16)
        np.testing.assert_array_equal(got_bf16.astype(np.float64), expected)
    else:
        # 2 * 2^127 already exceeds float32's max: raise, never return inf.
        with pytest.raises(ConversionError, match="overflows"):
            quant.dequant_mxfp4(packed, scale, name="big")
        small = _pack_codes(np.array([[0, 1, 2, 3, 9, 10, 11, 8] * 4]))
        want = np.array([[E2M1_BY_HAND[c] * 2.0 ** 127 for c in [0, 1, 2, 3, 9, 10, 11, 8] * 4]])
        np.testing.assert_array_equal(quant.dequant_mxfp4(small, scale), want.astype(np.float32))


def test_mxfp4_scale_255_raises_naming_tensor_unless_allowed():
    packed = np.full((2, 32), 0x22, np.uint8)  # in = 64: two blocks per row, all values 1.0
    scale = np.array([[127, 127], [128, 255]], np.uint8)
    with pytest.raises(ConversionError, match=r"layers\.3\.w1.*255.*\(1, 1\)"):
        quant.dequant_mxfp4(packed, scale, name="layers.3.w1")
    got = quant.dequant_mxfp4(packed, scale, allow_nan=True)
    assert np.isnan(got[1, 32:]).all() and not np.isnan(got[:, :32]).any()
    np.testing.assert_array_equal(got[1, :32], 2.0)
    # The F8_E8M0 spelling of the scale (some tools write it) decodes identically.
    e8 = np.array([[127, 127], [128, 126]], np.uint8)
    np.testing.assert_array_equal(quant.dequant_mxfp4(packed, e8.view(ml_dtypes.float8_e8m0fnu)),
                                  quant.dequant_mxfp4(packed, e8))


def test_mxfp4_nibble_order_low_nibble_is_even_column():
    packed = np.zeros((1, 16), np.uint8)
    packed[0, 0] = 0x71  # low nibble 1 (0.5) -> column 0; high nibble 7 (6.0) -> column 1
    packed[0, 1] = 0x9A  # low nibble 10 (-1.0) -> column 2; high nibble 9 (-0.5) -> column 3
    got = quant.dequant_mxfp4(packed, np.array([[128]], np.uint8))
    np.testing.assert_array_equal(got[0, :4], [1.0, 12.0, -2.0, -1.0])
    np.testing.assert_array_equal(got[0, 4:], 0.0)


def test_mxfp4_shape_and_dtype_checks():
    with pytest.raises(ConversionError, match="expected"):
        quant.dequant_mxfp4(np.zeros((4, 32), np.uint8), np.zeros((4, 1), np.uint8), name="x")
    with pytest.raises(ConversionError, match="uint8"):
        quant.dequant_mxfp4(np.zeros((4, 32), np.int32), np.zeros((4, 2), np.uint8))


def test_mxfp4_quant_dequant_round_trip_exact_for_representable_values():
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 16, size=(6, 128))
    # Put a magnitude-4 or -6 code in every block so the block max fixes the shared exponent.
    codes[:, ::32] = rng.choice([6, 7, 14, 15], size=(6, 4))
    scale = rng.integers(90, 170, size=(6, 4)).astype(np.uint8)
    w = quant.dequant_mxfp4(_pack_codes(codes), scale)
    packed2, scale2 = quant.quant_mxfp4(w)
    np.testing.assert_array_equal(scale2, scale)
    np.testing.assert_array_equal(quant.dequant_mxfp4(packed2, scale2), w)
    # bf16 input (how exported weights arrive) encodes the same.
    p3, s3 = quant.quant_mxfp4(w.astype(ml_dtypes.bfloat16))
    np.testing.assert_array_equal(quant.dequant_mxfp4(p3, s3), w)


def test_mxfp4_quant_rounding_matches_ml_dtypes_reference():
    rng = np.random.default_rng(1)
    w = (rng.standard_normal((8, 256)) * np.exp2(rng.integers(-6, 6, size=(8, 1)))).astype(np.float32)
    # Exact ties between E2M1 neighbours (x.25, x.75, 2.5, 3.5, 5) and saturating values (> 6 * 2^X).
    w[0, :32] = np.array([4, .25, .75, 1.25, 1.75, 2.5, 3.5, 5, -.25, -.75, -2.5, -5, 0, 1, 2, 3] * 2)
    w[1, :32] = np.array([7.9, 6.5, -7.0, 5.5] * 8)
    packed, scale = quant.quant_mxfp4(w)
    blocks = w.reshape(8, -1, 32)
    exponent = np.floor(np.log2(np.abs(blocks).max(-1, keepdims=True))) - 2  # OCP: emax(E2M1) = 2
    np.testing.assert_array_equal(scale, (exponent[..., 0] + 127).astype(np.uint8))
    ref = (blocks / 2.0 ** exponent).astype(ml_dtypes.float4_e2m1fn).astype(np.float64)
    ref = (ref * 2.0 ** exponent).reshape(w.shape)
    np.testing.assert_array_equal(quant.dequant_mxfp4(packed, scale, dtype=np.float64), ref)


def test_int4_hand_computed_packing_order_and_crop():
    # q = -8..7 -> u = q + 8 = 0..15; element k of a word sits in bits [4k, 4k+4).
    words = np.array([[0x76543210, 0xFEDCBA98 - 2**32]], np.int32)
    scale = np.array([[0.5]], ml_dtypes.bfloat16)
    got = quant.dequant_int4_pack(words, scale, shape=np.array([1, 16], np.int32))
    np.testing.assert_array_equal(got, np.arange(-8, 8, dtype=np.float32)[None] * 0.5)
    cropped = quant.dequant_int4_pack(words, scale, shape=(1, 13))
    np.testing.assert_array_equal(cropped, np.arange(-8, 5, dtype=np.float32)[None] * 0.5)
    # group_size 8: word 0 uses scale 2, word 1 uses scale -1.
    two = quant.dequant_int4_pack(words, np.array([[2.0, -1.0]], np.float32), group_size=8)
    np.testing.assert_array_equal(two[0, :8], np.arange(-8, 0) * 2.0)
    np.testing.assert_array_equal(two[0, 8:], np.arange(0, 8) * -1.0)
    with pytest.raises(ConversionError, match="weight_scale shape"):
        quant.dequant_int4_pack(words, np.ones((1, 3), np.float32), group_size=8)
    with pytest.raises(ConversionError, match="weight_shape"):
        quant.dequant_int4_pack(words, scale, shape=(1, 24))


def test_int4_zero_point_is_packed_along_output_rows():
    # Two output rows; zero points z = (1, -2) stored as u = (9, 6) in nibbles 0 and 1 of ONE word.
    words = np.array([[0x99999999], [0x66666666]], np.uint32).view(np.int32)  # u = 9 -> q = 1 ; u = 6 -> q = -2
    zp = np.array([[9 | (6 << 4)]], np.int32)
    scale = np.array([[3.0], [5.0]], np.float32)
    got = quant.dequant_int4_pack(words, scale, group_size=8, zero_point=zp)
    np.testing.assert_array_equal(got, np.zeros((2, 8), np.float32))  # (q - z) = 0 everywhere
    words2 = np.array([[0x99999999], [0x99999999]], np.uint32).view(np.int32)  # q = 1 on both rows
    got2 = quant.dequant_int4_pack(words2, scale, group_size=8, zero_point=zp)
    np.testing.assert_array_equal(got2, [[0.0] * 8, [15.0] * 8])  # (1 - 1) * 3, (1 + 2) * 5


@pytest.mark.parametrize("shape,group", [((5, 64), 32), ((3, 45), 16)])
def test_int4_round_trip_exact_for_representable_values(shape, group):
    rng = np.random.default_rng(2)
    n_groups = -(-shape[1] // group)
    q = rng.integers(-7, 8, size=shape).astype(np.float32)
    q[:, ::group] = rng.choice([-7.0, 7.0], size=(shape[0], n_groups))  # max |q| = 7 per group
    s = rng.uniform(0.001, 2.0, size=(shape[0], n_groups)).astype(ml_dtypes.bfloat16)
    w = q * np.repeat(s.astype(np.float32), group, axis=1)[:, : shape[1]]
    packed, scale, wshape = quant.quant_int4_pack(w, group_size=group)
    assert packed.dtype == np.int32 and packed.shape == (shape[0], -(-shape[1] // 8))
    assert scale.dtype == ml_dtypes.bfloat16 and list(wshape) == list(shape)
    np.testing.assert_array_equal(scale, s)
    np.testing.assert_array_equal(quant.dequant_int4_pack(packed, scale, group_size=group,
                                                          shape=wshape), w)
    # Arbitrary weights: error at most half a quantisation step.
    v = rng.standard_normal(shape).astype(np.float32)
    p2, s2, sh2 = quant.quant_int4_pack(v, group_size=group)
    step = np.repeat(s2.astype(np.float32), group, axis=1)[:, : shape[1]]
    err = np.abs(quant.dequant_int4_pack(p2, s2, group_size=group, shape=sh2) - v)
    assert (err <= 0.5 * step * 1.02).all()


def test_fp8_block_hand_computed_ragged_edges():
    w = np.array([[1, -2, 0.5], [448, 0, -0.25], [3, 4, -448]], np.float32).astype(
        ml_dtypes.float8_e4m3fn)
    s = np.array([[2.0, 10.0], [-1.0, 0.5]], np.float32)  # 3x3 with 2x2 blocks: ragged row/col
    got = quant.dequant_fp8_block(w, s, block=(2, 2))
    expected = np.array([[2, -4, 5], [896, 0, -2.5], [-3, -4, -224]], np.float32)
    np.testing.assert_array_equal(got, expected)
    e8 = np.array([[128, 127], [126, 130]], np.uint8)  # ue8m0 scales: 2, 1, 0.5, 8
    got_e8 = quant.dequant_fp8_block(w, e8, block=(2, 2))
    np.testing.assert_array_equal(got_e8, [[2, -4, .5], [896, 0, -.25], [1.5, 2, -3584]])
    with pytest.raises(ConversionError, match="shape"):
        quant.dequant_fp8_block(w, s[:1], block=(2, 2))
    nan = w.copy()
    nan.view(np.uint8)[1, 1] = 0x7F
    with pytest.raises(ConversionError, match="q_b_proj.*NaN"):
        quant.dequant_fp8_block(nan, s, block=(2, 2), name="q_b_proj")


@pytest.mark.parametrize("scale_fmt", ["f32", "ue8m0"])
def test_fp8_block_round_trip_exact_for_representable_values(scale_fmt):
    rng = np.random.default_rng(3)
    n_out, n_in = 200, 300  # ragged against 128 x 128 blocks
    grid = (2, 3)
    fp8_vals = rng.standard_normal((n_out, n_in)).astype(np.float32) * 50
    fp8_vals = np.clip(fp8_vals, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    fp8_vals[::128, ::128] = 448.0  # each block's amax is exactly 448 * s
    if scale_fmt == "f32":
        s = rng.uniform(1e-4, 1.0, grid).astype(ml_dtypes.bfloat16).astype(np.float32)
    else:
        s = np.exp2(rng.integers(-20, 4, grid)).astype(np.float32)
    w = fp8_vals * np.repeat(np.repeat(s, 128, 0), 128, 1)[:n_out, :n_in]
    q, s_stored = quant.quant_fp8_block(w, scale_fmt=scale_fmt)
    assert q.dtype == ml_dtypes.float8_e4m3fn and s_stored.shape == grid
    np.testing.assert_array_equal(quant.dequant_fp8_block(q, s_stored), w)
    v = rng.standard_normal((n_out, n_in)).astype(np.float32)
    q2, s2 = quant.quant_fp8_block(v, scale_fmt=scale_fmt)
    rel = np.abs(quant.dequant_fp8_block(q2, s2) - v) / np.abs(v).max()
    assert rel.max() < 2 ** -4 * (2 if scale_fmt == "ue8m0" else 1)


K3_QC = {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
         "quantization_status": "compressed",
         "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None,
                                       "weights": {"num_bits": 4, "type": "float",
                                                   "strategy": "group", "group_size": 32,
                                                   "symmetric": True}}},
         "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*lm_head.*"]}
K25_QC = {"quant_method": "compressed-tensors", "format": "pack-quantized",
          "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "int",
                                                    "group_size": 32, "symmetric": True}}}}
FP8_QC = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
          "weight_block_size": [128, 128]}


def test_detect_format_by_companion_tensors():
    p = "language_model.model.layers.1.block_sparse_moe."
    assert quant.detect_format({p + "experts.3.w1.weight_packed", p + "experts.3.w1.weight_scale"},
                               K3_QC) == "mxfp4"
    # The router is not in K3's ignore list but is stored BF16: decided by tensors, not regexes.
    assert quant.detect_format({p + "gate.weight"}, K3_QC) == "bf16"
    assert quant.detect_format({"weight_packed", "weight_scale", "weight_shape"}, K25_QC) == "int4_pack"
    assert quant.detect_format({"weight", "weight_scale_inv"}, FP8_QC) == "fp8_block"
    assert quant.detect_format({"w.weight_packed", "w.weight_scale"}, None) == "mxfp4"
    with pytest.raises(ConversionError, match="layout int4_pack.*declares"):
        quant.detect_format({"weight_packed", "weight_scale", "weight_shape"}, K3_QC)
    # NVFP4 (global scale) and MXFP8 (fp8 weight + E8M0 scale) layouts are not decodable here.
    for names in ({"weight_packed", "weight_scale", "weight_global_scale"},
                  {"weight", "weight_scale"}):
        with pytest.raises(ConversionError, match="unsupported quantization format.*supported:"):
            quant.detect_format(names, None)


@pytest.mark.parametrize("qc", [
    {"quant_method": "gptq", "bits": 4},
    {"quant_method": "mxfp4"},  # gpt-oss fused _blocks layout
    {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized"},
    {"quant_method": "compressed-tensors", "format": "pack-quantized",
     "config_groups": {"g": {"weights": {"num_bits": 8, "type": "int"}}}},
    {"quant_method": "fp8", "fmt": "e5m2"},
])
def test_unsupported_quantization_config_raises(qc):
    with pytest.raises(ConversionError, match="unsupported quantization format.*supported:"):
        quant.detect_format({"weight"}, qc)


def test_parse_quantization_config_parameters():
    assert quant.parse_quantization_config(None) == quant.QuantSpec()
    k25 = quant.parse_quantization_config({**K25_QC, "config_groups": {
        "g": {"weights": {"num_bits": 4, "type": "int", "group_size": 128}}}})
    assert k25.formats == {"int4_pack"} and k25.int4_group_size == 128
    fp8 = quant.parse_quantization_config({**FP8_QC, "weight_block_size": [64, 32]})
    assert fp8.formats == {"fp8_block"} and fp8.fp8_block == (64, 32)


@pytest.mark.parametrize("fmt", quant.FORMATS)
def test_encode_decode_weight_all_formats(fmt):
    rng = np.random.default_rng(4)
    w = rng.standard_normal((16, 64)).astype(np.float32)
    spec = quant.QuantSpec(fp8_block=(8, 32))
    stored = quant.encode_weight(w, fmt, spec)
    assert quant.detect_format(set(stored), None) == fmt
    got = quant.decode_weight(fmt, stored, spec)
    assert got.dtype == np.float32 and got.shape == w.shape
    tol = {"bf16": 2 ** -8, "mxfp4": 0.5, "int4_pack": 1 / 7, "fp8_block": 2 ** -4}[fmt]
    assert np.abs(got - w).max() <= tol * np.abs(w).max()
