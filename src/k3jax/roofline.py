"""Roofline estimates of a compiled step: analytic collective bytes per device, the train step's model
FLOPs, MFU and tokens/s/chip, and the decode step's HBM / ICI traffic (k3jax.compile reports them,
k3jax.plan ranks by them). Lower bounds: every term at full bandwidth, all overlapped."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from k3jax import counts
from k3jax import topology as TP
from k3jax.layers.common import is_variable
from k3jax.layout import layout
from k3jax.remat import recompute_factor
from k3jax.schema import MESH_AXES
from k3jax.stages import block_flags, bubble_fraction, cache_depth
from k3jax.validation import num_stages, pipeline_microbatches


def roofline(flops_per_device: float, bytes_per_device: float, chip: TP.Chip, ici_bytes: float = 0.0,
             dcn_bytes: float = 0.0, hop_s: float = 0.0, bubble: float = 0.0, host_bytes: float = 0.0) -> dict:
    """Lower-bound step time: the slowest of compute at peak, HBM traffic at full bandwidth and
    (when given) the analytic collective traffic at the chip's ICI and DCN bandwidths and the
    host-memory traffic of offloaded activations (``host_bytes``: ``host_transfer_bytes``) at its
    host link's one-way bandwidth, all overlapped; a pipelined step (``bubble`` > 0) takes 1 / (1 -
    bubble) of that, plus ``hop_s``, its stage hand-offs, which sit on the pipeline's critical path
    (each iteration waits for the last). ``exposed_s``: the part of the step compute and HBM traffic
    do not cover (collectives and host copies beyond them, and the hops). ``dcn_unknown`` /
    ``host_unknown``: DCN / host bytes on a chip whose bandwidth for them is not in the chip table,
    left out of the bound."""
    t_compute = flops_per_device / chip.peak_flops
    t_memory = bytes_per_device / chip.hbm_bandwidth
    t_ici = ici_bytes / chip.ici_bandwidth if ici_bytes and chip.ici_bandwidth else 0.0
    t_dcn = dcn_bytes / chip.dcn_bandwidth if dcn_bytes and chip.dcn_bandwidth else 0.0
    t_host = host_bytes / chip.host_bandwidth if host_bytes and chip.host_bandwidth else 0.0
    stretch = 1.0 / (1.0 - bubble)
    step = max(t_compute, t_memory, t_ici, t_dcn, t_host) * stretch + hop_s
    return {"t_compute": t_compute, "t_memory": t_memory, "t_ici": t_ici, "t_dcn": t_dcn, "t_host": t_host,
            "t_hops": hop_s, "bubble": bubble, "step_s": step,
            "exposed_s": step - max(t_compute, t_memory) * stretch,
            "dcn_unknown": bool(dcn_bytes) and not chip.dcn_bandwidth,
            "host_unknown": bool(host_bytes) and not chip.host_bandwidth}


def host_transfer_bytes(cfg, memory: dict) -> float:
    """Bytes one device moves over its host link per train step for offloaded activations: what the
    compiled step holds in host memory (``k3jax.compile.memory_report``'s host_temporaries, every
    offloaded tensor once: 16.00 of 16.00 MiB in benchmarks/offload_probe.py) written in the forward
    and read back in the backward, once per gradient-accumulation microbatch. The two directions
    are counted one after the other on the one-way bandwidth, since the writes happen in the
    forward and the reads in the backward."""
    return 2.0 * memory.get("host_temporaries", 0.0) * cfg.train.gradient_accumulation_steps


def _mesh_axes(entry) -> tuple:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


BATCH_AXES = ("stage", "data", "fsdp", "expert")   # outside the pipeline `stage` splits the rows too


def weight_collective_bytes(leaves, mesh_shape: dict, passes: int, dcn: dict | None = None,
                            stage_iters: float = 1.0) -> dict:
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

    Pipeline (a ``stage`` axis): the periods' stacked leaves split over ``stage`` are never gathered
    over it, and each stage gathers one period per pipeline iteration and reduce-scatters its
    gradient there: ``stage_iters`` = iterations / repeats = (M R + S - 1) / R times the unpipelined
    volume of its own periods. Leaves replicated over ``stage`` have their gradient summed over it.

    ``dcn``: {mesh axis: its size across slices}. A group of G = G_ici x G_dcn devices gathers
    hierarchically: (G_dcn - 1) shards over DCN, (G_ici - 1) G_dcn over ICI; an all-reduce over
    R = R_ici x R_dcn moves 2 (R_dcn - 1) / R_dcn of a 1 / R_ici share over DCN and 2 (R_ici - 1) /
    R_ici shards over ICI. With ``dcn`` the result gains ``dcn_weight_gather`` / ``dcn_grad_reduce``
    and the ICI figures leave those bytes out.
    """
    dcn = dcn or {}
    d = lambda axes: math.prod(dcn.get(a, 1) for a in axes)  # noqa: E731
    gather = reduce = dcn_gather = dcn_reduce = 0.0
    for shape, itemsize, spec, axes in leaves:
        split = [a for e in spec for a in _mesh_axes(e)]
        shard = math.prod(shape) * itemsize / math.prod(mesh_shape[a] for a in split)
        keep = {"tensor", "stage"} | ({"expert"} if "exp" in axes else set())
        group = [a for a in split if a not in keep]
        g, g_dcn = math.prod(mesh_shape[a] for a in group), d(group)
        f = stage_iters if "stage" in split else 1.0
        gather += f * passes * (g - g_dcn) * shard
        reduce += f * (g - g_dcn) * shard
        dcn_gather += f * passes * (g_dcn - 1) * shard
        dcn_reduce += f * (g_dcn - 1) * shard
        rest = [a for a in BATCH_AXES if a in mesh_shape and a not in split and not (a == "expert" and "exp" in axes)]
        r, r_dcn = math.prod(mesh_shape[a] for a in rest), d(rest)
        r_ici = r // r_dcn
        if r_ici > 1:
            reduce += 2 * (r_ici - 1) / r_ici * shard
        if r_dcn > 1:
            dcn_reduce += 2 * (r_dcn - 1) / r_dcn * shard / r_ici
    out = {"weight_gather": gather, "grad_reduce": reduce}
    if dcn:
        out.update(dcn_weight_gather=dcn_gather, dcn_grad_reduce=dcn_reduce)
    return out


