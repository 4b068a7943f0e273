"""Lazy validating reader, sharded writer and config reading (conversion/safetensors_io.py)."""
import json
import os
import sys

import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file

from conversion import quant
from conversion import safetensors_io as sio
from conversion.errors import ConversionError

K3_QC = {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
         "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "float",
                                                   "group_size": 32, "symmetric": True}}},
         "ignore": ["re:.*self_attn.*", "re:.*lm_head.*"]}
P = "language_model.model.layers.1."


def _tensors(rng):
    """A K3-flavoured mix: BF16 dense, F32 params, MXFP4 experts (U8), F8 and I32 tensors."""
    t = {
        P + "self_attn.q_proj.weight": rng.standard_normal((48, 64)).astype(ml_dtypes.bfloat16),
        P + "self_attn.A_log": rng.standard_normal(8).astype(np.float32),
        P + "self_attn.q_conv1d.weight": rng.standard_normal((48, 1, 4)).astype(np.float32),
        P + "block_sparse_moe.gate.e_score_correction_bias": np.arange(4, dtype=np.float32),
        "misc.fp8": rng.standard_normal((5, 7)).astype(ml_dtypes.float8_e4m3fn),
        "misc.e8m0": np.arange(120, 130, dtype=np.uint8).view(ml_dtypes.float8_e8m0fnu),
        "misc.i32": np.arange(-6, 6, dtype=np.int32).reshape(3, 4),
        "misc.scalar": np.float32(2.5),
    }
    for e in range(2):
        for w_name, shape in (("w1", (16, 64)), ("w2", (64, 32))):
            w = rng.standard_normal(shape).astype(np.float32)
            for suffix, arr in quant.encode_weight(w, "mxfp4").items():
                t[f"{P}block_sparse_moe.experts.{e}.{w_name}.{suffix}"] = arr
    return t


def _assert_same(a, b):
    """Bit-exact equality (NaN-safe, -0.0 distinct from 0.0)."""
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(a.reshape(-1).view(np.uint8), b.reshape(-1).view(np.uint8))


def stored_suffixes(stored):
    """{"m.w.weight_packed": a} -> {"weight_packed": a}."""
    return {k.rpartition(".")[2]: v for k, v in stored.items()}


@pytest.mark.parametrize("num_shards,index", [(1, False), (3, True), (2, False)])
def test_lazy_get_of_every_dtype_equals_written(tmp_path, num_shards, index):
    t = _tensors(np.random.default_rng(0))
    weight_map = sio.write_tiny_checkpoint(tmp_path, t, num_shards=num_shards, index=index)
    assert len(set(weight_map.values())) == num_shards
    assert os.path.exists(tmp_path / sio.INDEX_NAME) == index
    r = sio.CheckpointReader(str(tmp_path))
    assert r.keys() == sorted(t) and len(r) == len(t)
    assert r.total_bytes == sum(np.asarray(v).nbytes for v in t.values())
    for name, want in t.items():
        want = np.asarray(want)
        assert r.shape(name) == want.shape and r.dtype(name) == want.dtype
        _assert_same(r.get(name), want)
    if index:
        meta = json.loads((tmp_path / sio.INDEX_NAME).read_text())["metadata"]
        assert meta["total_size"] == r.total_bytes
    # The safetensors library reads what we wrote (numpy framework: native dtypes + BF16).
    file = weight_map[P + "self_attn.A_log"]
    with safe_open(str(tmp_path / file), framework="numpy") as f:
        for name in f.keys():
            if r.info(name).dtype in ("F32", "U8", "I32", "BF16"):
                _assert_same(f.get_tensor(name), r.get(name))


