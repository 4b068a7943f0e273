"""Multi-slice: the DCN term of the training roofline (k3jax.roofline) and the tiny pipelined model
compiled for two v5p slices joined over DCN.

The by-hand tests check every DCN byte count against arithmetic written out in the test. The
compile test lowers the tiny model's train step with libtpu for two v5p:2x2x1 slices at
dcn_stage_parallelism=2 (stage across the slices, fsdp=4 inside each) and reads the optimised
HLO: the stage hand-offs are collective-permutes whose source and target sit in different
slices, and no all-gather spanning both slices returns a pipelined (period) weight, i.e. each
stage keeps its own periods. One compile serves both checks; it skips only without libtpu.
"""
import re

import jax
import pytest

from k3jax import compile as K
from k3jax import config as C
from k3jax import roofline as R
from k3jax import topology as TP
from k3jax.state import abstract_state


def test_weight_collectives_split_between_ici_and_dcn_by_hand():
    from jax.sharding import PartitionSpec as P
    # data=2 entirely across two slices, fsdp=4 x expert=2 inside each; bf16, remat (3 passes).
    mesh = {"data": 2, "fsdp": 4, "expert": 2, "tensor": 1}
    dense = ((64, 32), 2, P(("fsdp", "expert"), "tensor"), ("embed", "mlp"))    # shard 512 B
    expert = ((2, 64, 32), 2, P("expert", "fsdp", "tensor"), ("exp", "embed", "mlp"))  # shard 1024 B
    vec = ((64,), 4, P(None), ("norm",))                                              # replicated 256 B
    got = R.weight_collective_bytes([dense, expert, vec], mesh, passes=3, dcn={"data": 2})
    # Gathers stay inside a slice (fsdp x expert, fsdp); the gradient all-reduce over data crosses:
    # 2 (2 - 1) / 2 of each shard (/ R_ici = 1) for the split two, and for the vector, replicated over
    # data x fsdp x expert = 2 x 8, 2 (8 - 1) / 8 of it over ICI and 2 (2 - 1) / 2 of an eighth over DCN.
    assert got["weight_gather"] == 3 * 7 * 512 + 3 * 3 * 1024
    assert got["grad_reduce"] == 7 * 512 + 3 * 1024 + 2 * 7 / 8 * 256
    assert got["dcn_weight_gather"] == 0.0
    assert got["dcn_grad_reduce"] == 512 + 1024 + 256 / 8
    # fsdp=8 as 4 per slice x 2 slices: of the 7 shards a device gathers, 1 comes over DCN.
    wide = ((64, 32), 2, P("fsdp", None), ("embed", "mlp"))                          # shard 512 B
    got = R.weight_collective_bytes([wide], {"data": 1, "fsdp": 8, "expert": 1, "tensor": 1}, 3, dcn={"fsdp": 2})
    assert (got["weight_gather"], got["dcn_weight_gather"]) == (3 * 6 * 512, 3 * 1 * 512)
    assert (got["grad_reduce"], got["dcn_grad_reduce"]) == (6 * 512, 512)


def test_pipelined_weights_are_gathered_per_iteration_and_not_over_stage():
    from jax.sharding import PartitionSpec as P
    mesh = {"stage": 2, "fsdp": 4}
    period = ((4, 64, 32), 2, P("stage", "fsdp", None), ("layers", "embed", "mlp"))  # shard 2048 B
    vec = ((64,), 4, P(None), ("norm",))                                              # 256 B, outside
    iters = (2 * 2 + 2 - 1) / 2       # M=2 microbatches, R=2 repeats, S=2 stages: 5 iterations per 2 periods
    got = R.weight_collective_bytes([period, vec], mesh, 3, dcn={"stage": 2}, stage_iters=iters)
    # The period leaf: gathered over fsdp only (3 shards, ICI) at every iteration, no gradient sum over
    # stage; the vector's gradient is summed over stage x fsdp = 2 slices x 4.
    assert got["weight_gather"] == iters * 3 * 3 * 2048 and got["dcn_weight_gather"] == 0.0
    assert got["grad_reduce"] == iters * 3 * 2048 + 2 * 3 / 4 * 256
    assert got["dcn_grad_reduce"] == 2 * 1 / 2 * 256 / 4


def test_roofline_with_dcn_bubble_and_hops_by_hand():
    chip = TP.CHIPS["v5p"]
    assert chip.dcn_bandwidth == 50e9 / 8 and TP.CHIPS["tpu7x"].dcn_bandwidth == 100e9 / 8 / 2
    flops = 2 * chip.peak_flops                           # 2 s of compute
    r = R.roofline(flops, 0.0, chip, ici_bytes=chip.ici_bandwidth, dcn_bytes=3 * chip.dcn_bandwidth,
                   hop_s=0.5, bubble=0.2)
    assert (r["t_compute"], r["t_ici"], r["t_dcn"]) == (2.0, 1.0, 3.0)
    assert r["step_s"] == pytest.approx(3.0 / 0.8 + 0.5)          # DCN-bound, stretched by the bubble, + hops
    assert r["exposed_s"] == pytest.approx(r["step_s"] - 2.0 / 0.8)
    assert not r["dcn_unknown"]
    assert R.roofline(flops, 0.0, TP.CHIPS["v4"], dcn_bytes=1.0)["dcn_unknown"]