def dcn_sizes(cfg) -> dict:
    """{mesh axis: its size across slices} (the dcn_*_parallelism keys, ``stage`` included)."""
    return {a: getattr(cfg.mesh, f"dcn_{a}_parallelism") for a in ("stage",) + MESH_AXES}


def pipeline_shape(cfg) -> dict:
    """Stages S, microbatches M, repeats R, iterations M R + S - 1 per pipeline run and the bubble
    fraction (S - 1) / (M R + S - 1) (k3jax.stages); S = 1 without a pipeline."""
    s = num_stages(cfg)
    if s == 1:
        return {"stages": 1, "microbatches": 1, "repeats": 1, "iterations": 1, "bubble": 0.0, "hop_bytes": 0.0}
    m = pipeline_microbatches(cfg)
    r = layout(cfg.model, cfg.train.scan_layers).num_periods // s
    return {"stages": s, "microbatches": m, "repeats": r, "iterations": m * r + s - 1,
            "bubble": bubble_fraction(s, m, r), "hop_bytes": 0.0}


def hop_buffers(cfg) -> int:
    """[mb, T, D] arrays one stage hand-off carries (k3jax.stages): the partial sum and, with the
    block cache (``pipeline_attn_res_cache``), the K newest AttnRes blocks (``stages.cache_depth``),
    else the whole block buffer [NB, mb, T, D]; without AttnRes, the hidden state."""
    m = cfg.model
    if not m.attn_res:
        return 1
    if not cfg.train.pipeline_attn_res_cache:
        return len(m.attn_res_block_starts) + 1
    return 1 + cache_depth(block_flags(m, layout(m, cfg.train.scan_layers)), num_stages(cfg))


def stage_hop_bytes(cfg, mesh_shape: dict, gb: int) -> float:
    """Bytes one device sends per stage hand-off: one microbatch's residual state without its block
    count (``hop_buffers`` arrays of [mb, T, D]), activation dtype, its rows split over the stage's
    data x fsdp x expert shards and its positions over context (k3jax.stages)."""
    m, t = cfg.model, cfg.train
    pipe = pipeline_shape(cfg)
    rows = gb / t.gradient_accumulation_steps / pipe["microbatches"]
    rows /= math.prod(mesh_shape.get(a, 1) for a in ("data", "fsdp", "expert"))
    buffers = hop_buffers(cfg)
    return buffers * rows * t.max_target_length / mesh_shape.get("context", 1) * m.hidden_size * \
        jnp.dtype(t.dtype).itemsize


