"""The model end to end: independent float64 reference, decode consistency, packing, sharding,
abstract parameter counts."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import k3_numpy_ref as ref
from helpers import randomize
from k3jax import config as C
from k3jax import counts
from k3jax import model as M
from k3jax import sharding as S
from k3jax.state import abstract_state, init_state

# A Kimi-Linear-shaped tiny config: every switch flipped relative to the tiny K3.
KIMI_LINEAR_TINY = ["model_name=tiny", "attn_res=false", "kda_gate=softplus", "kda_output_gate=low_rank",
                    "kda_output_gate_rank=8", "ffn_activation=swiglu", "moe_latent_size=null",
                    "moe_latent_norm=false", "q_lora_rank=null", "mla_use_output_gate=false",
                    "routed_scaling_factor=2.446", "router_weights_from_biased=true"]


def cfg_of(*args):
    return C.load(C.REPO_CONFIGS / "base.yml", list(args))


@pytest.fixture(scope="module", params=["k3", "kimi_linear"])
def tiny(request):
    args = ["model_name=tiny"] if request.param == "k3" else KIMI_LINEAR_TINY
    cfg = cfg_of(*args)
    model = randomize(M.build(cfg, 0))
    return request.param, cfg, model


# Jitted entry points: one compile per shape instead of thousands of eager op dispatches.
forward = nnx.jit(lambda m, t, s=None: m(t, s)[0])
step = nnx.jit(lambda m, tok, cache, pos, start: m.decode_step(tok, cache, pos, start))


def rel(a, b):
    return float(np.sqrt(np.mean((np.asarray(a, np.float64) - b) ** 2)) / np.sqrt(np.mean(np.asarray(b) ** 2)))


def test_matches_float64_reference(tiny):
    name, cfg, model = tiny
    tokens = np.random.default_rng(1).integers(0, cfg.model.vocab_size, 24)
    logits = forward(model, jnp.asarray(tokens)[None])
    want = ref.forward(cfg.model, model, tokens)
    assert rel(logits[0], want) <= 1e-5, name


def test_packed_documents_equal_separate_runs(tiny):
    _, cfg, model = tiny
    rng = np.random.default_rng(2)
    a, b = rng.integers(0, cfg.model.vocab_size, 11), rng.integers(0, cfg.model.vocab_size, 13)
    seg = np.array([1] * 11 + [2] * 13)
    packed = forward(model, jnp.asarray(np.concatenate([a, b]))[None], jnp.asarray(seg)[None])
    # Each alone in a row of the packed row's shape, padded after it (segment 0): the packed row's
    # program, no second compile.
    alone_a = forward(model, jnp.asarray(np.concatenate([a, b]))[None], jnp.asarray([[1] * 11 + [0] * 13]))[:, :11]
    alone_b = forward(model, jnp.asarray(np.concatenate([b, a]))[None], jnp.asarray([[1] * 13 + [0] * 11]))[:, :13]
    # f32 noise only: the second document sits at another offset inside its KDA chunks. Measured
    # on two hosts' CPUs: relative RMS <= 2.3e-6, max |diff| 4.8e-5 at logits up to 6.0 (an
    # elementwise 2e-5 failed on one of them). A wrong reset or mask moves logits by 0.1 to 1.
    for got, want in ((packed[0, :11], alone_a[0]), (packed[0, 11:], alone_b[0])):
        assert rel(got, want) <= 1e-5
        assert float(np.abs(got - want).max()) <= 1e-4 * float(np.abs(want).max())


def test_packed_documents_match_float64_reference(tiny):
    """Three documents in one row with resets inside KDA chunks (64 tokens): the tiny K3's bounded
    gate runs the bounded relation form of the chunked core, Kimi Linear's softplus gate the
    general one; both must match the float64 reference of the packed row (docs/kernels.md: 3.5e-6
    for either form at C=64; a wrong reset or mask is off by 1e-2 or more)."""
    name, cfg, model = tiny
    rng = np.random.default_rng(4)
    lens = (21, 70, 29)                                   # resets at tokens 21 and 91
    tokens = rng.integers(0, cfg.model.vocab_size, sum(lens))
    seg = np.repeat(np.arange(1, len(lens) + 1), lens)
    logits = forward(model, jnp.asarray(tokens)[None], jnp.asarray(seg)[None])
    want = ref.forward(cfg.model, model, tokens, seg)
    assert rel(logits[0], want) <= 1e-5, name


def test_prefill_then_decode_equals_full_forward(tiny):
    from k3jax.inference.batch_prefill import left_pad, prefill
    _, cfg, model = tiny
    rng = np.random.default_rng(3)
    n, m = 9, 6
    seq = rng.integers(0, cfg.model.vocab_size, (2, n + m))
    full = forward(model, jnp.asarray(seq))
    toks, seg, start = left_pad([list(r[:n]) for r in seq])
    logits, cache = nnx.jit(prefill, static_argnums=4)(model, jnp.asarray(toks), jnp.asarray(seg),
                                                       jnp.asarray(start), n + m)
    got = [logits]
    for i in range(m - 1):
        logits, cache = step(model, jnp.asarray(seq[:, n + i]), cache, n + i, jnp.asarray(start))
        got.append(logits)
    got = jnp.stack(got, 1)
    np.testing.assert_allclose(got, full[:, n - 1:n + m - 1], rtol=1e-4, atol=1e-4)


# generate()'s own logic (compile reuse, left padding, batching) is the same for both variants: its
# tests run on the tiny K3 only (Kimi Linear's decode step: test_prefill_then_decode_equals_full_forward).
K3_ONLY = pytest.mark.parametrize("tiny", ["k3"], indirect=True)


@K3_ONLY
def test_greedy_generate_equals_argmax_of_full_forwards(tiny):
    from k3jax.inference.generate import generate
    _, cfg, model = tiny
    rng = np.random.default_rng(4)

    def greedy_by_forwards(prompt):
        seq = list(prompt) + [0] * 5
        for i in range(5):  # fixed length: causal logits at position 6 + i ignore the zero padding
            logits = forward(model, jnp.asarray(seq)[None])
            seq[7 + i] = int(jnp.argmax(logits[0, 6 + i]))
        return seq[7:]

    for call in range(2):
        # The second call has the same shapes: it reuses the first call's compiled programs on a
        # new prompt, and must still be right.
        prompt = list(rng.integers(0, cfg.model.vocab_size, 7))
        out, timing = generate(model, [prompt], max_new_tokens=5)
        assert (timing["compile_s"] == 0) == (call == 1), timing
        assert out[0].tolist() == greedy_by_forwards(prompt)
    assert generate(model, [prompt], max_new_tokens=4)[1]["compile_s"] > 0    # another program


@K3_ONLY
def test_mixed_length_batch_equals_each_alone(tiny):
    from k3jax.inference.generate import generate
    _, cfg, model = tiny
    rng = np.random.default_rng(5)
    p1, p2 = list(rng.integers(0, cfg.model.vocab_size, 3)), list(rng.integers(0, cfg.model.vocab_size, 10))
    both, _ = generate(model, [p1, p2], max_new_tokens=4)
    a, _ = generate(model, [p1], max_new_tokens=4)
    b, _ = generate(model, [p2], max_new_tokens=4)
    assert both[0].tolist() == a[0].tolist() and both[1].tolist() == b[1 - 1].tolist()


def test_sharded_forward_equals_single_device():
    cfg = cfg_of("model_name=tiny", "ici_fsdp_parallelism=2", "ici_expert_parallelism=2", "ici_data_parallelism=2")
    mesh = S.make_mesh(cfg)
    gdef, st, _ = init_state(cfg, mesh, seed=0)
    sharded = nnx.merge(gdef, st["params"], st["rest"])
    single = M.build(cfg, 0)
    nnx.update(single, jax.device_get(nnx.state(sharded)))  # same values, one device
    tokens = jnp.asarray(np.random.default_rng(6).integers(0, cfg.model.vocab_size, (8, 16)))
    want = forward(single, tokens)        # jitted: one program, not every op compiled eagerly
    with jax.set_mesh(mesh):
        got, _ = jax.jit(lambda m, t: m(t))(sharded, tokens)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # Parameters really are distributed: an expert weight is split over the expert axis.
    w = sharded.periods.layers[0].mlp.w_gate[...]
    assert w.sharding.spec[1] == "expert"


def test_scan_and_unrolled_agree():
    cfg = cfg_of("model_name=tiny")
    unrolled_cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, scan_layers=False))
    a = M.build(cfg, 0)
    assert a.layout.num_periods == 2 and a.layout.tail == (12,)
    b = M.build(unrolled_cfg, 0)
    assert b.layout.num_periods == 0
    # 24 tokens: the scanned model's program is test_matches_float64_reference[k3]'s
    tokens = jnp.asarray(np.random.default_rng(7).integers(0, cfg.model.vocab_size, (1, 24)))
    for m in (a, b):
        np.testing.assert_allclose(forward(m, tokens)[0], ref.forward(cfg.model, m, np.asarray(tokens[0])),
                                   rtol=1e-4, atol=1e-5)
    assert len(b.prefix) == 13


@pytest.mark.parametrize("name", ["tiny", "kimi-linear-48b", "kimi-k3"])
def test_abstract_counts_match_config(name):
    cfg = cfg_of(f"model_name={name}")
    _, state, _ = abstract_state(cfg)
    total = sum(int(np.prod(v.shape)) for v in jax.tree.leaves(state))
    assert total == counts.param_counts(cfg.model)[0]
    if name == "kimi-k3":
        assert abs(total / 2.78e12 - 1) < 0.005


def test_k3_decode_cache_at_1m_tokens_matches_cache_spec():
    """counts.decode_cache_bytes against the shards model.cache_spec's leaves get on a context=16
    mesh (cache_seq -> context), for one 1M-token sequence of the full K3 (abstract, nothing
    allocated): the docs' cache table comes from this function."""
    from jax.sharding import AbstractMesh, AxisType
    k3 = cfg_of("model_name=kimi-k3")
    gdef, state, _ = abstract_state(k3)
    spec = nnx.merge(gdef, state["params"], state["rest"]).cache_spec(1, 2 ** 20)
    for cp in (1, 16):
        mesh = AbstractMesh((1, 1, cp, 1, 1), S.MESH_AXES, axis_types=(AxisType.Auto,) * 5)
        got = 0
        for shape, dtype, axes in jax.tree.leaves(spec, is_leaf=lambda x: isinstance(x, tuple) and len(x) == 3
                                                   and isinstance(x[0], tuple)):
            local = S.sharding_for(mesh, shape, axes).shard_shape(shape)
            got += int(np.prod(local)) * jnp.dtype(dtype).itemsize
        want = counts.decode_cache_bytes(k3.model, 2 ** 20, context=cp)
        assert got == want["total"], (cp, got, want)
    # 24 MLA layers x 2^20 tokens x (512 + 64) f32 values = 54 GiB on one chip, 3.4 GiB per shard of 16;
    # 69 KDA layers x 96 heads x 128 x 128 f32 states (+ conv tails) = 0.42 GiB per sequence, unsplit.
    assert want["mla_latent"] == 24 * 2 ** 16 * 576 * 4
    assert want["kda_state"] == 69 * 96 * 128 * 128 * 4