# 4 layers as 2 scanned periods of 2 (no unrolled prefix or tail), AttnRes blocks at layers 0 and 2.
TWO_SLICES = ["model_name=tiny", "num_layers=4", "mla_every=2", "first_k_dense=0", "mla_extra_layers=[]",
              "attn_res_block_size=2", "opt_type=adamw", "use_qk_clip=false", "compile_topology=v5p:2x2x1",
              "compile_topology_num_slices=2", "dcn_stage_parallelism=2", "ici_fsdp_parallelism=4",
              "enable_checkpointing=false", "remat_policy=none"]


@pytest.fixture(scope="module")
def pipelined_two_slices():
    """The tiny model at stage=2 across two v5p:2x2x1 slices x fsdp=4, 2 microbatches, no remat;
    compiled once (40 s of CPU on the 2-core host)."""
    if not TP.libtpu_available():
        pytest.skip("libtpu is not installed: no TPU compiler")
    cfg = C.load_from_argv(TWO_SLICES)
    topo, mesh = K.topology_mesh(cfg, "v5p:2x2x1")
    compiled, _, gb = K.compile_train(cfg, mesh)
    return cfg, topo, mesh, compiled, gb


def cross_slice_sends(text: str, slice_of: dict) -> list[tuple[str, str, tuple]]:
    """(transfer type, dtype, dims) of each collective libtpu lowers onto the slice network: a
    host-transfer ``send`` marked ``_xla_megascale_transfer_type`` (collectives within a slice stay
    ordinary HLO collectives over the slice's own device numbers). ONE_TO_ONE sends (collective-
    permutes) are kept only when one of their ``a->b`` device pairs joins two slices."""
    out = []
    for line in text.splitlines():
        kind = re.search(r'_xla_megascale_transfer_type="(\w+)"', line)
        op = re.match(r"\s*%send[.\d]* = \((\w+)\[([\d,]*)\]", line)
        if not (kind and op):
            continue
        if kind.group(1) == "ONE_TO_ONE":
            pairs = re.findall(r"\{(\d+)->(\d+)\}", line)
            if not any(slice_of[int(a)] != slice_of[int(b)] for a, b in pairs):
                continue
        out.append((kind.group(1), op.group(1), tuple(int(x) for x in op.group(2).split(",") if x)))
    return out


def _squeeze(dims) -> tuple:
    return tuple(d for d in dims if d != 1)


def test_pipeline_across_two_slices_permutes_over_dcn_and_keeps_period_weights(pipelined_two_slices):
    cfg, topo, mesh, compiled, gb = pipelined_two_slices
    assert dict(mesh.shape) == {"stage": 2, "data": 1, "fsdp": 4, "context": 1, "expert": 1, "tensor": 1}
    slice_of = {d.id: d.slice_index for d in mesh.devices.flat}
    assert [d.slice_index for d in mesh.devices.flat] == [0] * 4 + [1] * 4     # stage = the slice
    sends = cross_slice_sends(compiled.as_text(), slice_of)
    kinds = {k for k, _, _ in sends}
    # The gradient sums over stage of the weights outside the pipeline cross the slices: the parser
    # reads the slice network's collectives.
    assert "ALL_REDUCE" in kinds and "ONE_TO_ONE" in kinds
    # The hand-off of a microbatch (2 rows per device): the partial sum [2, T, D] and, with the block
    # cache, the one block the other stage has not seen [K=1, 2, T, D], permuted from each stage to
    # the other slice's (tests/test_pipeline.py checks the hops' operands exactly, on CPU).
    permuted = {(dt, _squeeze(d)) for k, dt, d in sends if k == "ONE_TO_ONE"}
    assert ("f32", (2, 64, 32)) in permuted, permuted
    # No all-gather over the slice network sends a period weight's shard, local or gathered over fsdp.
    params = abstract_state(cfg, mesh)[1]["params"]
    weights = set()
    for leaf in jax.tree.leaves(params["periods"]):
        local = leaf.sharding.shard_shape(leaf.shape)
        in_stage = (local[0],) + tuple(leaf.shape[1:])      # the stage's periods, whole
        weights |= {_squeeze(local), _squeeze(in_stage)}
    gathered = [d for k, _, d in sends if k == "ALL_GATHER" and _squeeze(d) in weights]
    assert not gathered, f"period weights all-gathered across the stage slices: {gathered}"
