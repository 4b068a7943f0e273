"""The k3jax optimizer: Muon for matrices, AdamW for the rest, grouped by declared metadata.

Every parameter is declared through ``layers/common.param`` with metadata ``axes`` (logical names,
a leading ``"layers"`` for scan-stacked copies) and ``matrix`` = (fan-in axis, fan-out axis) of the
full stacked shape, or None. That metadata alone decides the optimizer group:

- ``matrix`` set -> Muon with ``MuonDimensionNumbers(reduction_axis=fan_in, output_axis=fan_out)``.
  Every other axis (stacked layers, routed experts) is a batch axis, so each layer's and each
  expert's matrix is orthogonalised on its own.
- ``matrix`` None -> AdamW: embeddings, lm_head (declared without a matrix on purpose: Muon on a
  vocabulary-sized matrix is not the Kimi/Moonlight recipe), norm gains, biases, A_log, dt_bias,
  convolution filters, AttnRes pseudo-queries.

Variables that are not ``nnx.Param`` (``RouterBias``, updated by the balancing rule) are not in the
parameter state the optimizer sees; nothing here can touch them.

Update of one step (with ``gradient_accumulation_steps`` > 1 the train step hands in the gradient
already averaged over its micro-batches, see ``k3jax.step``)::

    g <- g with frozen leaves zeroed          (frozen grads must not inflate the clip norm)
    g <- clip_by_global_norm(g)               (gradient_clipping_threshold > 0)
    u <- partition(g):  muon   k3jax.optim.orthogonalize.scale_by_muon (Nesterov momentum,
                                   Newton-Schulz, consistent RMS), decoupled weight decay, * lr
                        adam   optax.adamw (no Nesterov)
                        frozen set_to_zero

The Muon branch computes what ``optax.contrib.muon`` computes (tested against it) but keeps batch
axes (stacked layers, experts) as separate dimensions instead of flattening them, so the update
stays sharded at pod scale; see ``orthogonalize.py`` for why that matters.

Nesterov: Muon keeps the Nesterov momentum of the Moonlight/K2 recipe. The AdamW group is plain
AdamW (``nesterov=False``), as in Moonlight's and K2's AdamW for non-matrix parameters
(``optax.contrib.muon``'s single ``nesterov`` flag would also turn its Adam branch into NAdam, a
step-1 update RMS of ~1.47 lr instead of lr).

Freezing (``freeze`` groups) is decided from metadata where metadata can tell and from the nnx
path structure only where it cannot; see ``leaf_groups`` and docs/optimizer.md for the table.
"""
from __future__ import annotations

from typing import Any, Iterable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from optax.contrib import MuonDimensionNumbers

from k3jax.config import FREEZABLE, ConfigError
from k3jax.layers.common import is_variable
from k3jax.optim.orthogonalize import MatrixSpec, newton_schulz_flops, scale_by_muon
from k3jax.optim.schedule import make_schedule

FREEZE_GROUPS = tuple(sorted(FREEZABLE))   # the config validates `freeze` against the same set
MUON_BETA = 0.95                           # Muon momentum (Moonlight / K2)

Path = tuple[Any, ...]


# ---- paths and metadata ------------------------------------------------------------------------

def _key(k):
    """A key-path entry -> dict key / list index; None for the attribute that holds a Variable's
    array (``.value``), so State-of-Variables trees and pure nested dicts share their paths."""
    if isinstance(k, jax.tree_util.DictKey):
        return k.key
    if isinstance(k, jax.tree_util.SequenceKey):
        return k.idx
    if isinstance(k, jax.tree_util.FlattenedIndexKey):
        return k.key
    return None


def param_path(keypath) -> Path:
    """jax key path -> plain tuple of dict keys and indices, e.g. ("prefix", 0, "self_attn", "q_a_proj")."""
    return tuple(c for c in map(_key, keypath) if c is not None)


