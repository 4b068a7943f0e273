"""Shared helpers of the benchmark scripts: CPU set-up, median timing, tables and JSON results.

Every benchmark is a script that prints a table and writes ``benchmarks/results/<name>.json``;
speed claims are ratios measured side by side in one run on the same machine (docs/benchmarks.md).
Import this module before jax: ``cpu_only()`` must run before jax picks its backend.
"""
from __future__ import annotations

import json
import os
import platform
import re
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


# XLA flags of the GPU mode (``--gpu``), as MaxText documents its own GPU flags. One card, so the
# collective-overlap flags MaxText sets for multi-GPU runs have nothing to overlap and are left out.
#   --xla_gpu_enable_latency_hiding_scheduler=true  schedule by estimated op latency, so async
#       copies and host transfers overlap compute (MaxText's first GPU flag; XLA's default is off)
#   --xla_gpu_enable_triton_gemm=false  matmuls through cuBLAS(Lt), not XLA's Triton GEMM emitter:
#       MaxText and JAX's GPU performance guide turn it off for bf16 training, where cuBLAS's
#       kernels are the faster ones on Hopper
# XLA_PYTHON_CLIENT_MEM_FRACTION: JAX takes 75% of the card's memory at start by default; a script
# that shares the card with a torch process (decode_vs_hf.py's transformers side) asks for less.
GPU_XLA_FLAGS = ("--xla_gpu_enable_latency_hiding_scheduler=true", "--xla_gpu_enable_triton_gemm=false")


def gpu_mode(argv: Sequence[str] | None = None) -> bool:
    """True when the script runs in its GPU mode: ``--gpu`` in its arguments."""
    return "--gpu" in (sys.argv[1:] if argv is None else argv)


def select_platform(argv: Sequence[str] | None = None, mem_fraction: float | None = None) -> str:
    """Before jax is imported: ``--gpu`` -> jax on the CUDA card with GPU_XLA_FLAGS (``--gpu
    --dry-run``: the same settings and flags on the host CPU, tiny sizes, as CI runs them);
    otherwise ``cpu_only()``. Returns the platform jax will use."""
    args = sys.argv[1:] if argv is None else list(argv)
    if not gpu_mode(args):
        cpu_only()
        return "cpu"
    if "jax" in sys.modules:
        raise RuntimeError("benchmarks.common.select_platform() must run before jax is imported")
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = " ".join([flags, *(f for f in GPU_XLA_FLAGS if f.split("=")[0] not in flags)]).strip()
    if mem_fraction is not None:
        os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", str(mem_fraction))
    platform_ = "cpu" if "--dry-run" in args else "cuda"
    os.environ["JAX_PLATFORMS"] = platform_
    return platform_


# Dense bf16 peak of the cards the GPU mode knows (NVIDIA's data sheets, without sparsity), keyed by
# a pattern of jax's device_kind. A card not listed gets no MFU (the table says so).
BF16_PEAK_TFLOPS = ((r"H100.*(PCIe)", 756.0), (r"H100 NVL", 835.0), (r"H100", 989.0), (r"H200", 989.0))


def bf16_peak_tflops(device_kind: str) -> float | None:
    """The card's dense bf16 peak in TFLOP/s, or None for a card not in BF16_PEAK_TFLOPS."""
    for pattern, tflops in BF16_PEAK_TFLOPS:
        if re.search(pattern, device_kind):
            return tflops
    return None


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


# Named scopes the train step's code opens (model.py, step.py, layers/moe.py, optim/orthogonalize.py),
# innermost last in an op's op_name; a profile's ops are grouped by the innermost one.
SCOPES = ("loss", "mixer", "ffn", "router", "dispatch", "residual_mix", "optimizer", "newton_schulz")


def hlo_op_names(hlo_text: str) -> dict[str, str]:
    """HLO instruction name -> its ``op_name`` metadata (the jax call path, named scopes included),
    from a compiled module's text (``compiled.as_text()``): what a trace's ``hlo_op`` refers to."""
    out = {}
    for m in re.finditer(r'%([\w.\-]+) = [^\n]*?metadata=\{op_name="([^"]*)"', hlo_text):
        out.setdefault(m.group(1), m.group(2))
    return out


