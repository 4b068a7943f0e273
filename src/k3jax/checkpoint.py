"""Orbax checkpoints: separate items ``params``, ``opt_state``, ``extra`` (router biases, step
counters) and ``data`` (the grain iterator), so a params-only restore is a single item and any item
can be restored onto a different mesh (the target's shardings decide the placement).

Layout: ``<run>/checkpoints/<step>/{params,opt_state,extra,data}``. The converter writes
``<out>/params`` (+ ``<out>/model.yml``); ``load_parameters_path`` accepts a step directory, a run
directory (latest step), a ``checkpoints`` directory or a converter output directory.
"""
from __future__ import annotations

import contextlib
import errno
import json
import logging
import re
import shutil
import sys
from pathlib import Path

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from k3jax import paths
from k3jax.errors import UserError

log = logging.getLogger(__name__)


# Subdirectory of a checkpoints directory holding deleted steps until they are removed.
TRASH = "deleted"


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
        self.directory = _absolute(paths.path(str(directory), "checkpoint directory"))
        handlers = {"params": ocp.StandardCheckpointHandler(), "opt_state": ocp.StandardCheckpointHandler(),
                    "extra": ocp.StandardCheckpointHandler()}
        if with_data:
            handlers["data"] = grain.checkpoint.CheckpointHandler()
        self.with_data = with_data
        self.mngr = ocp.CheckpointManager(
            self.directory,
            # Old steps are renamed into TRASH (atomic) and emptied from there: orbax's own deletion
            # removes a step's files one by one, and a process killed meanwhile left a listed step
            # without its params (found by tests/test_checkpoint_kills.py).
            options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, enable_async_checkpointing=async_save,
                                                 create=True, todelete_subdir=TRASH),
            item_handlers=handlers)

    def _empty_trash(self) -> None:
        """Remove the steps orbax renamed into TRASH (each gone whole or not at all from the
        listing, so an interrupted removal here cannot tear a checkpoint)."""
        trash = self.directory / TRASH
        if trash.is_dir():
            for d in trash.iterdir():
                shutil.rmtree(d, ignore_errors=True)

    def latest_step(self) -> int | None:
        return self.mngr.latest_step()

    def save(self, step: int, params, opt_state, extra, data_iter=None, *, force: bool = False) -> bool:
        """Start saving ``step`` (in the background when async); an earlier save that failed for a
        reason the user can fix (a full disk) raises CheckpointError here or in ``wait``/``close``.
        When it returns, every array has been copied to host memory (orbax's blocking part does the
        device-to-host copies of all arrays unless ``save_device_host_concurrent_bytes`` is set, which
        these handlers do not), so the caller may donate or delete them: the train step does, and so
        does the permutation back to the pipeline's order (k3jax.train)."""
        args = {"params": ocp.args.StandardSave(params), "opt_state": ocp.args.StandardSave(opt_state)}
        if jax.tree.leaves(extra):      # a model without MoE layers has no router biases: no item
            args["extra"] = ocp.args.StandardSave(extra)
        if self.with_data and data_iter is not None:
            args["data"] = grain.checkpoint.CheckpointSave(data_iter)
        self._empty_trash()
        with self._reporting(step):
            return self.mngr.save(step, args=ocp.args.Composite(**args), force=force)

    @contextlib.contextmanager
    def _reporting(self, step=None):
        """A save that fails for lack of space (or permission) becomes one CheckpointError naming
        the directory; orbax wraps the OSError of its writer threads, so its cause chain is searched.
        The checkpoints committed before it stay readable (a step is committed by a rename)."""
        try:
            yield
        except Exception as e:  # noqa: BLE001 - orbax re-raises writer errors in several wrappers
            cause = _os_error(e)
            if cause is None:
                raise
            what = f"a checkpoint save (reported at step {step})" if step is not None else "a checkpoint save"
            hint = ("free space there or lower max_checkpoints_to_keep" if cause.errno == errno.ENOSPC
                    else "check the directory's permissions")
            raise CheckpointError(f"{what} failed to write to {self.directory}: {cause.strerror or cause}; "
                                  f"{hint} (the checkpoints saved before it are kept)") from e

    def data_process_counts(self, step: int) -> list[int]:
        """The process counts the step's data-iterator states were saved by (grain writes one
        ``process_<i>-of-<n>.json`` per process)."""
        d = self.directory / str(step) / "data"
        if not d.is_dir():
            return []
        return sorted({int(m.group(1)) for f in d.iterdir() if (m := re.fullmatch(r"process_\d+-of-(\d+)\.json", f.name))})

    def saved_data_shards(self, step: int) -> list[tuple[int, int]] | None:
        """The data shard (index, count) of each process's iterator state of ``step``, by process
        index, as saved by as many processes as this run has (None when they were not). States saved
        before they named their shard are their process's own."""
        n = jax.process_count()
        out = []
        for i in range(n):
            f = self.directory / str(step) / "data" / f"process_{i}-of-{n}.json"
            if not f.exists():
                return None
            state = json.loads(f.read_text())
            out.append(tuple(state["data_shard"]) if "data_shard" in state else (i, n))
        return out

    def restore(self, step: int, abstract_params, abstract_opt_state, abstract_extra, data_iter=None,
                data_shards=None):
        """Restore onto the shardings carried by the abstract targets (any mesh shape, any process
        count: orbax reshards). -> (params, opt_state, extra, data_restored): the data iterators'
        states are restored when every process saved one for the data shard it reads now
        (``data_shards``: (shard, num_shards) of every process, by process index; default: this
        single process's iterator's); otherwise (an elastic restart, or a context axis that now
        spans hosts or no longer does) ``data_restored`` is False and the caller repositions the
        iterator. Every process decides alike from the same files, without talking to the others."""
        args = {"params": ocp.args.StandardRestore(abstract_params),
                "opt_state": ocp.args.StandardRestore(abstract_opt_state)}
        if jax.tree.leaves(abstract_extra):
            args["extra"] = ocp.args.StandardRestore(abstract_extra)
        if data_shards is None:
            data_shards = [getattr(data_iter, "shard", None)]
        data_restored = (self.with_data and data_iter is not None
                         and self.saved_data_shards(step) == [tuple(s) for s in data_shards])
        if data_restored:
            args["data"] = grain.checkpoint.CheckpointRestore(data_iter)
        try:
            r = self.mngr.restore(step, args=ocp.args.Composite(**args))
        except (ValueError, KeyError, FileNotFoundError) as e:
            self._explain_params_mismatch(step, abstract_params, e)
            raise CheckpointError(f"cannot restore step {step} from {self.directory}: {e}") from e
        return r["params"], r["opt_state"], r["extra"] if "extra" in args else abstract_extra, data_restored

    def _explain_params_mismatch(self, step: int, abstract_params, cause):
        """After a failed restore: when the step's parameter tree differs from the model's, raise
        the short error that names the cause (another scan_layers setting, another layer count)
        instead of orbax's tree-structure dump. Read only on failure: a resume reads nothing extra."""
        d = self.directory / str(step) / "params"
        try:
            meta = _item_metadata(ocp.StandardCheckpointer(), d)
        except CheckpointError:     # unreadable: orbax's own error follows
            return
        try:
            _check_compatible(getattr(meta, "item_metadata", meta), abstract_params, d)
        except CheckpointError as e:
            raise CheckpointError(f"cannot restore step {step}: {e}") from cause

    def saving(self) -> bool:
        """True while an async save is still being written."""
        return self.mngr.is_saving_in_progress()

    def wait(self):
        with self._reporting():
            self.mngr.wait_until_finished()

    def close(self):
        try:
            with self._reporting():
                self.mngr.wait_until_finished()
        except CheckpointError:
            with contextlib.suppress(Exception):   # the failed save is reported, not its clean-up
                self.mngr.close()
            raise
        self.mngr.close()
        self._empty_trash()


