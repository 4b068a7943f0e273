"""Shared helpers of the benchmark scripts: CPU set-up, median timing, tables and JSON results.

Every benchmark is a script that prints a table and writes ``benchmarks/results/<name>.json``;
speed claims are ratios measured side by side in one run on the same machine (docs/benchmarks.md).
Import this module before jax: ``cpu_only()`` must run before jax picks its backend.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from typing import Callable, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_DIR = os.path.join(ROOT, "benchmarks", "results")
sys.path.insert(0, os.path.join(ROOT, "src"))  # run as a script without installing


def cpu_only() -> None:
    """Pin jax to the host CPU with its one real device.

    The fake-device flag (--xla_force_host_platform_device_count) splits the same cores into N
    'devices' that then compete for them, so per-device figures would be meaningless; refuse it
    rather than silently benchmarking something else.
    """
    if "jax" in sys.modules:
        raise RuntimeError("benchmarks.common.cpu_only() must run before jax is imported")
    if "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
        raise SystemExit("error: unset --xla_force_host_platform_device_count in XLA_FLAGS; "
                         "the benchmarks measure one real CPU device")
    os.environ["JAX_PLATFORMS"] = "cpu"


def evict_from_page_cache(path: str) -> None:
    """Flush and drop the files directly in ``path`` from the page cache, so a benchmark that reads
    them next measures the disk, not RAM (Linux; files we wrote ourselves)."""
    for file in os.listdir(path):
        fd = os.open(os.path.join(path, file), os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def result_path(name: str) -> str:
    return os.path.join(RESULTS_DIR, f"{name}.json")


def median_time(fn: Callable[[], object], *, warmup: int, repeats: int) -> tuple[float, list[float]]:
    """Median wall seconds of ``fn()`` over ``repeats`` calls after ``warmup`` untimed calls.

    ``fn`` must block until its device work is done (``jax.block_until_ready``); the median (not
    the mean or best) because the CPUs are shared and a neighbour's burst lands on single calls.
    """
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


def machine() -> dict:
    """What the numbers were measured on (the JSON header)."""
    import jax
    dev = jax.devices()[0]
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = None
    return {"backend": jax.default_backend(), "device_kind": dev.device_kind, "num_devices": jax.device_count(),
            "cpu_count": os.cpu_count(), "load_avg_1min": load, "python": platform.python_version(),
            "jax": jax.__version__, "processor": platform.processor() or platform.machine()}


def fmt(v, spec: str) -> str:
    if v is None:
        return "-"
    return format(v, spec)


def print_table(rows: Sequence[dict], columns: Sequence[tuple[str, str, str]]) -> None:
    """Columns are (header, row key, format spec); widths fit the widest cell."""
    cells = [[h for h, _, _ in columns]] + [[fmt(r.get(k), s) for _, k, s in columns] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    for j, line in enumerate(cells):
        print("  ".join((c.ljust(w) if i == 0 else c.rjust(w)) for i, (c, w) in enumerate(zip(line, widths))))
        if j == 0:
            print("  ".join("-" * w for w in widths))


def write_json(path: str, payload: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as fh:
        json.dump(payload, fh, indent=2)
    print(f"\nwrote {path}")
