"""Ahead-of-time compilation for a TPU topology from a CPU host: does the step fit, and how fast?

    python -m k3jax.compile configs/base.yml model_name=kimi-k3 compile_topology=v5p-2048 \\
        ici_fsdp_parallelism=16 ici_expert_parallelism=64 per_device_batch_size=1 max_target_length=4096 \\
        dtype=bfloat16 weight_dtype=bfloat16 kda_impl=chunked moe_mode=capacity

Builds the abstract train state (parameters, optimizer moments, router biases: shapes, dtypes and
NamedShardings only, nothing allocated: ``state.abstract_state``), lowers the real jitted train step (``step.make_train_step``)
and the decode step (``model.decode_step`` over a cache of ``max_target_length`` slots) against the
topology's virtual devices and compiles them with libtpu. Prints per-device memory from
``memory_analysis()`` against the chip's HBM, XLA's FLOPs from ``cost_analysis()`` next to the
analytic ``counts.train_flops_per_token``, and a roofline step-time / MFU estimate. Exits 1 with a
one-line reason when a step does not fit in HBM, 2 on a configuration error.

Caveat on XLA's FLOPs: HLO cost analysis counts a while-loop body once, whatever its trip count, so
with scanned layers (``scan_layers=true``), gradient accumulation, the chunked loss or KDA's chunk
loop the XLA figure undercounts; the analytic figure is the one used for MFU (docs/flops.md).
"""
from __future__ import annotations

import math
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax import config as C
from k3jax.cli import run_tool
from k3jax.data.vision_processor import from_config, patch_bucket, resize_plan
from k3jax import counts
from k3jax import roofline as R
from k3jax import topology as TP
from k3jax.roofline import (collective_bytes as collective_bytes, context_attention_factor as context_attention_factor,
                            context_collective_bytes as context_collective_bytes, decode_estimate as decode_estimate,
                            format_decode as format_decode, gib as gib, roofline as roofline,
                            weight_collective_bytes as weight_collective_bytes)
from k3jax.kernels.moe.gmm import resolve_impl as resolve_moe_impl
from k3jax.kernels.platform import resolve
from k3jax.loss import resolve_loss_impl
from k3jax.feed import token_sharding
from k3jax.inference.batch_prefill import prefill
from k3jax.inference.programs import Programs
from k3jax.sharding import batch_sharding, make_mesh, refuse_stages, sharding_for
from k3jax.state import abstract_state
from k3jax.step import check_batch, jit_train_step
from k3jax.data.media_layout import ARRAY_KEYS, media_layout


class DoesNotFit(RuntimeError):
    """A compiled step needs more memory per device than the chip has."""


# ---- abstract inputs (the state comes from k3jax.state.abstract_state) ---------------------------

def abstract_batch(cfg, mesh, global_batch: int):
    """Train batch of [B,T]: int32 tokens/targets/segment_ids/positions and f32 loss_mask."""
    t = cfg.train.max_target_length
    sh = token_sharding(mesh)
    spec = lambda dt: jax.ShapeDtypeStruct((global_batch, t), dt, sharding=sh)  # noqa: E731
    batch = {"tokens": spec(jnp.int32), "targets": spec(jnp.int32), "segment_ids": spec(jnp.int32),
             "positions": spec(jnp.int32), "loss_mask": spec(jnp.float32)}
    media = media_plan(cfg)
    if media:
        batch["media"] = {k: jax.ShapeDtypeStruct((global_batch, *a.shape), a.dtype, sharding=batch_sharding(mesh, 1 + a.ndim))
                          for k, a in media["arrays"].items()}
    return batch