def save_weights(directory: str | Path, params, extra, step: int = 0) -> Path:
    """A checkpoint for inference only (what ``load_parameters_path`` reads: decode, serve,
    evaluate): ``params`` and ``extra`` as step ``step`` of ``directory``. Orbax refuses an empty
    item, so the optimizer state is a marker. -> the step's directory."""
    ckpt = Checkpointer(directory, async_save=False, with_data=False)
    ckpt.save(step, params, {"none": np.zeros((), np.int32)}, extra, force=True)
    ckpt.close()
    return Path(directory) / str(step)


def _os_error(e: BaseException) -> OSError | None:
    """The OSError of a full disk / refused write behind ``e`` (its cause or context chain)."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EROFS):
            return e
        if "No space left on device" in str(e):
            return OSError(errno.ENOSPC, "No space left on device")
        e = e.__cause__ or e.__context__
    return None


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
    meta = _item_metadata(ckptr, d)
    _check_compatible(getattr(meta, "item_metadata", meta), abstract_params, d)
    _note_cast(getattr(meta, "item_metadata", meta), abstract_params, d)
    return ckptr.restore(d, abstract_params)


def vision_item_dir(path: str | Path) -> Path | None:
    """The converter's ``vision`` item beside ``params`` (tower + projector), if any."""
    d = resolve_params_dir(path).parent / "vision"
    return d if d.is_dir() else None