def collective_bytes(cfg, params, mesh, gb: int | None = None) -> dict:
    """Analytic bytes one device receives per train step: weight all-gathers and gradient
    reduce-scatters (``weight_collective_bytes``) plus the MoE all-to-alls (dispatch and combine
    of tokens x top-k rows of the routed width, x capacity_factor in capacity mode, (ep - 1) / ep of
    them crossing devices, in every pass) and the context exchanges, over ICI (the top-level keys,
    "total" their sum) and over DCN (``dcn``: the same collectives' cross-slice share, and the
    stage hops). A lower bound: ring / hierarchical algorithms at full link use, no latency; XLA
    may also gather a weight once for several uses or re-gather it.

    With a ``stage`` axis (``pipeline``: its shape): ``stage_hops`` are the ICI bytes of the
    hand-offs, 2 (forward and backward) x iterations x ``stage_hop_bytes`` per pipeline run (one
    per gradient accumulation step), on the devices whose next stage is in the same slice;
    ``dcn["stage_hops"]`` the same on the devices whose next stage is in another slice (the
    dcn_stage boundaries: dcn_stage of the S ring edges). ``cross_slice_bytes``: what crosses the
    slice network per step, summed over all devices. ``gb``: the global batch (rows); default from
    the config."""
    m, t, k = cfg.model, cfg.train, cfg.kernel
    shape, dcn = dict(mesh.shape), dcn_sizes(cfg)
    passes = 2 if t.remat_policy == "none" else 3
    pipe = pipeline_shape(cfg)
    leaves = [(v.shape, jnp.dtype(v.dtype).itemsize, jax.tree.leaves(v)[0].sharding.spec, tuple(v.axes))
              for v in jax.tree.leaves(params, is_leaf=is_variable)]
    w = weight_collective_bytes(leaves, shape, passes, dcn, pipe["iterations"] / pipe["repeats"])
    out = {"weight_gather": w["weight_gather"], "grad_reduce": w["grad_reduce"]}
    ep, ep_dcn = shape.get("expert", 1), dcn["expert"]
    moe_layers = sum(m.ffn(l) == "moe" for l in range(m.num_layers))
    width = m.moe_latent_size or m.hidden_size
    # each device routes its own tokens: pdb rows of T / context positions
    rows = t.per_device_batch_size * t.max_target_length / shape.get("context", 1) * m.num_experts_per_token
    if k.moe_mode == "capacity":
        rows *= k.capacity_factor
    act = jnp.dtype(cfg.train.dtype).itemsize
    a2a = 2 * passes * moe_layers * rows * width * act
    out["expert_all_to_all"] = a2a * ((ep - 1) / ep - (ep_dcn - 1) / ep_dcn)   # to the other slices: (ep_dcn-1)/ep_dcn
    cp, cp_dcn = shape.get("context", 1), dcn["context"]
    ctx = context_collective_bytes(cfg, cp, passes)
    ctx_dcn = ctx * (cp_dcn - 1) / (cp - 1) if cp > 1 else 0.0   # the share of the cp - 1 peers in other slices
    out["context_exchange"] = ctx - ctx_dcn
    out["total"] = sum(out.values())
    gb = cfg.global_batch_size(mesh.devices.size) if gb is None else gb
    pipe["hop_bytes"] = stage_hop_bytes(cfg, shape, gb) if pipe["stages"] > 1 else 0.0
    hops = 2 * pipe["iterations"] * t.gradient_accumulation_steps * pipe["hop_bytes"]
    out["stage_hops"] = hops if shape.get("stage", 1) > dcn["stage"] else 0.0
    out["dcn"] = {"weight_gather": w["dcn_weight_gather"], "grad_reduce": w["dcn_grad_reduce"],
                  "expert_all_to_all": a2a * (ep_dcn - 1) / ep_dcn, "context_exchange": ctx_dcn,
                  "stage_hops": hops if dcn["stage"] > 1 else 0.0}
    out["dcn_total"] = sum(out["dcn"].values())
    n = mesh.devices.size
    crossing = n // pipe["stages"] * dcn["stage"] if dcn["stage"] > 1 else 0   # devices whose hop leaves the slice
    out["cross_slice_bytes"] = n * (out["dcn_total"] - out["dcn"]["stage_hops"]) + crossing * out["dcn"]["stage_hops"]
    out["pipeline"] = pipe
    return out


