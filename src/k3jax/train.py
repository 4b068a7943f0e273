"""Training entry point: ``python -m k3jax.train configs/base.yml model_name=... steps=... key=value``.

The loop around ``k3jax.step`` (the jitted optimizer step): state from ``k3jax.state`` (random init,
or ``load_parameters_path``), batches from the data pipeline, metrics to stdout / metrics.jsonl /
TensorBoard, checkpoints. Checkpoints hold params, optimizer state, extra state (router biases) and
the data iterator, so a killed run resumes with the same batches and losses. They store the scanned
periods in layer order at any stage count (``k3jax.state.layer_order``), so a run resumes or
fine-tunes with another pipeline stage count than the one that saved.
"""
from __future__ import annotations

import logging
import sys
import time

import jax
import numpy as np
import yaml

from k3jax import config as C
from k3jax import counts, paths
from k3jax.data.iterator import data_iterator
from k3jax.checkpoint import Checkpointer
from k3jax.cli import run_tool
from k3jax.errors import UserError
from k3jax.console import Console, timed_compile
from k3jax.evaluate import Evaluator, check_eval_data
from k3jax.metrics import MetricsWriter, peak_tflops_per_device
from k3jax.optim.schedule import make_schedule
from k3jax.preemption import EXIT_STATUS as PREEMPTED_EXIT, Preemption
from k3jax.profiler import Profiler
from k3jax.runtime import record_tokenizer, sync_processes
from k3jax.feed import host_feed, token_sharding
from k3jax.sharding import make_mesh, maybe_initialize_distributed
from k3jax.state import abstract_state, init_state, layer_order, memory_order, restore_state
from k3jax.step import check_batch, jit_train_step


class TrainingError(UserError, RuntimeError):
    """A run that cannot continue (e.g. a non-finite loss under nan_policy=stop)."""


