"""Step metrics: throughput, model FLOP/s and MFU, written to stdout, JSONL and TensorBoard."""
from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from k3jax import paths
from k3jax.topology import chip_of_device_kind

# Dense bf16 peak TFLOP/s per GPU (NVIDIA datasheets, dense). TPU peaks come from
# k3jax.topology.CHIPS, the table the AOT compiler and the planner use.
GPU_PEAK_TFLOPS = {"NVIDIA H100": 989.0, "NVIDIA H200": 989.0, "NVIDIA B200": 2250.0, "NVIDIA GB200": 2500.0}

_CPU_PEAK: float | None = None


def measure_cpu_matmul_peak(n: int = 2048, runs: int = 5, seconds: float = 1.0) -> dict:
    """The machine's own float32 matmul rate on one device, as the CPU 'peak' for MFU.

    Best of ``runs`` timed runs of about ``seconds`` each (repeated n x n matmuls): on shared cores
    one short run can land on a neighbour's burst (0.129 vs 0.468 TFLOP/s seen for one 0.5 s run at
    n=1024), while the best of several is what the machine can do. Returns {"tflops": best,
    "runs_tflops": every run, "spread": (max - min) / max, "n", "seconds"}.
    """
    a = jnp.ones((n, n), jnp.float32)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    rates = []
    for _ in range(runs):
        reps, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            f(a).block_until_ready()
            reps += 1
        rates.append(2 * n ** 3 * reps / (time.perf_counter() - t0) / 1e12)
    best = max(rates)
    return {"tflops": best, "runs_tflops": rates, "spread": (best - min(rates)) / best, "n": n,
            "seconds": seconds}


def measure_cpu_matmul_tflops(n: int = 2048, runs: int = 5, seconds: float = 1.0) -> float:
    """Best-of-runs float32 matmul TFLOP/s (``measure_cpu_matmul_peak``'s "tflops")."""
    return measure_cpu_matmul_peak(n, runs, seconds)["tflops"]


def peak_tflops_per_device(override: float | None = None) -> float:
    global _CPU_PEAK
    if override:
        return override
    kind = jax.devices()[0].device_kind
    chip = chip_of_device_kind(kind)
    if chip is not None:
        return chip.peak_flops / 1e12   # per JAX device (TPU7x: half a chip)
    for name, peak in sorted(GPU_PEAK_TFLOPS.items(), key=lambda kv: -len(kv[0])):
        if kind.startswith(name):
            return peak
    if _CPU_PEAK is None:
        _CPU_PEAK = measure_cpu_matmul_tflops()
    return _CPU_PEAK


class MetricsWriter:
    """One JSON object per logged step in ``metrics.jsonl``; TensorBoard scalars when available.
    Only process 0 writes (the others' records are the same numbers). A gs:// run directory gets
    the files written locally first and uploaded every ``sync_seconds`` and on close (objects
    cannot be appended to); a resumed run continues the uploaded metrics.jsonl."""

    def __init__(self, run_dir, tensorboard: bool = True, sync_seconds: float = 30.0):
        self.file = self.tb = None
        if jax.process_index() != 0:
            return
        self.remote = run_dir if paths.is_remote(run_dir) else None
        self.sync_seconds, self.last_sync = sync_seconds, time.monotonic()
        if self.remote is not None:
            local = Path(tempfile.mkdtemp(prefix="k3jax-metrics-"))
            if (run_dir / "metrics.jsonl").exists():
                (local / "metrics.jsonl").write_bytes((run_dir / "metrics.jsonl").read_bytes())
            run_dir = local
        self.local = run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / "metrics.jsonl"
        self.file = self.path.open("a")
        if tensorboard:
            try:
                from tensorboardX import SummaryWriter  # optional here: without it, TensorBoard logging is off
                self.tb = SummaryWriter(str(run_dir / "tensorboard"))
            except ImportError:
                print("note: tensorboardX is not installed; TensorBoard logging is off", file=sys.stderr)

    def write(self, record: dict) -> None:
        if self.file is None:
            return
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.tb is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, record["step"])
        if self.remote is not None and time.monotonic() - self.last_sync >= self.sync_seconds:
            self.sync()

    def sync(self) -> None:
        """Upload the local files to the gs:// run directory (nothing for a local one)."""
        if self.remote is None or self.file is None:
            return
        if self.tb is not None:
            self.tb.flush()
        paths.upload(self.local, str(self.remote))
        self.last_sync = time.monotonic()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.tb is not None:
            self.tb.close()
        if self.file is not None and self.remote is not None:
            paths.upload(self.local, str(self.remote))