def variables_by_path(state) -> dict[Path, nnx.Variable]:
    """Flatten an nnx.State of nnx.Param Variables (concrete or abstract) to {path: Variable}."""
    flat = jax.tree_util.tree_flatten_with_path(state, is_leaf=is_variable)[0]
    out = {}
    for kp, v in flat:
        if not is_variable(v):
            raise TypeError(f"{jax.tree_util.keystr(kp)}: expected nnx.Variable leaves carrying `axes` and "
                            f"`matrix` metadata (nnx.state(model, nnx.Param)), got {type(v).__name__}")
        if not isinstance(v, nnx.Param):
            # e.g. RouterBias: moved by the balancing rule; an optimizer step must never touch it.
            raise TypeError(f"{jax.tree_util.keystr(kp)}: {type(v).__name__} is not an nnx.Param; pass only "
                            f"the parameters (nnx.state(model, nnx.Param) or nnx.filter_state(state, nnx.Param))")
        out[param_path(kp)] = v
    return out


def _meta(v: nnx.Variable, name: str):
    return v.get_metadata().get(name)


def _map_vars(fn, state):
    """Replace each Variable of ``state`` by fn(path, variable); the result mirrors the State."""
    return jax.tree_util.tree_map_with_path(lambda kp, v: fn(param_path(kp), v), state, is_leaf=is_variable)


def _by_path(table: dict[Path, Any], what: str):
    """A function tree -> same-structure tree holding table[path] at every array leaf. Works on a
    State of Variables, on a pure nested dict, and on optax's masked trees (MaskedNode is an empty
    pytree, so masked-out leaves are simply not visited)."""
    def fn(tree):
        def get(kp, _):
            p = param_path(kp)
            if p not in table:
                raise KeyError(f"parameter {'/'.join(map(str, p))} is not in the state the optimizer was "
                               f"built from ({what})")
            return table[p]
        return jax.tree_util.tree_map_with_path(get, tree)
    return fn


# ---- grouping ----------------------------------------------------------------------------------

def dimension_number(v: nnx.Variable) -> MuonDimensionNumbers | None:
    """Muon dimension numbers of one Variable from its ``matrix`` metadata (None -> AdamW)."""
    mat = _meta(v, "matrix")
    if mat is None:
        return None
    fan_in, fan_out = mat
    nd = len(v.shape)
    if not (0 <= fan_in < nd and 0 <= fan_out < nd and fan_in != fan_out):
        raise ValueError(f"matrix={mat} does not name two distinct axes of a shape {tuple(v.shape)} parameter")
    return MuonDimensionNumbers(reduction_axis=fan_in, output_axis=fan_out)


def matrix_spec(v: nnx.Variable) -> MatrixSpec | None:
    """How ``k3jax.optim.orthogonalize`` treats one Variable: its matrix axes, and the scan-stacked
    ``layers`` axis (replicated by the sharding rules) to walk one layer at a time."""
    dn = dimension_number(v)
    if dn is None:
        return None
    axes = tuple(_meta(v, "axes") or ())
    loop = next((i for i, a in enumerate(axes) if a == "layers" and v.shape[i] > 1), None)
    return MatrixSpec(fan_in=dn.reduction_axis, fan_out=dn.output_axis, loop_axis=loop)


def matrix_specs(state) -> dict[Path, MatrixSpec]:
    """{path: MatrixSpec} for the Muon-shaped (``matrix`` metadata) params of ``state``."""
    out = {}
    for p, v in variables_by_path(state).items():
        spec = matrix_spec(v)
        if spec is not None:
            out[p] = spec
    return out


def dimension_numbers(state):
    """nnx.State of params -> same structure with MuonDimensionNumbers (matrix leaves) or None."""
    return _map_vars(lambda _, v: dimension_number(v), state)


def _core_axes(v: nnx.Variable) -> tuple:
    """Logical axes without the leading scan-stacked "layers" axes."""
    axes = tuple(_meta(v, "axes") or ())
    while axes and axes[0] == "layers":
        axes = axes[1:]
    return axes


