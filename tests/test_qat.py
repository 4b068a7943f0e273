"""MXFP4 quantization-aware training of the routed experts (``experts_qat=mxfp4``) and the quantized
exports (``k3jax_to_hf --experts_format mxfp4 | int4``).

The forward rounds the dense master experts exactly as the converter packs MXFP4 (the rounding
against the codec, bit for bit, on edge cases included), the gradient reaches the master weights
straight through (equal, bit for bit, to the dense model's gradient at the rounded weights), and a
QAT fine-tune exported to MXFP4, converted back packed and served with ``experts_format=mxfp4``
gives the training forward's logits. Expert widths are multiples of 32 (one E8M0 scale per 32
inputs), so the tiny model is test_mxfp4.py's."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conversion import quant
from conversion.hf_to_k3jax import convert
from conversion.k3jax_to_hf import export
from conversion.safetensors_io import CheckpointReader
from helpers import randomize
from k3jax import config as C
from k3jax import logit_check
from k3jax import model as M
from k3jax.kernels.moe.quantized import dequantize, fake_mxfp4, from_checkpoint_layout, mxfp4_round
from k3jax.layers.common import REST
from k3jax.sharding import make_mesh
from k3jax.state import restore_model
from k3jax.step import check_trainable
from k3jax.train import train

# As tests/test_mxfp4.py: the tiny K3 with expert input widths that are multiples of 32, 4 layers.
TINY = ["model_name=tiny", "moe_latent_size=32", "moe_intermediate_size=32", "weight_dtype=float32",
        "num_layers=4", "mla_extra_layers=[]", "attn_res_block_size=2"]
EXPERTS = ("w_gate", "w_up", "w_down")


def load(*args):
    return C.load(C.REPO_CONFIGS / "base.yml", [*TINY, *args])


def codec(w_kn: np.ndarray) -> np.ndarray:
    """[..., K, N] -> the converter's MXFP4 pack ([out, in] layout) decoded back, float32 [..., K, N]."""
    packed, scale = quant.quant_mxfp4(np.swapaxes(w_kn, -1, -2))
    return np.asarray(dequantize(from_checkpoint_layout(jnp.asarray(packed), jnp.asarray(scale))))


def bits(x) -> np.ndarray:
    return np.asarray(x, np.float32).view(np.uint32)


def test_rounding_equals_the_converters_pack_then_unpack():
    """Blocks over 16 binades, an all-zero block, every rounding midpoint (ties go to the even
    code), negatives that round to -0, saturation at 6 x 2^X; float32 and bfloat16 masters."""
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((3, 64, 16)) * np.exp2(rng.integers(-8, 8, (3, 2, 1, 16))).repeat(32, 1).reshape(3, 64, 16))
    w = w.astype(np.float32)
    w[0, :32, 0] = 0.0
    w[0, :32, 1] = [5.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, -0.25, -5.0, -0.1, 0.1, 4.5] + [0.0] * 20
    w[0, :32, 2] = [7.9, 6.5, 5.5, -7.99] + [0.01] * 28
    np.testing.assert_array_equal(bits(jax.jit(mxfp4_round)(w)), bits(codec(w)))
    got = np.asarray(jax.jit(mxfp4_round)(w))[0, :12, 1]
    assert list(got) == [4.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, -0.0, -4.0, -0.0, 0.0, 4.0]   # ties to even
    assert np.signbit(got[7]) and not np.signbit(got[1])
    wb = jnp.asarray(w, jnp.bfloat16)
    np.testing.assert_array_equal(bits(mxfp4_round(wb)), bits(codec(np.asarray(wb, np.float32))))
    with pytest.raises(ValueError, match="multiple of 32"):
        mxfp4_round(jnp.ones((48, 4)))


def test_gradient_passes_straight_through_in_the_masters_dtype():
    w = jnp.asarray(np.random.default_rng(1).standard_normal((64, 8)), jnp.bfloat16)
    cot = jnp.asarray(np.random.default_rng(2).standard_normal((64, 8)), jnp.float32)
    g = jax.grad(lambda x: jnp.sum(fake_mxfp4(x) * cot))(w)
    assert g.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(cot.astype(jnp.bfloat16), np.float32))


def _split(model):
    gdef, params, rest = nnx.split(model, nnx.Param, REST)
    return gdef, params, rest


