"""MXFP4 experts kept packed: the decode math against the converter's codec, the Pallas grouped
matmul (interpret mode) against the XLA reference, the model with packed experts against the
dense model holding the same decoded weights, expert-parallel decode against one device, the
config errors, and the kernel's TPU compile (v5p, ahead of time)."""
import textwrap
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conversion import quant
from helpers import randomize
from k3jax import config as C
from k3jax import model as M
from k3jax.inference.generate import generate
from k3jax.kernels.moe.mxfp4_gmm import mxfp4_grouped_matmul, tile_layout
from k3jax.kernels.moe.quantized import MXFP4, bits_per_weight, dequantize, from_checkpoint_layout
from k3jax.layers.common import REST, Packed
from k3jax.sharding import make_mesh
from k3jax.state import abstract_state, shardings
from k3jax.step import check_trainable
from tpu_aot import run_aot_script

# The tiny K3 with expert input widths that are multiples of 32 (one E8M0 scale per 32 inputs),
# cut to 4 layers (dense KDA, two MoE KDA, one MoE MLA; an AttnRes block start inside) so that the
# model compiles fast.
TINY = ["model_name=tiny", "moe_latent_size=32", "moe_intermediate_size=32", "weight_dtype=float32",
        "num_layers=4", "mla_extra_layers=[]", "attn_res_block_size=2"]


def rel_rms(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.sqrt(np.mean((a - b) ** 2) / np.mean(b ** 2)))


def _codec(w_kn: np.ndarray):
    """Dense [..., K, N] -> (MXFP4 made by the converter's codec, its numpy decode [..., K, N])."""
    packed, scale = quant.quant_mxfp4(np.swapaxes(w_kn, -1, -2))
    dense = np.swapaxes(quant.dequant_mxfp4(packed, scale), -1, -2)
    return from_checkpoint_layout(jnp.asarray(packed), jnp.asarray(scale)), dense


def test_dequantize_equals_the_codec_for_every_code_and_scale():
    codes = np.arange(256, dtype=np.uint8).reshape(1, 16, 16).repeat(2, 1)       # every byte
    scales = np.array([[0, 1, 100, 127], [128, 140, 200, 250]], np.uint8)[None].repeat(1, 0)
    scales = np.concatenate([scales] * 4, -1)                                      # [1, 2, 16]
    ours = np.asarray(dequantize(MXFP4(jnp.asarray(codes), jnp.asarray(scales))))
    t = lambda a: np.ascontiguousarray(np.swapaxes(a, -1, -2))  # noqa: E731 - to the [out, in] layout
    ref = np.swapaxes(quant.dequant_mxfp4(t(codes), t(scales), dtype=np.float64), -1, -2)
    # XLA (CPU and TPU) flushes float32 subnormals to zero, and at the edge of the normal range
    # (scale bytes 0 and 1, |w| <= 2^-124) XLA:CPU also flushed 2^-126: exact elsewhere.
    sub = np.abs(ref) < 2.0 ** -120
    np.testing.assert_array_equal(ours[~sub], ref[~sub].astype(np.float32))
    assert np.all((ours[sub] == 0) | (ours[sub] == ref[sub])) and np.count_nonzero(~sub) > 0.6 * sub.size
    bf = np.asarray(dequantize(MXFP4(jnp.asarray(codes), jnp.asarray(scales)), jnp.bfloat16), np.float64)
    np.testing.assert_array_equal(bf[~sub], ref[~sub])
    assert bits_per_weight(MXFP4(jnp.asarray(codes), jnp.asarray(scales))) == 4.25


