"""Device mesh and logical-axis sharding.

Every parameter and activation names its axes with the short logical vocabulary below; one rules
table maps those names to the mesh axes ``data``, ``fsdp``, ``context``, ``expert``, ``tensor``. No mesh axis name
appears under ``layers/``. The mesh uses ``AxisType.Auto`` (classic GSPMD propagation): parameters
and batches carry NamedShardings, activations are pinned with ``constrain``, and jitted steps pin
their output shardings to their inputs' (ecosystem.md §1).

See docs/sharding.md for the table and its reasoning.
"""
from __future__ import annotations

import math
from typing import Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from k3jax.config import MESH_AXES, VOCAB_PARALLEL_AXES, Config, mesh_shape  # noqa: F401 - re-exported
from k3jax.schema import ConfigError
from k3jax.validation import stage_sizes


# Logical name -> mesh axis (or tuple of axes, or None = replicated).
RULES: dict[str, str | tuple[str, ...] | None] = {
    # activations
    "batch": ("data", "fsdp", "expert"),  # every device holds distinct rows of the batch
    "seq": "context",                     # context parallelism: contiguous sequence slices
    "act_embed": None,                    # hidden width of activations stays whole
    "act_heads": "tensor",
    "act_mlp": "tensor",
    "act_vocab": "tensor",
    # parameters
    "vocab": "tensor",
    "embed": "fsdp",                      # FSDP: weights sharded on their model-width axis
    "heads": "tensor",                    # the flattened heads*head_dim axis of projections
    "mlp": "tensor",
    "exp": "expert",
    "rank": None,                         # small LoRA / low-rank / latent-norm axes
    "layers": None,                       # scan-stacked axis
    "norm": None,                         # vectors: norm weights, biases, per-channel constants
    # decode cache
    "cache_seq": "context",
}


def _axes(name: str) -> tuple[str, ...]:
    a = RULES[name]
    return (a,) if isinstance(a, str) else tuple(a or ())


# The rules above, read by the code that maps over mesh axes by hand (shard_map kernels take these
# as arguments: kernels/ never import this module).
BATCH_AXES = _axes("batch")                                # rows of every activation
EXPERT_AXIS = RULES["exp"]                                 # routed experts
HEAD_AXIS = RULES["act_heads"]                             # attention / KDA heads of activations
CONTEXT_AXIS = RULES["seq"]                                # contiguous sequence slices (layers/context.py)
# The MoE layer flattens [B, T] tokens into rows: B split over the batch axes, T over the context
# axis, so the rows lie in this order over the mesh, and every sequence slice is a token shard
# of the expert-parallel dispatch (not gathered and computed context-fold).
MOE_ROW_AXES = BATCH_AXES + (CONTEXT_AXIS,)
TOKEN_AXES = tuple(a for a in MOE_ROW_AXES if a != EXPERT_AXIS)  # token axes besides the expert axis
WEIGHT_EMBED_AXES = _axes("embed")                         # the model-width (FSDP) axis of weights
EXPERT_FFN_AXIS = RULES["mlp"]                             # the F axis of routed-expert weights


def logical_to_spec(names: Sequence[str | None], rules: dict | None = None) -> P:
    """Map logical axis names to a PartitionSpec, dropping a mesh axis already used earlier."""
    rules = RULES if rules is None else rules
    used: set[str] = set()
    out = []
    for name in names:
        if name is None:
            out.append(None)
            continue
        if name not in rules:
            raise KeyError(f"unknown logical axis '{name}'; known: {sorted(rules)}")
        axes = rules[name]
        axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
        axes = tuple(a for a in axes if a not in used)
        used.update(axes)
        out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return P(*out)


# Pipeline stages (k3jax.stages): the outermost mesh axis, present only when its size is > 1, so
# the rules above and every mesh without a pipeline are unchanged. Outside the pipeline it leads the
# rows of the batch (embedding, unrolled layers and loss run data-parallel over it); inside, where
# the pipeline's shard_map holds it manual, rows split as the rules say. The scan-stacked
# ``layers`` axis of parameters is split over it (each stage holds its own periods).
STAGE_AXIS = "stage"


def _stage_auto(mesh) -> bool:
    """Whether ``mesh`` has a stage axis that GSPMD places (not manual inside the pipeline)."""
    if mesh.shape.get(STAGE_AXIS, 1) == 1:
        return False
    return mesh.axis_types[mesh.axis_names.index(STAGE_AXIS)] != jax.sharding.AxisType.Manual


def in_stage(mesh) -> bool:
    """Whether ``mesh`` is the one inside the pipeline (a stage axis over 1, made manual)."""
    return mesh.shape.get(STAGE_AXIS, 1) > 1 and not _stage_auto(mesh)