def estimate_terms(comm: dict, chip: TP.Chip) -> dict:
    """``roofline``'s collective keywords from ``collective_bytes``: overlappable ICI and DCN bytes,
    the stage hops' time (each at the bandwidth of the slowest link it crosses) and the bubble."""
    dcn_hops = comm["dcn"]["stage_hops"]
    hop_s = dcn_hops / chip.dcn_bandwidth if dcn_hops and chip.dcn_bandwidth else \
        comm["stage_hops"] / chip.ici_bandwidth if comm["stage_hops"] and chip.ici_bandwidth else 0.0
    return {"ici_bytes": comm["total"], "dcn_bytes": comm["dcn_total"] - dcn_hops, "hop_s": hop_s,
            "bubble": comm["pipeline"]["bubble"]}


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


def train_estimate(cfg, gb: int, n_dev: int, chip: TP.Chip, cost: dict, ici_bytes: float = 0.0,
                   media: dict | None = None, comm: dict | None = None, host_bytes: float = 0.0) -> dict:
    """Analytic model FLOPs (6N-style, for MFU) and the roofline step time / MFU / tokens/s/chip;
    ``media``: the VL step's ``k3jax.compile.media_plan`` (None for text). ``comm``: the step's
    ``collective_bytes``; when given, its ICI and DCN terms, stage hops and bubble (``estimate_terms``)
    replace ``ici_bytes``. ``host_bytes``: the offloaded activations' host traffic (``host_transfer_bytes``).

    Compute time uses the executed FLOPs: model FLOPs x remat factor (full remat re-runs the forward:
    4/3; save_dot keeps matmul outputs: ~1) or XLA's count when larger. Memory time uses XLA's bytes
    accessed, a lower bound for the same loop-counting reason.
    """
    m, t = cfg.model, cfg.train
    tokens = gb * t.max_target_length
    per_tok = counts.train_flops_per_token(m, t.max_target_length, cfg.kernel.kda_chunk_size)
    vision = gb * counts.vision_train_flops(cfg.vision, m.hidden_size, media["grids"], t.freeze) if media else 0.0
    model_flops = (per_tok * tokens + vision) / n_dev
    remat = recompute_factor(t)
    # Context parallelism: MLA's walk does more than the causal attention core on the busiest shard.
    core = 3.0 * len(m.mla_layer_set) * counts.mla_attention_flops_per_token(m, t.max_target_length)
    cp_extra = (context_attention_factor(cfg, cfg.context_size(n_dev)) - 1.0) * core * tokens / n_dev
    executed = max((model_flops + cp_extra) * remat, cost["flops"])
    terms = estimate_terms(comm, chip) if comm is not None else {"ici_bytes": ici_bytes}
    r = roofline(executed, cost["bytes"], chip, host_bytes=host_bytes, **terms)
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


def pipeline_note(est: dict) -> str:
    """'' without a pipeline; else how the bound treats the bubble and the hops."""
    if not est["bubble"] and not est["t_hops"]:
        return ""
    return f", / (1 - bubble {est['bubble']:.3f}) + stage hops {est['t_hops']:.3f}s"


def format_multislice(comm: dict, est: dict, chip: TP.Chip, n_dev: int) -> list[str]:
    """The DCN and pipeline lines of the train report (none for one slice without stages)."""
    lines = []
    d, pipe = comm["dcn"], comm["pipeline"]
    if comm["dcn_total"]:
        lines.append(
            f"train DCN per device (analytic, lower bound): weight all-gathers {d['weight_gather']:.3e} B, gradient "
            f"reductions {d['grad_reduce']:.3e} B, expert all-to-alls {d['expert_all_to_all']:.3e} B, context "
            f"exchanges {d['context_exchange']:.3e} B, stage hops {d['stage_hops']:.3e} B; "
            f"{comm['cross_slice_bytes']:.3e} B cross the slices per step (all {n_dev} devices); "
            + (f"at {chip.dcn_bandwidth / 1e9:.2f} GB/s per device ({chip.dcn_gbps_per_chip:g} Gbit/s per chip): "
               f"{est['t_dcn']:.3f}s overlappable" + (f" + {est['t_hops']:.3f}s of hops" if d["stage_hops"] else "")
               if not est["dcn_unknown"] else f"DCN bandwidth of {chip.name} unknown: left out of the bound"))
    if pipe["stages"] > 1:
        lines.append(
            f"train pipeline: {pipe['stages']} stages x {pipe['microbatches']} microbatches x {pipe['repeats']} repeats = "
            f"{pipe['iterations']} iterations, bubble {100 * pipe['bubble']:.1f}%; hand-off "
            f"{pipe['hop_bytes']:.3e} B per device per hop, "
            f"{comm['stage_hops']:.3e} B over ICI / {d['stage_hops']:.3e} B over DCN per device per step; exposed "
            f"collectives (step beyond compute and HBM time) {est['exposed_s']:.3f}s")
    return lines
