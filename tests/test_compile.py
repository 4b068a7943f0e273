"""AOT compilation for TPU topologies (k3jax.compile / k3jax.topology) and the FLOPs formulas.

The topology test compiles a 4-layer tiny K3 (KDA, MLA, dense and MoE FFNs, AttnRes) with libtpu
for v5p:2x2x1 from this CPU host, its sequence split over context=4; it skips only when libtpu
cannot describe a TPU topology. The FLOPs test compares counts.forward_flops_per_token with
XLA:CPU's cost analysis of the forward.
"""
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from k3jax import compile as K
from k3jax import config as C
from k3jax import counts
from k3jax import model as M
from k3jax import topology as TP
from k3jax.state import abstract_state

TINY4 = ["model_name=tiny", "num_layers=4", "mla_extra_layers=[]", "attn_res_block_size=2", "opt_type=adamw",
         "use_qk_clip=false", "compile_topology=v5p:2x2x1"]


def test_topology_names():
    assert TP.resolve("v5p-2048").libtpu_name == "v5p:8x8x16"
    assert TP.resolve("v5p-8").libtpu_name == "v5p:2x2x1"
    t = TP.resolve("tpu7x-1024")
    assert (t.libtpu_name, t.num_chips, t.num_devices) == ("tpu7x:8x8x8", 512, 1024)
    assert TP.resolve("v6e:4x4").num_devices == 16
    assert TP.resolve("tpu7x-8").chip.hbm_bytes == pytest.approx(96e9)
    for bad in ("v5p-3", "v9-8", "v5p:2x2", "v5p-100"):
        with pytest.raises(C.ConfigError):
            TP.resolve(bad)


def test_main_reports_config_errors(capsys):
    assert K.main(["model_name=tiny"]) == 2
    assert "compile_topology is not set" in capsys.readouterr().err


@pytest.fixture(scope="module")
def tiny_compiled():
    """The train step with the sequence split four ways (context=4 on the 4 chips): the
    context-parallel KDA, short conv and MLA kernels lower under libtpu, and every weight is
    still split over the chips (parameters shard over the context axis as over fsdp) and
    gathered for its matmuls. One compile serves all the tests below. Without remat: on a loaded
    2-core host the compile took 52 s of CPU for fsdp=4 with full remat, 95 s for context=4 with
    full remat and 74 s for context=4 without."""
    if not TP.libtpu_available():
        pytest.skip("libtpu is not installed: no TPU compiler")
    cfg = C.load_from_argv(TINY4 + ["ici_context_parallelism=4", "ici_fsdp_parallelism=1", "remat_policy=none"])
    topo, mesh = K.topology_mesh(cfg, "v5p:2x2x1")
    compiled, secs, gb = K.compile_train(cfg, mesh)
    return cfg, topo, mesh, compiled, gb


def test_tiny_train_step_compiles_for_v5p(tiny_compiled):
    cfg, topo, mesh, compiled, gb = tiny_compiled
    assert mesh.devices.size == 4 and mesh.devices.flat[0].platform == "tpu"
    assert dict(mesh.shape) == {"data": 1, "fsdp": 1, "context": 4, "expert": 1, "tensor": 1}
    assert gb == 2      # 2 rows per device x 4 devices / context 4: the 4 devices hold slices of the same rows
    # The context kernels' ppermutes (conv halos, the previous slice's last segment id).
    assert "collective-permute" in compiled.as_text()
    # moe_impl=auto resolves for the mesh's TPU devices (ragged_dot), not for this CPU host (blocked).
    assert cfg.kernel.moe_impl == "auto" and "ragged" in compiled.as_text()
    mem = K.memory_report(compiled, topo.chip.hbm_bytes)
    assert mem["arguments"] > 0 and mem["temporaries"] > 0
    assert 0 < mem["total"] < mem["hbm"] and mem["fits"]
    assert "memory per device" in K.format_memory("train", mem) and "fits" in K.format_memory("train", mem)
    cost = K.cost_report(compiled)
    assert cost["flops"] > 0 and cost["bytes"] > 0
    est = K.train_estimate(cfg, gb, 4, topo.chip, cost)
    assert est["step_s"] > 0 and 0 < est["mfu"] < 1
    assert K.fit_error({"train": {"memory": mem}}) is None
    small = K.memory_report(compiled, hbm_bytes=1024.0)   # the same step on a 1 KiB chip
    assert not small["fits"]
    assert "does not fit" in K.fit_error({"train": {"memory": small}})