def test_get_dequantized_and_logical_view(tmp_path):
    rng = np.random.default_rng(1)
    t = _tensors(rng)
    sio.write_tiny_checkpoint(tmp_path, t, num_shards=2, config={"text_config": {
        "hidden_size": 64, "quantization_config": K3_QC}})
    r = sio.CheckpointReader(str(tmp_path))
    assert r.quant_spec.formats == {"mxfp4"}
    w1 = f"{P}block_sparse_moe.experts.1.w1"
    assert w1 + ".weight" in r.logical_keys() and w1 + ".weight_packed" not in r.logical_keys()
    assert r.format_of(w1 + ".weight") == "mxfp4" and r.logical_shape(w1 + ".weight") == (16, 64)
    want = quant.dequant_mxfp4(t[w1 + ".weight_packed"], t[w1 + ".weight_scale"])
    np.testing.assert_array_equal(r.get_dequantized(w1 + ".weight"), want)
    np.testing.assert_array_equal(r.get_dequantized(w1), want)  # bare base name works too
    q = P + "self_attn.q_proj.weight"
    assert r.format_of(q) == "bf16" and r.get_dequantized(q).dtype == np.float32
    np.testing.assert_array_equal(r.get_dequantized(q), t[q].astype(np.float32))
    np.testing.assert_array_equal(r.get_dequantized(P + "self_attn.A_log"), t[P + "self_attn.A_log"])
    with pytest.raises(ConversionError, match="pass the weight's name"):
        r.get_dequantized(w1 + ".weight_scale")
    with pytest.raises(ConversionError, match="no tensor"):
        r.get_dequantized("nope.weight")


def test_get_dequantized_int4_and_fp8_checkpoints(tmp_path):
    rng = np.random.default_rng(2)
    w = rng.standard_normal((24, 100)).astype(np.float32)
    k25_qc = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {
        "g": {"weights": {"num_bits": 4, "type": "int", "group_size": 16}}}}
    spec = quant.parse_quantization_config(k25_qc)
    stored = {f"m.experts.0.down_proj.{k}": v for k, v in quant.encode_weight(w, "int4_pack", spec).items()}
    sio.write_tiny_checkpoint(tmp_path / "k25", stored, config={"quantization_config": k25_qc})
    r = sio.CheckpointReader(str(tmp_path / "k25"))
    assert r.logical_shape("m.experts.0.down_proj.weight") == (24, 100)
    np.testing.assert_array_equal(r.get_dequantized("m.experts.0.down_proj.weight"),
                                  quant.decode_weight("int4_pack", stored_suffixes(stored), spec))
    fp8_qc = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [16, 32]}
    spec = quant.parse_quantization_config(fp8_qc)
    stored = {f"q_b_proj.{k}": v for k, v in quant.encode_weight(w, "fp8_block", spec).items()}
    assert stored["q_b_proj.weight_scale_inv"].shape == (2, 4)
    sio.write_tiny_checkpoint(tmp_path / "fp8", stored, config={"quantization_config": fp8_qc})
    r = sio.CheckpointReader(str(tmp_path / "fp8"))
    got = r.get_dequantized("q_b_proj.weight")
    np.testing.assert_array_equal(got, quant.decode_weight("fp8_block", stored_suffixes(stored), spec))
    assert np.abs(got - w).max() <= 2 ** -4 * np.abs(w).max()


def test_truncated_shard_error_names_file_and_sizes(tmp_path):
    t = _tensors(np.random.default_rng(3))
    weight_map = sio.write_tiny_checkpoint(tmp_path, t, num_shards=2)
    shard = tmp_path / sorted(set(weight_map.values()))[1]
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(size - 3)
    with pytest.raises(ConversionError) as e:
        sio.CheckpointReader(str(tmp_path))
    msg = str(e.value)
    assert str(shard) in msg and "truncated" in msg and str(size) in msg and str(size - 3) in msg
    with open(shard, "r+b") as f:  # cut inside the JSON header this time
        f.truncate(20)
    with pytest.raises(ConversionError, match=f"{shard.name}.*truncated.*20 bytes"):
        sio.CheckpointReader(str(tmp_path))