def leaf_groups(path: Path, v: nnx.Variable, paths: Iterable[Path]) -> frozenset[str]:
    """The freeze groups one parameter belongs to.

    From metadata (logical axes without "layers"):
      embed    axes == ("vocab", "embed")          lm_head  axes == ("embed", "vocab")
      norms    axes == ("norm",)  (every ("norm",) vector: norm gains, and also KDA's A_log and the
               AttnRes pseudo-queries, which share the replicated-vector axis name)
      experts  an "exp" axis (routed experts)
    From the nnx path, where metadata cannot tell (a mixer's projections and the router carry the
    same ("embed", ...) axes as any other projection):
      attention  under a layer's ``self_attn``;  mla / kda: that ``self_attn`` holds ``kv_b_proj``
                 (the MLA latent up-projection) / does not
      moe        under a layer's ``mlp`` that holds a ``router`` (router, latent projections and
                 norm, routed and shared experts; the dense layer-0 MLP is not MoE)
      router     the MoE ``router`` weight
      attn_res   under a layer's ``res`` (AttnResSites) or the model's ``output_attn_res_*``
    The vision side (params["vision"]) is in none of those: its tower's norms share the ("norm",)
    axis and its matrices the ("embed", ...) axes, so metadata cannot tell it apart; by path:
      vision     under ``vision/vision_tower`` (patch and position embeddings, blocks, final norm)
      projector  under ``vision/mm_projector``
    """
    paths = set(paths) if not isinstance(paths, (set, frozenset, dict)) else paths
    if path and path[0] == "vision":   # the tower and projector (params["vision"]) are in no text group
        part = {"vision_tower": "vision", "mm_projector": "projector"}.get(path[1] if len(path) > 1 else None)
        if part is None:
            raise KeyError(f"parameter {'/'.join(map(str, path))}: neither the tower (vision/vision_tower) nor "
                           f"the projector (vision/mm_projector)")
        return frozenset({part})
    axes = _core_axes(v)
    groups = set()
    if axes == ("vocab", "embed"):
        groups.add("embed")
    if axes == ("embed", "vocab"):
        groups.add("lm_head")
    if axes == ("norm",):
        groups.add("norms")
    if "exp" in axes:
        groups.add("experts")
    for i, k in enumerate(path[:-1]):
        if k == "self_attn":
            groups.add("attention")
            groups.add("mla" if path[:i + 1] + ("kv_b_proj",) in paths else "kda")
        if k == "mlp" and path[:i + 1] + ("router",) in paths:
            groups.add("moe")
            if path[i + 1:] == ("router",):
                groups.add("router")
        if k == "res":
            groups.add("attn_res")
    if isinstance(path[-1], str) and path[-1].startswith("output_attn_res"):
        groups.add("attn_res")
    return frozenset(groups)


def _frozen_table(state, freeze: Iterable[str]) -> dict[Path, bool]:
    freeze = set(freeze)
    unknown = freeze - set(FREEZE_GROUPS)
    if unknown:
        raise ConfigError(f"freeze={sorted(freeze)}: unknown {sorted(unknown)}; choose from {list(FREEZE_GROUPS)}")
    vars_ = variables_by_path(state)
    return {p: bool(leaf_groups(p, v, vars_) & freeze) for p, v in vars_.items()}


def frozen_mask(state, freeze: Iterable[str]):
    """nnx.State of params -> same structure of bools: True where a ``freeze`` group holds the leaf."""
    table = _frozen_table(state, freeze)
    return _map_vars(lambda p, _: table[p], state)


def param_labels(state, train_cfg) -> dict[Path, str]:
    """{path: "muon" | "adam" | "frozen"} for the params in ``state`` under ``train_cfg``."""
    frozen = _frozen_table(state, train_cfg.freeze)
    out = {}
    for p, v in variables_by_path(state).items():
        if frozen[p]:
            out[p] = "frozen"
        elif train_cfg.opt_type == "muon" and dimension_number(v) is not None:
            out[p] = "muon"
        else:
            out[p] = "adam"
    return out


def newton_schulz_flops_per_step(state, train_cfg) -> float:
    """Matmul FLOPs of Muon's Newton-Schulz iterations in one optimizer step: every trainable Muon
    leaf of ``state`` (concrete or abstract), whatever the batch size. Not model FLOPs (MFU leaves
    them out, as MaxText's does); benchmarks/train_step.py prints them beside."""
    labels = param_labels(state, train_cfg)
    specs = matrix_specs(state)
    return sum(newton_schulz_flops(v.shape, specs[p]) for p, v in variables_by_path(state).items()
               if labels[p] == "muon")