def test_tile_layout_gives_each_tile_one_group():
    sizes = jnp.array([3, 0, 9, 1, 0], jnp.int32)
    dest, tgroup, live, n_tiles = tile_layout(sizes, 16, 4)   # 13 live rows, 3 past the end
    assert n_tiles == (16 + 5 * 3 + 3) // 4
    dest, tgroup, live = map(np.asarray, (dest, tgroup, live))
    assert list(tgroup[:5]) == [0, 2, 2, 2, 3] and list(live) == [1] * 5 + [0] * (n_tiles - 5)
    assert list(dest[:13]) == [0, 1, 2, 4, 5, 6, 7, 8, 9, 10, 11, 12, 16] and (dest[13:] == n_tiles * 4).all()
    assert (tgroup[5:] == 3).all()    # unused tiles repeat the last group: no new weight fetch


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_pallas_mxfp4_gmm_matches_reference_output_and_gradient(dtype):
    rng = np.random.default_rng(0)
    g, k, n, m = 5, 64, 256, 40
    q, w = _codec(rng.standard_normal((g, k, n)).astype(np.float32))
    sizes = jnp.array([10, 0, 17, 5, 0], jnp.int32)           # empty groups; 8 rows past the sum
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    ct = jnp.asarray(rng.standard_normal((m, n)), jnp.float32)
    hi = jax.lax.Precision.HIGHEST

    def ours(a):
        return mxfp4_grouped_matmul(a, q, sizes, interpret=True, tiling=(16, 128, 128))

    def ref(a):   # the dense weights the codec decodes, exact products in f32
        return jax.lax.ragged_dot(a.astype(jnp.float32), jnp.asarray(w), sizes, precision=hi)

    got, want = ours(x), ref(x)
    assert got.dtype == jnp.float32
    assert rel_rms(got, want) <= (1e-6 if dtype == jnp.float32 else 1e-6), rel_rms(got, want)
    assert np.all(np.asarray(got[32:]) == 0)                  # rows past sum(group_sizes)
    g_ours = jax.grad(lambda a: jnp.sum(ours(a) * ct))(x)
    g_ref = jax.grad(lambda a: jnp.sum(ref(a) * ct))(x.astype(jnp.float32))
    assert rel_rms(g_ours, g_ref) <= (1e-6 if dtype == jnp.float32 else 1e-2), rel_rms(g_ours, g_ref)


@pytest.mark.parametrize("path", ["gather", "onehot", "loop"])
def test_few_token_dispatch_takes_packed_experts(path):
    """Decode steps route through the few-token dispatch: with packed experts it decodes the chosen
    (gather, loop) or all (one-hot) experts and equals the dense experts the codec decodes."""
    from k3jax.kernels.moe.dispatch import moe_few_tokens
    rng = np.random.default_rng(1)
    e, d, f, n, k = 8, 64, 32, 3, 2
    (qg, wg), (qu, wu), (qd, wd) = (_codec(rng.standard_normal(s).astype(np.float32))
                                    for s in ((e, d, f), (e, d, f), (e, f, d)))
    x = jnp.asarray(rng.standard_normal((n, d)), jnp.float32)
    idx = jnp.asarray([[0, 5], [5, 7], [2, 0]], jnp.int32)
    w = jnp.asarray(rng.random((n, k)), jnp.float32)
    swiglu = lambda g, u: jax.nn.silu(g) * u  # noqa: E731
    got = moe_few_tokens(x, w, idx, qg, qu, qd, swiglu, path=path)
    want = moe_few_tokens(x, w, idx, *map(jnp.asarray, (wg, wu, wd)), swiglu, path=path)
    assert rel_rms(got, want) <= 1e-6, rel_rms(got, want)


def _packed_pair(cfg_packed, cfg_dense, mesh, seed=0):
    """A model with packed experts made by the codec, and the dense model holding the decoded
    weights (all else equal), both on ``mesh``."""
    dense = randomize(M.build(cfg_dense, seed), seed=seed)
    packed = M.build(cfg_packed, seed)
    dflat = dict(nnx.to_flat_state(nnx.state(dense)))
    pflat = dict(nnx.to_flat_state(nnx.state(packed)))
    new_dense = {}
    for path, var in pflat.items():
        if path[-1] != "codes":
            continue
        base = path[:-1]
        q, w = _codec(np.asarray(dflat[base][...]))
        pflat[base + ("codes",)] = var.replace(q.codes)
        pflat[base + ("scales",)] = pflat[base + ("scales",)].replace(q.scales)
        new_dense[base] = w
    for path, var in dflat.items():
        if path not in new_dense:
            pflat[path] = var                                  # the same non-expert weights
    nnx.update(packed, nnx.from_flat_state(list(pflat.items())))
    nnx.update(dense, nnx.from_flat_state([(p, dflat[p].replace(jnp.asarray(w))) for p, w in new_dense.items()]))
    out = []
    for cfg, model in ((cfg_packed, packed), (cfg_dense, dense)):
        gdef, abstract, _ = abstract_state(cfg, mesh)
        _, params, rest = nnx.split(model, nnx.Param, REST)
        state = jax.device_put({"params": params, "rest": rest}, shardings(abstract))
        out.append(nnx.merge(gdef, state["params"], state["rest"]))
    return out