def test_attn_res_segment_scan_equals_flat_scan():
    """The block-by-block scan of the periods (attn_res_segment_scan) computes what one flat scan
    does, hidden states and every gradient: 12 layers in periods of 2 (KDA, MLA) and blocks of 4 cut
    the 5 scanned periods into the runs [0] (no block start) and [1,2],[3,4] (one outer scan of two
    segments of two periods), remat on."""
    cfg = cfg_of("model_name=tiny", "num_layers=12", "mla_every=2", "mla_extra_layers=[]", "attn_res_block_size=4",
                 "kda_impl=reference")
    seg_cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, attn_res_segment_scan=True))
    flat_cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, attn_res_segment_scan=False))
    seg, flat = randomize(M.build(seg_cfg, 0)), randomize(M.build(flat_cfg, 0))
    n = flat.layout.num_periods
    assert seg._segment_runs(np.array([[flat._block_start(l) for l in flat.layout.period_layers(i)]
                                       for i in range(n)])) == [(0, 1, 1, False), (1, 2, 2, True)]
    rng = np.random.default_rng(3)
    tokens = jnp.asarray(rng.integers(0, cfg.model.vocab_size, (2, 12)))
    segments = jnp.asarray(np.repeat([[1] * 7 + [2] * 5], 2, 0))

    def loss(m):
        h, _, _ = m.hidden(tokens, segments, remat="full")
        return jnp.mean(h * jnp.cos(jnp.arange(h.shape[-1]))), h

    (ls, hs), gs = nnx.jit(nnx.value_and_grad(loss, has_aux=True))(seg)
    (lf, hf), gf = nnx.jit(nnx.value_and_grad(loss, has_aux=True))(flat)
    np.testing.assert_array_equal(np.asarray(hs), np.asarray(hf))
    for (path, a), (_, b) in zip(jax.tree_util.tree_leaves_with_path(nnx.state(gs)),
                                 jax.tree_util.tree_leaves_with_path(nnx.state(gf))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7,
                                   err_msg=jax.tree_util.keystr(path))
