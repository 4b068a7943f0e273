"""Streaming conversion I/O: throughput and peak RSS versus checkpoint size.

For each size, writes a synthetic K3-shaped multi-shard checkpoint (BF16 ``{q,k,v}_proj``
[12288, 7168] and MXFP4 routed experts w1/w3 [3072, 3584], w2 [3584, 3072] as compressed-tensors
``weight_packed`` + ``weight_scale``), evicts it from the page cache, then in a fresh child process
reads every logical weight with ``CheckpointReader.get_dequantized`` (float32), casts it to BF16
and streams it into a ``ShardedWriter``. The child reports its wall time split and its own peak
RSS (VmHWM); the parent spot-checks the output bit for bit and asserts

    peak RSS <= max_shard_bytes + 2 x (largest dequantized float32 tensor) + 300 MB

(one output shard held by the writer, the current float32 weight plus its BF16 copy / read buffer,
and the interpreter with numpy). Results: a table on stdout and benchmarks/results/convert_io.json.

    .venv/bin/python benchmarks/convert_io.py                  # 0.5 GB and 2 GB
    .venv/bin/python benchmarks/convert_io.py --sizes-gb 0.25  # quick
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import ml_dtypes
import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # run as a script from anywhere: make `conversion` importable

from common import evict_from_page_cache  # noqa: E402  (benchmarks/ is on sys.path when run as a script)
from conversion import safetensors_io as sio  # noqa: E402

MB = 2**20
DENSE_SHAPE = (12288, 7168)  # K3 KDA q/k/v_proj, BF16
EXPERT_SHAPES = {"w1": (3072, 3584), "w3": (3072, 3584), "w2": (3584, 3072)}  # dequantized
K3_QC = {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
         "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "float",
                                                   "group_size": 32, "symmetric": True}}}}


def _synthetic_tensors(size_bytes: int, rng: np.random.Generator):
    """Yield (name, array) adding up to ~size_bytes: half BF16 dense, half MXFP4 experts."""
    dense_bytes = DENSE_SHAPE[0] * DENSE_SHAPE[1] * 2
    expert_bytes = {k: o * i // 2 + o * i // 32 for k, (o, i) in EXPERT_SHAPES.items()}
    n_dense = max(1, round(size_bytes / 2 / dense_bytes))
    n_expert = max(3, round(size_bytes / 2 / np.mean(list(expert_bytes.values()))))
    for j in range(n_dense):
        layer, proj = divmod(j, 3)
        # Clearing bit 14 (the top exponent bit) keeps every BF16 value finite, |x| < 2.
        bits = rng.integers(0, 2**16, DENSE_SHAPE, dtype=np.uint16) & 0xBFFF
        yield f"language_model.model.layers.{layer}.self_attn.{'qkv'[proj]}_proj.weight", \
            bits.view(ml_dtypes.bfloat16)
    for j in range(n_expert):
        expert, which = divmod(j, 3)
        o, i = EXPERT_SHAPES[("w1", "w3", "w2")[which]]
        base = f"language_model.model.layers.1.block_sparse_moe.experts.{expert}.{('w1', 'w3', 'w2')[which]}"
        yield base + ".weight_packed", rng.integers(0, 256, (o, i // 2), dtype=np.uint8)
        yield base + ".weight_scale", rng.integers(118, 127, (o, i // 32), dtype=np.uint8)


def _write_input(path: str, size_bytes: int, max_shard_bytes: int) -> None:
    with sio.ShardedWriter(path, max_shard_bytes) as w:
        for name, arr in _synthetic_tensors(size_bytes, np.random.default_rng(0)):
            w.add(name, arr)
    with open(os.path.join(path, sio.CONFIG_NAME), "w") as f:
        json.dump({"text_config": {"quantization_config": K3_QC}}, f)


def _peak_rss_bytes() -> int:
    """This process's peak RSS: VmHWM from /proc/self/status (Linux).

    Not ``getrusage().ru_maxrss``: Linux carries the high-water mark across fork+exec, so a child
    would report the parent's RSS at fork time (measured: 567 MB before any work) as its own.
    """
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status; this benchmark needs Linux")


def _convert(src: str, dst: str, max_shard_bytes: int) -> dict:
    """The measured work (runs in a fresh child process so the peak RSS is its own)."""
    rss_start = _peak_rss_bytes()
    t0 = time.perf_counter()
    reader = sio.CheckpointReader(src)
    t_open = time.perf_counter() - t0
    t_read = t_cast = t_write = 0.0
    largest_f32, n_params = 0, 0
    with sio.ShardedWriter(dst, max_shard_bytes) as writer:
        for name in reader.logical_keys():
            t = time.perf_counter()
            w = reader.get_dequantized(name)  # read + decode, float32 [out, in]
            t_read += time.perf_counter() - t
            largest_f32, n_params = max(largest_f32, w.nbytes), n_params + w.size
            t = time.perf_counter()
            w = w.astype(ml_dtypes.bfloat16)
            t_cast += time.perf_counter() - t
            t = time.perf_counter()
            writer.add(name, w)
            del w
            t_write += time.perf_counter() - t
        t = time.perf_counter()
    t_write += time.perf_counter() - t  # the last shard + index, written on close
    return {"seconds": time.perf_counter() - t0, "open_s": t_open, "read_decode_s": t_read,
            "cast_bf16_s": t_cast, "write_s": t_write, "params": n_params,
            "tensors": len(reader.logical_keys()), "input_bytes": reader.total_bytes,
            "output_bytes": writer.total_size, "largest_f32_bytes": largest_f32,
            "rss_after_imports_bytes": rss_start,
            "peak_rss_bytes": _peak_rss_bytes()}


def _spot_check(src: str, dst: str) -> int:
    """Every 7th output tensor equals the input's decode cast to BF16, bit for bit."""
    a, b = sio.CheckpointReader(src), sio.CheckpointReader(dst)
    names = b.keys()[::7]
    for name in names:
        want = a.get_dequantized(name).astype(ml_dtypes.bfloat16).view(np.uint16)
        got = b.get(name).view(np.uint16)
        if not np.array_equal(want, got):
            raise AssertionError(f"converted tensor {name} differs from the decoded input")
    return len(names)