def media_plan(cfg) -> dict | None:
    """The media of each row of the compiled VL train step (``compile_images_per_sequence`` square
    images of ``compile_image_size`` pixels), grouped per row (``VisionEncoder``'s [G, N, ...] form:
    each device encodes its own rows' images): grid, patch and token counts and one row's arrays
    (patch bucket from ``vision_patch_buckets`` as the processor pads). None for a text-only step."""
    n_img = cfg.compile.compile_images_per_sequence
    if not n_img:
        return None
    pcfg, v = from_config(cfg), cfg.vision
    side = cfg.compile.compile_image_size
    plan = resize_plan(side, side, pcfg)
    grids = [(1, plan.grid_h, plan.grid_w)] * n_img
    patches, tokens = n_img * plan.grid_h * plan.grid_w, n_img * plan.tokens
    if tokens >= cfg.train.max_target_length:
        raise C.ConfigError(f"{n_img} images of {side}x{side} pixels make {tokens} tokens, not fewer than "
                            f"max_target_length={cfg.train.max_target_length}; lower compile_images_per_sequence "
                            f"or compile_image_size")
    bucket = patch_bucket(patches, pcfg)
    m = bucket // v.vision_merge_kernel_size ** 2
    lay = media_layout(v, np.asarray(grids), bucket, m, max_frames=1)
    arrays = {k: lay[k] for k in ARRAY_KEYS}
    arrays["patches"] = np.zeros((bucket, pcfg.patch_dim), np.float32)
    arrays["slots"] = np.zeros(m, np.int32)
    return {"images": n_img, "grids": grids, "patches": patches, "tokens": tokens, "bucket": bucket, "arrays": arrays}


def abstract_cache(model, mesh, batch: int, length: int):
    """Decode cache of ``length`` slots for ``batch`` rows, sharded by its logical axes."""
    refuse_stages(mesh)
    spec = model.cache_spec(batch, length)
    leaf = lambda x: isinstance(x, tuple) and len(x) == 3 and isinstance(x[0], tuple)  # noqa: E731
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s[0], s[1], sharding=sharding_for(mesh, s[0], s[2])),
                        spec, is_leaf=leaf)


# ---- compilation -----------------------------------------------------------------------------------

def check_rows(mesh, rows: int, what: str) -> None:
    """The rows of a step split over the mesh's batch axes (data x fsdp x expert) or it cannot be laid
    out: a ConfigError naming the sizes, not the compiler's IndivisibleError."""
    spec = token_sharding(mesh).spec[0]
    axes = (spec,) if isinstance(spec, str) else tuple(spec or ())
    n = math.prod(mesh.shape[a] for a in axes)
    if rows % n:
        raise C.ConfigError(f"the {what} has {rows} row(s) but the batch axes {' x '.join(axes)} = {n} split rows; "
                            f"raise per_device_batch_size (rows = per_device_batch_size x devices / context) or the "
                            f"context parallelism so that the rows are a multiple of {n}")


def compiler_options(cfg) -> dict:
    """``compile()`` keywords: with compile_dump_dir set, the compiler (libtpu included, which reads
    no XLA_FLAGS of ours) dumps its optimised HLO, buffer assignment and memory-usage report there."""
    d = cfg.compile.compile_dump_dir
    return {"compiler_options": {"xla_dump_to": str(d), "xla_dump_hlo_as_text": True}} if d else {}


def compile_lowered(lowered, cfg, mesh):
    """``lowered.compile()`` with ``compiler_options``. For a mesh of another platform's virtual
    devices (a TPU topology compiled from a CPU host) nothing is written to the persistent
    compilation cache: this process has no client that can load such an executable, so an entry
    (a large one for K3, perhaps in a gs:// ``jax_cache_dir``) would only fail on every later read
    with "PjRtCompiler must be constructed with a Client" and be compiled again. jax decides once
    per process whether the cache is on, so the write is skipped through the one setting it reads
    at every write, the minimum compile time worth caching, raised to infinity for the call."""
    foreign = mesh.devices.flat[0].platform != jax.default_backend()
    key = "jax_persistent_cache_min_compile_time_secs"
    was = getattr(jax.config, key)
    if foreign:
        jax.config.update(key, float("inf"))
    try:
        return lowered.compile(**compiler_options(cfg))
    finally:
        if foreign:
            jax.config.update(key, was)


