"""hf_to_k3jax reads every common producer of a Kimi Linear checkpoint: transformers 5.x
``save_pretrained`` in its native names and in its default original-format layout (dense first-layer
MLP under ``block_sparse_moe.*``, bfloat16 here), and the released remote-code layout. Each is
converted with the default ``--dtype`` (the checkpoint's own) and its logits compared with the
transformers reference (tests/assets/kimi_linear_formats, scripts/make_convert_assets.py);
``router_weights_from_biased`` follows the layout: the remote code's convention only for the
remote-code layout."""
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest
import yaml

from conversion.hf_to_k3jax import convert
from conversion.param_map import detect_layout
from conversion.safetensors_io import CheckpointReader
from k3jax import config as C
from k3jax import logit_check
from k3jax.state import abstract_state

ASSETS = Path(__file__).parent / "assets" / "kimi_linear_formats"
# layout folder: (detected layout, stored dtype, router_weights_from_biased, reference logits, max |error|)
FORMATS = {"native": ("native", "float32", False, "logits", 1e-4),
           "original": ("remote_hf", "bfloat16", False, "logits_bf16", 1e-4),
           "remote": ("remote", "float32", True, "logits_biased", 1e-4)}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    out = {}
    for name in FORMATS:
        d = tmp_path_factory.mktemp(name) / "ckpt"
        convert(str(ASSETS / name), str(d), progress=False)
        out[name] = d
    return out


def _params(d):
    ckptr = ocp.StandardCheckpointer()
    meta = ckptr.metadata(d / "params")
    tree = getattr(meta, "item_metadata", meta).tree
    return {"/".join(map(str, p)): v for p, v in jax.tree_util.tree_flatten_with_path(
        ckptr.restore(d / "params"))[0]}, jax.tree.leaves(tree)


@pytest.mark.parametrize("name", list(FORMATS))
def test_each_producer_converts_with_its_dtype_router_convention_and_logits(name, converted, tmp_path):
    layout, dtype, biased, key, tol = FORMATS[name]
    assert detect_layout(CheckpointReader(str(ASSETS / name)).keys()) == layout
    out = converted[name]
    assert yaml.safe_load((out / "model.yml").read_text())["router_weights_from_biased"] is biased
    _, leaves = _params(out)
    # stored as the model holds them with weight_dtype = the checkpoint's dtype (a few gates stay f32)
    _, abstract, _ = abstract_state(C.load(C.REPO_CONFIGS / "base.yml", [f"model_name={out / 'model.yml'}",
                                                                        f"weight_dtype={dtype}"]))
    want = sorted(str(a.dtype) for a in jax.tree.leaves(abstract["params"]))
    assert sorted(str(m.dtype) for m in leaves) == want and dtype in want
    g = np.load(ASSETS / "golden.npz")
    golden = tmp_path / "golden.npz"
    np.savez(golden, tokens=g["input_ids"], logits=g[key])
    cfg = C.load(C.REPO_CONFIGS / "base.yml", [f"model_name={out / 'model.yml'}", f"load_parameters_path={out}",
                                               "weight_dtype=float32", f"golden={golden}"])
    metrics, _ = logit_check.run(cfg)
    print(name, metrics)
    assert metrics["max_abs_err"] <= tol and metrics["top1_token_agreement"] == 1.0, metrics


def test_the_three_layouts_hold_the_same_weights(converted):
    native, _ = _params(converted["native"])
    remote, _ = _params(converted["remote"])
    original, _ = _params(converted["original"])
    assert native.keys() == remote.keys() == original.keys()
    for k, v in native.items():
        assert np.array_equal(np.asarray(remote[k]), np.asarray(v)), k
        # transformers rounds float32 to bfloat16 to nearest even, as ml_dtypes does (gates kept in
        # float32 hold the rounded values)
        rounded = np.asarray(v).astype(ml_dtypes.bfloat16).astype(original[k].dtype)
        assert np.array_equal(np.asarray(original[k]), rounded), k