def run_size(size_gb: float, max_shard_mb: int, workdir: str | None) -> dict:
    tmp = tempfile.mkdtemp(prefix="k3jax_convert_io_", dir=workdir)
    src, dst = os.path.join(tmp, "in"), os.path.join(tmp, "out")
    try:
        t = time.perf_counter()
        _write_input(src, int(size_gb * 2**30), max_shard_mb * MB)
        gen_s = time.perf_counter() - t
        evict_from_page_cache(src)
        child = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--_child", src, dst, str(max_shard_mb)],
            check=True, capture_output=True, text=True)
        res = json.loads(child.stdout.strip().splitlines()[-1])
        res["checked_tensors"] = _spot_check(src, dst)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    res.update(size_gb=size_gb, max_shard_bytes=max_shard_mb * MB, generate_s=gen_s)
    res["rss_bound_bytes"] = res["max_shard_bytes"] + 2 * res["largest_f32_bytes"] + 300 * MB
    res["input_MBps"] = res["input_bytes"] / MB / res["seconds"]
    res["output_MBps"] = res["output_bytes"] / MB / res["seconds"]
    res["Mparams_per_s"] = res["params"] / 1e6 / res["seconds"]
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes-gb", default="0.5,2", help="comma-separated checkpoint sizes, GiB")
    ap.add_argument("--max-shard-mb", type=int, default=256, help="shard limit, in and out")
    ap.add_argument("--workdir", default=None, help="where temp checkpoints go (default TMPDIR)")
    ap.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "convert_io.json"))
    ap.add_argument("--_child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._child:
        src, dst, shard_mb = args._child
        print(json.dumps(_convert(src, dst, int(shard_mb) * MB)))
        return 0
    rows = [run_size(float(s), args.max_shard_mb, args.workdir) for s in args.sizes_gb.split(",")]
    print("| checkpoint | tensors | params | output | time s (read+decode / cast / write) "
          "| in MB/s | out MB/s | Mparam/s | peak RSS | bound |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['input_bytes'] / MB:.0f} MB | {r['tensors']} | {r['params'] / 1e9:.2f} B "
              f"| {r['output_bytes'] / MB:.0f} MB | {r['seconds']:.1f} ({r['read_decode_s']:.1f} / "
              f"{r['cast_bf16_s']:.1f} / {r['write_s']:.1f}) | {r['input_MBps']:.0f} "
              f"| {r['output_MBps']:.0f} | {r['Mparams_per_s']:.0f} | {r['peak_rss_bytes'] / MB:.0f} MB "
              f"| {r['rss_bound_bytes'] / MB:.0f} MB |")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"benchmark": "convert_io", "cpu_count": os.cpu_count(),
                   "page_cache": "input evicted with posix_fadvise(DONTNEED) before reading",
                   "rows": rows}, f, indent=2)
    print(f"wrote {args.out}")
    for r in rows:
        assert r["peak_rss_bytes"] <= r["rss_bound_bytes"], (
            f"peak RSS {r['peak_rss_bytes'] / MB:.0f} MB exceeds the bound "
            f"{r['rss_bound_bytes'] / MB:.0f} MB for a {r['input_bytes'] / MB:.0f} MB checkpoint")
    return 0


if __name__ == "__main__":
    sys.exit(main())
