"""loss_impl=vocab_parallel (the lm head's vocabulary split over mesh axes under shard_map) against
ours (loss_impl=chunked): loss sum, mask sum, correct argmax count and the gradients of the hidden
states and the lm head, on meshes of the 8 CPU devices; the choice of the vocabulary group; the
errors. The train step with it is in test_loss_tokamax.py (one test for both loss_impls)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from k3jax import config as C
from k3jax.loss import choose_vocab_axes, chunked_cross_entropy, vocab_parallel_cross_entropy
from k3jax.sharding import BATCH_AXES, CONTEXT_AXIS, MESH_AXES, VOCAB_PARALLEL_AXES, param_sharding

B, T, D, V = 4, 12, 32, 256
Z = 1e-2   # z-loss on


def _problem(b=B):
    """Random h and targets with a masked out-of-vocabulary target and a fractional weight; the
    head's two vocabulary halves are equal, so every argmax ties across the devices' slices (the
    first index must win, as in jnp.argmax), and a third of the targets are that first index (they
    count as correct) and some the tied copy in the second half (they do not)."""
    k1, k2, k3, k4 = jax.random.split(jax.random.key(0), 4)
    h = jax.random.normal(k1, (b, T, D))
    half = jax.random.normal(k2, (D, V // 2)) / np.sqrt(D)
    w = jnp.concatenate([half, half], axis=1)
    first = jnp.argmax(jnp.einsum("btd,dv->btv", h, w), -1)
    pick = jax.random.randint(k3, (b, T), 0, 3)
    t = jnp.where(pick == 0, first, jnp.where(pick == 1, first + V // 2, jax.random.randint(k4, (b, T), 0, V)))
    mask = (jax.random.uniform(k4, (b, T)) > 0.3).astype(jnp.float32)
    mask = mask.at[1, 3].set(0.5)
    t = t.at[0, 0].set(-1)
    mask = mask.at[0, 0].set(0.0)
    return h, w, t, mask


def _grad(fn):
    """jitted (h, w, targets, mask) -> ((mean loss, (loss sum, mask sum, correct)), (dh, dw))."""
    def f(h, w, t, mask):
        s, n, c = fn(h, w, t, mask)
        return s / n, (s, n, c)
    return jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))


_CHUNKED = _grad(lambda *a: chunked_cross_entropy(*a, chunk=5, z_loss_weight=Z))


@pytest.mark.parametrize("shape,axes,b", [
    ((1, 2, 2, 2, 1), ("fsdp", "expert", "context"), B),   # every device a vocabulary slice, tokens gathered over all
    ((1, 2, 2, 2, 1), ("fsdp",), B),                       # 4 groups of 2: w split along D over expert x context
    ((1, 4, 1, 1, 2), ("tensor", "fsdp"), B),              # tensor holds replicas of the rows: nothing to gather
    ((1, 4, 1, 1, 2), ("fsdp",), 3),                       # 3 rows, which fsdp=4 does not split: replicated
], ids=["fsdp2xep2xcp2-all", "fsdp2xep2xcp2-fsdp", "fsdp4xtp2", "fsdp4xtp2-3-rows"])
def test_vocab_parallel_equals_chunked(shape, axes, b):
    h, w, t, mask = _problem(b)
    want = _CHUNKED(h, w, t, mask)
    mesh = jax.make_mesh(shape, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 5)
    with jax.set_mesh(mesh):
        rows = NamedSharding(mesh, P(BATCH_AXES if b % 4 == 0 else None, CONTEXT_AXIS))
        args = (jax.device_put(h, NamedSharding(mesh, P(*rows.spec, None))),
                jax.device_put(w, param_sharding(mesh, (D, V), ("embed", "vocab"))))

        def fn(*a):
            return vocab_parallel_cross_entropy(*a, chunk=5, z_loss_weight=Z, vocab_axes=axes,
                                                batch_axes=BATCH_AXES, seq_axis=CONTEXT_AXIS)
        args += (jax.device_put(t, rows), jax.device_put(mask, rows))
        compiled = _grad(fn).lower(*args).compile()
        got = compiled(*args)
    hlo = compiled.as_text()
    (_, (s1, n1, c1)), (dh1, dw1) = got
    (_, (s2, n2, c2)), (dh2, dw2) = want
    np.testing.assert_allclose(s1, s2, rtol=1e-5)
    assert float(n1) == float(n2) and float(c1) == float(c2) > 0
    np.testing.assert_allclose(dh1, dh2, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(dw1, dw2, rtol=1e-5, atol=1e-7)
    assert np.all(np.asarray(dh1)[0, 0] == 0)   # masked position: no gradient
    assert f"f32[{D},{V}]" not in hlo           # no device holds the whole head or its gradient


def test_vocab_parallel_without_a_mesh_is_the_chunked_loss():
    h, w, t, mask = _problem()
    got = _grad(lambda *a: vocab_parallel_cross_entropy(*a, chunk=5, z_loss_weight=Z, vocab_axes=()))(h, w, t, mask)
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(_CHUNKED(h, w, t, mask))):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7)


def test_choose_vocab_axes():
    def mesh(fsdp=1, expert=1, context=1, tensor=1):
        return jax.sharding.AbstractMesh((1, fsdp, context, expert, tensor), MESH_AXES)

    def choose(m, b, t, v):
        return choose_vocab_axes(m, b, t, v, batch_axes=BATCH_AXES, seq_axis=CONTEXT_AXIS,
                                 candidates=VOCAB_PARALLEL_AXES)
    # K3 on v5p-2048, one row of 4096 per device: fsdp alone (8 x 4096 tokens gathered, a 1/8
    # slice), not fsdp x expert (4M tokens gathered for a 1/1024 slice)
    assert choose(mesh(fsdp=8, expert=128), 1024, 4096, 163840) == ("fsdp",)
    # few tokens per device: every axis
    assert choose(mesh(fsdp=2, expert=2, context=2), 4, 12, 256) == ("fsdp", "expert", "context")
    # tensor holds replicas of the rows, so it is always taken while it divides V
    assert choose(mesh(fsdp=8, expert=128, tensor=2), 1024, 4096, 163840) == ("tensor", "fsdp")
    assert choose(mesh(fsdp=8, expert=128, tensor=3), 1024, 4096, 163840) == ("fsdp",)
    # never empty while an axis divides V, even when gathering costs more than the head saves
    assert choose(mesh(fsdp=2), 64, 4096, 1024) == ("fsdp",)
    assert choose(mesh(fsdp=3), 3, 16, 1024) == ()
    assert choose(mesh(), 4, 16, 1024) == ()


def test_vocab_parallel_errors():
    h, w, t, mask = _problem()
    mesh = jax.make_mesh((1, 2, 2, 2, 1), MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 5)
    with jax.set_mesh(mesh), pytest.raises(ValueError, match="do not divide the vocabulary"):
        vocab_parallel_cross_entropy(h, w[:, :255], t % 255, mask, vocab_axes=("fsdp",))
    with jax.set_mesh(mesh), pytest.raises(ValueError, match="not .* axes of the mesh"):
        vocab_parallel_cross_entropy(h, w, t, mask, vocab_axes=("model",))
    base = C.REPO_CONFIGS / "base.yml"
    with pytest.raises(C.ConfigError, match="loss_impl=.nope.: must be one of auto, chunked, chunked_fused, tokamax, vocab_parallel"):
        C.load(base, ["loss_impl=nope"])
    with pytest.raises(C.ConfigError, match="loss_chunk_size=0"):
        C.load(base, ["loss_chunk_size=0"])
    cfg = C.load(base, ["model_name=tiny", "loss_impl=vocab_parallel", "vocab_size=1001", "z_loss_weight=1e-4"])
    with pytest.raises(C.ConfigError, match="none of them .* divides vocab_size=1001"):
        C.validate(cfg, num_devices=8)
    C.validate(cfg, num_devices=1)          # one device: nothing to split, the loss runs as chunked
    C.validate(C.override(cfg, {"vocab_size": 1000}), num_devices=8)