def test_index_errors_missing_entry_missing_shard_bad_header(tmp_path):
    t = {"a": np.ones(3, np.float32), "b": np.zeros((2, 2), ml_dtypes.bfloat16)}
    sio.write_tiny_checkpoint(tmp_path, t, num_shards=2)
    index_path = tmp_path / sio.INDEX_NAME
    index = json.loads(index_path.read_text())
    good = dict(index)
    index["weight_map"]["ghost"] = index["weight_map"]["a"]
    index_path.write_text(json.dumps(index))
    with pytest.raises(ConversionError, match="index entry 'ghost'.*no tensor 'ghost'"):
        sio.CheckpointReader(str(tmp_path))
    index = json.loads(json.dumps(good))
    index["weight_map"]["a"] = "model-00009-of-00009.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(ConversionError, match="'a' maps to shard 'model-00009-of-00009"):
        sio.CheckpointReader(str(tmp_path))
    index["weight_map"]["a"] = "../outside.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(ConversionError, match="not a file in"):
        sio.CheckpointReader(str(tmp_path))
    index_path.write_text(json.dumps(good))
    shard = tmp_path / good["weight_map"]["b"]
    raw = bytearray(shard.read_bytes())
    raw[8:10] = b"[["  # break the JSON header
    shard.write_bytes(bytes(raw))
    with pytest.raises(ConversionError, match=f"{shard.name}.*not valid JSON"):
        sio.CheckpointReader(str(tmp_path))


def test_duplicate_tensor_across_unindexed_files_and_empty_dir(tmp_path):
    sio.write_tiny_checkpoint(tmp_path / "a", {"x": np.ones(2, np.float32)})
    os.rename(tmp_path / "a" / sio.SINGLE_NAME, tmp_path / "a" / "one.safetensors")
    sio.write_safetensors(str(tmp_path / "a" / "two.safetensors"), [("x", np.ones(2, np.int32))])
    with pytest.raises(ConversionError, match="'x' is in both"):
        sio.CheckpointReader(str(tmp_path / "a"))
    os.makedirs(tmp_path / "empty")
    with pytest.raises(ConversionError, match="no model.safetensors.index.json"):
        sio.CheckpointReader(str(tmp_path / "empty"))


def test_unsupported_quantization_is_rejected_on_open(tmp_path):
    sio.write_tiny_checkpoint(tmp_path, {"x.qweight": np.ones((2, 2), np.int32)},
                              config={"quantization_config": {"quant_method": "awq", "bits": 4}})
    with pytest.raises(ConversionError, match="unsupported quantization format 'awq'; supported:"):
        sio.CheckpointReader(str(tmp_path))
    r = sio.CheckpointReader(str(tmp_path), quantization_config=K3_QC)  # explicit override
    assert r.keys() == ["x.qweight"] and r.quant_spec.formats == {"mxfp4"}
    nvfp4 = {"y.weight_packed": np.ones((4, 32), np.uint8), "y.weight_scale": np.ones((4, 4), np.uint8),
             "y.weight_global_scale": np.ones(1, np.float32)}
    sio.write_tiny_checkpoint(tmp_path / "nv", nvfp4)
    with pytest.raises(ConversionError, match="unsupported quantization format.*weight_global_scale"):
        sio.CheckpointReader(str(tmp_path / "nv")).get_dequantized("y.weight")


