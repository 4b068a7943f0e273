"""What a training run tells its operator: the step line, compile and checkpoint notices, the ETA.

The step line, every ``log_period`` steps (and at the first and last step):

    step 120/400  loss 3.6330  acc 0.312  lr 3.00e-03  grad 1.51  tok/s/chip 1,470  TFLOP/s/chip 0.006
        MFU 2.53%  experts max/mean 1.42  qk-clip 0 heads  ETA 1m43s

Throughput is per chip, the unit a TPU slice is bought and sized in: a JAX device is a chip on
v5e/v6e/v5p (megacore), but TPU7x exposes each of its two TensorCores as a device, so per-device
figures there would be half the chip's (``topology.Chip.devices_per_chip``; CPUs and GPUs count one
device per chip). MFU is the same number either way: model FLOP/s over the peak of the same unit.
The ETA is the remaining steps times the mean time of the last 20 steps (compilation is timed
apart, and the first step, which also waits for the input pipeline, counts only until there is a
second); evaluation and checkpoint time are not in it.
"""
from __future__ import annotations

import collections
import time

import jax

from k3jax.topology import chip_of_device_kind


def devices_per_chip() -> int:
    """JAX devices per physical chip of this host's accelerator (1 when unknown: CPU, GPU)."""
    chip = chip_of_device_kind(jax.devices()[0].device_kind)
    return chip.devices_per_chip if chip is not None else 1


def duration(seconds: float) -> str:
    """4s, 3m07s, 2h05m: short enough for a log line, exact enough for an ETA."""
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def note(msg: str) -> None:
    """One operator notice on stdout, flushed so that it shows before a long compile or save."""
    print(msg, flush=True)


def timed_compile(name: str, jitted, *args):
    """``jitted.lower(*args).compile()`` between "compiling the <name> ..." and its time."""
    note(f"compiling the {name} ...")
    t0 = time.perf_counter()
    compiled = jitted.lower(*args).compile()
    note(f"compiled the {name} in {time.perf_counter() - t0:.1f} s")
    return compiled


class Console:
    """Turns the step's metrics into the record written to metrics.jsonl and the log line."""

    def __init__(self, cfg, *, num_devices: int, start_step: int, tokens_per_step: float,
                 flops_per_token: float, peak_tflops_per_device: float, chip_devices: int | None = None):
        self.cfg, self.total = cfg, cfg.train.steps
        self.chips = num_devices / (chip_devices or devices_per_chip())
        self.tokens, self.flops_tok = tokens_per_step, flops_per_token
        self.num_devices, self.peak_dev = num_devices, peak_tflops_per_device
        self.start = start_step
        self.recent = collections.deque(maxlen=20)   # step times behind the ETA
        self.pending_saves: dict[int, float] = {}    # async checkpoint step -> save start time

    def record(self, step: int, metrics: dict, dt: float, learning_rate: float, extra_flops: float = 0.0) -> dict:
        """The metrics.jsonl record of optimizer step ``step`` (1-based) that took ``dt`` s;
        ``extra_flops``: model FLOPs of the step beyond the tokens' (an image batch's tower and
        projector, ``counts.vision_train_flops``)."""
        if step > self.start + 1:   # the first step also waits for the input pipeline to fill
            self.recent.append(dt)
        tps = self.tokens / dt
        flops_s = tps * self.flops_tok + extra_flops / dt
        rec = {"step": step, **{k: float(v) for k, v in metrics.items() if k != "finite"},
               "learning_rate": learning_rate, "step_time_s": dt, "tokens_per_s": tps,
               "tokens_per_s_per_chip": tps / self.chips,
               "tflops_per_device": flops_s / self.num_devices / 1e12,
               "tflops_per_chip": flops_s / self.chips / 1e12}
        rec["mfu"] = rec["tflops_per_device"] / self.peak_dev
        recent = self.recent or [dt]
        rec["eta_s"] = (self.total - step) * sum(recent) / len(recent)
        return rec

    def due(self, step: int) -> bool:
        return step % self.cfg.train.log_period == 0 or step == self.start + 1 or step == self.total

    def line(self, rec: dict) -> str:
        parts = [f"step {rec['step']}/{self.total}", f"loss {rec['loss']:.4f}"]
        if "accuracy" in rec:
            parts.append(f"acc {rec['accuracy']:.3f}")
        parts += [f"lr {rec['learning_rate']:.2e}", f"grad {rec['grad_norm']:.3f}",
                  f"tok/s/chip {rec['tokens_per_s_per_chip']:,.0f}", f"TFLOP/s/chip {rec['tflops_per_chip']:.3f}",
                  f"MFU {100 * rec['mfu']:.2f}%"]
        if "expert_load_max_over_mean" in rec:
            parts.append(f"experts max/mean {rec['expert_load_max_over_mean']:.2f}")
        if "qk_clipped_heads" in rec:
            parts.append(f"qk-clip {int(rec['qk_clipped_heads'])} heads (max logit {rec['max_logit']:.1f})")
        if rec.get("bad_records"):
            parts.append(f"bad records {int(rec['bad_records'])}")
        if "eval_loss" in rec:
            ev = f"eval loss {rec['eval_loss']:.4f} acc {rec['eval_accuracy']:.3f}"
            if "eval_hellaswag_accuracy" in rec:
                ev += f" hellaswag {rec['eval_hellaswag_accuracy']:.3f}"
            parts.append(ev)
        parts.append(f"ETA {duration(rec['eta_s'])}")
        return "  ".join(parts)

    # ---- checkpoints: an async save returns at once and is written in the background, so its
    # notice waits until the manager reports it finished (timed to the step that observed it).
    def checkpoint_started(self, step: int, t0: float, async_save: bool) -> None:
        if async_save:
            self.pending_saves[step] = t0
        else:
            note(f"checkpoint {step} saved in {time.perf_counter() - t0:.1f} s")

    def poll_checkpoints(self, saving: bool) -> None:
        """Report pending async saves once ``saving`` (the manager's in-progress flag) is False."""
        if self.pending_saves and not saving:
            now = time.perf_counter()
            for step, t0 in sorted(self.pending_saves.items()):
                note(f"checkpoint {step} saved in {now - t0:.1f} s")
            self.pending_saves.clear()