def _with_stage(spec: P, names: Sequence[str | None], mesh) -> P:
    """``spec`` with the stage axis leading the rows of a ``batch`` dimension (see STAGE_AXIS)."""
    if "batch" not in names or not _stage_auto(mesh):
        return spec
    entries = list(tuple(spec) + (None,) * (len(names) - len(spec)))
    i = list(names).index("batch")
    rows = (entries[i],) if isinstance(entries[i], str) else tuple(entries[i] or ())
    entries[i] = (STAGE_AXIS, *rows)
    return P(*entries)


def stage_rows(axes: Sequence[str], mesh) -> tuple[str, ...]:
    """The mesh axes splitting the rows of an activation for a shard_map kernel that names them
    itself (the MoE expert-parallel dispatch, the tokamax and vocab-parallel losses): ``axes`` led
    by the stage axis where GSPMD places it, as ``_with_stage`` lays out the rows outside the
    pipeline. Without it the unrolled prefix/tail layers' kernels and the loss take their rows
    replicated over ``stage`` and GSPMD gathers the whole global batch onto every device (K3's
    bf16[2, 4194304, 7168] buffers at dcn_stage=2)."""
    return ((STAGE_AXIS,) if _stage_auto(mesh) else ()) + tuple(axes)


def logical_sharding(mesh: Mesh, names: Sequence[str | None]) -> NamedSharding:
    return NamedSharding(mesh, _with_stage(logical_to_spec(names), names, mesh))


def _fits(shape: Sequence[int], spec: P, mesh: Mesh) -> P:
    """Replicate any dimension its mesh axes do not divide (tiny configs on big meshes). Axes the
    mesh lacks are dropped (a hand-built mesh without the context axis, say)."""
    fixed = []
    for dim, axes in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
        axes = tuple(a for a in ((axes,) if isinstance(axes, str) else axes or ()) if a in mesh.shape)
        if not axes:
            fixed.append(None)
            continue
        axes = axes[0] if len(axes) == 1 else axes
        size = math.prod(mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes))
        fixed.append(axes if dim % size == 0 else None)
    return P(*fixed)


def sharding_for(mesh: Mesh, shape: Sequence[int], names: Sequence[str | None]) -> NamedSharding:
    """NamedSharding for an array of ``shape`` with logical ``names`` (divisibility-checked)."""
    if len(names) != len(shape):
        raise ValueError(f"logical axes {tuple(names)} do not match shape {tuple(shape)}")
    return NamedSharding(mesh, _fits(shape, _with_stage(logical_to_spec(names), names, mesh), mesh))


# Mesh axes that hold distinct parameter shards (ZeRO-3 style). Weights are all-gathered for
# compute whatever their layout (activations are batch-sharded over every axis but tensor), so a
# weight should be split over all of these, not only the one its logical rule names. The context
# axis holds distinct sequence slices of the same rows, so without it here every weight would be
# replicated context-fold.
PARAM_SHARD_AXES = ("fsdp", "expert", "context")
# config.VOCAB_PARALLEL_AXES (loss_impl=vocab_parallel) is the head's own vocabulary axis and the
# parameter-sharding axes; config cannot read the rules (this module imports it), so check here.
if VOCAB_PARALLEL_AXES != (*_axes("vocab"), *PARAM_SHARD_AXES):
    raise ImportError(f"config.VOCAB_PARALLEL_AXES {VOCAB_PARALLEL_AXES} disagrees with the sharding rules")


def param_sharding(mesh: Mesh, shape: Sequence[int], names: Sequence[str | None], *,
                   extend: bool = True) -> NamedSharding:
    """NamedSharding for a parameter: ``sharding_for``, then every parameter-sharding mesh axis
    (PARAM_SHARD_AXES) the logical rules left unused is added to a dimension it divides.

    Why: the rules shard a projection's ``embed`` axis over ``fsdp`` only, so with expert
    parallelism every non-expert weight (K3: ~50B parameters: KDA/MLA projections, shared experts,
    latent projections, router, embeddings) would be replicated across the ``expert`` axis (16-way
    instead of 1024-way sharded on fsdp=16 x expert=64: ~20 GB per device more for weights,
    momentum and gradients), and ``("rank", "heads")`` matrices such as MLA's q_b/kv_b projections
    across both axes. Routed-expert weights already use both axes and are unchanged.

    Placement: a dimension already split over a parameter-sharding axis first (it extends the
    fsdp split, keeping the all-gather pattern of that weight), then the others in order; the
    scan-stacked ``layers`` axis never (the scan slices it). Vectors are left as the rules say.

    ``extend=False`` (``shard_params_over_all_axes=false``, serving) keeps the rules' placement:
    non-expert weights are then replicated over ``expert`` and tensor-split only, so a decode step
    reads its shard instead of all-gathering the dense weights every token.
    """
    spec = [(() if a is None else (a,) if isinstance(a, str) else tuple(a))
            for a in tuple(_fits(shape, logical_to_spec(names), mesh)) + (None,) * (len(shape) - len(names))]
    dims = [i for i, n in enumerate(names) if n != "layers"]
    if len(dims) >= 2 and extend:
        used = {a for axes in spec for a in axes}
        for ax in PARAM_SHARD_AXES:
            if ax in used or mesh.shape.get(ax, 1) == 1:
                continue
            order = ([i for i in dims if set(spec[i]) & set(PARAM_SHARD_AXES)] +
                     [i for i in dims if not set(spec[i]) & set(PARAM_SHARD_AXES)])
            for i in order:
                if shape[i] % (math.prod(mesh.shape[a] for a in spec[i]) * mesh.shape[ax]) == 0:
                    spec[i] += (ax,)
                    used.add(ax)
                    break
    stages = mesh.shape.get(STAGE_AXIS, 1)
    if names and names[0] == "layers" and stages > 1 and shape[0] % stages == 0:
        spec[0] = (STAGE_AXIS,)    # a pipeline stage holds its own periods (k3jax.stages)
    entries = [None if not a else a[0] if len(a) == 1 else a for a in spec]
    return NamedSharding(mesh, P(*entries))


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Pin an activation's sharding by logical names; a no-op outside a mesh context."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    spec = _fits(x.shape, _with_stage(logical_to_spec(names), names, mesh), mesh)
    return jax.lax.with_sharding_constraint(x, spec)


