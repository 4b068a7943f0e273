"""Mesh construction on 8 fake CPU devices and logical-axis rule resolution."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from k3jax import config as C
from k3jax import sharding as S


def cfg(*args):
    return C.load(C.REPO_CONFIGS / "base.yml", list(args))


@pytest.mark.parametrize("args,shape", [
    ([], (1, 8, 1, 1, 1)),
    (["ici_expert_parallelism=2", "ici_data_parallelism=2"], (2, 2, 1, 2, 1)),
    (["ici_fsdp_parallelism=2", "ici_expert_parallelism=4"], (1, 2, 1, 4, 1)),
    (["ici_fsdp_parallelism=1", "ici_tensor_parallelism=2", "ici_data_parallelism=-1"], (4, 1, 1, 1, 2)),
    (["ici_fsdp_parallelism=2", "ici_expert_parallelism=2", "ici_data_parallelism=2"], (2, 2, 1, 2, 1)),
    (["ici_context_parallelism=4", "ici_fsdp_parallelism=2"], (1, 2, 4, 1, 1)),
])
def test_mesh_shapes(args, shape):
    mesh = S.make_mesh(cfg(*args))
    assert mesh.axis_names == S.MESH_AXES
    assert tuple(mesh.shape[a] for a in S.MESH_AXES) == shape
    assert len(set(mesh.devices.flat)) == 8


@pytest.mark.parametrize("args,fragment", [
    (["ici_fsdp_parallelism=3"], "mesh data=1 x fsdp=3"),
    (["ici_fsdp_parallelism=-1", "ici_data_parallelism=-1"], "only one"),
    (["ici_data_parallelism=3"], "does not divide the 8 devices"),
    (["ici_expert_parallelism=3"], "num_experts=8 is not divisible by expert parallelism 3"),
    (["ici_fsdp_parallelism=1", "ici_expert_parallelism=8", "ici_data_parallelism=1"],
     "num_experts=8 is not divisible" if False else None),
    (["ici_fsdp_parallelism=2", "ici_expert_parallelism=4", "num_experts=6", "num_experts_per_token=2"],
     "num_experts=6 is not divisible by expert parallelism 4"),
    (["ici_fsdp_parallelism=2", "ici_tensor_parallelism=4", "num_attention_heads=2"],
     "is not divisible by tensor parallelism 4"),
    (["dcn_data_parallelism=2"], "dcn parallelism product 2 != number of slices 1"),
    (["ici_data_parallelism=0"], "must be a positive size"),
    (["ici_context_parallelism=8", "ici_fsdp_parallelism=1", "max_target_length=12"],
     "max_target_length=12 must split into 8 context slices"),
    (["ici_context_parallelism=8", "ici_fsdp_parallelism=1", "max_target_length=16"],
     "of equal length >= 3"),
])
def test_impossible_meshes(args, fragment):
    if fragment is None:
        S.make_mesh(cfg(*args))  # 8 experts over expert=8 is fine
        return
    with pytest.raises(C.ConfigError, match=fragment.replace("(", r"\(")):
        S.make_mesh(cfg(*args))


def test_rules_resolution():
    assert S.logical_to_spec(("batch", "seq", "act_embed")) == P(("data", "fsdp", "expert"), "context", None)
    assert S.logical_to_spec(("batch", "cache_seq", None)) == P(("data", "fsdp", "expert"), "context", None)
    assert S.logical_to_spec(("embed", "mlp")) == P("fsdp", "tensor")
    assert S.logical_to_spec(("layers", "exp", "embed", "mlp")) == P(None, "expert", "fsdp", "tensor")
    # A mesh axis is used at most once per spec.
    assert S.logical_to_spec(("batch", "embed")) == P(("data", "fsdp", "expert"), None)
    with pytest.raises(KeyError, match="unknown logical axis"):
        S.logical_to_spec(("bogus",))


def test_sharding_for_replicates_indivisible_dims():
    mesh = S.make_mesh(cfg("ici_fsdp_parallelism=4", "ici_tensor_parallelism=2", "num_attention_heads=2", "kda_num_heads=2"))
    assert S.sharding_for(mesh, (64, 32), ("embed", "mlp")).spec == P("fsdp", "tensor")
    assert S.sharding_for(mesh, (6, 32), ("embed", "mlp")).spec == P(None, "tensor")
    with pytest.raises(ValueError, match="do not match shape"):
        S.sharding_for(mesh, (6,), ("embed", "mlp"))


def test_constrain_places_activations():
    mesh = S.make_mesh(cfg("ici_fsdp_parallelism=2", "ici_data_parallelism=4"))
    x = jnp.arange(8 * 4 * 2, dtype=jnp.float32).reshape(8, 4, 2)
    assert S.constrain(x, ("batch", None, None)) is x  # no mesh context: unchanged

    @jax.jit
    def f(x):
        return S.constrain(x * 2, ("batch", None, None))

    with jax.set_mesh(mesh):
        y = f(x)
    assert y.sharding.spec == P(("data", "fsdp", "expert"), None, None) or \
        y.sharding.is_equivalent_to(S.batch_sharding(mesh, 3), 3)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x) * 2)


def test_param_sharding_spreads_weights_over_fsdp_and_expert():
    """Weights are split over every parameter-sharding axis the rules leave unused (non-expert
    weights would otherwise be replicated across `expert`); experts, vectors and the stacked
    `layers` axis keep the rules' layout; indivisible dims are skipped."""
    mesh = S.make_mesh(cfg("ici_fsdp_parallelism=2", "ici_expert_parallelism=4"))
    spec = lambda shape, names: S.param_sharding(mesh, shape, names).spec  # noqa: E731
    assert spec((64, 32), ("embed", "mlp")) == P(("fsdp", "expert"), "tensor")
    assert spec((8, 64, 32), ("exp", "embed", "mlp")) == P("expert", "fsdp", "tensor")
    assert spec((3, 64, 32), ("layers", "embed", "heads")) == P(None, ("fsdp", "expert"), "tensor")
    assert spec((16, 96), ("rank", "heads")) == P(("fsdp", "expert"), "tensor")
    assert spec((320, 64), ("vocab", "embed")) == P("tensor", ("fsdp", "expert"))
    assert spec((64,), ("norm",)) == P(None)
    # fsdp divides 6 on embed but expert does not: expert moves to the next dim it divides.
    assert spec((6, 32), ("embed", "mlp")) == P("fsdp", ("tensor", "expert"))
    assert spec((6, 3), ("embed", "mlp")) == P("fsdp", "tensor")      # expert divides nothing