def train(cfg, *, on_step=None) -> dict:
    """The training loop; -> {"history", "state", "run_dir", "preempted"} (``preempted``: the step
    saved after SIGTERM, else None)."""
    maybe_initialize_distributed(cfg)
    mesh = make_mesh(cfg)
    n_dev = mesh.devices.size
    gb = check_batch(cfg, n_dev)
    run_dir = paths.run_dir(cfg)
    lead = jax.process_index() == 0
    run_dir.mkdir(parents=True, exist_ok=True)
    check_resumable(cfg, run_dir)
    if lead:
        (run_dir / "config.yml").write_text(yaml.safe_dump(cfg.flat(), sort_keys=False))
    tok = record_tokenizer(cfg, run_dir, write=lead)   # <run>/tokenizer: what decode and serve read with the checkpoints
    feed = host_feed(mesh, gb, cfg.train.max_target_length)   # this process's rows and sequence slices
    if jax.process_count() > 1:
        print(feed.describe(), flush=True)
    data = _data(cfg, gb, tok, feed)   # opens the files, checks records
    if cfg.eval.eval_dataset_path:
        check_eval_data(cfg, tok)
    ckpt = last = None
    if cfg.checkpoint.enable_checkpointing:
        ckpt = Checkpointer(run_dir / "checkpoints", max_to_keep=cfg.checkpoint.max_checkpoints_to_keep,
                            async_save=cfg.checkpoint.async_checkpointing)
        last = ckpt.latest_step()
    if last is not None:  # resume: the full state (and the data position) straight into the shardings
        gdef, state, tx, data_restored = restore_checkpoint(cfg, mesh, ckpt, last, data, feed.shards)
        print(f"resumed from {run_dir / 'checkpoints' / str(last)} at step {last}")
        if not data_restored:
            _skip_batches(data, last, ckpt.data_process_counts(last), ckpt.saved_data_shards(last), feed.shards)
    elif cfg.checkpoint.load_parameters_path:
        gdef, state, tx = restore_state(cfg, mesh, optimizer=True)
        print(f"loaded parameters from {cfg.checkpoint.load_parameters_path}")
    else:
        gdef, state, tx = init_state(cfg, mesh, optimizer=True)
    start = last or 0
    step_fn = MediaSteps(cfg, gdef, tx, state) if _mm(cfg) else compile_train_step(cfg, gdef, tx, state, mesh, gb)
    sync_processes("compiled the train step")
    evaluator = Evaluator(cfg, mesh, gdef, tok) if cfg.eval.eval_dataset_path else None
    console = Console(cfg, num_devices=n_dev, start_step=start, tokens_per_step=float(gb * cfg.train.max_target_length),
                      flops_per_token=counts.train_flops_per_token(cfg.model, cfg.train.max_target_length,
                                                                   cfg.kernel.kda_chunk_size),
                      peak_tflops_per_device=peak_tflops_per_device(cfg.train.peak_tflops))
    writer = MetricsWriter(run_dir, cfg.train.enable_tensorboard)
    schedule = make_schedule(cfg.train)
    profiler = Profiler(cfg, run_dir, start)
    preemption = Preemption()
    preempted = None
    tty = sys.stdout.isatty()
    history = []
    t_last = time.perf_counter()
    try:
        for step in range(start, cfg.train.steps):
            raw = next(data, None)
            if raw is None:   # num_epoch passes are used up
                state = _data_ran_out(cfg, step, start, ckpt, state, data, console)
                break
            profiler.before(step)
            raw, vision = vision_flops(cfg, feed, raw)   # mm_sft: one patch bucket on every process
            batch = feed.put_batch(raw)
            with jax.set_mesh(mesh):
                state, m = step_fn(state, batch)
            m = jax.device_get(m)
            if isinstance(step_fn, MediaSteps):   # a new patch bucket compiled: not step time
                t_last += step_fn.take_compile_s()
            profiler.after(step)
            if not bool(m["finite"]) and cfg.train.nan_policy == "stop":
                raise TrainingError(f"non-finite loss at step {step + 1} (loss={float(m['loss'])}, grad_norm="
                                    f"{float(m['grad_norm'])}); stopped without saving; the last good checkpoint "
                                    f"is kept (set nan_policy=skip to skip such steps)")
            # tokens processed, padding included; the time covers the batch's input and the step
            # (mm_sft: the tower and projector's FLOPs count too)
            rec = console.record(step + 1, m, time.perf_counter() - t_last, float(schedule(step)), extra_flops=vision)
            stats = getattr(data, "stats", None)
            if stats is not None:   # records read so far (the reader runs a little ahead of the steps)
                rec.update(records_read=stats.records, bad_records=stats.bad,
                           empty_records=stats.empty)
            if evaluator and evaluator.due(step + 1):
                rec.update(evaluator.run(state))
            history.append(rec)
            writer.write(rec)
            if on_step:
                on_step(rec)
            if console.due(step + 1) or "eval_loss" in rec:
                print(("\r" if tty else "") + console.line(rec), flush=True)
            if preemption.due(step + 1):
                preempted = step + 1
                state = _save_on_preemption(ckpt, step + 1, state, data, console, cfg)
                break
            if ckpt and ((step + 1) % cfg.checkpoint.checkpoint_period == 0 or step + 1 == cfg.train.steps):
                state = _save(ckpt, step + 1, state, data, console, cfg, force=step + 1 == cfg.train.steps)
            if ckpt:
                console.poll_checkpoints(ckpt.saving())
            t_last = time.perf_counter()   # evaluation, logging and checkpoint time are not step time
    finally:
        profiler.close()
        preemption.close()
        if ckpt:
            ckpt.close()
            console.poll_checkpoints(False)
        writer.close()
    if preempted is None:
        _report_sft_fitting(cfg, data)
    return {"history": history, "state": state, "run_dir": run_dir, "preempted": preempted}


def _mm(cfg) -> bool:
    return cfg.data.dataset_type == "mm_sft"


def _data(cfg, gb: int, tok, feed):
    """The batch iterator of this process's data shard (``data.iterator.data_iterator``; image
    conversations through ``k3jax.data.mm_sft``, whose batches carry ``"media"``)."""
    return data_iterator(cfg, gb, tok, shard=feed.shard, num_shards=feed.num_shards)


def vision_flops(cfg, feed, raw: dict) -> tuple[dict, float]:
    """mm_sft: -> (the batch with its media on every process's common patch bucket, the global
    batch's tower + projector training FLOPs: ``HostFeed.agree_media``). A text batch: (raw, 0.0)."""
    if raw.get("media") is None:
        return raw, 0.0
    grids = raw["media_grids"].tolist()
    flops = counts.vision_train_flops(cfg.vision, cfg.model.hidden_size, grids, cfg.train.freeze) if grids else 0.0
    return feed.agree_media(raw, cfg.vision.vision_merge_kernel_size, flops)