def test_packed_model_logits_equal_dense_model_from_decoded_weights():
    """XLA path (moe_impl=ragged_dot) and the Pallas kernel (megablox, interpret) vs dense."""
    dense_cfg = C.load(C.REPO_CONFIGS / "base.yml", TINY)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, dense_cfg.model.vocab_size, (2, 12)), jnp.int32)
    mesh = make_mesh(dense_cfg, jax.devices()[:1])
    errs = {}
    for impl in ("ragged_dot", "megablox"):
        cfg = C.load(C.REPO_CONFIGS / "base.yml", [*TINY, "experts_format=mxfp4", f"moe_impl={impl}",
                                                   "pallas_interpret=true"])
        with jax.set_mesh(mesh):
            packed, dense = _packed_pair(cfg, dense_cfg, mesh)
            assert {v[...].dtype for _, v in nnx.to_flat_state(nnx.state(packed, Packed))} == {jnp.dtype(jnp.uint8)}
            fwd = nnx.jit(lambda m, t: m(t)[0])
            errs[impl] = rel_rms(fwd(packed, tokens), fwd(dense, tokens))
    print(f"packed vs dense logits, relative RMS: {errs}")
    assert all(e <= 1e-5 for e in errs.values()), errs


def test_expert_parallel_decode_equals_one_device_for_any_batch_and_prompt():
    """ep=2 on the 8-device mesh: 3 rows left-padded to 6 prompt tokens (prefill 18 tokens, decode
    3: neither divides the 8 token shards) decode the same greedy tokens as on one device, with
    packed experts."""
    base = [*TINY, "experts_format=mxfp4"]
    one = C.load(C.REPO_CONFIGS / "base.yml", base)
    ep = C.load(C.REPO_CONFIGS / "base.yml", [*base, "ici_expert_parallelism=2"])
    dense = C.load(C.REPO_CONFIGS / "base.yml", TINY)
    prompts = [[5, 17, 42, 8, 99, 3], [7, 1], [250, 12, 60, 61]]
    got = {}
    for name, cfg, devs in (("one", one, jax.devices()[:1]), ("ep", ep, jax.devices())):
        mesh = make_mesh(cfg, devs)
        with jax.set_mesh(mesh):
            model, _ = _packed_pair(cfg, dense, mesh, seed=3)
            got[name] = np.asarray(generate(model, prompts, max_new_tokens=4)[0])
    assert dict(make_mesh(ep, jax.devices()).shape)["expert"] == 2
    np.testing.assert_array_equal(got["ep"], got["one"])
    assert len(set(got["one"].ravel().tolist())) > 2              # not a degenerate repetition


@pytest.mark.parametrize("packed, impl", [(False, "ragged_dot"), (True, "ragged_dot"), (False, "megablox"),
                                          (True, "megablox")])
