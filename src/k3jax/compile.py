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
from flax import nnx

from k3jax import config as C
from k3jax.cli import run_tool
from k3jax import counts
from k3jax import topology as TP
from k3jax.layers.common import is_variable
from k3jax.kernels.moe.gmm import resolve_impl as resolve_moe_impl
from k3jax.kernels.platform import resolve
from k3jax.loss import resolve_loss_impl
from k3jax.feed import token_sharding
from k3jax.sharding import batch_sharding, make_mesh, sharding_for
from k3jax.state import abstract_state
from k3jax.step import check_batch, jit_train_step


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
    import numpy as np
    from k3jax.data.vision_processor import from_config, patch_bucket, resize_plan
    from k3jax.vision.layout import ARRAY_KEYS, media_layout
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


def compile_train(cfg, mesh):
    """Lower and compile the jitted train step for ``mesh``; -> (Compiled, seconds, global batch)."""
    gb = check_batch(cfg, mesh.devices.size)
    check_rows(mesh, gb, "train batch")
    gdef, state, tx = abstract_state(cfg, mesh, optimizer=True)
    step = jit_train_step(cfg, gdef, tx, state)
    t0 = time.perf_counter()
    with jax.set_mesh(mesh):
        compiled = compile_lowered(step.lower(state, abstract_batch(cfg, mesh, gb)), cfg, mesh)
    return compiled, time.perf_counter() - t0, gb


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
    """Compile ``decode.prefill`` of a max_target_length-token prompt per row into a cache of as many
    slots: the prompt forward under the training mesh (its sequence split over the context axis, the
    context-parallel KDA / MLA / conv kernels) and the cache it leaves, sharded as decode reads it."""
    from k3jax.decode import prefill

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


# ---- reports ---------------------------------------------------------------------------------------

def memory_report(compiled, hbm_bytes: float) -> dict:
    """Per-device bytes from ``compiled.memory_analysis()``.

    total = arguments + outputs - aliased (donated buffers reused as outputs) + temporaries +
    generated code: the peak a device must hold while the step runs.
    """
    ma = compiled.memory_analysis()
    if ma is None:
        raise RuntimeError("the compiled executable has no memory analysis")
    r = {"arguments": ma.argument_size_in_bytes, "outputs": ma.output_size_in_bytes,
         "aliased": ma.alias_size_in_bytes, "temporaries": ma.temp_size_in_bytes,
         "code": ma.generated_code_size_in_bytes}
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


def roofline(flops_per_device: float, bytes_per_device: float, chip: TP.Chip, ici_bytes: float = 0.0) -> dict:
    """Lower-bound step time: the slowest of compute at peak, HBM traffic at full bandwidth and
    (when given) the analytic collective traffic at the chip's ICI bandwidth, all overlapped."""
    t_compute = flops_per_device / chip.peak_flops
    t_memory = bytes_per_device / chip.hbm_bandwidth
    t_ici = ici_bytes / chip.ici_bandwidth if ici_bytes and chip.ici_bandwidth else 0.0
    return {"t_compute": t_compute, "t_memory": t_memory, "t_ici": t_ici,
            "step_s": max(t_compute, t_memory, t_ici)}


def _mesh_axes(entry) -> tuple:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def weight_collective_bytes(leaves, mesh_shape: dict, passes: int) -> dict:
    """ICI bytes one device receives per step for the weights ``leaves`` =
    [(shape, itemsize, PartitionSpec, logical axes)].

    Activations are batch-sharded over data/fsdp/expert, so each weight is all-gathered for its
    matmuls over every mesh axis it is split on except ``tensor`` (tensor-parallel matmuls keep
    their shard) and, for routed-expert weights (an ``exp`` axis), ``expert`` (each device runs its
    own experts). A ring all-gather over G devices receives (G - 1) shards; ``passes`` gathers per
    step (forward, backward, and remat's recomputed forward). The gradient leaves by a
    reduce-scatter over the same group (G - 1 shards) and an all-reduce over the batch axes (data,
    fsdp, expert; not expert for routed experts) the weight is not split on (2 (R - 1) / R shards,
    R their size: a replicated weight's gradient is summed over every device's rows).
    """
    gather = reduce = 0.0
    for shape, itemsize, spec, axes in leaves:
        split = [a for e in spec for a in _mesh_axes(e)]
        shard = math.prod(shape) * itemsize / math.prod(mesh_shape[a] for a in split)
        keep = {"tensor"} | ({"expert"} if "exp" in axes else set())
        g = math.prod(mesh_shape[a] for a in split if a not in keep)
        gather += passes * (g - 1) * shard
        reduce += (g - 1) * shard
        r = math.prod(mesh_shape.get(a, 1) for a in ("data", "fsdp", "expert")
                      if a not in split and not (a == "expert" and "exp" in axes))
        if r > 1:
            reduce += 2 * (r - 1) / r * shard
    return {"weight_gather": gather, "grad_reduce": reduce}