def compile_train(cfg, mesh, on_trace=None):
    """Lower and compile the jitted train step for ``mesh``; -> (Compiled, seconds, global batch).
    ``on_trace(jaxpr)``: called with the traced step's jaxpr (e.g. ``host_moves``) before it compiles."""
    gb = check_batch(cfg, mesh.devices.size)
    check_rows(mesh, gb, "train batch")
    gdef, state, tx = abstract_state(cfg, mesh, optimizer=True)
    step = jit_train_step(cfg, gdef, tx, state)
    t0 = time.perf_counter()
    with jax.set_mesh(mesh):
        traced = step.trace(state, abstract_batch(cfg, mesh, gb))
        if on_trace is not None:
            on_trace(traced.jaxpr)
        compiled = compile_lowered(traced.lower(), cfg, mesh)
    return compiled, time.perf_counter() - t0, gb


def host_moves(jaxpr) -> dict:
    """{checkpoint name: {"moves": copies to host memory per step, "bytes": their bytes}} of a traced
    program: every ``device_put`` to host memory space (what an offload remat policy inserts)
    counted under the ``checkpoint_name`` of its operand (``"?"`` for an unnamed one), times the
    trip counts of the scans around it. Bytes are of the traced (global) shapes, per shard inside a
    shard_map."""
    out: dict = {}

    def walk(jx, times):
        named = {}
        for eqn in jx.eqns:
            p = eqn.primitive.name
            if p == "name":
                named[eqn.outvars[0]] = eqn.params["name"]
            if p == "device_put":
                for v, o in zip(eqn.invars, eqn.outvars):
                    if getattr(o.aval, "memory_space", None) == jax.memory.Space.Host:
                        r = out.setdefault(named.get(v, "?"), {"moves": 0, "bytes": 0})
                        r["moves"] += times
                        r["bytes"] += times * o.aval.size * o.aval.dtype.itemsize
            inner = times * eqn.params["length"] if p == "scan" else times
            for val in eqn.params.values():
                for sub in val if isinstance(val, (tuple, list)) else (val,):
                    sub = getattr(sub, "jaxpr", sub)          # a ClosedJaxpr's Jaxpr
                    if hasattr(sub, "eqns"):
                        walk(sub, inner)

    walk(jaxpr.jaxpr if hasattr(jaxpr, "jaxpr") else jaxpr, 1)
    return out


def host_copies(compiled) -> dict:
    """The compiled program's host-memory traffic: buffers in host memory space (``S(5)`` in TPU HLO
    layouts) and async copies started."""
    text = compiled.as_text()
    return {"host_memory_space": text.count("S(5)"), "copy_start": text.count("copy-start")}


def decode_inputs(cfg, mesh, gb: int):
    """(params, rest, cache, cache layout tree) of the decode step, abstract and sharded."""
    gdef, state, _ = abstract_state(cfg, mesh)
    params, rest = state["params"], state["rest"]
    model = nnx.merge(gdef, params, rest)
    length = cfg.train.max_target_length
    return params, rest, abstract_cache(model, mesh, gb, length), model.cache_spec(gb, length)


def _serving_state(cfg, mesh, what: str):
    """(rows, graphdef, params, rest, cache of max_target_length slots) of the decode and prefill
    compiles, abstract and sharded; the rows must split over the batch axes."""
    gb = cfg.global_batch_size(mesh.devices.size)
    check_rows(mesh, gb, what)
    gdef, state, _ = abstract_state(cfg, mesh)
    params, rest = state["params"], state["rest"]
    cache = abstract_cache(nnx.merge(gdef, params, rest), mesh, gb, cfg.train.max_target_length)
    return gb, gdef, params, rest, cache


