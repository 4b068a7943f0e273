"""Training entry point: ``python -m k3jax.train configs/base.yml model_name=... steps=... key=value``.

The loop around ``k3jax.step`` (the jitted optimizer step): state from ``k3jax.state`` (random init,
or ``load_parameters_path``), batches from the data pipeline, metrics to stdout / metrics.jsonl /
TensorBoard, checkpoints. Checkpoints hold params, optimizer state, extra state (router biases) and
the data iterator, so a killed run resumes with the same batches and losses.
"""
from __future__ import annotations

import logging
import sys
import time

import jax
import yaml

from k3jax import config as C
from k3jax import counts
from k3jax.checkpoint import Checkpointer
from k3jax.cli import run_tool
from k3jax.errors import UserError
from k3jax.metrics import MetricsWriter, peak_tflops_per_device
from k3jax.optim import make_schedule
from k3jax.runtime import load_tokenizer
from k3jax.sharding import make_mesh, maybe_initialize_distributed
from k3jax.state import abstract_state, init_state, restore_state
from k3jax.step import check_batch, data_iterator, global_batch, jit_train_step



class TrainingError(UserError, RuntimeError):
    """A run that cannot continue (e.g. a non-finite loss under nan_policy=stop)."""


def train(cfg, *, on_step=None) -> dict:
    maybe_initialize_distributed(cfg)
    mesh = make_mesh(cfg)
    n_dev = mesh.devices.size
    gb = check_batch(cfg, n_dev)
    run_dir = cfg.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yml").write_text(yaml.safe_dump(cfg.flat(), sort_keys=False))
    tok = load_tokenizer(cfg) if cfg.data.dataset_type != "synthetic" or cfg.data.tokenizer_path else None
    data = data_iterator(cfg, gb, tok)
    ckpt = last = None
    if cfg.checkpoint.enable_checkpointing:
        ckpt = Checkpointer(run_dir / "checkpoints", max_to_keep=cfg.checkpoint.max_checkpoints_to_keep,
                            async_save=cfg.checkpoint.async_checkpointing)
        last = ckpt.latest_step()
    if last is not None:  # resume: the full state (and the data position) straight into the shardings
        gdef, abstract, tx = abstract_state(cfg, mesh, optimizer=True)
        p, o, r = ckpt.restore(last, abstract["params"], abstract["opt_state"], abstract["rest"], data)
        state = {"params": p, "opt_state": o, "rest": r}
        print(f"resumed from {run_dir / 'checkpoints' / str(last)} at step {last}")
    elif cfg.checkpoint.load_parameters_path:
        gdef, state, tx = restore_state(cfg, mesh, optimizer=True)
        print(f"loaded parameters from {cfg.checkpoint.load_parameters_path}")
    else:
        gdef, state, tx = init_state(cfg, mesh, optimizer=True)
    start = last or 0
    step_fn = jit_train_step(cfg, gdef, tx, state)
    flops_tok = counts.train_flops_per_token(cfg.model, cfg.train.max_target_length, cfg.kernel.kda_chunk_size)
    peak = peak_tflops_per_device(cfg.train.peak_tflops)
    writer = MetricsWriter(run_dir, cfg.train.enable_tensorboard)
    schedule = make_schedule(cfg.train)
    tty = sys.stdout.isatty()
    history = []
    t_last = time.perf_counter()
    try:
        for step in range(start, cfg.train.steps):
            batch = global_batch(next(data), mesh, gb)
            with jax.set_mesh(mesh):
                state, m = step_fn(state, batch)
            m = jax.device_get(m)
            if not bool(m["finite"]) and cfg.train.nan_policy == "stop":
                raise TrainingError(f"non-finite loss at step {step + 1} (loss={float(m['loss'])}, grad_norm="
                                    f"{float(m['grad_norm'])}); stopped without saving; the last good checkpoint "
                                    f"is kept (set nan_policy=skip to skip such steps)")
            now = time.perf_counter()
            dt, t_last = now - t_last, now
            tokens = float(gb * cfg.train.max_target_length)  # processed, padding included
            rec = {"step": step + 1, **{k: float(v) for k, v in m.items() if k != "finite"},
                   "learning_rate": float(schedule(step)), "step_time_s": dt, "tokens_per_s": tokens / dt,
                   "tflops_per_device": tokens * flops_tok / dt / n_dev / 1e12}
            rec["mfu"] = rec["tflops_per_device"] / peak
            history.append(rec)
            writer.write(rec)
            if on_step:
                on_step(rec)
            if (step + 1) % cfg.train.log_period == 0 or step == start or step + 1 == cfg.train.steps:
                line = (f"step {step + 1:>6}  loss {rec['loss']:.4f}  grad_norm {rec['grad_norm']:.3f}  "
                        f"lr {rec['learning_rate']:.2e}  tok/s {rec['tokens_per_s']:.0f}  "
                        f"TFLOP/s/dev {rec['tflops_per_device']:.3f}  MFU {100 * rec['mfu']:.2f}%")
                print(("\r" if tty else "") + line, flush=True)
            if ckpt and ((step + 1) % cfg.checkpoint.checkpoint_period == 0 or step + 1 == cfg.train.steps):
                ckpt.save(step + 1, state["params"], state["opt_state"], state["rest"], data,
                          force=step + 1 == cfg.train.steps)
    finally:
        if ckpt:
            ckpt.close()
        writer.close()
    return {"history": history, "state": state, "run_dir": run_dir}


def _run(cfg) -> int:
    C.validate(cfg, num_devices=len(jax.devices()))
    out = train(cfg)
    h = out["history"]
    if h:
        print(f"done: {len(h)} steps, loss {h[0]['loss']:.4f} -> {h[-1]['loss']:.4f}; run dir {out['run_dir']}")
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return run_tool("train", _run, argv, __doc__)


if __name__ == "__main__":
    raise SystemExit(main())
