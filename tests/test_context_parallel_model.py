"""The tiny K3 with its sequence split over a context mesh axis (context=4 x fsdp=2 on the 8 fake CPU
devices) against the same weights on one device: logits, the per-head MLA max logits (QK-clip's
statistic) and the gradient of every parameter, with documents that start inside slices and
exactly at slice starts. The layers switch to the context-parallel kernels (layers/context.py).

Tolerances: sharding alone (fsdp=8, no context axis) already moves this randomised model's
gradients by up to 5.1e-5 relative RMS per parameter against one device (f32 reductions in another
order) and the logits by 2.3e-6; context=4 x fsdp=2 measures 3.3e-5 and 1.9e-6. A wrong state or
halo at a slice boundary moves them by 0.1 to 1. The FFNs are dense (first_k_dense=4) to keep the
compile short: the MoE layers see only per-token work, and with them (the 13-layer tiny) the
same comparison measured logits 3.7e-6 and gradients 5.4e-4 (fsdp=8 alone: 1.0e-3 on 4 layers).
"""
import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType

from helpers import randomize, rel

from k3jax import config as C
from k3jax import model as M
from k3jax import sharding as S
from k3jax.layers import context as CP
from k3jax.state import init_state

# The smallest K3 schedule with both mixers and AttnRes: three KDA layers, then one MLA layer.
SMALL = ["model_name=tiny", "num_layers=4", "mla_extra_layers=[]", "attn_res_block_size=2", "first_k_dense=4",
         "max_target_length=32"]


def _loss(m, tokens, seg, pos, cot):
    logits, aux = m(tokens, seg, pos, compute_aux=True)
    return jnp.sum(logits * cot), (logits, aux)


def _max_logits(tree) -> list:
    """Every "max_logits" entry of an aux tree (one per MLA layer), in tree order."""
    if isinstance(tree, dict):
        own = [np.asarray(tree["max_logits"])] if "max_logits" in tree else []
        return own + [x for k, v in tree.items() if k != "max_logits" for x in _max_logits(v)]
    if isinstance(tree, (list, tuple)):
        return [x for v in tree for x in _max_logits(v)]
    return []


grad_fn = nnx.jit(lambda m, *a: nnx.value_and_grad(_loss, has_aux=True)(m, *a))


@pytest.fixture(scope="module")
def models():
    """(cfg, mesh, the randomised tiny K3 on one device, the same weights on context=4 x fsdp=2)."""
    cfg = C.load(C.REPO_CONFIGS / "base.yml", SMALL + ["ici_context_parallelism=4", "ici_fsdp_parallelism=2"])
    mesh = S.make_mesh(cfg)
    single = randomize(M.build(cfg, 0), seed=1)
    gdef, st, _ = init_state(cfg, mesh, seed=0)
    sharded = nnx.merge(gdef, st["params"], st["rest"])
    nnx.update(sharded, jax.device_put(nnx.state(single), jax.tree.map(lambda x: x.sharding, nnx.state(sharded))))
    return cfg, mesh, single, sharded


def test_tiny_k3_context4_fsdp2_equals_one_device(models):
    cfg, mesh, single, sharded = models
    assert dict(mesh.shape) == {"data": 1, "fsdp": 2, "context": 4, "expert": 1, "tensor": 1}
    # Weights are split over the context axis too (not replicated context-fold).
    spec = sharded.prefix[0].self_attn.q_proj[...].sharding.spec
    assert "context" in [a for e in spec if e for a in ((e,) if isinstance(e, str) else e)], spec

    B, T = 4, 32                                      # 8 tokens per context shard
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, cfg.model.vocab_size, (B, T)))
    starts = np.zeros((B, T), bool)
    starts[0, [5, 8, 16, 19]] = True                  # inside slices and at slice starts 8, 16
    starts[1, [24]] = True
    starts[2, [8, 9, 31]] = True
    seg = jnp.asarray(np.cumsum(starts, 1).astype(np.int32) + 1)
    pos = jnp.broadcast_to(jnp.arange(T), (B, T))
    cot = jnp.asarray(rng.standard_normal((B, T, cfg.model.vocab_size)), jnp.float32)

    (_, (want, aux_w)), g_w = grad_fn(single, tokens, seg, pos, cot)
    with jax.set_mesh(mesh):
        (_, (got, aux_g)), g_g = grad_fn(sharded, tokens, seg, pos, cot)
    assert rel(got, want) < 1e-5
    m_got, m_want = _max_logits(aux_g), _max_logits(aux_w)
    assert len(m_got) == len(m_want) == 1             # the one MLA layer
    for a, b in zip(m_got, m_want):
        np.testing.assert_allclose(a, b, rtol=1e-5)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(nnx.state(g_g))[0]]
    errs = {p: rel(a, b) for p, a, b in zip(paths, jax.tree.leaves(nnx.state(g_g)), jax.tree.leaves(nnx.state(g_w)))}
    worst = sorted(errs.items(), key=lambda x: -x[1])[:3]
    assert worst[0][1] < 2e-4, worst


