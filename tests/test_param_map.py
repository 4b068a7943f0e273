"""The HF <-> k3jax name map (conversion/param_map.py) as a pure table: coverage and inverses.

Every parameter slice (a layer of a scanned stack, or a whole unstacked leaf) of the tiny K3, the
tiny Kimi Linear (golden asset config) and the full kimi-k3 abstract models is produced by exactly
one rule; on the tiny models each rule's ``to_hf`` / ``fuse_to_hf`` is inverted by its ``to_ours``.
"""
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import yaml
from flax import nnx

from conversion import param_map
from conversion.hf_to_k3jax import conversion_steps, model_overrides_from_hf
from conversion.safetensors_io import read_config
from k3jax import config as C
from k3jax import model as M

ASSET = Path(__file__).parent / "assets" / "kimi_linear_tiny"


def _cfg(name, tmp_path_factory):
    if name == "kimi_linear_tiny":
        yml = tmp_path_factory.mktemp("pm") / "model.yml"
        yml.write_text(yaml.safe_dump(model_overrides_from_hf(read_config(str(ASSET)))))
        return C.load(C.REPO_CONFIGS / "base.yml", [f"model_name={yml}"])
    return C.load(C.REPO_CONFIGS / "base.yml", [f"model_name={name}"])


def _abstract(cfg):
    model = nnx.eval_shape(lambda: M.build(cfg, 0))
    return model, {tuple(p): tuple(v.shape) for p, v in nnx.to_flat_state(nnx.state(model))}


@pytest.mark.parametrize("name,layout", [("default", "remote_prefixed"), ("default", "native"),
                                         ("kimi_linear_tiny", "native"), ("kimi_linear_tiny", "remote"),
                                         ("kimi-k3", "remote_prefixed")])
def test_every_parameter_slice_covered_exactly_once(name, layout, tmp_path_factory):
    cfg = _cfg(name, tmp_path_factory)
    model, leaves = _abstract(cfg)
    slices = Counter()
    hf_uses = Counter()
    for _, path, index, hf, to_ours in conversion_steps(model, cfg.model, layout):
        assert path in leaves, f"rule targets {path}, which the model does not have"
        slices[(path, index)] += 1
        hf_uses.update(hf)
        if hasattr(to_ours, "each"):  # one HF tensor per expert
            assert len(hf) == leaves[path][len(index)], path
    dup = [k for k, n in slices.items() if n != 1]
    assert not dup, dup[:4]
    lay = model.layout
    for path in leaves:
        n = lay.num_periods if path[0] == "periods" else 0
        want = {(path, (i,)) for i in range(n)} if n else {(path, ())}
        assert want <= set(slices), f"{path} not fully covered"
    assert len(slices) == sum(lay.num_periods if p[0] == "periods" else 1 for p in leaves)
    # One HF tensor feeds one parameter slice, except the native fused tensors.
    shared = {n for n, k in hf_uses.items() if k > 1}
    assert all(n.endswith(("conv1d.weight", "experts.gate_up_proj")) for n in shared), sorted(shared)[:4]
    if name == "kimi-k3":
        assert sum(len(hf) for *_, hf, _ in conversion_steps(model, cfg.model, layout)) > 92 * 896 * 3
        assert any(n == "language_model.model.layers.92.self_attn.kv_b_proj.weight" for n in hf_uses)


@pytest.mark.parametrize("name,layout", [("default", "remote_prefixed"), ("default", "native"),
                                         ("kimi_linear_tiny", "native"), ("kimi_linear_tiny", "remote")])
def test_to_hf_then_to_ours_is_identity(name, layout, tmp_path_factory):
    cfg = _cfg(name, tmp_path_factory)
    model, leaves = _abstract(cfg)
    m = cfg.model
    rng = np.random.default_rng(0)
    rules = [(r, ()) for r in param_map.global_rules(m, layout)]
    for l in range(m.num_layers):
        rules += [(r, (l,)) for r in param_map.layer_rules(m, l, layout)]
    fused: dict[tuple, list] = {}
    for (our, hf, to_ours, to_hf), where in rules:
        x = rng.standard_normal(_slice_shape(model, leaves, our, where)).astype(np.float32)
        if to_hf is None:
            fused.setdefault((hf[0], where), []).append((x, to_ours))
            continue
        h = to_hf(x)
        h = h if isinstance(h, list) else [h]
        assert len(h) == len(hf)
        np.testing.assert_array_equal(to_ours(*h), x, err_msg=f"{our} {where}")
    assert bool(fused) == (layout == "native" and m.num_layers > m.first_k_dense)
    for (name_, where), parts in fused.items():
        h = param_map.fuse_to_hf(name_, [x for x, _ in parts])
        for x, to_ours in parts:
            np.testing.assert_array_equal(to_ours(h), x, err_msg=f"{name_} {where}")


def _slice_shape(model, leaves, our, where):
    if not where:
        return leaves[tuple(our.split("."))]
    loc, idx = model.layout.where(where[0])
    shape = leaves[loc + tuple(our.split("."))]
    return shape if idx is None else shape[1:]


def test_detect_layout():
    assert param_map.detect_layout(["model.layers.0.self_attn.conv1d.weight"]) == "native"
    assert param_map.detect_layout(["model.layers.0.self_attn.q_conv1d.weight"]) == "remote"
    assert param_map.detect_layout(["language_model.model.norm.weight"]) == "remote_prefixed"