SMALL = dict(vocab_size=4096, hidden_size=512, num_layers=4, mla_every=4, mla_extra_layers=[], first_k_dense=1,
             kda_num_heads=4, kda_head_dim=64, kda_gate_rank=64, num_attention_heads=4, q_lora_rank=128,
             kv_lora_rank=64, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, intermediate_size=1024,
             num_experts=1, num_experts_per_token=1, num_shared_experts=1, moe_intermediate_size=256,
             moe_latent_size=256, attn_res_block_size=2, scan_layers=False, max_target_length=64, kda_chunk_size=64)


def test_forward_flops_match_xla_cost_analysis():
    """Analytic forward FLOPs within 10% of XLA's count. One expert with top-1 (XLA:CPU counts a
    ragged_dot as every group on every row), T = one KDA chunk and unrolled layers (XLA counts a
    loop body once), so XLA's figure is the full work; docs/flops.md explains the choices."""
    cfg = C.load(C.REPO_CONFIGS / "base.yml", {k: str(v) for k, v in SMALL.items()})
    b, t = 2, cfg.train.max_target_length
    gdef, st = nnx.split(nnx.eval_shape(lambda: M.build(cfg, 0)))
    st = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), st)
    fwd = jax.jit(lambda st, tok: nnx.merge(gdef, st)(tok)[0])
    compiled = fwd.lower(st, jax.ShapeDtypeStruct((b, t), jnp.int32)).compile()
    xla = K.cost_report(compiled)["flops"] / (b * t)
    analytic = counts.forward_flops_per_token(cfg.model, t, cfg.kernel.kda_chunk_size)
    assert abs(xla / analytic - 1) < 0.10, (xla, analytic)
    assert counts.train_flops_per_token(cfg.model, t, 64) == pytest.approx(3 * analytic)


def test_plan_candidates_and_overrides():
    from k3jax import plan as PL
    cfg = C.load_from_argv(["model_name=kimi-k3", "topology=tpu7x-1024"])
    cands = PL.candidates(cfg, 1024)
    assert {c["ici_expert_parallelism"] for c in cands} == {128, 64, 32}   # divisors of 896 and 1024
    c = C.override(cfg, cands[0])
    assert c.mesh.ici_expert_parallelism == 128 and c.train.remat_policy == cands[0]["remat_policy"]
    assert "rank" in PL.table([], 4096)
    narrow = C.load_from_argv(["model_name=kimi-k3", "topology=tpu7x-1024", "plan_expert_parallelism=[64, 7]",
                               "plan_data_parallelism=[1]", "plan_remat_policies=[full]", "plan_batch_sizes=[1]"])
    assert PL.candidates(narrow, 1024) == [{"ici_expert_parallelism": 64, "ici_data_parallelism": 1,
                                            "ici_context_parallelism": 1, "ici_fsdp_parallelism": -1,
                                            "remat_policy": "full", "per_device_batch_size": 1.0}]   # 7 does not divide 1024
    # Context sizes: 3 divides neither the 16 devices left beside expert=64 nor 4096 tokens; 32
    # does not divide the 16 devices.
    long = C.override(narrow, {"plan_context_parallelism": [1, 3, 4, 16, 32]})
    cands = PL.candidates(long, 1024)
    assert [c["ici_context_parallelism"] for c in cands] == [1, 4, 16]
    c = C.override(long, cands[-1])
    C.validate(c, num_devices=1024)
    assert C.mesh_shape(c, 1024, 1)[0] == {"data": 1, "fsdp": 1, "context": 16, "expert": 64, "tensor": 1}


def test_plan_table_ranks_equal_bounds_by_memory():
    from k3jax import plan as PL
    est = {"step_s": 7.6, "mfu": 0.75, "tokens_per_s_per_chip": 539.0}
    row = lambda ep, gib: {"ici_expert_parallelism": ep, "ici_data_parallelism": 1, "remat_policy": "full",  # noqa: E731
                           "per_device_batch_size": 1.0, "mesh": f"fsdp={1024 // ep} x expert={ep}", "global_batch": 1024,
                           "estimate": est, "memory": {"total": gib * 2 ** 30, "hbm": 95 * 2 ** 30, "fits": True}}
    lines = PL.table([row(64, 88.5), row(128, 85.7), {**row(32, 120.0), "memory": {
        "total": 120 * 2 ** 30, "hbm": 95 * 2 ** 30, "fits": False}}], 4096).splitlines()
    assert "expert=128" in lines[2] and "expert=64" in lines[3]
    assert "roofline bounds" in lines[4] and "needs 120.0 GiB" in lines[-1]