def collective_bytes(cfg, params, mesh) -> dict:
    """Analytic ICI bytes one device receives per train step: weight all-gathers and gradient
    reduce-scatters (``weight_collective_bytes``) plus the MoE all-to-alls (dispatch and combine
    of tokens x top-k rows of the routed width, x capacity_factor in capacity mode, (ep - 1) / ep of
    them crossing devices, in every pass). A lower bound: ring algorithms at full link use, no
    DCN, no latency; XLA may also gather a weight once for several uses or re-gather it."""
    m, t, k = cfg.model, cfg.train, cfg.kernel
    passes = 2 if t.remat_policy == "none" else 3
    leaves = [(v.shape, jnp.dtype(v.dtype).itemsize, jax.tree.leaves(v)[0].sharding.spec, tuple(v.axes))
              for v in jax.tree.leaves(params, is_leaf=is_variable)]
    out = weight_collective_bytes(leaves, dict(mesh.shape), passes)
    ep = mesh.shape.get("expert", 1)
    moe_layers = sum(m.ffn(l) == "moe" for l in range(m.num_layers))
    width = m.moe_latent_size or m.hidden_size
    # each device routes its own tokens: pdb rows of T / context positions
    rows = t.per_device_batch_size * t.max_target_length / mesh.shape.get("context", 1) * m.num_experts_per_token
    if k.moe_mode == "capacity":
        rows *= k.capacity_factor
    act = jnp.dtype(cfg.train.dtype).itemsize
    out["expert_all_to_all"] = 2 * passes * moe_layers * rows * width * act * (ep - 1) / ep
    out["context_exchange"] = context_collective_bytes(cfg, mesh.shape.get("context", 1), passes)
    out["total"] = sum(out.values())
    return out


def context_collective_bytes(cfg, cp: int, passes: int) -> float:
    """Analytic ICI bytes one device receives per train step for context parallelism over ``cp``
    sequence slices (0 when cp = 1), each pass (forward, remat's re-forward, backward: the
    transposes move the same volume back) of every layer:

    - MLA all-gathers its slice's compressed latent and rope key (kv_lora_rank + qk_rope_head_dim
      values per token, activation dtype) from the cp - 1 other shards;
    - KDA combines the slices' affine state maps in f32: with ``allgather`` every (Phi, Psi)
      [rows, H, K, K + V]; with ``ring`` cp - 1 rounds of one [rows, H, K, V] state;
    - the short convs take the previous slice's last kda_conv_size - 1 inputs of q, k and v (f32);
    - with ``context_parallel_load_balance`` MLA's zigzag moves the slice's queries (H x qk_head_dim)
      out and its outputs (H x v_head_dim) back, activation dtype.

    Per device: pdb rows of T / cp tokens each (pdb = per_device_batch_size; the cp devices of a
    context group hold slices of the same rows, ``Config.global_batch_size``). Segment-id halos,
    the final-state psum and QK-clip's pmax are left out (a few bytes per row)."""
    if cp <= 1:
        return 0.0
    m, t = cfg.model, cfg.train
    rows = t.per_device_batch_size
    tokens = rows * t.max_target_length / cp
    act = jnp.dtype(t.dtype).itemsize
    mla = len(m.mla_layer_set)
    kda = m.num_layers - mla
    h, dk = m.kda_num_heads, m.kda_head_dim
    latent = (cp - 1) * tokens * (m.kv_lora_rank + m.qk_rope_head_dim) * act
    state = h * dk * (dk + dk if cfg.kernel.context_parallel_strategy == "allgather" else dk) * 4
    maps = (cp - 1) * rows * state
    halo = rows * (m.kda_conv_size - 1) * 3 * h * dk * 4
    if cfg.kernel.context_parallel_load_balance:
        latent += tokens * m.num_attention_heads * (m.qk_head_dim + m.v_head_dim) * act
    return float(passes * (mla * latent + kda * (maps + halo)))