def test_prefill_under_context_parallelism_then_decode_equals_one_device(models):
    """A long-prompt prefill split over context=4 (the context-parallel KDA, conv and MLA kernels,
    left padding in one row) leaves the cache and last logits of the one-device prefill; decoding
    from that cache (the latent's cache_seq split over the context axis) continues identically."""
    from k3jax.inference.batch_prefill import left_pad, prefill
    cfg, mesh, single, sharded = models
    rng = np.random.default_rng(5)
    prompts = [rng.integers(1, cfg.model.vocab_size, n).tolist() for n in (32, 27)]
    toks, seg, start = (jnp.asarray(a) for a in left_pad(prompts))
    total = 40                                        # room for 8 new tokens per row
    run = nnx.jit(prefill, static_argnums=4)
    step = nnx.jit(lambda m, tok, cache, pos, start: m.decode_step(tok, cache, pos, start))

    def greedy(model, n):
        logits, cache = run(model, toks, seg, start, total)
        out = [logits]
        for i in range(n):
            logits, cache = step(model, jnp.argmax(out[-1], -1).astype(jnp.int32), cache, 32 + i, start)
            out.append(logits)
        return out, cache

    want, cache_w = greedy(single, 3)
    with jax.set_mesh(mesh):
        got, cache_g = greedy(sharded, 3)
    assert [int(x) for x in jnp.argmax(got[-1], -1)] == [int(x) for x in jnp.argmax(want[-1], -1)]
    for a, b in zip(got, want):
        assert rel(a, b) < 1e-5
    for a, b in zip(jax.tree.leaves(cache_g), jax.tree.leaves(cache_w)):
        assert rel(a, b) < 1e-5


def test_generate_pads_a_short_prompt_to_the_context_slices(models):
    """generate() under context=4 with a 3-token prompt (shorter than 4 slices of the conv halo):
    left-padded to equal slices, it yields the one-device tokens."""
    from k3jax.inference.generate import generate
    _, mesh, single, sharded = models
    want, _ = generate(single, [[5, 6, 7]], max_new_tokens=4)
    with jax.set_mesh(mesh):
        got, _ = generate(sharded, [[5, 6, 7]], max_new_tokens=4)
    assert got.tolist() == want.tolist()


def test_sequence_not_splitting_into_context_slices_is_a_config_error():
    mesh = jax.make_mesh((4, 2), ("context", "fsdp"), axis_types=(AxisType.Auto,) * 2)
    x = jnp.zeros((2, 10, 8))
    with jax.set_mesh(mesh), pytest.raises(C.ConfigError, match="10 tokens does not split into 4"):
        CP.short_conv(x, jnp.ones((8, 4)), segment_ids=jnp.ones((2, 10), jnp.int32))


def _train_losses(args, batches) -> list[float]:
    """Losses of len(batches) train steps (k3jax.step's jitted step, Muon + QK-clip) from the seed-0
    state on the mesh ``args`` describe."""
    from k3jax.step import jit_train_step
    cfg = C.load(C.REPO_CONFIGS / "base.yml", SMALL + TRAIN + args)
    mesh = S.make_mesh(cfg)
    gdef, state, tx = init_state(cfg, mesh, seed=0, optimizer=True)
    losses = []
    with jax.set_mesh(mesh):
        step = jit_train_step(cfg, gdef, tx, state)
        for b in batches:
            state, m = step(state, b)
            losses.append(float(m["loss"]))
    return losses