def scope_of(op_name: str | None) -> str:
    """The group of one op: its innermost named scope of SCOPES, prefixed "bwd" when it runs in the
    backward (under ``transpose(``, remat recomputation included) or "fwd" under ``jvp(``."""
    if not op_name:
        return "(no op_name)"
    inner = [p for p in re.split(r"[/()]", op_name) if p in SCOPES]
    phase = "bwd " if "transpose(" in op_name else "fwd " if "jvp(" in op_name else ""
    if inner and inner[-1] in ("optimizer", "newton_schulz"):
        phase = ""
    return phase + (inner[-1] if inner else "other")


def profile_top_ops(fn: Callable[[], object], trace_dir: str, top: int = 15, hlo_text: str | None = None) -> dict:
    """Run ``fn()`` under ``jax.profiler.trace(trace_dir, create_perfetto_trace=True)``; print and
    return the ``top`` HLO ops by total time (the trace's complete events that XLA tagged with an
    ``hlo_op``, aggregated by (module, op name) over all their executions) and, given the compiled
    module's text of the profiled program, the op time per named scope (``scope_of``): a scan or
    while loop is one op of the first table, while the second splits its body by what it computes.

    Returns {"ops": rows {"module", "op", "total_ms", "count", "mean_us", "share_pct"} (share of all
    HLO op time), "scopes": rows {"scope", "total_ms", "ops", "share_pct", "top_op"} or None}.
    Open ``<trace_dir>/plugins/profile/*/perfetto_trace.json.gz`` in ui.perfetto.dev for the timeline.
    """
    import glob
    import gzip
    import jax
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        fn()
    path = max(glob.glob(os.path.join(trace_dir, "plugins", "profile", "*", "perfetto_trace.json.gz")),
               key=os.path.getmtime)
    with gzip.open(path) as fh:
        trace = json.load(fh)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    # XLA tags each executed HLO op with args.hlo_op / hlo_module; runtime bookkeeping, compiler
    # passes and the Python tracer carry no hlo_op and are left out.
    totals: dict[tuple[str, str], list[float]] = {}
    for e in events:
        args = e.get("args") or {}
        if e.get("ph") != "X" or "hlo_op" not in args:
            continue
        t = totals.setdefault((args.get("hlo_module", ""), args["hlo_op"]), [0.0, 0])
        t[0] += e.get("dur", 0.0)
        t[1] += 1
    all_us = sum(v[0] for v in totals.values()) or 1.0
    rows = [{"module": mod, "op": name, "total_ms": us / 1e3, "count": n, "mean_us": us / n,
             "share_pct": 100 * us / all_us}
            for (mod, name), (us, n) in sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]]
    print(f"\ntop {top} ops by total time ({all_us / 1e3:.1f} ms of ops in the trace; {path})")
    print_table(rows, [("module", "module", "s"), ("op", "op", "s"), ("total ms", "total_ms", ".2f"), ("count", "count", "d"),
                       ("mean us", "mean_us", ".1f"), ("share %", "share_pct", ".1f")])
    scopes = None
    if hlo_text is not None:
        # A loop op's own time contains its body's ops, which the trace also records: only leaf
        # ops (no while/call/conditional wrappers) are summed, so nothing is counted twice.
        names = hlo_op_names(hlo_text)
        by: dict[str, dict] = {}
        leaf_us = 0.0
        for (_, op), (us, _n) in totals.items():
            if re.match(r"(while|call|conditional)(\.|$)", op):
                continue
            leaf_us += us
            g = by.setdefault(scope_of(names.get(op)), {"us": 0.0, "ops": {}})
            g["us"] += us
            g["ops"][op] = g["ops"].get(op, 0.0) + us
        scopes = [{"scope": k, "total_ms": g["us"] / 1e3, "ops": len(g["ops"]),
                   "share_pct": 100 * g["us"] / (leaf_us or 1.0), "top_op": max(g["ops"], key=g["ops"].get)}
                  for k, g in sorted(by.items(), key=lambda kv: -kv[1]["us"])]
        print(f"\nop time by named scope ({leaf_us / 1e3:.1f} ms of leaf ops; bwd = backward, remat included)")
        print_table(scopes, [("scope", "scope", "s"), ("total ms", "total_ms", ".2f"), ("ops", "ops", "d"),
                             ("share %", "share_pct", ".1f"), ("top op", "top_op", "s")])
    return {"ops": rows, "scopes": scopes}


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
