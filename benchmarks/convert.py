"""HF -> k3jax conversion through the real converter: throughput and peak RSS vs checkpoint size.

For each size, writes a synthetic checkpoint with K3's per-tensor shapes (hidden 7168, KDA 96 x 128
heads, gated MLA, latent MoE with 3584-wide MXFP4 experts, 2 shared experts) but fewer layers and
experts and a 4096-token vocabulary, in the released remote layout (``language_model.`` prefix,
BF16 + F32 + MXFP4 ``weight_packed``/``weight_scale``, 1 GiB shards). The input is evicted from the
page cache, then a fresh child process runs ``conversion.hf_to_k3jax.convert`` (BF16 output) and
reports its wall time, its RSS after the imports (baseline) and its peak RSS (VmHWM). The peak is
expected to follow the largest tensor (a [12288, 7168] projection: 176 MB BF16, 352 MB as f32), not
the checkpoint size. Table on stdout, JSON in benchmarks/results/convert.json.

    .venv/bin/python benchmarks/convert.py                       # layers x experts = 1x4, 2x12
    .venv/bin/python benchmarks/convert.py --points 1x4          # quick
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

import ml_dtypes
import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "src"))

from common import evict_from_page_cache  # noqa: E402  (benchmarks/ is on sys.path when run as a script)

MB = 2**20
K3_QC = {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
         "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "float",
                                                                          "group_size": 32, "symmetric": True}}}}

CHILD = r"""
import json, sys, time
sys.path.insert(0, {repo!r}); sys.path.insert(0, {src!r})
from conversion import hf_to_k3jax
import jax, orbax.checkpoint, tensorstore  # noqa: F401  (baseline includes the converter's imports)
def rss(key):
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(key))
base = rss("VmRSS:")
t0 = time.perf_counter()
s = hf_to_k3jax.convert({hf!r}, {out!r}, dtype="bfloat16", progress=False)
print(json.dumps(dict(seconds=time.perf_counter() - t0, baseline_rss=base, peak_rss=rss("VmHWM:"),
                      tensors=s["tensors"], bytes=s["bytes"], parameters=s["parameters"])))
"""


def model_config(layers: int, experts: int):
    from k3jax import config as C
    return C.load(os.path.join(REPO, "configs", "base.yml"), [
        "model_name=kimi-k3", f"num_layers={layers}", "mla_extra_layers=[]" if layers < 2 else f"mla_extra_layers=[{layers - 1}]",
        "first_k_dense=0", f"num_experts={experts}", "num_experts_per_token=2", "vocab_size=4096",
        "attn_res_block_size=1", "max_position_embeddings=4096"])


def write_input(path: str, cfg) -> int:
    """Stream the synthetic checkpoint into ``path``; returns its tensor bytes."""
    from flax import nnx

    from conversion import param_map
    from conversion.k3jax_to_hf import F32_SUFFIXES, hf_config
    from conversion.safetensors_io import CONFIG_NAME, ShardedWriter
    from k3jax import model as M
    m = cfg.model
    model = nnx.eval_shape(lambda: M.build(cfg, 0))
    leaves = {tuple(p): tuple(v.shape) for p, v in nnx.to_flat_state(nnx.state(model))}
    rng = np.random.default_rng(0)
    rules = [(r, None) for r in param_map.global_rules(m, "remote_prefixed")]
    rules += [(r, l) for l in range(m.num_layers) for r in param_map.layer_rules(m, l, "remote_prefixed")]
    with ShardedWriter(path, 2**30) as w:
        for (our, hf, _, to_hf), l in rules:
            loc, idx = model.layout.where(l) if l is not None else ((), None)
            shape = leaves[loc + tuple(our.split("."))][(0 if idx is None else 1):]
            if hasattr(to_hf, "each_hf"):  # MXFP4 experts: random codes, scales 2^-9 .. 2^-1
                out_dim, in_dim = shape[-1], shape[-2]
                for name in hf:
                    base = name[: -len("weight")]
                    w.add(base + "weight_packed", rng.integers(0, 256, (out_dim, in_dim // 2), dtype=np.uint8))
                    w.add(base + "weight_scale", rng.integers(118, 127, (out_dim, in_dim // 32), dtype=np.uint8))
                continue
            # Shapes only: a transpose is the reversed shape; other maps run on a zero-stride view.
            hf_shape = shape[::-1] if to_hf is param_map._t else to_hf(np.broadcast_to(np.float32(0), shape)).shape
            if hf[0].endswith(F32_SUFFIXES):
                arr = rng.standard_normal(hf_shape, dtype=np.float32)
            else:  # random BF16 bits with the top exponent bit cleared: finite, |x| < 2
                arr = (rng.integers(0, 2**16, hf_shape, dtype=np.uint16) & 0xBFFF).view(ml_dtypes.bfloat16)
            w.add(hf[0], arr)
    config = hf_config(m, "remote_prefixed", "bfloat16")
    config["text_config"]["quantization_config"] = K3_QC
    with open(os.path.join(path, CONFIG_NAME), "w") as f:
        json.dump(config, f)
    return w.total_size


def du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


def run_point(layers: int, experts: int, workdir: str) -> dict:
    hf, out = os.path.join(workdir, "hf"), os.path.join(workdir, "out")
    shutil.rmtree(hf, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    size = write_input(hf, model_config(layers, experts))
    evict_from_page_cache(hf)
    code = CHILD.format(repo=REPO, src=os.path.join(REPO, "src"), hf=hf, out=out)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    if r.returncode:
        raise SystemExit(r.stderr[-3000:])
    res = json.loads(r.stdout.strip().splitlines()[-1])
    res.update(layers=layers, experts=experts, input_bytes=size, output_bytes=du(out),
               mb_per_s=size / MB / res["seconds"], peak_minus_baseline=res["peak_rss"] - res["baseline_rss"])
    shutil.rmtree(hf, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--points", nargs="+", default=["1x4", "2x12"], help="LAYERSxEXPERTS per run")
    ap.add_argument("--workdir", default=None)
    a = ap.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    work = a.workdir or tempfile.mkdtemp(prefix="k3jax_convert_bench_")
    rows = [run_point(*map(int, p.split("x")), work) for p in a.points]
    print(f"{'layers':>6} {'experts':>7} {'input MB':>9} {'output MB':>9} {'time s':>7} {'MB/s':>6} "
          f"{'baseline MB':>11} {'peak RSS MB':>11} {'peak-base MB':>12}")
    for r in rows:
        print(f"{r['layers']:>6} {r['experts']:>7} {r['input_bytes'] / MB:>9.0f} {r['output_bytes'] / MB:>9.0f} "
              f"{r['seconds']:>7.1f} {r['mb_per_s']:>6.1f} {r['baseline_rss'] / MB:>11.0f} "
              f"{r['peak_rss'] / MB:>11.0f} {r['peak_minus_baseline'] / MB:>12.0f}")
    os.makedirs(os.path.join(REPO, "benchmarks", "results"), exist_ok=True)
    with open(os.path.join(REPO, "benchmarks", "results", "convert.json"), "w") as f:
        json.dump({"host_cpus": os.cpu_count(), "rows": rows}, f, indent=2)
    if not a.workdir:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