def test_weight_collective_bytes_by_hand():
    """fsdp=4 x expert=2 x data=2 x tensor=1, bf16, remat (3 passes)."""
    from jax.sharding import PartitionSpec as P
    mesh = {"data": 2, "fsdp": 4, "expert": 2, "tensor": 1}
    dense = ((64, 32), 2, P(("fsdp", "expert"), "tensor"), ("embed", "mlp"))    # shard 64*32*2/8 = 512 B
    expert = ((2, 64, 32), 2, P("expert", "fsdp", "tensor"), ("exp", "embed", "mlp"))  # shard 1024 B
    vec = ((64,), 4, P(None), ("norm",))                                              # replicated 256 B
    got = K.weight_collective_bytes([dense, expert, vec], mesh, passes=3)
    # dense: gathered over fsdp x expert (G = 8): 3 * 7 * 512; experts stay local on `expert`, gathered
    # over fsdp (G = 4): 3 * 3 * 1024; the vector is not gathered.
    assert got["weight_gather"] == 3 * 7 * 512 + 3 * 3 * 1024
    # reduce-scatters (7 * 512 + 3 * 1024), the all-reduce over data=2 (2 * 1/2 shard) for the split
    # two and over data x fsdp x expert = 16 (2 * 15/16 shard) for the replicated vector.
    assert got["grad_reduce"] == 7 * 512 + 3 * 1024 + (512 + 1024 + 2 * 15 / 16 * 256)
    assert K.weight_collective_bytes([dense], {"data": 1, "fsdp": 1, "expert": 1, "tensor": 1}, 3) == \
        {"weight_gather": 0.0, "grad_reduce": 0.0}


HEADS = (2, 24, 16)