def compile_decode(cfg, mesh):
    """Compile one ``model.decode_step`` (one token per row, cache of max_target_length slots)."""
    gb, gdef, params, rest, cache = _serving_state(cfg, mesh, "decode batch")
    cache_sh = jax.tree.map(lambda x: x.sharding, cache)
    rows = batch_sharding(mesh, 1)
    scalar = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    def step(params, rest, tokens, cache, pos, start):
        return nnx.merge(gdef, params, rest).decode_step(tokens, cache, pos, start)

    fn = jax.jit(step, donate_argnums=3, out_shardings=(None, cache_sh))
    args = (params, rest, jax.ShapeDtypeStruct((gb,), jnp.int32, sharding=rows), cache,
            jax.ShapeDtypeStruct((), jnp.int32, sharding=scalar), jax.ShapeDtypeStruct((gb,), jnp.int32, sharding=rows))
    t0 = time.perf_counter()
    with jax.set_mesh(mesh):
        compiled = compile_lowered(fn.lower(*args), cfg, mesh)
    return compiled, time.perf_counter() - t0, gb


def compile_prefill(cfg, mesh):
    """Compile ``inference.batch_prefill.prefill`` of a max_target_length-token prompt per row into a
    cache of as many slots: the prompt forward under the training mesh (its sequence split over the
    context axis, the context-parallel KDA / MLA / conv kernels) and the cache it leaves, sharded as
    decode reads it."""
    gb, gdef, params, rest, cache = _serving_state(cfg, mesh, "prefill batch")
    length = cfg.train.max_target_length
    rows = batch_sharding(mesh, 1)
    tok = jax.ShapeDtypeStruct((gb, length), jnp.int32, sharding=token_sharding(mesh))

    def step(params, rest, tokens, segment_ids, start):
        return prefill(nnx.merge(gdef, params, rest), tokens, segment_ids, start, length)

    fn = jax.jit(step, out_shardings=(None, jax.tree.map(lambda x: x.sharding, cache)))
    t0 = time.perf_counter()
    with jax.set_mesh(mesh):
        compiled = compile_lowered(fn.lower(params, rest, tok, tok, jax.ShapeDtypeStruct((gb,), jnp.int32, sharding=rows)),
                                   cfg, mesh)
    return compiled, time.perf_counter() - t0, gb


def compile_serve(cfg, mesh):
    """The inference core's programs as ``k3jax.serve`` runs them (``serve_max_batch`` slots of
    max_target_length positions; the largest decode bucket, ``serve_decode_steps`` steps per call;
    the ``serve_prefill_chunk`` prefill), compiled for the mesh -> ({name: compiled}, seconds)."""
    gdef, state, _ = abstract_state(cfg, mesh)
    sv = cfg.serve
    progs = Programs(nnx.merge(gdef, state["params"], state["rest"]), mesh, slots=sv.serve_max_batch,
                     length=cfg.train.max_target_length, chunk=sv.serve_prefill_chunk,
                     decode_sizes=sv.serve_decode_buckets, decode_steps=sv.serve_decode_steps,
                     compile_fn=lambda lowered: compile_lowered(lowered, cfg, mesh))
    b, c = progs.decode_sizes[-1], progs.buckets[-1]
    out = {f"decode[{b}]": progs.program("decode", b), f"prefill[{c}]": progs.program("prefill", c)}
    return out, progs.compile_s


# ---- reports (the roofline estimates live in k3jax.roofline) ---------------------------------------

def memory_report(compiled, hbm_bytes: float) -> dict:
    """Per-device bytes from ``compiled.memory_analysis()``.

    total = arguments + outputs - aliased (donated buffers reused as outputs) + temporaries +
    generated code: the peak a device must hold while the step runs. host_temporaries: what the step
    holds in the host's memory for this device (activations an offload remat policy moved there).
    """
    ma = compiled.memory_analysis()
    if ma is None:
        raise RuntimeError("the compiled executable has no memory analysis")
    r = {"arguments": ma.argument_size_in_bytes, "outputs": ma.output_size_in_bytes,
         "aliased": ma.alias_size_in_bytes, "temporaries": ma.temp_size_in_bytes,
         "code": ma.generated_code_size_in_bytes,
         "host_temporaries": getattr(ma, "host_temp_size_in_bytes", 0)}   # offloaded activations (remat)
    r["total"] = r["arguments"] + r["outputs"] - r["aliased"] + r["temporaries"] + r["code"]
    r["hbm"] = hbm_bytes
    r["fits"] = r["total"] <= hbm_bytes
    return r