def test_qat_forward_and_gradients_equal_the_dense_model_at_the_rounded_weights():
    """The QAT model (dense masters W) against the plain dense model holding codec(W) (which
    differs from W in nearly every weight): logits bit for bit, and every gradient (the experts'
    included: straight through) bit for bit."""
    qcfg, dcfg = load("experts_qat=mxfp4"), load()
    qat = randomize(M.build(qcfg, 0), seed=3)
    rounded = randomize(M.build(dcfg, 0), seed=3)
    flat = dict(nnx.to_flat_state(nnx.state(rounded)))
    n = 0
    for path, var in flat.items():
        if path[-1] in EXPERTS:
            w = np.asarray(var[...])
            flat[path] = var.replace(jnp.asarray(codec(w)))
            assert np.mean(codec(w) != w) > 0.9             # 4-bit rounding moves nearly every weight
            n += 1
    assert n == 3 * 3                                   # three MoE layers' gate / up / down stacks
    nnx.update(rounded, nnx.from_flat_state(list(flat.items())))
    tokens = jnp.asarray(np.random.default_rng(4).integers(0, qcfg.model.vocab_size, (2, 16)), jnp.int32)
    cot = jnp.asarray(np.random.default_rng(5).standard_normal((2, 16, qcfg.model.vocab_size)), jnp.float32)

    def value_and_grads(model):
        gdef, params, rest = _split(model)

        def f(p):
            logits = nnx.merge(gdef, p, rest)(tokens)[0]
            return jnp.sum(logits * cot), logits
        (_, logits), g = jax.jit(jax.value_and_grad(f, has_aux=True))(params)
        return np.asarray(logits), {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(g)}

    lq, gq = value_and_grads(qat)
    lr, gr = value_and_grads(rounded)
    np.testing.assert_array_equal(bits(lq), bits(lr))
    assert gq.keys() == gr.keys()
    for k in gq:
        np.testing.assert_array_equal(bits(gq[k]), bits(gr[k]), err_msg=k)


def test_qat_mistakes_are_one_line():
    with pytest.raises(C.ConfigError, match="experts_qat=mxfp4 trains dense master weights.*experts_format=dense"):
        load("experts_qat=mxfp4", "experts_format=mxfp4")
    with pytest.raises(C.ConfigError, match="experts_qat=mxfp4 needs the routed experts' input widths"):
        C.load(C.REPO_CONFIGS / "base.yml", ["model_name=tiny", "experts_qat=mxfp4"])
    with pytest.raises(C.ConfigError, match="freezes them; drop experts from freeze or set experts_qat=none"):
        check_trainable(load("experts_qat=mxfp4", "freeze=[experts]"))
    with pytest.raises(C.ConfigError, match="experts_qat=.nvfp4.: must be one of none, mxfp4"):
        load("experts_qat=nvfp4")


def test_qat_fine_tune_exports_to_the_weights_its_forward_used(tmp_path):
    """Two QAT steps, saved; exported with --experts_format mxfp4 (the release's layout:
    weight_packed + weight_scale per expert, quantization_config declared) and converted back
    packed: served with experts_format=mxfp4 it gives the training forward's logits. The int4
    export holds the int4 codec of the same master weights."""
    run = load("experts_qat=mxfp4", "steps=2", "per_device_batch_size=1", "max_target_length=16", "log_period=1",
               "checkpoint_period=2", "enable_tensorboard=false", f"base_output_directory={tmp_path}", "run_name=qat")
    out = train(run)
    assert len(out["history"]) == 2 and all(np.isfinite(h["loss"]) for h in out["history"])
    ckpt = tmp_path / "qat" / "checkpoints" / "2"
    hf, back = tmp_path / "hf", tmp_path / "back"
    export(str(ckpt), str(hf), dtype="float32", experts_format="mxfp4", progress=False)
    reader = CheckpointReader(str(hf))
    names = reader.logical_keys()
    expert_names = [n for n in names if ".experts." in n]
    assert expert_names and all(reader.format_of(n) == "mxfp4" for n in expert_names)
    config = json.loads((hf / "config.json").read_text())
    assert config["text_config"]["quantization_config"]["format"] == "mxfp4-pack-quantized"
    convert(str(hf), str(back), dtype="float32", experts_format="mxfp4", progress=False)

    tokens = jnp.asarray(np.random.default_rng(6).integers(0, run.model.vocab_size, (2, 16)), jnp.int32)
    trained = C.override(run, {"load_parameters_path": str(ckpt)})
    served = load(f"load_parameters_path={back}", "experts_format=mxfp4")
    mesh = make_mesh(served, jax.devices()[:1])
    with jax.set_mesh(mesh):
        want = np.asarray(logit_check._forward()(restore_model(trained, mesh), tokens))
        got = np.asarray(logit_check._forward()(restore_model(served, mesh), tokens))
    rel = float(np.sqrt(np.mean((got - want) ** 2) / np.mean(want ** 2)))
    print(f"QAT training forward vs the served MXFP4 export: {np.mean(got != want):.4f} of logits differ, "
          f"relative RMS {rel:.2e}")
    np.testing.assert_array_equal(bits(got), bits(want))

    dense, int4 = tmp_path / "dense", tmp_path / "int4"
    export(str(ckpt), str(dense), dtype="float32", progress=False)
    export(str(ckpt), str(int4), dtype="float32", experts_format="int4", progress=False)
    rd, r4 = CheckpointReader(str(dense)), CheckpointReader(str(int4))
    assert json.loads((int4 / "config.json").read_text())["text_config"]["quantization_config"]["format"] == \
        "pack-quantized"
    for name in expert_names:
        master = rd.get_dequantized(name)                       # the trained float32 masters
        assert r4.format_of(name) == "int4_pack" and rd.format_of(name) == "bf16"
        want = quant.decode_weight("int4_pack", quant.encode_weight(master, "int4_pack"))
        np.testing.assert_array_equal(bits(r4.get_dequantized(name)), bits(want), err_msg=name)
        np.testing.assert_array_equal(bits(reader.get_dequantized(name)), bits(codec(master.T).T), err_msg=name)