def test_expert_times_tensor_parallel_moe_equals_one_device(packed, impl):
    """ep=2 x tensor=2 (F sharded, partial down projections psum'd), 6 tokens over 4 token shards:
    output and d x / d routing weights (and d experts when dense) equal the one-device dropless."""
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    from k3jax.kernels.moe.dispatch import moe_dropless
    from k3jax.kernels.moe.expert_parallel import moe_expert_parallel
    from k3jax.kernels.moe.routing import route
    rng = np.random.default_rng(4)
    n, d, f, e = 6, 64, 64, 8
    x = jnp.asarray(rng.standard_normal((n, d)), jnp.float32)
    ct = jnp.asarray(rng.standard_normal((n, d)), jnp.float32)
    weights, idx = route(jnp.asarray(rng.standard_normal((n, e)), jnp.float32), None, top_k=2)
    (qg, wg), (qu, wu), (qd, wd) = (_codec(rng.standard_normal(s).astype(np.float32) / 8)
                                    for s in ((e, d, f), (e, d, f), (e, f, d)))
    mesh = jax.make_mesh((1, 2, 2, 2), ("data", "fsdp", "expert", "tensor"), axis_types=(AxisType.Auto,) * 4)
    put = lambda a, spec: jax.tree.map(lambda v: jax.device_put(v, NamedSharding(mesh, spec)), a)  # noqa: E731
    act = lambda g, u: jax.nn.silu(g) * u  # noqa: E731
    ws = (qg, qu, qd) if packed else tuple(jnp.asarray(w) for w in (wg, wu, wd))
    ws_sh = (put(ws[0], P("expert", None, "tensor")), put(ws[1], P("expert", None, "tensor")),
             put(ws[2], P("expert", "tensor", None)))

    def ep(x, w, *ws):
        return moe_expert_parallel(x, w, idx, *ws, act, mesh=mesh, expert_axis="expert", token_axes=("data", "fsdp"),
                                   transport="padded", ffn_axis="tensor", impl=impl, interpret=True)

    def one(x, w, *ws):
        return moe_dropless(x, w, idx, *ws, act)

    argnums = (0, 1) if packed else (0, 1, 2, 3, 4)
    grad = lambda fn: jax.jit(jax.value_and_grad(lambda *a: jnp.sum(fn(*a) * ct), argnums))  # noqa: E731
    with jax.set_mesh(mesh):
        got_out = jax.jit(ep)(x, weights, *ws_sh)
        got = grad(ep)(x, weights, *ws_sh)
    want_out = jax.jit(one)(x, weights, *ws)
    want = grad(one)(x, weights, *ws)
    assert rel_rms(got_out, want_out) <= 1e-6
    for a, b in zip(got[1], want[1]):
        assert rel_rms(a, b) <= 1e-5, (rel_rms(a, b))


def test_training_packed_experts_needs_them_frozen():
    cfg = C.load(C.REPO_CONFIGS / "base.yml", [*TINY, "experts_format=mxfp4"])
    with pytest.raises(C.ConfigError, match="experts_format=mxfp4.*freeze"):
        check_trainable(cfg)
    check_trainable(C.load(C.REPO_CONFIGS / "base.yml", [*TINY, "experts_format=mxfp4", "freeze=[experts]"]))
    with pytest.raises(C.ConfigError, match="multiples of 32.*moe_latent_size"):
        C.load(C.REPO_CONFIGS / "base.yml", ["model_name=tiny", "moe_intermediate_size=32", "experts_format=mxfp4"])


_AOT = textwrap.dedent("""
    import json, os
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5p-8")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    import jax, jax.numpy as jnp
    from jax.experimental import topologies
    from jax.sharding import NamedSharding, PartitionSpec as P
    from k3jax.kernels.moe.quantized import MXFP4
    from k3jax.kernels.moe.mxfp4_gmm import mxfp4_grouped_matmul

    devices = topologies.get_topology_desc(topology_name="v5p:2x2x1", platform="tpu").devices
    mesh = jax.make_mesh((len(devices),), ("expert",), devices=devices)
    G, K, N, M = 8, 512, 256, 64     # per device: 8 experts, a decode-sized 64 rows
    sd = lambda s, d: jax.ShapeDtypeStruct(s, d, sharding=NamedSharding(mesh, P("expert")))
    args = (sd((4 * M, K), jnp.bfloat16), sd((4 * G, K // 2, N), jnp.uint8),
            sd((4 * G, K // 32, N), jnp.uint8), sd((4 * G,), jnp.int32))
    f = jax.shard_map(lambda x, c, s, gs: mxfp4_grouped_matmul(x, MXFP4(c, s), gs, preferred_element_type=jnp.bfloat16),
                      mesh=mesh, in_specs=(P("expert"),) * 4, out_specs=P("expert"))
    loss = lambda *a: jnp.sum(f(*a).astype(jnp.float32) ** 2)
    with jax.set_mesh(mesh):
        for name, fn in [("fwd", f), ("bwd", jax.grad(loss))]:
            compiled = jax.jit(fn).lower(*args).compile()
            hlo = compiled.as_text()
            print(json.dumps({"kind": devices[0].device_kind, "pass": name,
                              "mosaic_calls": hlo.count("tpu_custom_call"),
                              "dense_weights_in_hbm": "bf16[8,512,256]" in hlo or "f32[8,512,256]" in hlo}),
                  flush=True)
""")


