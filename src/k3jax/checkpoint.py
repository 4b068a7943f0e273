"""Orbax checkpoints: separate items ``params``, ``opt_state``, ``extra`` (router biases, step
counters) and ``data`` (the grain iterator), so a params-only restore is a single item and any item
can be restored onto a different mesh (the target's shardings decide the placement).

Layout: ``<run>/checkpoints/<step>/{params,opt_state,extra,data}``. The converter writes
``<out>/params`` (+ ``<out>/model.yml``); ``load_parameters_path`` accepts a step directory, a run
directory (latest step), a ``checkpoints`` directory or a converter output directory.
"""
from __future__ import annotations

import logging
import re
from pathlib import Path

import jax
import orbax.checkpoint as ocp

from k3jax import paths
from k3jax.errors import UserError

log = logging.getLogger(__name__)


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that cannot be used; the message says which path and why."""


def _absolute(p):
    return p.absolute() if isinstance(p, Path) else p


def _restore_args(abstract):
    return jax.tree.map(lambda a: ocp.ArrayRestoreArgs(sharding=a.sharding, global_shape=a.shape, dtype=a.dtype),
                        abstract)


class Checkpointer:
    def __init__(self, directory: str | Path, *, max_to_keep: int = 3, async_save: bool = True,
                 with_data: bool = True):
        import grain
        self.directory = _absolute(paths.path(str(directory), "checkpoint directory"))
        handlers = {"params": ocp.StandardCheckpointHandler(), "opt_state": ocp.StandardCheckpointHandler(),
                    "extra": ocp.StandardCheckpointHandler()}
        if with_data:
            handlers["data"] = grain.checkpoint.CheckpointHandler()
        self.with_data = with_data
        self.mngr = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, enable_async_checkpointing=async_save,
                                                 create=True),
            item_handlers=handlers)

    def latest_step(self) -> int | None:
        return self.mngr.latest_step()

    def save(self, step: int, params, opt_state, extra, data_iter=None, *, force: bool = False) -> bool:
        import grain
        args = {"params": ocp.args.StandardSave(params), "opt_state": ocp.args.StandardSave(opt_state),
                "extra": ocp.args.StandardSave(extra)}
        if self.with_data and data_iter is not None:
            args["data"] = grain.checkpoint.CheckpointSave(data_iter)
        return self.mngr.save(step, args=ocp.args.Composite(**args), force=force)

    def data_process_counts(self, step: int) -> list[int]:
        """The process counts the step's data-iterator states were saved by (grain writes one
        ``process_<i>-of-<n>.json`` per process)."""
        d = self.directory / str(step) / "data"
        if not d.is_dir():
            return []
        return sorted({int(m.group(1)) for f in d.iterdir() if (m := re.fullmatch(r"process_\d+-of-(\d+)\.json", f.name))})

    def restore(self, step: int, abstract_params, abstract_opt_state, abstract_extra, data_iter=None):
        """Restore onto the shardings carried by the abstract targets (any mesh shape, any process
        count: orbax reshards). -> (params, opt_state, extra, data_restored): the data iterator's
        state is restored when it was saved by as many processes as this run has; otherwise (an
        elastic restart) ``data_restored`` is False and the caller repositions the iterator."""
        import grain
        args = {"params": ocp.args.StandardRestore(abstract_params),
                "opt_state": ocp.args.StandardRestore(abstract_opt_state),
                "extra": ocp.args.StandardRestore(abstract_extra)}
        data_restored = (self.with_data and data_iter is not None
                         and jax.process_count() in self.data_process_counts(step))
        if data_restored:
            args["data"] = grain.checkpoint.CheckpointRestore(data_iter)
        try:
            r = self.mngr.restore(step, args=ocp.args.Composite(**args))
        except (ValueError, KeyError, FileNotFoundError) as e:
            raise CheckpointError(f"cannot restore step {step} from {self.directory}: {e}") from e
        return r["params"], r["opt_state"], r["extra"], data_restored

    def saving(self) -> bool:
        """True while an async save is still being written."""
        return self.mngr.is_saving_in_progress()

    def wait(self):
        self.mngr.wait_until_finished()

    def close(self):
        self.mngr.wait_until_finished()
        self.mngr.close()


def resolve_params_dir(path: str | Path) -> Path:
    """Find the ``params`` item under a step dir, run dir, checkpoints dir or converter output."""
    p = _absolute(paths.path(str(path), "load_parameters_path"))
    if not p.exists():
        raise CheckpointError(f"load_parameters_path={path}: no such directory")
    if (p / "params").is_dir():
        return p / "params"
    if p.name == "params" and p.is_dir():
        return p
    ckpts = p / "checkpoints" if (p / "checkpoints").is_dir() else p
    steps = sorted((int(d.name), d) for d in ckpts.iterdir() if d.is_dir() and d.name.isdigit()
                   and (d / "params").is_dir())
    if not steps:
        raise CheckpointError(f"load_parameters_path={path}: no 'params' item and no checkpoint steps found "
                              f"(expected <step>/params, a run directory, or a converter output directory)")
    return steps[-1][1] / "params"


def load_params(path: str | Path, abstract_params):
    """Params-only restore (e.g. from converted weights) onto the target's shardings. The parameter
    tree and every shape are checked against the model first, and a mismatch names the first
    offending parameters; values are cast to the target's dtypes."""
    d = resolve_params_dir(path)
    ckptr = ocp.StandardCheckpointer()
    try:
        meta = ckptr.metadata(d)
    except Exception as e:  # noqa: BLE001 - orbax raises many kinds for unreadable dirs
        raise CheckpointError(f"{d}: not a readable orbax checkpoint ({type(e).__name__}: {e})") from e
    _check_compatible(getattr(meta, "item_metadata", meta), abstract_params, d)
    return ckptr.restore(d, abstract_params)