def test_context_collective_bytes_by_hand():
    """base.yml's model (13 layers, 4 MLA: 9 KDA with H=2, K=V=16, conv 4; latent 32 + rope 8),
    T=64, per_device_batch_size=2, f32 activations, context=4, no remat (2 passes)."""
    cfg = C.load(C.REPO_CONFIGS / "base.yml", ["ici_context_parallelism=4"])
    m = cfg.model
    assert (m.num_layers, len(m.mla_layer_set), m.kda_num_heads, m.kda_head_dim, m.kda_conv_size,
            m.kv_lora_rank + m.qk_rope_head_dim, cfg.train.dtype) == (13, 4, 2, 16, 4, 40, "float32")
    assert (m.num_attention_heads, m.qk_head_dim, m.v_head_dim) == HEADS
    # Per device 2 rows of 64 / 4 = 16 positions. MLA: 3 of the 4 slices' latents, 2 x 16 tokens of
    # 40 f32 values, plus the zigzag's 32 queries out (H x qk_head_dim f32) and outputs back
    # (H x v_head_dim); KDA: 3 maps of 2 x 16 x (16 + 16) f32 per row, and 3 halo tokens x 3 convs
    # x 32 channels per row.
    H, QK, V = HEADS
    mla, zigzag = 3 * 32 * 40 * 4, 32 * H * (QK + V) * 4
    maps, halo = 3 * 2 * 2 * 16 * 32 * 4, 2 * 3 * 3 * 32 * 4
    assert K.context_collective_bytes(cfg, 4, passes=2) == 2 * (4 * (mla + zigzag) + 9 * (maps + halo))
    ring = C.override(cfg, {"context_parallel_strategy": "ring", "context_parallel_load_balance": False})
    assert K.context_collective_bytes(ring, 4, passes=2) == 2 * (4 * mla + 9 * (maps // 2 + halo))
    assert K.context_collective_bytes(cfg, 1, passes=2) == 0.0


def test_context_attention_factor_counts_the_busiest_shards_key_blocks():
    """Per query half chunk, the causal average is cp half chunks of keys. Balanced: shard j's
    two halves (j and 2cp-1-j) walk 2cp+1 of them together; unbalanced: the last shard's 4cp-1."""
    cfg = C.load(C.REPO_CONFIGS / "base.yml", ["ici_context_parallelism=4"])
    assert K.context_attention_factor(cfg, 1) == 1.0
    assert K.context_attention_factor(cfg, 4) == 9 / 8
    off = C.override(cfg, {"context_parallel_load_balance": False})
    assert K.context_attention_factor(off, 4) == 15 / 8


def test_collective_estimate_on_the_tiny_compile(tiny_compiled):
    cfg, topo, mesh, compiled, gb = tiny_compiled
    comm = K.collective_bytes(cfg, abstract_state(cfg, mesh)[1]["params"], mesh)
    assert comm["weight_gather"] > 0 and comm["context_exchange"] > 0 and comm["total"] == pytest.approx(sum(
        comm[k] for k in ("weight_gather", "grad_reduce", "expert_all_to_all", "context_exchange")))
    est = K.train_estimate(cfg, gb, 4, topo.chip, K.cost_report(compiled), comm["total"])
    assert est["t_ici"] == pytest.approx(comm["total"] / topo.chip.ici_bandwidth)
    assert est["step_s"] == max(est["t_compute"], est["t_memory"], est["t_ici"])



def test_compile_dump_dir_reaches_the_compiler_options():
    """libtpu reads no XLA_FLAGS of this process: the dump request travels in compile()'s options."""
    cfg = C.load(C.REPO_CONFIGS / "base.yml", [])
    assert K.compiler_options(cfg) == {}
    opts = K.compiler_options(C.override(cfg, {"compile_dump_dir": "/tmp/x"}))
    assert opts == {"compiler_options": {"xla_dump_to": "/tmp/x", "xla_dump_hlo_as_text": True}}


def test_topology_compiles_write_nothing_to_the_persistent_cache():
    """A TPU executable compiled from a CPU process cannot be read back by it (no TPU client): while
    one compiles, no compile time is long enough to be cached, and the setting is as it was
    afterwards; local compiles keep it. (test_mxfp4's v5p serving test checks the real compile.)"""
    import types

    import numpy as np
    cfg = C.load(C.REPO_CONFIGS / "base.yml", ["compile_dump_dir=/tmp/x"])
    key = "jax_persistent_cache_min_compile_time_secs"
    seen = []

    class Lowered:
        def compile(self, **kw):
            seen.append((getattr(jax.config, key), jax.config.jax_enable_compilation_cache, kw))
            return "compiled"

    def mesh(platform):
        return types.SimpleNamespace(devices=np.array([types.SimpleNamespace(platform=platform)]))

    before, enabled = getattr(jax.config, key), jax.config.jax_enable_compilation_cache
    assert K.compile_lowered(Lowered(), cfg, mesh("tpu")) == "compiled"
    assert getattr(jax.config, key) == before
    K.compile_lowered(Lowered(), cfg, mesh(jax.default_backend()))
    assert [t for t, _, _ in seen] == [float("inf"), before]
    assert all(on == enabled and kw == K.compiler_options(cfg) for _, on, kw in seen)


def test_rows_that_do_not_split_over_the_batch_axes_are_a_config_error():
    from k3jax import sharding as S
    cfg = C.load(C.REPO_CONFIGS / "base.yml", ["ici_fsdp_parallelism=8"])
    mesh = S.make_mesh(cfg)
    K.check_rows(mesh, 16, "prefill batch")
    with pytest.raises(C.ConfigError, match=r"prefill batch has 1 row\(s\) but the batch axes data x fsdp x expert = 8"):
        K.check_rows(mesh, 1, "prefill batch")


def test_prefill_compiles_under_context_parallelism(capsys):
    """compile_step=prefill: the prompt forward with the context-parallel kernels (context=4) and
    its cache, compiled for v5p:2x2x1; the report names the slice and fits."""
    if not TP.libtpu_available():
        pytest.skip("libtpu is not installed: no TPU compiler")
    cfg = C.load_from_argv(TINY4 + ["ici_context_parallelism=4", "ici_fsdp_parallelism=1", "compile_step=prefill",
                                    "compile_topology=v5p:2x2x1", "per_device_batch_size=1", "max_target_length=256"])
    reports = K.run(cfg)
    assert list(reports) == ["prefill"] and reports["prefill"]["memory"]["fits"]
    assert reports["prefill"]["global_batch"] == 1 and reports["prefill"]["estimate"]["step_s"] > 0
    assert "context=4: 64 tokens per slice" in capsys.readouterr().out


def test_serve_programs_compile_for_v5p(capsys):
    """compile_step=serve: the inference core's programs as the server runs them (its largest decode
    bucket with several steps per call, its prefill chunk, the slot cache sharded over the mesh)
    compile for v5p:2x2x1 from this host, each with its memory report."""
    if not TP.libtpu_available():
        pytest.skip("libtpu is not installed: no TPU compiler")
    cfg = C.load_from_argv(TINY4 + ["compile_step=serve", "serve_max_batch=4", "serve_decode_steps=4",
                                    "serve_prefill_chunk=32", "max_target_length=128"])
    reports = K.run(cfg)
    assert list(reports) == ["decode[4]", "prefill[32]"]
    for r in reports.values():
        assert r["memory"]["fits"] and r["memory"]["arguments"] > 0 and r["cost"]["flops"] > 0
    assert "4 slots x 128 positions, 4 decode step(s) per call" in capsys.readouterr().out