# ---------------------------------------------------------------------------------------------
# Mesh construction
# ---------------------------------------------------------------------------------------------

def make_mesh(cfg: Config, devices: Sequence | None = None) -> Mesh:
    """Build the (data, fsdp, context, expert, tensor) mesh for ``devices`` (default: all devices),
    led by the ``stage`` axis when the pipeline has more than one stage."""
    devices = list(jax.devices() if devices is None else devices)
    num_slices = len({getattr(d, "slice_index", 0) for d in devices})
    ici, dcn = mesh_shape(cfg, len(devices), num_slices)
    names = MESH_AXES
    ici_stage, dcn_stage = stage_sizes(cfg)
    if ici_stage * dcn_stage > 1:
        names = (STAGE_AXIS,) + MESH_AXES
        ici, dcn = {STAGE_AXIS: ici_stage, **ici}, {STAGE_AXIS: dcn_stage, **dcn}
    if num_slices > 1:
        arr = mesh_utils.create_hybrid_device_mesh([ici[a] for a in names], [dcn[a] for a in names],
                                                   devices=devices)
        return Mesh(arr, names, axis_types=(jax.sharding.AxisType.Auto,) * len(names))
    shape = [ici[a] for a in names]
    try:
        return jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(names),
                             devices=devices)
    except (ValueError, NotImplementedError):
        # Topology-aware placement needs a physical layout the mesh shape may not match
        # (e.g. CPU or a sub-slice); a row-major reshape is then the only sensible order.
        arr = np.asarray(devices, dtype=object).reshape(shape)
        return Mesh(arr, names, axis_types=(jax.sharding.AxisType.Auto,) * len(names))


def maybe_initialize_distributed(cfg: Config) -> None:
    """Join the multi-process job (``enable_distributed``) with ``jax.distributed.initialize``: the
    coordinator, process count and index from ``coordinator_address`` / ``num_processes`` /
    ``process_id`` when set, else JAX's auto-detection (TPU VMs, GKE). On CPU the collectives run
    over gloo. Must run before anything touches a device; a second call is a no-op."""
    m = cfg.mesh
    if not m.enable_distributed or jax.distributed.is_initialized():
        return
    platforms = jax.config.jax_platforms or ""
    if platforms.split(",")[0] == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    given = {"coordinator_address": m.coordinator_address, "num_processes": m.num_processes,
             "process_id": m.process_id}
    try:
        jax.distributed.initialize(**{k: v for k, v in given.items() if v is not None},
                                   initialization_timeout=m.jax_distributed_initialization_timeout)
    except ValueError as e:   # auto-detection found no cluster (e.g. a plain host without the keys)
        raise ConfigError(f"enable_distributed=true: {e} JAX found no TPU/GKE cluster to join; set "
                          f"coordinator_address, num_processes and process_id, or launch with "
                          f"scripts/local_pod.sh") from None


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    return logical_sharding(mesh, ("batch",) + (None,) * (ndim - 1))


def refuse_stages(mesh) -> None:
    """Decode and serve run without pipeline stages (the model's periods run as one scan): one
    error line when ``mesh`` has a ``stage`` axis of size > 1."""
    n = dict(mesh.shape).get(STAGE_AXIS, 1) if mesh is not None else 1
    if n > 1:
        raise ConfigError(f"decode and serve run without pipeline stages, but the mesh has {n} stages; set "
                          f"ici_stage_parallelism=1 dcn_stage_parallelism=1")