# Two layers (one KDA, one MLA: both context-parallel mixers, the short conv, AttnRes and the loss
# over the sharded sequence) keep the two train-step compiles at ~15 s each. Warmup off and a larger
# learning rate: every step moves the weights by O(lr), so a wrong gradient on one context shard
# shows in the next step's loss. No remat (smaller compile).
TRAIN = ["num_layers=2", "mla_extra_layers=[1]", "attn_res_block_size=1", "first_k_dense=2", "remat_policy=none",
         "warmup_steps_fraction=0", "learning_rate=0.02", "adam_eps=1e-3"]


def test_training_losses_context4_fsdp2_equal_fsdp8():
    """Three train steps on the same packed batches: context=4 x fsdp=2 against fsdp=8. Measured:
    the losses agree to 1e-7 relative while they move by 3e-3 per step."""
    rng = np.random.default_rng(3)
    B, T = 8, 32
    batches = []
    for _ in range(3):
        tokens = rng.integers(0, 256, (B, T + 1)).astype(np.int32)
        starts = rng.random((B, T)) < 0.08
        starts[:, [8, 16]] |= rng.random((B, 2)) < 0.5        # documents starting at slice starts
        starts[:, 0] = False
        mask = np.ones((B, T), np.float32)
        mask[1, 20:] = 0.0                                    # loss tokens differ per context slice
        batches.append({"tokens": tokens[:, :-1], "targets": tokens[:, 1:],
                        "segment_ids": (np.cumsum(starts, 1) + 1).astype(np.int32),
                        "positions": np.broadcast_to(np.arange(T, dtype=np.int32), (B, T)), "loss_mask": mask})
    want = _train_losses(["ici_fsdp_parallelism=8"], batches)
    got = _train_losses(["ici_context_parallelism=4", "ici_fsdp_parallelism=2"], batches)
    assert want[0] != want[-1]                                # the steps do train
    np.testing.assert_allclose(got, want, rtol=1e-5)


def _moe_rows_per_device(jaxpr) -> list[int]:
    """Rows of tokens each device's expert-parallel dispatch body receives (the first operand of
    every shard_map over the expert axis), in any sub-jaxpr."""
    rows = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "shard_map" and "expert" in str(eqn.params["in_specs"][0]):
            rows.append(eqn.params["jaxpr"].invars[0].aval.shape[0])
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            rows += _moe_rows_per_device(sub)
    return rows


def test_moe_expert_parallel_splits_tokens_over_context_slices():
    """context=2 x expert=2 x fsdp=2: the MoE layers' dispatch takes each device's own
    B*T/8 tokens (the sequence slices are token shards; before, every context shard gathered and
    routed its row's whole sequence, B*T/4 here), and the forward equals one device's."""
    cfg = C.load(C.REPO_CONFIGS / "base.yml", ["model_name=tiny", "num_layers=2", "mla_extra_layers=[1]",
                                               "attn_res_block_size=1", "first_k_dense=0", "max_target_length=32",
                                               "ici_context_parallelism=2",
                                               "ici_expert_parallelism=2", "ici_fsdp_parallelism=2"])
    mesh = S.make_mesh(cfg)
    single = randomize(M.build(cfg, 0), seed=2)
    gdef, st, _ = init_state(cfg, mesh, seed=0)
    sharded = nnx.merge(gdef, st["params"], st["rest"])
    nnx.update(sharded, jax.device_put(nnx.state(single), jax.tree.map(lambda x: x.sharding, nnx.state(sharded))))
    B, T = 4, 32
    rng = np.random.default_rng(1)
    tokens = jnp.asarray(rng.integers(0, cfg.model.vocab_size, (B, T)))
    seg = jnp.asarray(np.repeat([[1] * 12 + [2] * 20], B, 0).astype(np.int32))
    pos = jnp.broadcast_to(jnp.arange(T), (B, T))
    fwd = nnx.jit(lambda m, *a: m(*a)[0])
    want = fwd(single, tokens, seg, pos)
    with jax.set_mesh(mesh):
        got = fwd(sharded, tokens, seg, pos)
        rows = _moe_rows_per_device(jax.make_jaxpr(lambda *a: sharded(*a)[0])(tokens, seg, pos).jaxpr)
    assert rows == [B * T // 8] * 2, rows             # both layers are MoE
    assert rel(got, want) < 1e-5