def cost_report(compiled) -> dict:
    """Per-device FLOPs and bytes accessed from XLA's cost analysis (loop bodies counted once)."""
    ca = compiled.cost_analysis()
    if isinstance(ca, (list, tuple)):  # older jax returned one dict per program
        ca = ca[0] if ca else {}
    ca = ca or {}
    return {"flops": float(ca.get("flops", 0.0)), "bytes": float(ca.get("bytes accessed", 0.0))}


def train_estimate(cfg, gb: int, n_dev: int, chip: TP.Chip, cost: dict, ici_bytes: float = 0.0,
                   comm: dict | None = None, host_bytes: float = 0.0) -> dict:
    """``roofline.train_estimate`` with the compiled step's media (its vision FLOPs)."""
    return R.train_estimate(cfg, gb, n_dev, chip, cost, ici_bytes, media=media_plan(cfg), comm=comm,
                            host_bytes=host_bytes)


def format_memory(name: str, mem: dict) -> str:
    pct = 100 * mem["total"] / mem["hbm"]
    return (f"{name} memory per device: arguments {gib(mem['arguments'])}, outputs {gib(mem['outputs'])} "
            f"(aliased {gib(mem['aliased'])}), temporaries {gib(mem['temporaries'])}, code {gib(mem['code'])}; "
            f"total {gib(mem['total'])} of {gib(mem['hbm'])} HBM ({pct:.1f}%) -> "
            f"{'fits' if mem['fits'] else 'DOES NOT FIT'}"
            + (f"; host memory {gib(mem['host_temporaries'])}" if mem.get("host_temporaries") else ""))


def mesh_desc(mesh) -> str:
    return " x ".join(f"{a}={s}" for a, s in mesh.shape.items())


def topology_mesh(cfg, name: str):
    """(Topology, Mesh over its virtual devices) for ``name``, mesh sizes from cfg.mesh."""
    topo = TP.resolve(name)
    slices = cfg.compile.compile_topology_num_slices
    devs = TP.devices(topo, slices)
    C.validate(cfg)
    C.mesh_shape(cfg, len(devs), slices)   # the dcn_* sizes span the slices
    return topo, make_mesh(cfg, devices=devs)


