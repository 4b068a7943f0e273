"""The model state, described once: abstract (shapes, dtypes, shardings), initialised, restored.

Every entry point starts here. ``abstract_state`` is the single description of what lives on the
devices (parameters, router biases and, for training, the optimizer moments): each leaf is a
``jax.ShapeDtypeStruct`` carrying the ``NamedSharding`` derived from the logical axes its parameter
declared (``layers.common.param``). From it:

- ``init_state`` materialises random parameters straight into those shardings;
- ``restore_state`` / ``restore_model`` read ``load_parameters_path`` into them (no random init
  first); the train loop restores full checkpoints into the same targets;
- ``k3jax.compile`` lowers the train and decode steps against it for a TPU topology.

State layout: ``{"params": nnx.State of nnx.Param, "rest": nnx.State of RouterBias and Packed
(MXFP4 experts with ``experts_format=mxfp4``), "opt_state": optax state}`` (``opt_state`` only with an optimizer). Parameters stay nnx Variables
so their metadata (logical axes, matrix axes) travels with them to the optimizer and the planner.

With pipeline stages the scanned periods' stacked leaves sit stage-major in memory (k3jax.stages);
checkpoints and ``load_parameters_path`` hold them in layer order whatever the stage count.
``layer_order`` / ``memory_order`` convert a state between the two, donating what they move (the
one place the model's state changes order: ``model.build`` draws in layer order and knows no
stages); ``init_state`` and ``restore_state`` return memory order, and the train loop converts
around each save.
"""
from __future__ import annotations

import sys

import jax
import numpy as np
from flax import nnx

from k3jax import model as M
from k3jax.checkpoint import (CheckpointError, load_extra, load_packed_experts, load_params, load_vision_params,
                              packed_experts_dir, vision_item_dir)
from k3jax.config import ConfigError
from k3jax.layers.common import REST, Packed, RouterBias
from k3jax.layout import layout
from k3jax.optim.muon import init_sharded, make_optimizer, opt_state_shardings
from k3jax.sharding import param_sharding
from k3jax.stages import reorder_state
from k3jax.validation import num_stages


def _with_shardings(state, mesh, extend: bool = True):
    """Variables holding ShapeDtypeStructs with the NamedSharding of their logical axes."""
    return jax.tree.map(
        lambda v: v.replace(jax.ShapeDtypeStruct(v.shape, v.dtype,
                                                 sharding=param_sharding(mesh, v.shape, v.axes, extend=extend))),
        state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def shardings(state):
    """The NamedSharding of every leaf of a (concrete or abstract) state."""
    return jax.tree.map(lambda x: x.sharding, state)


def abstract_state(cfg, mesh=None, *, optimizer: bool = False):
    """-> (graphdef, state, tx): the state as ShapeDtypeStructs, allocating nothing (works for the
    full 2.78T kimi-k3 as for the tiny config); with a ``mesh`` every leaf carries its NamedSharding.

    state = {"params", "rest"} and, with ``optimizer``, "opt_state" (the moments take their
    parameters' shardings); tx is the optax optimizer then, else None. Built under the mesh so
    kernels that check their target (the Pallas KDA) see the mesh's devices, not the host.
    """
    def build():
        return nnx.eval_shape(lambda: M.build(cfg, nnx.Rngs(0)))

    if mesh is None:
        model = build()
    else:
        with jax.set_mesh(mesh):
            model = build()
    gdef, params, rest = nnx.split(model, nnx.Param, REST)
    if mesh is not None:
        extend = cfg.mesh.shard_params_over_all_axes
        params, rest = _with_shardings(params, mesh, extend), _with_shardings(rest, mesh, extend)
        if "vision" in params and cfg.vision.vision_param_sharding == "replicated":
            whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
            params["vision"] = jax.tree.map(lambda v: v.replace(jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=whole)),
                                            params["vision"], is_leaf=lambda x: isinstance(x, nnx.Variable))
    state = {"params": params, "rest": rest}
    tx = None
    if optimizer:
        tx = make_optimizer(cfg.train, params)
        state["opt_state"] = jax.eval_shape(tx.init, params)
        if mesh is not None:
            state["opt_state"] = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                              state["opt_state"], opt_state_shardings(tx, params))
    return gdef, state, tx


def init_state(cfg, mesh, *, seed: int | None = None, optimizer: bool = False):
    """-> (graphdef, state, tx) with random parameters (``seed``, default ``cfg.train.seed``) born in
    their shardings, zero router biases and, with ``optimizer``, fresh moments.

    Pod-scale models are initialised by a jit whose out_shardings place every shard where it lives
    (nothing is gathered on one host). Models below ``model.FLAT_INIT_MAX_PARAMS`` fit one device by
    construction; they are built eagerly and then placed, because XLA:CPU's SPMD partitioning of
    the init graph alone took ~100 s for the tiny config on 8 devices.
    """
    seed = cfg.train.seed if seed is None else seed
    gdef, abstract, _ = abstract_state(cfg, mesh)
    target = shardings(abstract)

    def init():     # drawn in layer order, held in the pipeline's memory order (k3jax.stages)
        _, params, rest = nnx.split(M.build(cfg, seed), nnx.Param, REST)
        return memory_order(cfg, {"params": params, "rest": rest})

    if M.count_params(abstract["params"]) <= M.FLAT_INIT_MAX_PARAMS:
        state = jax.device_put(init(), target)
    else:
        with jax.set_mesh(mesh):
            state = jax.jit(init, out_shardings=target)()
    return gdef, *_add_optimizer(cfg, mesh, state, optimizer)