class MediaSteps:
    """mm_sft: the train step compiled for each patch bucket when its first batch comes (a few
    shapes: ``vision_patch_buckets``), each compile reported like the text step's."""

    def __init__(self, cfg, gdef, tx, state):
        self.jitted = jit_train_step(cfg, gdef, tx, state)
        self.programs: dict = {}
        self.compile_s = 0.0

    def __call__(self, state, batch):
        key = tuple((k, v.shape) for k, v in sorted(batch["media"].items()))
        prog = self.programs.get(key)
        if prog is None:
            t0 = time.perf_counter()
            n = batch["media"]["patches"].shape[1]
            prog = self.programs[key] = timed_compile(f"train step for {n} image patches per row", self.jitted,
                                                      state, batch)
            self.compile_s += time.perf_counter() - t0
        return prog(state, batch)

    def take_compile_s(self) -> float:
        s, self.compile_s = self.compile_s, 0.0
        return s


def _skip_batches(data, step: int, saved_counts: list[int], saved_shards, shards) -> None:
    """Elastic restart: the checkpoint's data-iterator states belong to another process count, or
    to other data shards (a context axis that spans hosts now, or no longer), so this run's
    iterator restarts at its step-derived position (``step`` batches in)."""
    if saved_shards is not None:
        show = lambda s: " ".join(f"{i}/{n}" for i, n in s)  # noqa: E731
        why = (f"holds the processes' data shards {show(saved_shards)}, this mesh reads {show(shards)} "
               f"(processes of one context group share a shard)")
    else:
        why = (f"was saved by {'/'.join(map(str, saved_counts)) or 'no'} process(es), this run has "
               f"{jax.process_count()}")
    print(f"note: the checkpoint's data iterator {why}; the data restarts at its step-derived position "
          f"({step} batches skipped; the records are this run's shard order, not the saved run's)", flush=True)
    for _ in range(step):
        if next(data, None) is None:
            break


def _save_on_preemption(ckpt, step: int, state, data, console, cfg):
    """SIGTERM: every process saves the agreed step, waits for the save, and the run exits 143.
    -> the state (its arrays are new after a save with pipeline stages: see ``_save``)."""
    t0 = time.perf_counter()
    if ckpt is None:
        print(f"preempted (SIGTERM) at step {step}; checkpointing is off, nothing saved; exiting with status "
              f"{PREEMPTED_EXIT}", flush=True)
        return state
    if ckpt.latest_step() != step:
        state = save_checkpoint(ckpt, step, state, data, cfg, force=True)
    ckpt.wait()
    console.pending_saves.clear()
    print(f"preempted (SIGTERM): checkpoint {step} saved in {time.perf_counter() - t0:.1f} s in "
          f"{ckpt.directory}; exiting with status {PREEMPTED_EXIT} so the job is restarted", flush=True)
    return state


# Keys beyond the model section that decide the shapes or dtypes of a full training state.
STATE_KEYS = ("weight_dtype", "mu_dtype", "opt_type", "freeze")


def check_resumable(cfg, run_dir) -> None:
    """A run directory with checkpoints resumes its full state (parameters, optimizer moments,
    router biases), which only fits the configuration that wrote it: a different model or state
    dtype is an error naming the keys, before anything is restored (or the saved config.yml of
    the run overwritten)."""
    saved_file = run_dir / "config.yml"
    ckpts = run_dir / "checkpoints"
    if not saved_file.is_file() or not ckpts.is_dir() or not any(d.name.isdigit() for d in ckpts.iterdir()):
        return
    saved = yaml.safe_load(saved_file.read_text()) or {}
    now = cfg.flat()
    keys = [k for k in C.KEYS if C.KEYS[k][0] == "model"] + list(STATE_KEYS)
    diff = [k for k in keys if k in saved and saved[k] != now[k]]
    if diff:
        shown = "; ".join(f"{k}: checkpoint {saved[k]!r} vs now {now[k]!r}" for k in diff[:6])
        raise C.ConfigError(f"{run_dir} holds checkpoints of another configuration ({len(diff)} keys differ: {shown}); "
                            f"resume with the same settings, or use a new run_name with "
                            f"load_parameters_path={run_dir} to start from its weights")