def test_k3_parameters_are_split_over_every_device_of_a_pod_mesh():
    """The full 2.78T K3 tree on a v5p-2048 mesh (fsdp=16 x expert=64, no devices needed): the
    per-device share is within 1% of total / 1024, i.e. no matrix is replicated across an axis
    (only vectors are, a few MB). Before param_sharding, non-expert weights were split 16-way."""
    from flax import nnx
    from jax.sharding import AbstractMesh, AxisType
    from k3jax.state import abstract_state
    k3 = C.load(C.REPO_CONFIGS / "base.yml", ["model_name=kimi-k3"])
    mesh = AbstractMesh((1, 16, 1, 64, 1), S.MESH_AXES, axis_types=(AxisType.Auto,) * 5)
    _, state, _ = abstract_state(k3)
    total = per_device = 0
    for v in jax.tree.leaves(state["params"], is_leaf=lambda x: isinstance(x, nnx.Variable)):
        spec = S.param_sharding(mesh, v.shape, v.axes).spec
        shards = math.prod(mesh.shape[a] for e in spec if e for a in ((e,) if isinstance(e, str) else e))
        n = math.prod(v.shape)
        total += n
        per_device += n / shards
        if len(v.shape) - list(v.axes).count("layers") >= 2:
            assert shards == 1024, (v.axes, v.shape, spec)
    assert total == pytest.approx(2.78e12, rel=2e-3)
    assert per_device <= 1.01 * total / 1024, per_device / (total / 1024)