# ---- the optimizer -----------------------------------------------------------------------------

def make_optimizer(train_cfg, state) -> optax.GradientTransformationExtraArgs:
    """Build the optimizer for the params in ``state`` (an nnx.State of Variables with metadata,
    concrete or abstract: only paths and metadata are read).

    The result works on any tree with the same paths: the nnx.State of params (as from
    ``nnx.split(model, nnx.Param, ...)``) or its pure-dict form. ``update`` needs ``params``
    (decoupled weight decay). Moments are created with the params' shapes; with
    ``init_sharded`` they also keep the params' shardings.
    """
    t = train_cfg
    if t.opt_type not in ("muon", "adamw"):
        raise ConfigError(f"opt_type={t.opt_type!r}: must be muon or adamw")
    lr = make_schedule(t)
    mu_dtype = jnp.dtype(t.mu_dtype)
    labels = param_labels(state, t)
    transforms = {
        "adam": optax.adamw(lr, b1=t.adam_b1, b2=t.adam_b2, eps=t.adam_eps, mu_dtype=mu_dtype,
                            weight_decay=t.adam_weight_decay, nesterov=False),
        "frozen": optax.set_to_zero(),
    }
    if t.opt_type == "muon":
        # Only Muon leaves reach this branch (the rest are MaskedNodes of optax.partition).
        transforms["muon"] = optax.chain(
            scale_by_muon(_by_path(matrix_specs(state), "Muon matrix specs"), beta=MUON_BETA,
                          mu_dtype=mu_dtype, nesterov=True, consistent_rms=t.muon_consistent_rms,
                          ns_dtype=jnp.dtype(t.muon_ns_dtype)),
            optax.add_decayed_weights(t.muon_weight_decay),
            optax.scale_by_learning_rate(lr))
    used = set(labels.values())
    transforms = {k: v for k, v in transforms.items() if k in used}
    parts = []
    if "frozen" in used:
        parts.append(optax.masked(optax.set_to_zero(),
                                  _by_path({p: l == "frozen" for p, l in labels.items()}, "freeze mask")))
    if t.gradient_clipping_threshold > 0:
        parts.append(optax.clip_by_global_norm(t.gradient_clipping_threshold))
    parts.append(optax.partition(transforms, _by_path(labels, "optimizer groups")))
    return optax.chain(*parts)


# ---- sharded optimizer state -------------------------------------------------------------------

def opt_state_shardings(tx: optax.GradientTransformation, params):
    """NamedShardings for ``tx.init(params)``: every param-shaped moment (Muon/Adam mu, nu) takes
    its parameter's sharding, everything else (step
    counts, Newton-Schulz coefficients) is replicated.

    ``params``: arrays or ShapeDtypeStructs carrying NamedShardings (concrete or abstract state, so
    this also gives the restore target and AOT shardings). A state leaf belongs to the parameter
    whose path is the longest suffix of the leaf's path and whose shape matches. ``jit(tx.init)``
    without these as ``out_shardings`` returns single-device moments (zeros have no input to
    follow), hence this function.
    """
    by_path = {param_path(kp): x for kp, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    meshes = [x.sharding.mesh for x in by_path.values()
              if isinstance(getattr(x, "sharding", None), jax.sharding.NamedSharding)]
    if not meshes:
        raise ValueError("opt_state_shardings: no parameter carries a NamedSharding")
    replicated = jax.sharding.NamedSharding(meshes[0], jax.sharding.PartitionSpec())

    def pick(kp, leaf):
        p = param_path(kp)
        for i in range(len(p)):
            x = by_path.get(p[i:])
            if x is not None and tuple(x.shape) == tuple(leaf.shape):
                return x.sharding
        return replicated

    return jax.tree_util.tree_map_with_path(pick, jax.eval_shape(tx.init, params))


def init_sharded(tx: optax.GradientTransformation, params):
    """``tx.init(params)`` under jit with the moments placed like their parameters."""
    return jax.jit(tx.init, out_shardings=opt_state_shardings(tx, params))(params)