def context_attention_factor(cfg, cp: int) -> float:
    """Executed over causal attention-core work on the busiest context shard: the walk visits
    whole key blocks up to each query half chunk's end (kernels/attention/context_parallel.py), so
    balanced shards do (2cp + 1) / 2cp of the causal average, the unbalanced last one (4cp - 1) / 2cp."""
    if cp <= 1:
        return 1.0
    return (2 * cp + 1 if cfg.kernel.context_parallel_load_balance else 4 * cp - 1) / (2 * cp)


def train_estimate(cfg, gb: int, n_dev: int, chip: TP.Chip, cost: dict, ici_bytes: float = 0.0) -> dict:
    """Analytic model FLOPs (6N-style, for MFU) and the roofline step time / MFU / tokens/s/chip.

    Compute time uses the executed FLOPs: model FLOPs x remat factor (full remat re-runs the forward:
    4/3; save_dot keeps matmul outputs: ~1) or XLA's count when larger. Memory time uses XLA's bytes
    accessed, a lower bound for the same loop-counting reason.
    """
    m, t = cfg.model, cfg.train
    tokens = gb * t.max_target_length
    per_tok = counts.train_flops_per_token(m, t.max_target_length, cfg.kernel.kda_chunk_size)
    media = media_plan(cfg)
    vision = gb * counts.vision_train_flops(cfg.vision, m.hidden_size, media["grids"], t.freeze) if media else 0.0
    model_flops = (per_tok * tokens + vision) / n_dev
    remat = {"none": 1.0, "save_dot": 1.0, "save_mixer_out": 4.0 / 3.0, "full": 4.0 / 3.0}[t.remat_policy]
    # Context parallelism: MLA's walk does more than the causal attention core on the busiest shard.
    core = 3.0 * len(m.mla_layer_set) * counts.mla_attention_flops_per_token(m, t.max_target_length)
    cp_extra = (context_attention_factor(cfg, cfg.context_size(n_dev)) - 1.0) * core * tokens / n_dev
    executed = max((model_flops + cp_extra) * remat, cost["flops"])
    r = roofline(executed, cost["bytes"], chip, ici_bytes)
    r.update({"tokens": tokens, "flops_per_token": per_tok, "model_flops_per_device": model_flops,
              "vision_flops_per_device": vision / n_dev,
              "executed_flops_per_device": executed,
              "mfu": model_flops / r["step_s"] / chip.peak_flops if r["step_s"] else 0.0})
    r["tokens_per_s_per_chip"] = tokens / r["step_s"] / (n_dev / chip.devices_per_chip) if r["step_s"] else 0.0
    return r


def _split(mesh, sharding) -> dict:
    """{mesh axis: size} a leaf is split over."""
    return {a: mesh.shape[a] for e in sharding.spec for a in _mesh_axes(e)}


