"""Streaming HF -> k3jax conversion, k3jax -> HF export, input validation and the logit checker.

Two sources: the tiny transformers Kimi Linear golden asset (native layout, F32), and a tiny K3
written here with our own writer in the released K3 layout (``language_model.`` prefix, per-expert
MXFP4 ``w1/w2/w3``, F32 convs / A_log [128] / dt_bias / o_norm / router bias, BF16 elsewhere,
two shards + index, a ``modeling_*.py`` that must never run).
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from safetensors.numpy import load_file

from conversion import param_map, quant
from conversion.hf_to_k3jax import convert, load_into_model, main as convert_main, model_overrides_from_hf
from conversion.k3jax_to_hf import F32_SUFFIXES, export, hf_config, open_item
from conversion.safetensors_io import CheckpointReader, read_config, write_tiny_checkpoint
from k3jax import config as C
from k3jax import logit_check
from k3jax import model as M
from k3jax.sharding import make_mesh
from k3jax.state import restore_model

REPO = Path(__file__).resolve().parents[1]
ASSET = REPO / "tests" / "assets" / "kimi_linear_tiny"
K3_QC = {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
         "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "float",
                                                                          "group_size": 32, "symmetric": True}}},
         "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*lm_head.*"]}
EVIL = "import pathlib\npathlib.Path(__file__).with_name('EXECUTED').write_text('ran')\n"


def k3_tensors(cfg, seed=0):
    """Random tiny-K3 HF tensors in the remote prefixed layout (MXFP4 experts) + config.json."""
    m = cfg.model
    model = nnx.eval_shape(lambda: M.build(cfg, 0))
    leaves = {tuple(p): tuple(v.shape) for p, v in nnx.to_flat_state(nnx.state(model))}
    rng = np.random.default_rng(seed)
    rules = [(r, None) for r in param_map.global_rules(m, "remote_prefixed")]
    rules += [(r, l) for l in range(m.num_layers) for r in param_map.layer_rules(m, l, "remote_prefixed")]
    out = {}
    for (our, hf, _, to_hf), l in rules:
        loc, idx = model.layout.where(l) if l is not None else ((), None)
        shape = leaves[loc + tuple(our.split("."))][(0 if idx is None else 1):]
        x = (0.3 * rng.standard_normal(shape)).astype(np.float32)
        if our.endswith(("norm", "norm.weight")):
            x += 1.0
        h = to_hf(x)
        if hasattr(to_hf, "each_hf"):
            for name, w in zip(hf, h):
                for suffix, arr in quant.encode_weight(w, "mxfp4").items():
                    out[name[: -len("weight")] + suffix] = arr
            continue
        out[hf[0]] = h.astype(np.float32 if hf[0].endswith(F32_SUFFIXES) else ml_dtypes.bfloat16)
    config = hf_config(m, "remote_prefixed", "bfloat16")
    config["text_config"]["quantization_config"] = K3_QC
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_kimi.KimiForCausalLM"}
    return out, config


def write_k3(path, tensors, config):
    write_tiny_checkpoint(str(path), tensors, num_shards=2, config=config)
    for f in ("modeling_kimi.py", "__init__.py", "configuration_kimi.py"):
        (Path(path) / f).write_text(EVIL)
    return path


@pytest.fixture(scope="module")
def k3(tmp_path_factory):
    cfg = C.load(C.REPO_CONFIGS / "base.yml", ["moe_latent_size=64", "weight_dtype=float32"])
    tensors, config = k3_tensors(cfg)
    hf_dir = write_k3(tmp_path_factory.mktemp("k3") / "hf", tensors, config)
    out = tmp_path_factory.mktemp("k3") / "ckpt"
    convert(str(hf_dir), str(out), dtype="float32", progress=False)
    return cfg, tensors, config, hf_dir, out


@pytest.fixture(scope="module")
def kl(tmp_path_factory):
    out = tmp_path_factory.mktemp("kl") / "ckpt"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-m", "conversion.hf_to_k3jax", "--hf_dir", str(ASSET), "--out", str(out),
                        "--dtype", "float32"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "tensors" in r.stderr and "MiB/s" in r.stderr  # the progress bar
    return out


def test_kimi_linear_cli_conversion_logits_match_golden_via_logit_check(kl, tmp_path, capsys):
    g = np.load(ASSET / "golden.npz")
    good, bad = tmp_path / "good.npz", tmp_path / "bad.npz"
    np.savez(good, tokens=g["input_ids"].astype(np.int32), logits=g["logits"])
    noisy = g["logits"] + np.random.default_rng(0).normal(0, 0.5, g["logits"].shape).astype(np.float32)
    np.savez(bad, tokens=g["input_ids"].astype(np.int32), logits=noisy)
    args = ["configs/base.yml", f"model_name={kl / 'model.yml'}", f"load_parameters_path={kl}", "weight_dtype=float32",
            "atol=1e-3", "max_kl=1e-6"]
    assert logit_check.main([*args, f"golden={good}"]) == 0
    text = capsys.readouterr().out
    assert "PASS" in text and "top-1 agreement, sequences  1.0000" in text, text
    err = float(next(ln for ln in text.splitlines() if ln.startswith("max |logit error|")).split()[3])
    assert err <= 1e-3
    assert logit_check.main([*args, f"golden={bad}"]) == 1
    assert "FAIL" in capsys.readouterr().out
    assert logit_check.main([*args, f"golden={tmp_path / 'none.npz'}"]) == 2


def test_k3_conversion_matches_model_built_from_dequantized_weights(k3):
    cfg, _, _, hf_dir, out = k3
    assert not (hf_dir / "EXECUTED").exists()  # modeling_*.py / __init__.py never imported
    derived = C.load(C.REPO_CONFIGS / "base.yml", [f"model_name={out / 'model.yml'}", "weight_dtype=float32"])
    assert derived.model == cfg.model
    reader = CheckpointReader(str(hf_dir))
    ref = load_into_model(nnx.eval_shape(lambda: M.build(cfg, 1)), cfg.model, reader.get_dequantized, reader.keys())
    run = C.load(C.REPO_CONFIGS / "base.yml", [f"model_name={out / 'model.yml'}", "weight_dtype=float32",
                                               f"load_parameters_path={out}"])
    mesh = make_mesh(run, jax.devices()[:1])  # one device: the forward compiles much faster on CI
    with jax.set_mesh(mesh):
        got = restore_model(run, mesh)
    ref_flat = dict(nnx.to_flat_state(nnx.state(ref)))
    for path, var in nnx.to_flat_state(nnx.state(got)):
        np.testing.assert_array_equal(np.asarray(var[...]), np.asarray(ref_flat[path][...]), err_msg=str(path))
    # The reference on the same shardings: one compiled forward serves both models.
    nnx.update(ref, jax.tree.map(lambda r, g: jax.device_put(r, g.sharding), nnx.state(ref), nnx.state(got)))
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, cfg.model.vocab_size, (2, 24)), jnp.int32)
    with jax.set_mesh(mesh):
        want = np.asarray(logit_check._forward()(ref, tokens))
        have = np.asarray(logit_check._forward()(got, tokens))
    assert np.abs(want).max() > 0.1
    np.testing.assert_allclose(have, want, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def k3_packed(k3, tmp_path_factory):
    out = tmp_path_factory.mktemp("k3") / "packed"
    convert(str(k3[3]), str(out), dtype="float32", experts_format="mxfp4", progress=False)
    return out


def test_packed_mxfp4_experts_decode_to_the_dense_conversion(k3, k3_packed, tmp_path):
    _, _, _, hf_dir, dense = k3
    out = k3_packed
    packed = ocp.StandardCheckpointer().restore(out / "experts_mxfp4")
    dense_leaves = open_item(dense / "params")
    assert len(packed) == sum(p[-1] in ("w_gate", "w_up", "w_down") for p in dense_leaves) > 0
    for key, item in packed.items():
        path = tuple(int(k) if k.isdigit() else k for k in key.split("."))
        w = quant.dequant_mxfp4(np.asarray(item["codes"]), np.asarray(item["scales"]))  # [..., E, out, in]
        np.testing.assert_array_equal(np.swapaxes(w, -1, -2), dense_leaves[path].read().result(), err_msg=key)
    params = open_item(out / "params")
    assert not any(p[-1] in ("w_gate", "w_up", "w_down") for p in params)
    with pytest.raises(Exception, match="experts_format mxfp4"):
        export(str(out), str(tmp_path / "hf"), progress=False)


def test_packed_mxfp4_conversion_serves_the_dense_conversions_logits(k3, k3_packed, tmp_path, capsys):
    """experts_format=mxfp4 loads the converter's packed output as is (uint8 codes + E8M0 scales,
    4.25 bits per routed-expert weight, measured from the live arrays) and its logits equal the
    model holding the same experts dequantized by the codec (the dense conversion)."""
    from k3jax.kernels.moe.quantized import MXFP4, bits_per_weight
    from k3jax.layers.common import Packed
    cfg, _, _, _, dense = k3
    args = [f"model_name={dense / 'model.yml'}", "weight_dtype=float32"]
    ref_cfg = C.load(C.REPO_CONFIGS / "base.yml", [*args, f"load_parameters_path={dense}"])
    run = C.load(C.REPO_CONFIGS / "base.yml", [*args, f"load_parameters_path={k3_packed}", "experts_format=mxfp4"])
    mesh = make_mesh(run, jax.devices()[:1])
    with jax.set_mesh(mesh):
        ref, got = restore_model(ref_cfg, mesh), restore_model(run, mesh)
    packed = dict(nnx.to_flat_state(nnx.state(got, Packed)))
    codes = [p[:-1] for p in packed if p[-1] == "codes"]
    ws = [MXFP4(packed[p + ("codes",)][...], packed[p + ("scales",)][...]) for p in codes]
    m = cfg.model
    assert sum(int(np.prod(w.shape)) for w in ws) == (m.num_layers - m.first_k_dense) * m.num_experts * 3 * \
        m.routed_width * m.moe_intermediate_size        # every routed-expert weight is packed
    bits = [bits_per_weight(w) for w in ws]
    assert all(b == 4.25 for b in bits), bits
    assert all(v[...].dtype == jnp.uint8 for v in packed.values())
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, cfg.model.vocab_size, (2, 24)), jnp.int32)
    with jax.set_mesh(mesh):
        want = np.asarray(logit_check._forward()(ref, tokens))
        have = np.asarray(logit_check._forward()(got, tokens))
    rel = float(np.sqrt(np.mean((have - want) ** 2) / np.mean(want ** 2)))
    print(f"mxfp4 vs dense logits: relative RMS {rel:.3e}, {bits[0]} bits per routed-expert weight")
    assert np.abs(want).max() > 0.1 and rel <= 1e-5
    # The logit checker CLI reads the packed conversion as is (on all 8 devices, so reductions run
    # in another order than the one-device reference: the thresholds of the Kimi Linear check).
    golden = tmp_path / "dense.npz"
    np.savez(golden, tokens=np.asarray(tokens), logits=want)
    assert logit_check.main(["configs/base.yml", *args, f"load_parameters_path={k3_packed}", "experts_format=mxfp4",
                             f"golden={golden}", "atol=1e-3", "max_kl=1e-6"]) == 0
    assert "PASS" in capsys.readouterr().out


def test_k3_round_trip_bit_exact(k3, tmp_path):
    cfg, tensors, config, hf_dir, _ = k3
    ckpt, back = tmp_path / "ckpt", tmp_path / "hf"
    convert(str(hf_dir), str(ckpt), dtype="bfloat16", progress=False)
    export(str(ckpt), str(back), progress=False)
    got = {}
    for f in back.glob("*.safetensors"):
        got.update(load_file(f))
    reader = CheckpointReader(str(hf_dir))
    assert set(got) == set(reader.logical_keys())
    n_exact = 0
    for name, arr in got.items():
        if name in tensors and tensors[name].dtype == ml_dtypes.bfloat16:
            assert arr.dtype == ml_dtypes.bfloat16 and np.array_equal(arr.view(np.uint16), tensors[name].view(np.uint16)), name
            n_exact += 1
        else:  # MXFP4 experts come back dense (exact in BF16); F32 tensors keep F32
            want = reader.get_dequantized(name)
            rounded = want.astype(ml_dtypes.bfloat16).astype(np.float32)  # via a bf16 model parameter
            assert np.array_equal(arr.astype(np.float32), want) or np.array_equal(arr.astype(np.float32), rounded), name
    assert n_exact > 100
    exported = json.loads((back / "config.json").read_text())
    assert model_overrides_from_hf(exported["text_config"]) == model_overrides_from_hf(read_config(str(hf_dir)))
    assert not (hf_dir / "EXECUTED").exists()


def test_kimi_linear_round_trip_bit_exact_native_layout(kl, tmp_path):
    export(str(kl), str(tmp_path / "hf"), dtype="float32", progress=False)
    src = load_file(ASSET / "model.safetensors")
    got = {}
    for f in (tmp_path / "hf").glob("*.safetensors"):
        got.update(load_file(f))
    assert set(got) == set(src)
    for name in src:
        assert got[name].dtype == src[name].dtype and np.array_equal(got[name], src[name]), name
    orig = json.loads((ASSET / "config.json").read_text())
    new = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert model_overrides_from_hf(new) == model_overrides_from_hf(orig)
    same = ("architectures", "model_type", "layer_types", "mlp_layer_types", "linear_num_heads", "num_experts",
            "head_dim", "qk_head_dim", "pad_token_id", "bos_token_id", "model_max_length")
    assert {k: new[k] for k in same} == {k: orig[k] for k in same}


def _variant(k3, tmp_path, edit=None, config_edit=None):
    _, tensors, config, _, _ = k3
    tensors, config = dict(tensors), json.loads(json.dumps(config))
    if edit:
        edit(tensors)
    if config_edit:
        config_edit(config)
    return write_k3(tmp_path / "hf", tensors, config)


L0 = "language_model.model.layers.0."


def _drop(t):
    del t[L0 + "self_attn.q_proj.weight"], t["language_model.model.norm.weight"]


@pytest.mark.parametrize("edit,config_edit,extra_args,fragments", [
    (_drop, None, [], ["2 tensors the model needs are missing", L0 + "self_attn.q_proj.weight",
                       "language_model.model.norm.weight"]),
    (lambda t: t.update({L0 + "self_attn.extra_proj.weight": np.zeros((4, 4), ml_dtypes.bfloat16)}), None, [],
     ["unexpected tensors", L0 + "self_attn.extra_proj.weight"]),
    (lambda t: t.update({L0 + "self_attn.q_proj.weight": np.zeros((31, 64), ml_dtypes.bfloat16)}), None, [],
     ["converted shape (64, 31)", "model shape (64, 32)", L0 + "self_attn.q_proj.weight"]),
    (lambda t: t.update({L0 + "self_attn.o_proj.weight": np.zeros((64, 32), np.int32)}), None, [],
     [L0 + "self_attn.o_proj.weight", "dtype I32", "floating-point"]),
    (None, lambda c: c["text_config"]["quantization_config"].update(format="nvfp4-pack-quantized"), [],
     ["unsupported quantization format", "nvfp4-pack-quantized"]),
    (None, None, ["--model_name", "tiny"], ["disagrees with model_name=tiny", "hidden_size"]),
], ids=["missing", "unexpected", "shape", "dtype", "quant_format", "config"])
def test_malformed_inputs_fail_with_clear_errors(k3, tmp_path, capsys, edit, config_edit, extra_args, fragments):
    hf = _variant(k3, tmp_path, edit, config_edit)
    out = tmp_path / "out"
    assert convert_main(["--hf_dir", str(hf), "--out", str(out), "--quiet", *extra_args]) == 2
    err = capsys.readouterr().err
    for f in fragments:
        assert f in err, (f, err)
    assert not (out / "params").exists() and not list(out.glob("*.partial"))
    assert not (hf / "EXECUTED").exists()


def test_truncated_shard_fails_with_clear_error(k3, tmp_path, capsys):
    hf = _variant(k3, tmp_path)
    shard = sorted(hf.glob("model-*.safetensors"))[-1]
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(size - 100)
    assert convert_main(["--hf_dir", str(hf), "--out", str(tmp_path / "out"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "truncated safetensors file" in err and shard.name in err and str(size - 100) in err
