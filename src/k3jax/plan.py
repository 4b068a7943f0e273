"""Mesh planner: AOT-compile candidate meshes for a TPU topology and rank those that fit.

    python -m k3jax.plan configs/base.yml model_name=kimi-k3 topology=tpu7x-1024 max_target_length=4096

Candidates are (expert parallelism, data parallelism, context parallelism, remat policy,
per-device batch) with fsdp filling the remaining devices of the slice, from the plan_* keys
(``plan_context_parallelism``, default [1]: at 128K tokens one sequence's activations need several
chips, so try e.g. [8, 16]; a per-device batch of 1 then gives each device one row's 128K / context
tokens, and global batch = per-device batch x devices / context rows); expert parallelism defaults to
the three largest common divisors of num_experts and the device count (experts dominate K3's
memory). Every candidate's train step is
compiled with libtpu (k3jax.compile) and kept when its per-device memory fits in HBM; the table
is ranked by the roofline estimate of tokens/s/chip (model FLOPs and XLA bytes at the chip's peak,
see k3jax.compile.train_estimate). A candidate the compiler rejects is listed with its reason.
Offload remat policies (``plan_remat_policies=[save_mixer_out, offload_mixer_out]``) rank beside the
device-only ones: their HBM is what the compiled step keeps on device, and the bound gains a host
term, the offloaded activations out and back over the chip's host link (``roofline.host_transfer_bytes``
at ``Chip.host_bandwidth``).

Multi-slice (``compile_topology_num_slices`` = N > 1): every in-slice candidate is tried once per
axis of ``plan_dcn_axes`` (default data and stage) with that axis N across the slices
(``dcn_<axis>_parallelism=N``; stage candidates stream ``num_pipeline_microbatches`` microbatches
and compile without checkpointing, which the pipeline refuses): dcn_data keeps the whole training
state in each slice, dcn_fsdp gathers every weight over DCN, dcn_expert sends tokens over it,
dcn_stage hands the residual state over it. One table ranks them all by the roofline with the DCN
term (``k3jax.roofline``: DCN bytes at the chip's DCN bandwidth, the pipeline's bubble and stage
hops), with the bubble, the bytes crossing slices per step and the DCN time beside; candidates that
do not fit or do not compile are listed below it.

``plan_step=decode`` searches serving meshes instead: tensor x expert (data = fsdp = 1, non-expert
weights replicated over expert: ``shard_params_over_all_axes=false``), expert sizes from
``plan_expert_parallelism`` or the divisors of num_experts and the device count from 2 up to
three, tensor filling the rest and dividing the attention / KDA heads. Each decode step (batch
``per_device_batch_size`` x devices, a cache of max_target_length) is compiled, kept when it fits,
and ranked by the analytic roofline ms per token (``k3jax.compile.decode_estimate``).
"""
from __future__ import annotations

import sys

from k3jax import compile as K
from k3jax import config as C
from k3jax.cli import run_tool
from k3jax import roofline as R
from k3jax import topology as TP
from k3jax.sharding import make_mesh
from k3jax.state import abstract_state