# ---- the parts of the loop an operator sees (k3jax.console) ---------------------------------------

def compile_train_step(cfg, gdef, tx, state, mesh, rows: int):
    """The train step compiled ahead of the first batch, against the batch's shapes and sharding,
    with its compile time reported apart from the step times (and so out of the ETA)."""
    sh = token_sharding(mesh)
    t = cfg.train.max_target_length
    batch = {k: jax.ShapeDtypeStruct((rows, t), np.float32 if k == "loss_mask" else np.int32, sharding=sh)
             for k in ("tokens", "targets", "segment_ids", "positions", "loss_mask")}
    with jax.set_mesh(mesh):
        return timed_compile("train step", jit_train_step(cfg, gdef, tx, state), state, batch)


def _save(ckpt, step: int, state, data, console, cfg, *, force: bool):
    """Start saving ``step``; -> the state to go on with."""
    t0 = time.perf_counter()
    state = save_checkpoint(ckpt, step, state, data, cfg, force=force)
    console.checkpoint_started(step, t0, cfg.checkpoint.async_checkpointing)
    return state


def restore_checkpoint(cfg, mesh, ckpt, step: int, data=None, data_shards=None):
    """-> (graphdef, state, tx, data_restored): the full training state of checkpoint ``step`` read
    into ``cfg``'s shardings on ``mesh`` and put in the pipeline's memory order (the checkpoint holds
    layer order, whatever stage count saved it); ``data`` / ``data_shards`` as ``Checkpointer.restore``."""
    gdef, abstract, tx = abstract_state(cfg, mesh, optimizer=True)
    p, o, r, data_restored = ckpt.restore(step, abstract["params"], abstract["opt_state"], abstract["rest"],
                                          data, data_shards=data_shards)
    return gdef, memory_order(cfg, {"params": p, "opt_state": o, "rest": r}), tx, data_restored


def save_checkpoint(ckpt, step: int, state, data, cfg, *, force: bool):
    """Save ``state`` with the scanned periods in layer order. With pipeline stages the periods'
    leaves are permuted to layer order just before the save and back right after, each permutation
    donating its input, so the devices never hold two copies of the state; that is safe because
    ``Checkpointer.save`` has copied every array to host memory when it returns (async saves
    included). -> the state in memory order (new arrays when stages > 1, the same ones otherwise)."""
    state = layer_order(cfg, state)
    try:
        ckpt.save(step, state["params"], state["opt_state"], state["rest"], data, force=force)
    finally:
        state = memory_order(cfg, state)
    return state


def _data_ran_out(cfg, step: int, start: int, ckpt, state, data, console):
    """num_epoch passes are done before ``steps``: say so, and keep the state reached (-> it)."""
    print(f"the training data ran out after num_epoch={cfg.data.num_epoch} passes at step {step} of "
          f"{cfg.train.steps}; stopping", flush=True)
    if ckpt and step > start and step % cfg.checkpoint.checkpoint_period:
        state = _save(ckpt, step, state, data, console, cfg, force=True)
    return state


def _report_sft_fitting(cfg, data) -> None:
    """Conversations longer than a row are never split (the pieces would lack their question):
    how many were truncated or dropped, counted over the records read (the reader runs a little
    ahead of the steps)."""
    stats = getattr(data, "stats", None)
    if stats is not None and (stats.sft_truncated or stats.sft_dropped):
        print(f"sft: {stats.sft_truncated} conversations truncated and {stats.sft_dropped} dropped for being longer "
              f"than max_target_length={cfg.train.max_target_length} (sft_overlong={cfg.data.sft_overlong})")


def _run(cfg) -> int:
    out = train(cfg)
    if out["preempted"] is not None:
        return PREEMPTED_EXIT
    h = out["history"]
    if h:
        print(f"done: {len(h)} steps, loss {h[0]['loss']:.4f} -> {h[-1]['loss']:.4f}; run dir {out['run_dir']}")
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return run_tool("train", _run, argv, __doc__, local_devices=True)


if __name__ == "__main__":
    raise SystemExit(main())