def load_vision_params(path: str | Path, abstract_vision):
    """The tower and projector from the converter's ``vision`` item (docs/conversion.md) onto
    ``abstract_vision`` (the model's params["vision"]), checked and cast like ``load_params``."""
    d = vision_item_dir(path)
    if d is None:
        raise CheckpointError(f"load_parameters_path={path}: vision_enabled=true but there is no 'vision' item beside "
                              f"'params' (a text-only conversion); convert with the vision tower, or set "
                              f"vision_enabled=false")
    ckptr = ocp.StandardCheckpointer()
    meta = _item_metadata(ckptr, d)
    meta = getattr(meta, "item_metadata", meta)
    _check_compatible(meta, abstract_vision, d)
    _note_cast(meta, abstract_vision, d)
    return ckptr.restore(d, abstract_vision)


def _item_metadata(ckptr, d):
    """The orbax metadata of the item directory ``d``, or CheckpointError when it is unreadable."""
    try:
        # An item directory has no step-level _CHECKPOINT_METADATA; orbax logs a warning about it
        # on every decode and serve start that means nothing here.
        with _quiet("absl"):
            return ckptr.metadata(d)
    except Exception as e:  # noqa: BLE001 - orbax raises many kinds for unreadable dirs
        raise CheckpointError(f"{d}: not a readable orbax checkpoint ({type(e).__name__}: {e})") from e


@contextlib.contextmanager
def _quiet(logger: str):
    """Warnings of ``logger`` off inside the block."""
    log_ = logging.getLogger(logger)
    level = log_.level
    log_.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log_.setLevel(level)


def _note_cast(meta, abstract, where) -> None:
    """One notice when the stored parameter dtypes differ from the model's weight dtype (e.g.
    bfloat16 weights fine-tuned in float32): restore casts them, which is normal but worth saying."""
    want, have = _flat(abstract), _flat(meta)
    pairs = sorted({(str(getattr(have[k], "dtype", "?")), str(a.dtype)) for k, a in want.items()
                    if str(getattr(have[k], "dtype", a.dtype)) != str(a.dtype)})
    if pairs:
        stored = ", ".join(sorted({p[0] for p in pairs}))
        target = ", ".join(sorted({p[1] for p in pairs}))
        print(f"note: {where} holds {stored} parameters; cast to weight_dtype={target}", file=sys.stderr)


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
    if not have:
        raise CheckpointError(f"{where}: holds no parameter arrays; not a k3jax checkpoint (expected a converter "
                              f"output or a training checkpoint's <step>/params)")
    missing = sorted(set(want) - set(have))
    extra = sorted(set(have) - set(want))
    if missing or extra:
        raise CheckpointError(f"{where}: parameter tree does not match the model config "
                              f"(missing {len(missing)}: {missing[:4]}; unexpected {len(extra)}: {extra[:4]}); "
                              f"{_layout_hint(want, have)}")
    for k, a in want.items():
        shape = tuple(getattr(have[k], "shape", ()))
        if shape != tuple(a.shape):
            raise CheckpointError(f"{where}: {k} has shape {shape} in the checkpoint but {tuple(a.shape)} in the "
                                  f"model; check model_name")