def load_extra(path: str | Path, abstract_rest):
    """Router biases (the ``extra`` item beside ``params``) restored onto ``abstract_rest``'s
    shardings. They decide expert selection, so a model with router biases cannot run correctly
    without them: a checkpoint lacking the item raises CheckpointError (the caller decides whether
    zeros are acceptable). A model without MoE layers has nothing to restore."""
    if not jax.tree.leaves(abstract_rest):
        return abstract_rest
    extra = resolve_params_dir(path).parent / "extra"
    if not extra.is_dir():
        raise CheckpointError(f"load_parameters_path={path}: no 'extra' item (router biases) beside 'params'; "
                              f"they decide which experts run. Re-convert the checkpoint, or set "
                              f"allow_missing_router_biases=true to start them at zero")
    return ocp.StandardCheckpointer().restore(extra, abstract_rest)


def _flat(tree):
    """{'a/b/c': leaf}; Variables flatten as attribute '.value' in the abstract tree but as a
    'value' dict key in orbax metadata, so both are normalised to plain path parts."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]

    def part(k):
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                return str(getattr(k, attr))
        return str(k)
    return {"/".join(part(k) for k in path): v for path, v in leaves}


def _check_compatible(meta, abstract, where):
    want = _flat(abstract)
    have = _flat(meta)
    missing = sorted(set(want) - set(have))
    extra = sorted(set(have) - set(want))
    if missing or extra:
        raise CheckpointError(f"{where}: parameter tree does not match the model config "
                              f"(missing {len(missing)}: {missing[:4]}; unexpected {len(extra)}: {extra[:4]}); "
                              f"check model_name")
    for k, a in want.items():
        shape = tuple(getattr(have[k], "shape", ()))
        if shape != tuple(a.shape):
            raise CheckpointError(f"{where}: {k} has shape {shape} in the checkpoint but {tuple(a.shape)} in the "
                                  f"model; check model_name")
