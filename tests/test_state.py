"""k3jax.state: one abstract description of the state, init into it, restore into it.

Tiny model on one device (small compiles); the multi-device placement is covered by test_model's
sharded forward and the pod-scale one by test_sharding.
"""
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from k3jax import config as C
from k3jax.checkpoint import CheckpointError
from k3jax.sharding import make_mesh
from k3jax.state import abstract_state, init_state, restore_model, restore_state


def load(*args):
    return C.load(C.REPO_CONFIGS / "base.yml", ["model_name=tiny", *args])


@pytest.fixture(scope="module")
def tiny():
    cfg = load()
    mesh = make_mesh(cfg, jax.devices()[:1])
    return cfg, mesh, init_state(cfg, mesh, optimizer=True)


def test_init_matches_the_abstract_state(tiny):
    cfg, mesh, (_, state, _) = tiny
    _, abstract, tx = abstract_state(cfg, mesh, optimizer=True)
    assert tx is not None and set(abstract) == set(state) == {"params", "rest", "opt_state"}
    got, want = jax.tree.leaves(state), jax.tree.leaves(abstract)
    assert len(got) == len(want)
    for a, s in zip(got, want):
        assert (a.shape, a.dtype) == (s.shape, s.dtype)
        assert a.sharding.is_equivalent_to(s.sharding, a.ndim)
    # Without a mesh: shapes only (tests, counting), no shardings.
    bare = abstract_state(cfg)[1]
    assert all(getattr(x, "sharding", None) is None for x in jax.tree.leaves(bare))


def _save(path, tree):
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(path, tree)
    ckptr.wait_until_finished()


def test_restore_needs_router_biases(tiny, tmp_path, capsys):
    cfg, mesh, (_, state, _) = tiny
    biases = jax.tree.map(lambda x: x + 0.25, state["rest"])
    _save(tmp_path / "full" / "params", state["params"])
    _save(tmp_path / "full" / "extra", biases)
    model = restore_model(C.override(cfg, {"load_parameters_path": str(tmp_path / "full")}), mesh)
    bias = model.layer(model.layout.sites()[-1]).mlp.e_score_correction_bias[...]
    np.testing.assert_array_equal(bias, np.full(bias.shape, 0.25, np.float32))

    _save(tmp_path / "bare" / "params", state["params"])
    bare = C.override(cfg, {"load_parameters_path": str(tmp_path / "bare")})
    with pytest.raises(CheckpointError, match="allow_missing_router_biases=true"):
        restore_state(bare, mesh)
    _, got, _ = restore_state(C.override(bare, {"allow_missing_router_biases": True}), mesh)
    assert "starting them at zero" in capsys.readouterr().err
    assert all(not np.any(x) for x in jax.tree.leaves(got["rest"]))
    for a, b in zip(jax.tree.leaves(got["params"]), jax.tree.leaves(state["params"])):
        np.testing.assert_array_equal(a, b)


def test_params_of_the_other_layer_layout_name_scan_layers(tiny, tmp_path):
    """A checkpoint saved with the other scan_layers setting misses every layer's keys; the error
    names the setting to load it with (each way); another layer count is named as such."""
    from k3jax.checkpoint import Checkpointer, load_params
    cfg, mesh, (_, state, _) = tiny
    unrolled = load("scan_layers=false")
    _, flat, _ = init_state(unrolled, mesh)
    _save(tmp_path / "scanned" / "params", state["params"])
    _save(tmp_path / "unrolled" / "params", flat["params"])
    want_flat = abstract_state(unrolled, mesh)[1]["params"]
    want_scan = abstract_state(cfg, mesh)[1]["params"]
    with pytest.raises(CheckpointError, match=r"13 layers are scanned \('periods/...'\).* scan_layers=true"):
        load_params(tmp_path / "scanned", want_flat)
    with pytest.raises(CheckpointError, match="13 layers are unrolled.*load it with scan_layers=false"):
        load_params(tmp_path / "unrolled", want_scan)
    other = abstract_state(load("num_layers=9", "mla_extra_layers=[]"), mesh)[1]["params"]
    with pytest.raises(CheckpointError, match=r"\); the checkpoint has 13 decoder layers and this model 9: check"):
        load_params(tmp_path / "unrolled", other)
    got = load_params(tmp_path / "unrolled", want_flat)     # the matching layout loads
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(flat["params"])):
        np.testing.assert_array_equal(a, b)
    # A run resumed with the other setting: the same short error, not orbax's tree dump.
    ck = Checkpointer(tmp_path / "run", async_save=False, with_data=False)
    ck.save(1, state["params"], state["opt_state"], state["rest"])
    ck.wait()
    abstract = abstract_state(unrolled, mesh, optimizer=True)[1]
    with pytest.raises(CheckpointError, match=r"cannot restore step 1: .*13 layers are scanned .* scan_layers=true"):
        ck.restore(1, abstract["params"], abstract["opt_state"], abstract["rest"])
    ck.close()


def test_load_parameters_casts_to_weight_dtype_with_one_notice(tmp_path, capsys):
    """bfloat16 weights read into a float32 model: cast, and said once with both dtypes."""
    import jax.numpy as jnp
    import orbax.checkpoint as ocp

    from k3jax.checkpoint import load_params
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(tmp_path / "conv" / "params", {"a": jnp.full((4, 4), 1.5, jnp.bfloat16),
                                               "b": jnp.full((3,), 2.0, jnp.bfloat16)})
    ckptr.wait_until_finished()
    dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = {"a": jax.ShapeDtypeStruct((4, 4), jnp.float32, sharding=dev),
              "b": jax.ShapeDtypeStruct((3,), jnp.float32, sharding=dev)}
    got = load_params(tmp_path / "conv", target)
    assert got["a"].dtype == jnp.float32 and float(got["a"][0, 0]) == 1.5 and float(got["b"][0]) == 2.0
    err = capsys.readouterr().err
    assert err.count("note:") == 1 and "holds bfloat16 parameters; cast to weight_dtype=float32" in err, err
    load_params(tmp_path / "conv", jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, jnp.bfloat16,
                                                                               sharding=dev), target))
    assert "note:" not in capsys.readouterr().err      # same dtype: nothing to say


def test_a_model_without_moe_layers_saves_and_resumes(tmp_path):
    """All-dense layers leave no router biases: the step saves without an 'extra' item (orbax
    refuses an empty one) and restores, the empty extra coming back as it went in."""
    import jax.numpy as jnp

    from k3jax.checkpoint import Checkpointer

    params, opt = {"w": jnp.arange(6.0).reshape(2, 3)}, {"m": jnp.ones(3)}
    ck = Checkpointer(tmp_path / "ck", async_save=False, with_data=False)
    assert ck.save(1, params, opt, {})
    ck.mngr.wait_until_finished()
    assert (tmp_path / "ck" / "1" / "params").is_dir() and not (tmp_path / "ck" / "1" / "extra").exists()
    p, o, extra, _ = ck.restore(1, jax.tree.map(ocp.utils.to_shape_dtype_struct, params),
                                jax.tree.map(ocp.utils.to_shape_dtype_struct, opt), {})
    assert extra == {} and np.array_equal(p["w"], params["w"]) and np.array_equal(o["m"], opt["m"])