def decode_estimate(cfg, mesh, chip: TP.Chip, params, rest, cache, cache_specs, batch: int) -> dict:
    """Analytic per-device traffic of one decode step (one token for each of ``batch`` rows, a
    cache of max_target_length slots) and its roofline time; a lower bound, since XLA's cost
    analysis counts the scanned layers once.

    HBM: every non-expert weight shard, all-gathered first over the batch axes (data, fsdp,
    expert) it is split on (of the embedding table only the looked-up rows); of the routed experts only the expected touched share of the local
    ones, 1 - (1 - 1/E)^(rows of the expert group x top_k) under uniform routing; the whole local
    cache read, recurrent states (no cache_seq axis) also written. ICI: those weight gathers, the
    expert all-to-all (each local row's top_k latent rows out and back), the psum over tensor of
    the expert down projections (f32, over the static receive buffer the dropless EP kernel
    allocates: ep * rows * min(top_k, E_local)), and four tensor-parallel reductions of the
    [rows, D] activations per layer. Compute: 2 x active parameters per row plus MLA attention
    over the context. Collectives' latency is not modelled (only bandwidth).
    """
    m = cfg.model
    shape = dict(mesh.shape)
    batch_axes = ("data", "fsdp", "expert")
    groups = math.prod(shape.get(a, 1) for a in ("data", "fsdp"))
    ep, tp = shape.get("expert", 1), shape.get("tensor", 1)
    rows_local = -(-batch // (groups * ep))                   # rows per device (padded)
    rows_group = rows_local * ep                              # rows an expert group routes
    touched = 1.0 - (1.0 - 1.0 / m.num_experts) ** (rows_group * m.num_experts_per_token)
    hbm = {"dense_weights": 0.0, "experts": 0.0, "cache": 0.0}
    ici = {"weight_gather": 0.0}
    for v in jax.tree.leaves({"p": params, "r": rest}, is_leaf=is_variable):
        a = jax.tree.leaves(v)[0]
        split = _split(mesh, a.sharding)
        shard = math.prod(a.shape) * jnp.dtype(a.dtype).itemsize / math.prod(split.values())
        if "exp" in tuple(v.axes):
            hbm["experts"] += touched * shard
            continue
        g = math.prod(s for ax, s in split.items() if ax in batch_axes)
        if tuple(v.axes)[-2:] == ("vocab", "embed"):   # the embedding lookup reads one row per token
            shard = min(shard, batch * a.shape[-1] * jnp.dtype(a.dtype).itemsize / math.prod(split.values()))
        hbm["dense_weights"] += shard * g
        ici["weight_gather"] += shard * (g - 1)
    specs = jax.tree.leaves(cache_specs, is_leaf=_is_cache_spec)
    for a, spec in zip(jax.tree.leaves(cache), specs, strict=True):
        shard = math.prod(a.shape) * jnp.dtype(a.dtype).itemsize / math.prod(_split(mesh, a.sharding).values())
        hbm["cache"] += shard * (1 if "cache_seq" in spec[2] else 2)   # recurrent states are written back
    moe_layers = sum(m.ffn(l) == "moe" for l in range(m.num_layers))
    act = jnp.dtype(cfg.train.dtype).itemsize
    k, lw = m.num_experts_per_token, m.routed_width
    ici["expert_all_to_all"] = moe_layers * 2 * rows_local * k * lw * act * (ep - 1) / ep
    e_local = m.num_experts // ep
    buf = ep * rows_local * min(k, e_local)
    ici["expert_tensor_psum"] = moe_layers * 2 * (tp - 1) / tp * buf * lw * 4 if tp > 1 else 0.0
    ici["tensor_reductions"] = m.num_layers * 4 * 2 * (tp - 1) / tp * rows_local * m.hidden_size * act
    total, active = counts.param_counts(m)
    ctx = cfg.train.max_target_length
    mla_layers = len(m.mla_layer_set)
    attn = mla_layers * 2 * 2 * ctx * m.num_attention_heads * (m.kv_lora_rank + m.qk_rope_head_dim)
    flops = (2 * active + attn) * batch / mesh.devices.size
    r = roofline(flops, sum(hbm.values()), chip, sum(ici.values()))
    chips = mesh.devices.size / chip.devices_per_chip
    r.update({"hbm_bytes": hbm, "ici_bytes": ici, "flops_per_device": flops, "batch": batch, "context": ctx,
              "experts_touched_fraction": touched, "ms_per_token": 1e3 * r["step_s"],
              "tokens_per_s_per_chip": batch / r["step_s"] / chips if r["step_s"] else 0.0})
    return r


def _is_cache_spec(x) -> bool:
    return isinstance(x, tuple) and len(x) == 3 and isinstance(x[0], tuple)


def format_decode(est: dict, chip: TP.Chip) -> str:
    h, i = est["hbm_bytes"], est["ici_bytes"]
    return (f"decode roofline (analytic, batch {est['batch']}, context {est['context']}): HBM per device "
            f"{gib(sum(h.values()))} (dense weights {gib(h['dense_weights'])}, experts touched "
            f"{100 * est['experts_touched_fraction']:.1f}% = {gib(h['experts'])}, cache {gib(h['cache'])}) at "
            f"{chip.hbm_bandwidth / 1e9:.0f} GB/s = {1e3 * est['t_memory']:.3g} ms; ICI per device "
            f"{sum(i.values()) / 1e6:.1f} MB (weight gathers {i['weight_gather'] / 1e6:.1f}, expert all-to-all "
            f"{i['expert_all_to_all'] / 1e6:.1f}, expert tensor psum {i['expert_tensor_psum'] / 1e6:.1f}, tensor "
            f"reductions {i['tensor_reductions'] / 1e6:.1f}) at {chip.ici_bandwidth / 1e9:.0f} GB/s = "
            f"{1e3 * est['t_ici']:.3g} ms; compute {1e3 * est['t_compute']:.3g} ms -> "
            f"{est['ms_per_token']:.3g} ms per token, {est['tokens_per_s_per_chip']:.0f} tokens/s/chip")


def gib(x: float) -> str:
    return f"{x / TP.GiB:.2f} GiB"


def format_memory(name: str, mem: dict) -> str:
    pct = 100 * mem["total"] / mem["hbm"]
    return (f"{name} memory per device: arguments {gib(mem['arguments'])}, outputs {gib(mem['outputs'])} "
            f"(aliased {gib(mem['aliased'])}), temporaries {gib(mem['temporaries'])}, code {gib(mem['code'])}; "
            f"total {gib(mem['total'])} of {gib(mem['hbm'])} HBM ({pct:.1f}%) -> "
            f"{'fits' if mem['fits'] else 'DOES NOT FIT'}")


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
    out(f"topology {topo}; mesh {mesh_desc(mesh)}; model {cfg.model_name}: {counts.human(total)} params, "
        f"{counts.human(active)} active; kernels kda={resolve('kda_impl', cfg.kernel.kda_impl, platform)} "
        f"attention={resolve('attention_impl', cfg.kernel.attention_impl, platform)} "
        f"moe={resolve_moe_impl(cfg.kernel.moe_impl, platform)}/{cfg.kernel.moe_mode}/"
        f"{resolve('moe_ep_transport', cfg.kernel.moe_ep_transport, platform)} "
        f"loss={resolve_loss_impl(cfg.kernel.loss_impl, platform)}; "
        f"remat={cfg.train.remat_policy}")
    reports = {}
    if cfg.compile.compile_step in ("train", "both"):
        compiled, secs, gb = compile_train(cfg, mesh)
        mem, cost = memory_report(compiled, chip.hbm_bytes), cost_report(compiled)
        comm = collective_bytes(cfg, abstract_state(cfg, mesh)[1]["params"], mesh)
        est = train_estimate(cfg, gb, n, chip, cost, comm["total"])
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
        out(f"train FLOPs per device: XLA cost analysis {cost['flops']:.3e} (loop bodies once), analytic model "
            f"{est['model_flops_per_device']:.3e} ({counts.human(est['flops_per_token'])} per token), executed "
            f"with remat {est['executed_flops_per_device']:.3e}; XLA bytes accessed {cost['bytes']:.3e}")
        out(f"train collectives per device (analytic, lower bound): weight all-gathers {comm['weight_gather']:.3e} B, "
            f"gradient reductions {comm['grad_reduce']:.3e} B, expert all-to-alls {comm['expert_all_to_all']:.3e} B, "
            f"context-parallel exchanges {comm['context_exchange']:.3e} B (context={mesh.shape.get('context', 1)}: "
            f"{cfg.train.max_target_length // mesh.shape.get('context', 1)} tokens per slice)")
        out(f"train roofline bound at peak ({chip.peak_flops / 1e12:.0f} TFLOP/s, {chip.hbm_bandwidth / 1e9:.0f} GB/s "
            f"HBM, {chip.ici_bandwidth / 1e9:.0f} GB/s ICI per device, all overlapped): step >= {est['step_s']:.3f}s "
            f"(compute {est['t_compute']:.3f}s, memory {est['t_memory']:.3f}s, collectives {est['t_ici']:.3f}s), "
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