def test_writer_reader_round_trip_bit_exact_bf16_multi_shard(tmp_path):
    rng = np.random.default_rng(4)
    tensors = {f"layers.{i}.w": rng.standard_normal((32, 16 + i)).astype(ml_dtypes.bfloat16)
               for i in range(7)}
    tensors["layers.7.w"] = np.array([np.inf, -0.0, 1e-40, np.nan], np.float32).astype(
        ml_dtypes.bfloat16)  # special values survive bit for bit
    tensors["big"] = rng.standard_normal((64, 64)).astype(ml_dtypes.bfloat16)  # 8 KiB > limit
    tensors["f32"] = rng.standard_normal(5).astype(np.float32)
    limit = 3000
    out = tmp_path / "out"
    with sio.ShardedWriter(str(out), max_shard_bytes=limit) as w:
        for name, arr in tensors.items():
            w.add(name, arr)
            assert w._pending_bytes <= max(limit, arr.nbytes)  # at most one shard held
    files = sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))
    n = len(files)
    assert n >= 4 and files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert not [f for f in os.listdir(out) if f.endswith(".partial")]
    index = json.loads((out / sio.INDEX_NAME).read_text())
    assert set(index["weight_map"]) == set(tensors) and set(index["weight_map"].values()) == set(files)
    assert index["metadata"]["total_size"] == sum(a.nbytes for a in tensors.values())
    big_shard = index["weight_map"]["big"]
    assert [k for k, v in index["weight_map"].items() if v == big_shard] == ["big"]
    r = sio.CheckpointReader(str(out))
    for name, arr in tensors.items():
        _assert_same(r.get(name), arr)
    on_disk = load_file(str(out / index["weight_map"]["layers.0.w"]))  # library-readable
    _assert_same(on_disk["layers.0.w"], tensors["layers.0.w"])


def test_writer_refusals_and_abort(tmp_path):
    w = sio.ShardedWriter(str(tmp_path / "o"), max_shard_bytes=16)
    w.add("a", np.ones(8, np.float32))
    with pytest.raises(ConversionError, match="duplicate"):
        w.add("a", np.ones(1, np.float32))
    with pytest.raises(ConversionError, match="no safetensors equivalent"):
        w.add("c", np.ones(2, np.complex64))
    w.close()
    with pytest.raises(ConversionError, match="after close"):
        w.add("b", np.ones(1, np.float32))
    with pytest.raises(ConversionError, match="already holds checkpoint files"):
        sio.ShardedWriter(str(tmp_path / "o"))
    with pytest.raises(RuntimeError):
        with sio.ShardedWriter(str(tmp_path / "p"), max_shard_bytes=4) as w2:
            w2.add("x", np.ones(4, np.float32))
            w2.add("y", np.ones(4, np.float32))  # flushes x to a .partial shard
            raise RuntimeError("conversion failed midway")
    assert os.listdir(tmp_path / "p") == []  # no partial shards, no index


def test_read_config_text_config_nesting(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["KimiK3ForConditionalGeneration"],
        "text_config": {"hidden_size": 7168, "quantization_config": K3_QC}}))
    cfg = sio.read_config(str(tmp_path))
    assert cfg["hidden_size"] == 7168 and cfg["quantization_config"] == K3_QC
    (tmp_path / "config.json").write_text(json.dumps({
        "text_config": {"hidden_size": 7168}, "quantization_config": K3_QC}))
    assert sio.read_config(str(tmp_path))["quantization_config"] == K3_QC
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 2304}))
    assert sio.read_config(str(tmp_path)) == {"hidden_size": 2304, "quantization_config": None}
    (tmp_path / "config.json").write_text(json.dumps({
        "text_config": {"quantization_config": K3_QC}, "quantization_config": {"quant_method": "fp8"}}))
    with pytest.raises(ConversionError, match="differ"):
        sio.read_config(str(tmp_path))


def test_no_python_file_in_checkpoint_dir_is_executed(tmp_path):
    marker = tmp_path / "EXECUTED"
    payload = f"open({str(marker)!r}, 'w').write('pwned')\n"
    for file in ("modeling_kimi.py", "configuration_kimi.py", "tokenization_kimi.py", "__init__.py"):
        (tmp_path / file).write_text(payload)
    t = _tensors(np.random.default_rng(5))
    sio.write_tiny_checkpoint(tmp_path, t, num_shards=2, config={
        "auto_map": {"AutoConfig": "configuration_kimi.KimiConfig",
                     "AutoModelForCausalLM": "modeling_kimi.KimiForCausalLM"},
        "text_config": {"quantization_config": K3_QC}})
    r = sio.CheckpointReader(str(tmp_path))
    sio.read_config(str(tmp_path))
    for name in r.logical_keys():
        r.get_dequantized(name)
    assert not marker.exists()
    assert not [m for m in sys.modules if m.endswith(("modeling_kimi", "tokenization_kimi"))]