def candidates(cfg, num_devices: int) -> list[dict]:
    """Mesh/remat/batch combinations to try (plan_* keys), most expert-parallel first (experts
    dominate memory); expert sizes that do not divide both num_experts and the device count, and
    data sizes that do not divide what is left, are skipped."""
    m, c = cfg.model, cfg.compile
    eps = list(c.plan_expert_parallelism) or sorted(
        (e for e in range(1, num_devices + 1) if num_devices % e == 0 and m.num_experts % e == 0),
        reverse=True)[:3]
    out = []
    for ep in sorted({int(e) for e in eps}, reverse=True):
        if num_devices % ep or m.num_experts % ep:
            continue
        for dp in c.plan_data_parallelism:
            if (num_devices // ep) % int(dp):
                continue
            for cp in c.plan_context_parallelism:
                if (num_devices // ep // int(dp)) % int(cp) or cfg.train.max_target_length % int(cp):
                    continue
                for remat in c.plan_remat_policies:
                    for pdb in c.plan_batch_sizes:
                        out.append({"ici_expert_parallelism": ep, "ici_data_parallelism": int(dp),
                                    "ici_context_parallelism": int(cp), "ici_fsdp_parallelism": -1,
                                    "remat_policy": str(remat), "per_device_batch_size": float(pdb)})
    return out


DCN_AXES = ("data", "fsdp", "expert", "stage")


def _dcn_split(axis: str, slices: int) -> dict | None:
    """plan_dcn_axes entry -> {mesh axis: its size across the ``slices``}: one axis ("fsdp") takes
    them all; a pair ("stage*fsdp") gives the first the smallest divisor d of the slices with
    1 < d < slices and the second slices / d (4 slices: stage=2 x fsdp=2); None when no such d."""
    parts = axis.split("*")
    if len(parts) == 1:
        return {axis: slices}
    d = next((d for d in range(2, slices) if slices % d == 0), None)
    return None if d is None else {parts[0]: d, parts[1]: slices // d}


def multislice_candidates(cfg, devices_per_slice: int, slices: int) -> list[dict]:
    """The in-slice candidates once per entry of plan_dcn_axes spanning the ``slices``: one axis
    across all of them, or two ("stage*fsdp") splitting them (``_dcn_split``)."""
    axes = [str(a) for a in cfg.compile.plan_dcn_axes]
    bad = [a for a in axes if len(a.split("*")) > 2 or len(set(a.split("*"))) < len(a.split("*"))
           or any(p not in DCN_AXES for p in a.split("*"))]
    if bad or not axes:
        raise C.ConfigError(f"plan_dcn_axes={axes}: each entry must be one of {', '.join(DCN_AXES)}, or two of "
                            f"them joined by '*' (e.g. stage*fsdp: the slices split between them; at least one entry)")
    out = []
    for axis in axes:
        split = _dcn_split(axis, slices)
        if split is None:          # a pair needs a slice count with a divisor between 1 and itself
            continue
        for cand in candidates(cfg, devices_per_slice):
            extra = {"enable_checkpointing": False} if "stage" in split else {}
            out.append({**cand, **{f"dcn_{a}_parallelism": n for a, n in split.items()}, "dcn_axis": axis, **extra})
    return out


def decode_candidates(cfg, num_devices: int) -> list[dict]:
    """Serving meshes tensor x expert to try, least expert-parallel first (most tensor-parallel)."""
    m = cfg.model
    eps = [int(e) for e in cfg.compile.plan_expert_parallelism] or [
        e for e in range(2, num_devices + 1) if num_devices % e == 0 and m.num_experts % e == 0][:3]
    out = []
    for ep in sorted(set(eps)):
        tp = num_devices // ep
        if num_devices % ep or m.num_experts % ep or m.num_attention_heads % tp or m.kda_num_heads % tp:
            continue
        out.append({"ici_expert_parallelism": ep, "ici_tensor_parallelism": tp, "ici_data_parallelism": 1,
                    "ici_fsdp_parallelism": 1, "shard_params_over_all_axes": False})
    return out


def _compiled(cfg, devices, cand: dict, compile_fn):
    """Compile ``cand``'s step with ``compile_fn``; -> (row, (cfg, mesh, compiled, secs, batch)), or
    (row with the refusal under "error", None) for a config error or the compiler's refusal (HBM
    OOM at compile time, kernel refusals)."""
    row = dict(cand)
    try:
        c = C.override(cfg, {k: v for k, v in cand.items() if k != "dcn_axis"})
        C.validate(c, num_devices=len(devices))
        mesh = make_mesh(c, devices=devices)
        row["mesh"] = K.mesh_desc(mesh)
        compiled, secs, gb = compile_fn(c, mesh)
    except C.ConfigError as e:
        row["error"] = str(e)
        return row, None
    except (ValueError, RuntimeError, NotImplementedError) as e:
        row["error"] = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        return row, None
    return row, (c, mesh, compiled, secs, gb)


def evaluate_decode(cfg, devices, chip: TP.Chip, cand: dict) -> dict:
    """Compile one serving mesh's decode step; -> row with memory and the decode roofline."""
    row, done = _compiled(cfg, devices, cand, K.compile_decode)
    if done is None:
        return row
    c, mesh, compiled, secs, gb = done
    row.update(memory=K.memory_report(compiled, chip.hbm_bytes), global_batch=gb, compile_s=secs,
               estimate=K.decode_estimate(c, mesh, chip, *K.decode_inputs(c, mesh, gb), gb))
    return row


def decode_table(rows: list[dict]) -> str:
    ok = sorted((r for r in rows if "memory" in r and r["memory"]["fits"]),
                key=lambda r: (r["estimate"]["ms_per_token"], r["memory"]["total"]))
    head = (f"{'rank':>4}  {'mesh':<52} {'batch':>5} {'context':>7} {'mem/dev GiB':>11} {'HBM%':>5} "
            f"{'ms/token':>8} {'tok/s/chip':>10}")
    lines = [head, "-" * len(head)]
    for i, r in enumerate(ok, 1):
        e, m = r["estimate"], r["memory"]
        lines.append(f"{i:>4}  {r['mesh']:<52} {r['global_batch']:>5} {e['context']:>7} {m['total'] / TP.GiB:>11.2f} "
                     f"{100 * m['total'] / m['hbm']:>5.1f} {e['ms_per_token']:>8.3g} {e['tokens_per_s_per_chip']:>10.0f}")
    if ok:
        lines.append("ms/token and tok/s/chip: analytic decode roofline (HBM bytes, collective bytes at ICI bandwidth, "
                     "compute; overlapped; latency of collectives not modelled)")
    for r in (r for r in rows if r not in ok):
        why = r.get("error") or f"needs {r['memory']['total'] / TP.GiB:.1f} GiB per device"
        lines.append(f"      expert={r['ici_expert_parallelism']} tensor={r['ici_tensor_parallelism']}: {why}")
    return "\n".join(lines)


def evaluate(cfg, devices, chip: TP.Chip, cand: dict) -> dict:
    """Compile one candidate; -> row with memory, estimate, or the compiler's refusal."""
    row, done = _compiled(cfg, devices, cand, K.compile_train)
    if done is None:
        return row
    c, mesh, compiled, secs, gb = done
    mem, cost = K.memory_report(compiled, chip.hbm_bytes), K.cost_report(compiled)
    comm = K.collective_bytes(c, abstract_state(c, mesh)[1]["params"], mesh, gb)
    est = K.train_estimate(c, gb, len(devices), chip, cost, comm=comm, host_bytes=R.host_transfer_bytes(c, mem))
    row.update(memory=mem, cost=cost, estimate=est, collectives=comm, global_batch=gb, compile_s=secs)
    return row


def _label(r: dict) -> str:
    axis = r.get("dcn_axis")
    across = "".join(f"dcn_{a}={r[f'dcn_{a}_parallelism']} " for a in axis.split("*")) if axis else ""
    return (f"{across}expert={r['ici_expert_parallelism']} data={r['ici_data_parallelism']} "
            f"context={r.get('ici_context_parallelism', 1)} remat={r['remat_policy']} "
            f"batch/dev={r['per_device_batch_size']:g}")


def table(rows: list[dict], seq: int) -> str:
    """Ranked table of fitting rows (best tokens/s/chip bound first, then least memory), then the
    rejected ones. Multi-slice rows add the axis across slices, the bubble, the bytes crossing the
    slices per step (all devices) and the DCN time (overlappable + stage hops)."""
    # Best bound first; equal bounds (compute-bound candidates with the same batch and remat) rank
    # by memory, the candidate with more headroom first.
    ok = sorted((r for r in rows if "memory" in r and r["memory"]["fits"]),
                key=lambda r: (-round(r["estimate"]["tokens_per_s_per_chip"], 6), r["memory"]["total"]))
    multi = any("dcn_axis" in r for r in rows)
    host = any(r.get("memory", {}).get("host_temporaries") for r in ok)
    head = (f"{'rank':>4}  {'mesh':<52} {'remat':<17} {'batch/dev':>9} {'global':>7} {'mem/dev GiB':>11} "
            f"{'HBM%':>5} {'step s':>8} {'MFU%':>5} {'tok/s/chip':>10}")
    if host:
        head += f" {'host GiB':>8} {'host s':>7}"
    if multi:
        head += f" {'across':>11} {'bubble%':>7} {'x-slice GB':>10} {'DCN s':>7}"
    lines = [head, "-" * len(head)]
    for i, r in enumerate(ok, 1):
        e, m = r["estimate"], r["memory"]
        line = (f"{i:>4}  {r['mesh']:<52} {r['remat_policy']:<17} {r['per_device_batch_size']:>9g} "
                f"{r['global_batch']:>7} {m['total'] / TP.GiB:>11.2f} {100 * m['total'] / m['hbm']:>5.1f} "
                f"{e['step_s']:>8.3f} {100 * e['mfu']:>5.1f} {e['tokens_per_s_per_chip']:>10.0f}")
        if host:
            line += f" {m.get('host_temporaries', 0) / TP.GiB:>8.2f} {e.get('t_host', 0.0):>7.3f}"
        if multi:
            line += (f" {r['dcn_axis']:>11} {100 * e['bubble']:>7.1f} {r['collectives']['cross_slice_bytes'] / 1e9:>10.1f} "
                     f"{e['t_dcn'] + e['t_hops']:>7.3f}")
        lines.append(line)
    if ok:
        lines.append("step s, MFU% and tok/s/chip are roofline bounds: the slowest of compute at peak, XLA's HBM "
                     "bytes and the analytic collective bytes at ICI and DCN bandwidth, fully overlapped"
                     + ("; a pipelined step is that / (1 - bubble) plus its stage hops (k3jax.roofline)" if multi else "")
                     + ("; host GiB: offloaded activations per device, host s: them out and back over the host link"
                        if host else ""))
    rejected = [r for r in rows if r not in ok]
    if rejected:
        lines.append(f"not fitting or not compiling (sequence length {seq}):")
        for r in rejected:
            why = r.get("error") or f"needs {r['memory']['total'] / TP.GiB:.1f} GiB per device"
            lines.append(f"      {_label(r)}: {why}")
    return "\n".join(lines)


def plan(cfg, out=print, limit: int | None = None) -> list[dict]:
    """Try the candidates for cfg.compile.topology (x compile_topology_num_slices); print progress
    and the ranked table."""
    if not cfg.compile.topology:
        raise C.ConfigError("topology is not set; e.g. topology=tpu7x-1024 or topology=v5p-2048")
    topo = TP.resolve(cfg.compile.topology)
    slices = cfg.compile.compile_topology_num_slices
    if slices < 1:
        raise C.ConfigError(f"compile_topology_num_slices={slices}: must be 1 or more")
    if slices > 1 and cfg.compile.plan_step == "decode":
        raise C.ConfigError("plan_step=decode plans one slice; set compile_topology_num_slices=1")
    devices = TP.devices(topo, slices)
    if cfg.compile.plan_step == "decode":
        return _plan_decode(cfg, topo, devices, out, limit)
    per_slice = len(devices) // slices
    cands = (multislice_candidates(cfg, per_slice, slices) if slices > 1 else candidates(cfg, per_slice))[:limit]
    where = f"{slices} x {topo}" if slices > 1 else str(topo)
    out(f"planning {cfg.model_name} on {where}: {len(cands)} candidates, sequence length {cfg.train.max_target_length}")
    rows = []
    for i, cand in enumerate(cands, 1):
        r = evaluate(cfg, devices, topo.chip, cand)
        status = r.get("error") or (f"{r['memory']['total'] / TP.GiB:.1f} GiB/dev, "
                                    f"{r['estimate']['tokens_per_s_per_chip']:.0f} tok/s/chip")
        out(f"[{i}/{len(cands)}] {_label(cand)}: {status}")
        rows.append(r)
    out(table(rows, cfg.train.max_target_length))
    return rows


def _plan_decode(cfg, topo, devices, out, limit) -> list[dict]:
    cands = decode_candidates(cfg, len(devices))[:limit]
    out(f"planning {cfg.model_name} decode on {topo}: {len(cands)} serving meshes, batch "
        f"{cfg.global_batch_size(len(devices))}, context {cfg.train.max_target_length}")
    rows = []
    for i, cand in enumerate(cands, 1):
        r = evaluate_decode(cfg, devices, topo.chip, cand)
        status = r.get("error") or (f"{r['memory']['total'] / TP.GiB:.1f} GiB/dev, "
                                    f"{r['estimate']['ms_per_token']:.3g} ms/token")
        out(f"[{i}/{len(cands)}] expert={cand['ici_expert_parallelism']} tensor={cand['ici_tensor_parallelism']}: "
            f"{status}")
        rows.append(r)
    out(decode_table(rows))
    return rows


def _run(cfg) -> int:
    try:
        rows = plan(cfg)
    except RuntimeError as e:   # libtpu unavailable
        print(f"error: {e}", file=sys.stderr)
        return 1
    if not any("memory" in r and r["memory"]["fits"] for r in rows):
        print("error: no candidate fits; try a longer slice, a shorter max_target_length or moe_mode=capacity",
              file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_tool("plan", _run, argv, __doc__)


if __name__ == "__main__":
    raise SystemExit(main())