def run(cfg, out=print) -> dict:
    """Compile the steps named by cfg.compile.compile_step; -> {"train": report, "decode": report}."""
    if not cfg.compile.compile_topology:
        raise C.ConfigError("compile_topology is not set; e.g. compile_topology=v5p-2048 or v5p:2x2x1")
    topo, mesh = topology_mesh(cfg, cfg.compile.compile_topology)
    chip, n = topo.chip, mesh.devices.size
    m = cfg.model
    total, active = counts.param_counts(m)
    platform = mesh.devices.flat[0].platform
    slices = cfg.compile.compile_topology_num_slices
    out(f"topology {f'{slices} x ' if slices > 1 else ''}{topo}; mesh {mesh_desc(mesh)}; model {cfg.model_name}: {counts.human(total)} params, "
        f"{counts.human(active)} active; kernels kda={resolve('kda_impl', cfg.kernel.kda_impl, platform)} "
        f"attention={resolve('attention_impl', cfg.kernel.attention_impl, platform)} "
        f"moe={resolve_moe_impl(cfg.kernel.moe_impl, platform)}/{cfg.kernel.moe_mode}/"
        f"{resolve('moe_ep_transport', cfg.kernel.moe_ep_transport, platform)} "
        f"loss={resolve_loss_impl(cfg.kernel.loss_impl, platform)}; "
        f"remat={cfg.train.remat_policy}")
    reports = {}
    if cfg.compile.compile_step in ("train", "both"):
        moves = {}
        compiled, secs, gb = compile_train(cfg, mesh, on_trace=lambda jx: moves.update(host_moves(jx)))
        mem, cost = memory_report(compiled, chip.hbm_bytes), cost_report(compiled)
        comm = collective_bytes(cfg, abstract_state(cfg, mesh)[1]["params"], mesh, gb)
        est = train_estimate(cfg, gb, n, chip, cost, comm=comm, host_bytes=R.host_transfer_bytes(cfg, mem))
        reports["train"] = {"memory": mem, "cost": cost, "estimate": est, "collectives": comm, "compile_s": secs,
                            "global_batch": gb}
        out(f"train step: global batch {gb} x {cfg.train.max_target_length} tokens, compiled in {secs:.1f}s")
        media = media_plan(cfg)
        if media:
            g = media["grids"][0]
            out(f"train media per sequence: {media['images']} images of {cfg.compile.compile_image_size}px -> grid "
                f"{g[1]}x{g[2]}, {media['patches']} patches (bucket {media['bucket']}), {media['tokens']} tokens; "
                f"tower + projector {'frozen' if {'vision', 'projector'} <= set(cfg.train.freeze) else 'trained'}: "
                f"{est['vision_flops_per_device']:.3e} model FLOPs per device "
                f"({100 * est['vision_flops_per_device'] / est['model_flops_per_device']:.1f}% of the step)")
        out(format_memory("train", mem))
        if moves:
            hc = host_copies(compiled)
            out(f"train offload to host: " + ", ".join(f"{k} {v['moves']} copies ({v['bytes'] / 2**20:.2f} MiB, all "
                                                       f"devices)" for k, v in sorted(moves.items()))
                + f" per step; compiled: {hc['host_memory_space']} host-memory buffers (S(5)), {hc['copy_start']} "
                  f"async copies; host link {chip.host_gbps_per_chip:g} GB/s per chip: "
                + (f"{est['t_host']:.3f}s for {R.host_transfer_bytes(cfg, mem) / 2**30:.2f} GiB out and back"
                   if not est["host_unknown"] else "bandwidth unknown, left out of the bound"))
        out(f"train FLOPs per device: XLA cost analysis {cost['flops']:.3e} (loop bodies once), analytic model "
            f"{est['model_flops_per_device']:.3e} ({counts.human(est['flops_per_token'])} per token), executed "
            f"with remat {est['executed_flops_per_device']:.3e}; XLA bytes accessed {cost['bytes']:.3e}")
        out(f"train collectives per device (analytic, lower bound): weight all-gathers {comm['weight_gather']:.3e} B, "
            f"gradient reductions {comm['grad_reduce']:.3e} B, expert all-to-alls {comm['expert_all_to_all']:.3e} B, "
            f"context-parallel exchanges {comm['context_exchange']:.3e} B (context={mesh.shape.get('context', 1)}: "
            f"{cfg.train.max_target_length // mesh.shape.get('context', 1)} tokens per slice)")
        for line in R.format_multislice(comm, est, chip, n):
            out(line)
        out(f"train roofline bound at peak ({chip.peak_flops / 1e12:.0f} TFLOP/s, {chip.hbm_bandwidth / 1e9:.0f} GB/s "
            f"HBM, {chip.ici_bandwidth / 1e9:.0f} GB/s ICI, {chip.dcn_bandwidth / 1e9:.2f} GB/s DCN per device, all "
            f"overlapped{R.pipeline_note(est)}): step >= {est['step_s']:.3f}s (compute {est['t_compute']:.3f}s, memory "
            f"{est['t_memory']:.3f}s, collectives {est['t_ici']:.3f}s ICI / {est['t_dcn']:.3f}s DCN), "
            f"MFU <= {100 * est['mfu']:.1f}%, <= {est['tokens_per_s_per_chip']:.0f} tokens/s/chip")
    if cfg.compile.compile_step in ("decode", "both"):
        compiled, secs, gb = compile_decode(cfg, mesh)
        mem, cost = memory_report(compiled, chip.hbm_bytes), cost_report(compiled)
        est = decode_estimate(cfg, mesh, chip, *decode_inputs(cfg, mesh, gb), gb)
        reports["decode"] = {"memory": mem, "cost": cost, "compile_s": secs, "global_batch": gb, "estimate": est}
        out(f"decode step: batch {gb}, cache {cfg.train.max_target_length} slots, experts "
            f"{cfg.model.experts_format}, compiled in {secs:.1f}s")
        out(format_memory("decode", mem))
        out(f"decode FLOPs per device: XLA {cost['flops']:.3e}; bytes accessed {cost['bytes']:.3e} "
            f"(scanned layers counted once by XLA)")
        out(format_decode(est, chip))
    if cfg.compile.compile_step == "prefill":
        compiled, secs, gb = compile_prefill(cfg, mesh)
        mem, cost = memory_report(compiled, chip.hbm_bytes), cost_report(compiled)
        tokens = gb * cfg.train.max_target_length
        flops = counts.forward_flops_per_token(m, cfg.train.max_target_length, cfg.kernel.kda_chunk_size) * tokens / n
        r = roofline(flops, cost["bytes"], chip)
        reports["prefill"] = {"memory": mem, "cost": cost, "compile_s": secs, "global_batch": gb, "estimate": r}
        cp = mesh.shape.get("context", 1)
        out(f"prefill: {gb} prompt(s) x {cfg.train.max_target_length} tokens (context={cp}: "
            f"{cfg.train.max_target_length // cp} tokens per slice), compiled in {secs:.1f}s")
        out(format_memory("prefill", mem))
        out(f"prefill FLOPs per device: analytic forward {flops:.3e}; XLA {cost['flops']:.3e} (loop bodies once), "
            f"bytes accessed {cost['bytes']:.3e}; roofline at peak: >= {r['step_s']:.2f}s "
            f"({tokens / max(r['step_s'], 1e-12):.0f} prompt tokens/s on the whole slice)")
    if cfg.compile.compile_step == "serve":
        sv = cfg.serve
        programs, secs = compile_serve(cfg, mesh)
        out(f"serve: {sv.serve_max_batch} slots x {cfg.train.max_target_length} positions, {sv.serve_decode_steps} "
            f"decode step(s) per call, prefill chunk {sv.serve_prefill_chunk}; compiled in {secs:.1f}s")
        for name, compiled in programs.items():
            mem, cost = memory_report(compiled, chip.hbm_bytes), cost_report(compiled)
            reports[name] = {"memory": mem, "cost": cost}
            out(format_memory(name, mem))
            out(f"{name} per call: XLA FLOPs {cost['flops']:.3e}, bytes accessed {cost['bytes']:.3e} (loop bodies "
                f"counted once)")
    return reports


def fit_error(reports: dict) -> str | None:
    """One actionable line naming the steps that do not fit in HBM, or None when all fit."""
    over = [k for k, r in reports.items() if not r["memory"]["fits"]]
    if not over:
        return None
    need = "; ".join(f"{k} needs {gib(reports[k]['memory']['total'])} per device of {gib(reports[k]['memory']['hbm'])}"
                     for k in over)
    return (f"the {' and '.join(over)} step does not fit in HBM: {need} (raise ici_fsdp/expert parallelism, lower "
            f"per_device_batch_size or max_target_length, use remat_policy=full or moe_mode=capacity)")


def _run(cfg) -> int:
    try:
        reports = run(cfg)
    except (RuntimeError, NotImplementedError) as e:  # libtpu missing, a kernel that cannot lower, or OOM
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if "RESOURCE_EXHAUSTED" in first or "HbmOom" in first:  # XLA refuses at compile time
            print(f"error: does not fit: the TPU compiler ran out of HBM: {first}", file=sys.stderr)
        else:
            print(f"error: compilation failed: {type(e).__name__}: {first}", file=sys.stderr)
        return 1
    problem = fit_error(reports)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_tool("compile", _run, argv, __doc__)


if __name__ == "__main__":
    raise SystemExit(main())