def test_mxfp4_kernel_compiles_for_tpu_v5p():
    proc, rows = run_aot_script(_AOT)
    assert proc.returncode == 0 and len(rows) == 2, proc.stderr[-4000:]
    assert all(r["kind"] == "TPU v5" and r["mosaic_calls"] >= 1 for r in rows), rows
    fwd = next(r for r in rows if r["pass"] == "fwd")
    assert not fwd["dense_weights_in_hbm"], fwd     # the forward never forms the decoded experts


def test_serving_mesh_decode_compiles_for_v5p_with_packed_experts():
    """compile_step=decode on an expert x tensor serving mesh (non-expert weights replicated over
    expert): the packed experts run through the Pallas kernel, the step fits, the analytic decode
    roofline is positive, and the planner's serving candidates are tensor x expert meshes."""
    from k3jax import compile as K
    from k3jax import plan as PL
    from k3jax import topology as TP
    if not TP.libtpu_available():
        pytest.skip("libtpu is not installed: no TPU compiler")
    args = [*TINY[:-3], "num_layers=4", "mla_extra_layers=[]", "attn_res_block_size=2", "moe_intermediate_size=128",
            "experts_format=mxfp4", "moe_impl=megablox", "compile_topology=v5p:2x2x1", "compile_step=decode",
            "ici_expert_parallelism=2", "ici_tensor_parallelism=2", "ici_fsdp_parallelism=1",
            "shard_params_over_all_axes=false", "per_device_batch_size=2", "max_target_length=256",
            "dtype=bfloat16", "weight_dtype=bfloat16"]
    cfg = C.load_from_argv(args)
    lines = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reports = K.run(cfg, out=lines.append)
        topo, mesh = K.topology_mesh(cfg, "v5p:2x2x1")
        compiled, _, _ = K.compile_decode(cfg, mesh)       # the same program again
    # The first compile must not have left a persistent-cache entry this CPU process cannot load.
    assert not [w for w in caught if "persistent compilation cache" in str(w.message)]
    dec = reports["decode"]
    assert dec["memory"]["fits"] and dec["global_batch"] == 8
    est = dec["estimate"]
    assert est["hbm_bytes"]["experts"] > 0 and est["hbm_bytes"]["dense_weights"] > 0 and est["hbm_bytes"]["cache"] > 0
    assert est["ici_bytes"]["weight_gather"] == 0          # dense weights are never gathered
    assert est["ici_bytes"]["expert_all_to_all"] > 0 and est["ici_bytes"]["expert_tensor_psum"] > 0
    assert est["ms_per_token"] > 0 and any("ms per token" in ln for ln in lines), lines
    assert "mxfp4_gmm" in compiled.as_text()
    k3 = C.load_from_argv(["model_name=kimi-k3", "topology=tpu7x-32", "plan_step=decode"])
    assert [(c["ici_expert_parallelism"], c["ici_tensor_parallelism"]) for c in PL.decode_candidates(k3, 32)] == \
        [(2, 16), (4, 8), (8, 4)]


def test_training_with_frozen_packed_experts_runs_and_keeps_them(tmp_path):
    """freeze=[experts]: the train loop runs with packed experts (built as zero codes: a run from
    scratch has no checkpoint to load them from), the losses are finite, and the uint8 codes are
    carried through the steps unchanged, outside the optimizer."""
    from k3jax.train import train
    cfg = C.load(C.REPO_CONFIGS / "base.yml", [*TINY, "experts_format=mxfp4", "freeze=[experts]", "steps=2",
                                               "per_device_batch_size=1", "max_target_length=16",
                                               "enable_checkpointing=false", "enable_tensorboard=false",
                                               f"base_output_directory={tmp_path}", "log_period=1"])
    out = train(cfg)
    assert len(out["history"]) == 2 and all(np.isfinite(h["loss"]) for h in out["history"])
    packed = [v[...] for _, v in nnx.to_flat_state(nnx.filter_state(out["state"]["rest"], Packed))]
    assert packed and all(p.dtype == jnp.uint8 and not np.asarray(p).any() for p in packed)  # init zeros, untouched