def _add_optimizer(cfg, mesh, state, optimizer: bool):
    if not optimizer:
        return state, None
    tx = make_optimizer(cfg.train, state["params"])
    with jax.set_mesh(mesh):
        state = dict(state, opt_state=init_sharded(tx, state["params"]))  # moments born sharded
    return state, tx


def restore_state(cfg, mesh, *, optimizer: bool = False):
    """-> (graphdef, state, tx) with the parameters and router biases of ``load_parameters_path``
    (a converter output, a checkpoint step, a run directory) read straight into their shardings,
    and, with ``optimizer``, fresh moments (fine-tuning starts a new optimizer).

    A model with MoE layers needs the checkpoint's ``extra`` item (router biases: they decide which
    experts run); a checkpoint without one is an error unless ``allow_missing_router_biases=true``,
    which starts the biases at zero.
    """
    path = cfg.checkpoint.load_parameters_path
    if not path:
        raise ConfigError("load_parameters_path is not set; pass the converter's output directory or a "
                          "checkpoint step directory")
    gdef, abstract, _ = abstract_state(cfg, mesh)
    packed = nnx.filter_state(abstract["rest"], Packed)
    converted = packed_experts_dir(path) is not None
    try:
        params = _load_params(cfg, path, abstract["params"])
    except CheckpointError as e:
        if jax.tree.leaves(packed) and not converted:
            raise CheckpointError(f"load_parameters_path={path}: experts_format=mxfp4 needs a conversion made with "
                                  f"--experts_format mxfp4 (an experts_mxfp4 item beside params) or a checkpoint "
                                  f"saved with experts_format=mxfp4 ({e})") from e
        raise
    if jax.tree.leaves(packed) and not converted:
        rest = load_extra(path, abstract["rest"])      # a k3jax checkpoint keeps them in 'extra'
    else:
        rest = _load_biases(cfg, path, nnx.filter_state(abstract["rest"], RouterBias))
        if jax.tree.leaves(packed):
            rest = nnx.merge_state(rest, load_packed_experts(path, packed))
    # Stored in layer order, read into the pipeline's shardings (the same for either order).
    state = memory_order(cfg, {"params": params, "rest": rest})
    return gdef, *_add_optimizer(cfg, mesh, state, optimizer)


def _periods(cfg) -> tuple[int, int]:
    """(stages, scanned periods) of ``cfg``."""
    return num_stages(cfg), layout(cfg.model, cfg.train.scan_layers).num_periods


def layer_order(cfg, state):
    """``state`` (any of params, rest, opt_state) with the periods' stacked leaves in layer order, as a
    checkpoint stores them; the moved leaves are donated. Nothing moves without pipeline stages."""
    return reorder_state(state, *_periods(cfg), to="canonical")


def memory_order(cfg, state):
    """Inverse of ``layer_order``: the periods' leaves back in the pipeline's stage-major order."""
    return reorder_state(state, *_periods(cfg), to="stage_major")


def _load_params(cfg, path, abstract_params):
    """The parameters; with the vision tower and a converter output (its ``vision`` item beside
    ``params``), the text part from ``params`` and params["vision"] from ``vision``. A training
    checkpoint holds the tower inside ``params`` and loads whole."""
    if "vision" not in abstract_params or vision_item_dir(path) is None:
        return load_params(path, abstract_params)
    text = nnx.State({k: v for k, v in abstract_params.items() if k != "vision"})
    params = load_params(path, text)
    params["vision"] = load_vision_params(path, abstract_params["vision"])
    return params


def _load_biases(cfg, path, abstract_biases):
    try:
        return load_extra(path, abstract_biases)
    except CheckpointError:
        if not cfg.checkpoint.allow_missing_router_biases:
            raise
        print(f"note: {path} has no router biases ('extra' item); starting them at zero "
              f"(allow_missing_router_biases=true)", file=sys.stderr)
        return jax.tree.map(lambda a: jax.device_put(np.zeros(a.shape, a.dtype), a.sharding), abstract_biases)


def restore_model(cfg, mesh) -> M.K3Model:
    """The model with ``load_parameters_path``'s weights on ``mesh`` (decode, logit_check, serving)."""
    gdef, state, _ = restore_state(cfg, mesh)
    return nnx.merge(gdef, state["params"], state["rest"])


def load_model(cfg, mesh) -> M.K3Model:
    """The model for inference (decode, serve): ``load_parameters_path``'s weights restored straight
    into their shardings, or random weights with a loud warning when no path is given."""
    if not cfg.checkpoint.load_parameters_path:
        print("WARNING: no load_parameters_path given: decoding with RANDOM weights", file=sys.stderr)
        gdef, state, _ = init_state(cfg, mesh)
        return nnx.merge(gdef, state["params"], state["rest"])
    return restore_model(cfg, mesh)