def test_dcn_terms_of_the_pipelined_compile_by_hand(pipelined_two_slices):
    cfg, topo, mesh, compiled, gb = pipelined_two_slices
    comm = R.collective_bytes(cfg, abstract_state(cfg, mesh)[1]["params"], mesh, gb)
    pipe = comm["pipeline"]
    # 2 stages, 2 microbatches (-1 = the stage count), 2 periods: 1 repeat, 3 iterations, bubble 1/3.
    assert (pipe["stages"], pipe["microbatches"], pipe["repeats"], pipe["iterations"]) == (2, 2, 1, 3)
    assert pipe["bubble"] == pytest.approx(1 / 3)
    # A hop: 16 rows / 2 microbatches / fsdp 4 = 2 rows per device, (partial + 1 block, the block
    # cache) x 64 x 32 f32; without the cache (partial + 2 blocks) x 64 x 32.
    assert gb == 16 and pipe["hop_bytes"] == 2 * 2 * 64 * 32 * 4
    assert R.stage_hop_bytes(C.override(cfg, {"pipeline_attn_res_cache": False}), dict(mesh.shape), gb) == \
        3 * 2 * 64 * 32 * 4
    # Forward and backward, 3 iterations each, every hop crossing the slices (stage is all DCN).
    assert comm["dcn"]["stage_hops"] == 2 * 3 * pipe["hop_bytes"] and comm["stage_hops"] == 0.0
    assert comm["dcn"]["weight_gather"] == 0.0 and comm["dcn"]["expert_all_to_all"] == 0.0
    assert comm["dcn"]["grad_reduce"] > 0          # the weights outside the pipeline, summed over stage
    # Every device's hop leaves its slice (the ring of 2 stages has both edges across).
    assert comm["cross_slice_bytes"] == 8 * comm["dcn_total"]
    cost = K.cost_report(compiled)
    est = K.train_estimate(cfg, gb, 8, topo.chip, cost, comm=comm)
    hop_s = comm["dcn"]["stage_hops"] / topo.chip.dcn_bandwidth
    assert est["t_hops"] == pytest.approx(hop_s) and est["bubble"] == pipe["bubble"]
    assert est["step_s"] == pytest.approx(max(est["t_compute"], est["t_memory"], est["t_ici"], est["t_dcn"]) * 1.5
                                          + hop_s)
    lines = R.format_multislice(comm, est, topo.chip, 8)
    assert "stage hops" in lines[0] and "bubble 33.3%" in lines[1]


def test_plan_multislice_candidates_and_table():
    from k3jax import plan as PL
    cfg = C.load_from_argv(["model_name=kimi-k3", "topology=v5p-2048", "compile_topology_num_slices=2",
                            "plan_expert_parallelism=[128]", "plan_data_parallelism=[1]", "plan_remat_policies=[full]",
                            "plan_batch_sizes=[1]"])
    cands = PL.multislice_candidates(cfg, 1024, 2)       # default plan_dcn_axes: data, stage
    assert [c["dcn_axis"] for c in cands] == ["data", "stage"]
    assert cands[0]["dcn_data_parallelism"] == 2 and "dcn_stage_parallelism" not in cands[0]
    assert cands[1]["dcn_stage_parallelism"] == 2 and cands[1]["enable_checkpointing"] is False
    for bad in (["tensor"], ["stage*stage"], ["stage*fsdp*data"], ["stage*tensor"]):
        with pytest.raises(C.ConfigError, match="plan_dcn_axes"):
            PL.multislice_candidates(C.override(cfg, {"plan_dcn_axes": bad}), 1024, 2)
    # A pair splits the slices: 4 slices -> stage=2 x fsdp=2 (the winner on 4 x v5p-512,
    # docs/multislice.md); 2 slices have no split, so the pair adds no candidate there.
    mixed = PL.multislice_candidates(C.override(cfg, {"plan_dcn_axes": ["fsdp", "stage*fsdp"]}), 256, 4)
    assert [(c["dcn_axis"], c.get("dcn_stage_parallelism"), c["dcn_fsdp_parallelism"]) for c in mixed] == \
        [("fsdp", None, 4), ("stage*fsdp", 2, 2)]
    assert mixed[1]["enable_checkpointing"] is False
    assert PL._label(dict(mixed[1], remat_policy="full", per_device_batch_size=1)).startswith("dcn_stage=2 dcn_fsdp=2 ")
    assert PL.multislice_candidates(C.override(cfg, {"plan_dcn_axes": ["stage*fsdp"]}), 1024, 2) == []
    # One table: the fitting row ranked with its axis, bubble, cross-slice bytes and DCN time; the
    # row over HBM listed below with the axis it tried.
    est = {"tokens_per_s_per_chip": 346.0, "step_s": 11.8, "mfu": 0.48, "bubble": 0.0435, "t_dcn": 0.04, "t_hops": 3.89}
    ok = dict(cands[1], mesh="stage=2 x fsdp=8 x expert=128", global_batch=2048, estimate=est,
              memory={"total": 60 * TP.GiB, "hbm": 95 * TP.GiB, "fits": True},
              collectives={"cross_slice_bytes": 5.03e13})
    over = dict(cands[0], memory={"total": 120 * TP.GiB, "hbm": 95 * TP.GiB, "fits": False})
    text = PL.table([over, ok], 4096)
    first = text.splitlines()[2]
    assert "stage" in first and "4.3" in first and "50300.0" in first and "3.930" in first
    assert "dcn_data=2 expert=128 data=1 context=1 remat=full batch/dev=1: needs 120.0 GiB per device" in text
