"""loss_impl=tokamax (tokamax's fused lm head + CE) against ours (loss_impl=chunked): the masked
loss sum and the gradients of the hidden states and the lm head, alone and under an fsdp x tensor
mesh of the 8 CPU devices, and two train steps of the tiny model with either loss (and with
loss_impl=vocab_parallel, whose own tests are test_loss_vocab_parallel.py)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from k3jax import config as C
from k3jax.loss import chunked_cross_entropy, tokamax_cross_entropy

B, T, D, V = 4, 12, 32, 2048


def _problem(seed=0, t_len=T):
    k1, k2, k3, k4 = jax.random.split(jax.random.key(seed), 4)
    h = jax.random.normal(k1, (B, t_len, D))
    w = jax.random.normal(k2, (D, V)) / np.sqrt(D)
    t = jax.random.randint(k3, (B, t_len), 0, V)
    mask = (jax.random.uniform(k4, (B, t_len)) > 0.3).astype(jnp.float32)
    mask = mask.at[1, 3].set(0.5)   # a fractional loss weight, not only a 0/1 mask
    t = t.at[0, 0].set(-1)
    mask = mask.at[0, 0].set(0.0)   # a masked position with an out-of-vocabulary target
    return h, w, t, mask


def _loss_and_grads(impl, h, w, t, mask):
    def f(h, w):
        if impl == "chunked":
            s, n, _ = chunked_cross_entropy(h, w, t, mask, chunk=5)
        else:
            s, n, _ = tokamax_cross_entropy(h, w, t, mask, implementation="chunked_xla",
                                            row_axes=("data", "fsdp", "expert", "context", "tensor"))
        return s / n
    return jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(h, w)


def _check(got, want):
    (l1, (dh1, dw1)), (l2, (dh2, dw2)) = got, want
    np.testing.assert_allclose(l1, l2, rtol=1e-6)
    np.testing.assert_allclose(dh1, dh2, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(dw1, dw2, rtol=1e-5, atol=1e-7)
    assert np.any(np.asarray(dh2) != 0) and np.all(np.asarray(dh1)[0, 0] == 0)   # masked row: no gradient


def test_tokamax_loss_and_grads_equal_chunked():
    h, w, t, mask = _problem()
    _check(_loss_and_grads("tokamax", h, w, t, mask), _loss_and_grads("chunked", h, w, t, mask))


@pytest.mark.parametrize("shape,t_len", [((1, 4, 1, 1, 2), T), ((2, 2, 1, 1, 2), T), ((1, 4, 1, 1, 2), 3)],
                         ids=["fsdp4xtp2", "data2xfsdp2xtp2", "fsdp4xtp2-12-rows"])
def test_tokamax_loss_under_a_mesh_equals_chunked(shape, t_len):
    """Rows sharded over the batch axes, the lm head over fsdp (embed) and tensor (vocab) as the
    model shards it: the same loss and gradients as ours. 48 rows split over fsdp and tensor; 12
    rows split over fsdp only, the tensor replicas counted once."""
    from k3jax.sharding import BATCH_AXES, MESH_AXES, logical_to_spec
    mesh = jax.make_mesh(shape, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 5)
    h, w, t, mask = _problem(1, t_len)
    want = _loss_and_grads("chunked", h, w, t, mask)
    with jax.set_mesh(mesh):
        rows = NamedSharding(mesh, P(BATCH_AXES))
        h_s = jax.device_put(h, NamedSharding(mesh, P(BATCH_AXES, None, None)))
        w_s = jax.device_put(w, NamedSharding(mesh, logical_to_spec(("embed", "vocab"))))
        got = _loss_and_grads("tokamax", h_s, w_s, jax.device_put(t, rows), jax.device_put(mask, rows))
        hlo = jax.jit(lambda h, w: _loss_and_grads("tokamax", h, w, t, mask)).lower(h_s, w_s).as_text()
    _check(got, want)
    assert "manual" in hlo   # the op ran per device inside shard_map


def test_tokamax_xla_path_refuses_a_vocabulary_it_gets_wrong():
    h, w, t, mask = _problem()
    with pytest.raises(ValueError, match="multiple of 2048"):
        tokamax_cross_entropy(h, w[:, :384], t % 384, mask, implementation="chunked_xla")


@pytest.mark.parametrize("impl,devices,mesh_args", [
    ("tokamax", 1, []),
    ("vocab_parallel", 8, ["ici_fsdp_parallelism=4", "ici_tensor_parallelism=2"]),   # vocabulary over tensor x fsdp
])
def test_train_step_with_another_loss_equals_chunked(impl, devices, mesh_args):
    """Two train steps of a one-layer model: the same losses and gradient norm with either loss_impl;
    the tokamax step logs no accuracy, vocab_parallel the same as ours. (One layer keeps the two
    step compiles small; tokamax's sharded loss is the mesh test above, vocab_parallel's are in
    test_loss_vocab_parallel.py: here it runs on fsdp=4 x tensor=2 with the head split 8 ways.)"""
    from k3jax import sharding as S
    from k3jax.state import init_state
    from k3jax.step import make_train_step
    # one MLA layer with a dense FFN, plain residuals, AdamW: the smallest step that compiles fast
    args = ["model_name=tiny", "vocab_size=2048", "num_layers=1", "mla_every=1", "first_k_dense=1", "mla_extra_layers=[]",
            "attn_res=false", "attn_res_block_size=1", "opt_type=adamw", "use_qk_clip=false", "remat_policy=none",
            "lr_schedule=constant", "warmup_steps_fraction=0",   # the second step sees updated weights
            "z_loss_weight=0" if impl == "tokamax" else "z_loss_weight=1e-3", *mesh_args]
    ours, theirs = (C.load(C.REPO_CONFIGS / "base.yml", [*args, f"loss_impl={i}"]) for i in ("chunked", impl))
    mesh = S.make_mesh(ours, jax.devices()[:devices])
    gdef, state, tx = init_state(ours, mesh, optimizer=True)
    rng = np.random.default_rng(0)
    b, t = 4, 16
    tokens = rng.integers(0, 2048, (b, t + 1)).astype(np.int32)
    mask = np.ones((b, t), np.float32)
    mask[0, 5:] = 0.0
    batch = {"tokens": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": np.ones((b, t), np.int32),
             "positions": np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)), "loss_mask": mask}
    with jax.set_mesh(mesh):
        batch = jax.device_put(batch, S.batch_sharding(mesh))
        runs = []
        for cfg in (ours, theirs):
            step, s, metrics = jax.jit(make_train_step(cfg, gdef, tx)), state, []
            for _ in range(2):
                s, m = step(s, batch)
                metrics.append(jax.device_get(m))
            runs.append(metrics)
    for m1, m2 in zip(*runs):
        assert float(m1["loss_tokens"]) == float(m2["loss_tokens"]) == 53.0
        np.testing.assert_allclose(float(m2["loss"]), float(m1["loss"]), rtol=1e-6)
        np.testing.assert_allclose(float(m2["grad_norm"]), float(m1["grad_norm"]), rtol=1e-5)
        assert ("accuracy" in m2) == (impl != "tokamax")
        if impl != "tokamax":
            assert float(m2["accuracy"]) == float(m1["accuracy"])
    assert float(runs[0][1]["loss"]) != float(runs[0][0]["loss"])   # the second step saw updated weights


def test_tokamax_loss_config_errors():
    with pytest.raises(C.ConfigError, match="z_loss_weight"):
        C.load(C.REPO_CONFIGS / "base.yml", ["loss_impl=tokamax", "z_loss_weight=1e-4"])
    cfg = C.load(C.REPO_CONFIGS / "base.yml", ["loss_impl=tokamax", "vocab_size=1000"])
    with pytest.raises(C.ConfigError, match="multiple of 2048"):
        C.validate(cfg, platform="cpu")
    C.validate(cfg, platform="tpu")   # the Mosaic kernel masks the vocabulary tail


_AOT_SCRIPT = """
import json, time
import jax, jax.numpy as jnp
import numpy as np
from jax.experimental import topologies
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from k3jax.loss import tokamax_context, tokamax_cross_entropy
from k3jax.sharding import BATCH_AXES, MESH_AXES, logical_to_spec
topo = topologies.get_topology_desc(topology_name="v5p:2x2x1", platform="tpu")
mesh = Mesh(np.asarray(topo.devices).reshape(1, 2, 1, 1, 2), MESH_AXES)   # fsdp=2 x tensor=2
b, t, d, v = 4, 128, 256, 2048
rows = NamedSharding(mesh, P(BATCH_AXES))
args = (jax.ShapeDtypeStruct((b, t, d), jnp.bfloat16, sharding=NamedSharding(mesh, P(BATCH_AXES, None, None))),
        jax.ShapeDtypeStruct((d, v), jnp.float32, sharding=NamedSharding(mesh, logical_to_spec(("embed", "vocab")))),
        jax.ShapeDtypeStruct((b, t), jnp.int32, sharding=rows), jax.ShapeDtypeStruct((b, t), jnp.float32, sharding=rows))
def loss(h, w, tg, m):
    s, n, _ = tokamax_cross_entropy(h, w, tg, m, implementation="mosaic_tpu",
                                    row_axes=("data", "fsdp", "expert", "context", "tensor"))
    return s / n
t0 = time.time()
with jax.set_mesh(mesh), tokamax_context("mosaic_tpu"):
    lowered = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).trace(*args).lower()
compiled = lowered.compile()
print(json.dumps({"mosaic_calls": lowered.as_text().count("tpu_custom_call"), "seconds": time.time() - t0,
                  "temp": compiled.memory_analysis().temp_size_in_bytes}))
"""


def test_tokamax_loss_compiles_for_tpu():
    """loss_impl=tokamax AOT-compiled for v5p:2x2x1 from this host (fsdp=2 x tensor=2, forward and
    backward): the Mosaic kernels are in the program, inside the per-device map."""
    from tpu_aot import run_aot_script
    proc, rows = run_aot_script(_AOT_SCRIPT, timeout=300)
    assert proc.returncode == 0 and rows, proc.stderr[-3000:]
    assert rows[0]["mosaic_calls"] >= 2, rows   # forward and backward kernels