def _layer_count(flat) -> int | None:
    """Decoder layers in a flat parameter tree: unrolled ``prefix/<i>`` and ``tail/<i>`` layers plus,
    for a scanned period ``periods/layers/<j>``, its positions times the stacked period count (the
    leading dimension of its leaves). None when a period leaf has no shape to read."""
    unrolled = {tuple(k.split("/")[:2]) for k in flat if k.startswith(("prefix/", "tail/"))}
    period = {k.split("/")[2] for k in flat if k.startswith("periods/layers/")}
    if not period:
        return len(unrolled)
    stack = next(tuple(getattr(v, "shape", ())) for k, v in flat.items() if k.startswith("periods/layers/"))
    return len(unrolled) + len(period) * stack[0] if stack else None


def _layout_hint(want, have) -> str:
    """What to check for a key mismatch. Scanned layers live under ``periods/`` (stacked), unrolled
    ones under ``prefix/<layer>``, so a checkpoint saved with the other ``scan_layers`` setting
    misses every layer's keys; with the same number of layers on both sides that is the likelier
    cause, with another number the model settings are."""
    scanned = [any(k.startswith("periods/") for k in keys) for keys in (want, have)]
    n_want, n_have = _layer_count(want), _layer_count(have)
    if scanned[0] != scanned[1] and n_want == n_have:
        saved = "scanned ('periods/...')" if scanned[1] else "unrolled"
        return (f"the checkpoint's {n_have} layers are {saved} and this model's are not: load it with "
                f"scan_layers={str(scanned[1]).lower()} (as it was saved), or check model_name")
    if None not in (n_want, n_have) and n_want != n_have:
        return f"the checkpoint has {n_have} decoder layers and this model {n_want}: check model_name / num_layers"
    tower = [any(k.startswith("vision/") for k in keys) for keys in (want, have)]
    if tower[0] != tower[1] and {k for k in want if not k.startswith("vision/")} == \
            {k for k in have if not k.startswith("vision/")}:
        return ("this model has the vision tower (vision_enabled=true) and the checkpoint none (a text-only "
                "conversion keeps it out): set vision_enabled=false, or convert with the tower" if tower[0] else
                "the checkpoint holds a vision tower (params['vision']) and this model none: set vision_enabled=true "
                "with the tower's vision_* keys (its model config)")
    return "check model_name"


def packed_experts_dir(path: str | Path) -> Path | None:
    """The converter's ``experts_mxfp4`` item beside ``params`` (``--experts_format mxfp4``), if any."""
    try:
        d = resolve_params_dir(path).parent / "experts_mxfp4"
    except CheckpointError:
        return None
    return d if d.is_dir() else None


def load_packed_experts(path: str | Path, abstract_packed):
    """MXFP4 experts from the converter's ``experts_mxfp4`` item into the model's packed variables.

    The item stores, per dense expert leaf (dotted path), ``codes`` uint8 [..., E, out, in/2] and
    ``scales`` uint8 [..., E, out, in/32] in the checkpoint's [out, in] orientation; the model keeps
    them K-major ([..., E, in/2, out], kernels/moe/quantized.py). Each leaf is read sharded as
    the model's leaf is (its last two mesh axes swapped) and transposed on its devices: the bytes
    stay packed throughout."""
    d = packed_experts_dir(path)
    flat = nnx.to_flat_state(abstract_packed)
    target, where = {}, {}
    for p, v in flat:
        a = v.get_value() if hasattr(v, "get_value") else v.value
        key, leaf = ".".join(map(str, p[:-1])), str(p[-1])
        spec = tuple(a.sharding.spec) + (None,) * (len(a.shape) - len(a.sharding.spec))
        swapped = NamedSharding(a.sharding.mesh, P(*spec[:-2], spec[-1], spec[-2]))
        target.setdefault(key, {})[leaf] = jax.ShapeDtypeStruct((*a.shape[:-2], a.shape[-1], a.shape[-2]),
                                                                np.uint8, sharding=swapped)
        where[(key, leaf)] = (p, a)
    ckptr = ocp.StandardCheckpointer()
    meta = _item_metadata(ckptr, d)
    _check_compatible(getattr(meta, "item_metadata", meta), target, d)
    got = ckptr.restore(d, target)
    out, var = [], dict(flat)
    for (key, leaf), (p, a) in where.items():
        swap = jax.jit(lambda x: jax.numpy.swapaxes(x, -1, -2), out_shardings=a.sharding)
        out.append((p, var[p].replace(swap(got[key][leaf]))))
        got[key][leaf] = None   # free the checkpoint-layout copy
    return nnx.from_flat_state(out)
