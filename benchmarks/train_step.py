"""One real jitted train step per config on one CPU device: tokens/s, model TFLOP/s, vs matmul peak.

For each config: the model is built from configs/base.yml + configs/models/<name>.yml + the
overrides below, with `k3jax.state.init_state` and `k3jax.step.jit_train_step` (the same Muon + QK-clip
step, remat and scanned layers as `python -m k3jax.train`), fed synthetic batches from the real
data pipeline (drawn before timing, so the input pipeline is not timed). Warm-up steps (the first
compiles), then the median of the timed steps.

  tokens/s      batch x sequence tokens per step / median step time (MaxText's Tokens/s/device)
  TFLOP/s       counts.train_flops_per_token (analytic 3 x forward model FLOPs, no remat
                recompute) x tokens/s
  vs peak       TFLOP/s / this machine's float32 matmul rate (metrics.measure_cpu_matmul_peak:
                best of 5 runs of ~1 s at n=2048, measured just before each config's timing, in
                the same process; the spread of the 5 runs is printed and kept in the JSON): the
                CPU 'MFU'
  --profile DIR two more steps under jax.profiler.trace (a perfetto trace per config under DIR);
                the top-15 ops by total time and the op time per named scope (loss, mixer,
                dispatch, router, ffn, residual_mix, optimizer, newton_schulz; fwd / bwd) printed
                and kept in the JSON (common.profile_top_ops, mapped through the step's HLO text)

The deepseek3-tiny row uses exactly MaxText's settings for that model (DS3_TINY below), so its
tokens/s can be set beside MaxText's Tokens/s/device for the same model on the same machine.

    .venv/bin/python benchmarks/train_step.py                               # tiny small
    .venv/bin/python benchmarks/train_step.py --config tiny small deepseek3-tiny
    .venv/bin/python benchmarks/train_step.py --config small --set opt_type=adamw
    .venv/bin/python benchmarks/train_step.py --config small --profile /tmp/prof

GPU mode (--gpu; scripts/gpu_check.sh runs it): jax on the CUDA card (common.GPU_XLA_FLAGS), rows
k3-slice (configs/models/k3-slice.yml: K3's widths, 4 layers, 4.88B parameters) and small at the
batch x length of GPU_ROWS, in bfloat16 (activations, weights and mu_dtype), each at remat none and
full (--remat); 2 warm-up steps, then the median of steps 3-10 (optimizer included). MFU = the
model FLOPs per token above x tokens/s / the card's dense bf16 peak (common.BF16_PEAK_TFLOPS by
jax's device_kind; a card not in that table gets no MFU, and the table says so). A row that fails
(out of memory, say) keeps its error in the JSON and the others still run; the JSON is rewritten
after every row. --dry-run runs the same code on the host CPU (CI: tiny sizes).

    python benchmarks/train_step.py --gpu --out /tmp/train_step_gpu.json
    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/train_step.py --gpu --dry-run --config tiny \
        --set per_device_batch_size=1 max_target_length=32 --warmup 1 --repeats 1
Results: stdout table and benchmarks/results/train_step.json (--out to change).
"""
from __future__ import annotations

import argparse
import os
import time

from common import (bf16_peak_tflops, gpu_mode, machine, median_time, print_table, profile_top_ops, result_path,
                    select_platform, write_json)

select_platform()

import jax  # noqa: E402

from k3jax import config as C  # noqa: E402
from k3jax import counts  # noqa: E402
from k3jax.metrics import measure_cpu_matmul_peak  # noqa: E402
from k3jax.model import count_params  # noqa: E402
from k3jax.optim.muon import newton_schulz_flops_per_step  # noqa: E402
from k3jax.sharding import make_mesh  # noqa: E402
from k3jax.state import init_state  # noqa: E402
from k3jax.feed import host_feed  # noqa: E402
from k3jax.data.iterator import data_iterator  # noqa: E402
from k3jax.step import jit_train_step  # noqa: E402

# The training settings of each row. tiny/small: sizes a 2-core CPU steps in well under a second
# (tiny) / a few seconds (small) while matrix work still dominates small; deepseek3-tiny: MaxText's.
COMMON = ["opt_type=muon", "use_qk_clip=true", "dtype=float32", "weight_dtype=float32", "scan_layers=true",
          "remat_policy=full", "gradient_accumulation_steps=1", "enable_checkpointing=false",
          "enable_tensorboard=false"]
ROWS = {
    "tiny": ["per_device_batch_size=8", "max_target_length=256"],
    "small": ["per_device_batch_size=2", "max_target_length=512"],
    "deepseek3-tiny": ["per_device_batch_size=2", "max_target_length=256", "dtype=float32",
                       "weight_dtype=float32", "scan_layers=true", "remat_policy=full", "opt_type=muon",
                       "use_qk_clip=true"],
}
# GPU mode: bf16 everywhere (k3-slice's 4.88B parameters need bf16 weights and momentum on one
# card) and batch x length sized for one H100/H200. The implementation keys stay at their `auto`
# defaults (kernels.platform.AUTO: on a GPU kda_impl=chunked, attention_impl=cudnn where cuDNN takes
# the call, moe_impl=ragged_dot, loss_impl=chunked), so the row measures what a user gets there.
GPU_COMMON = ["opt_type=muon", "use_qk_clip=true", "dtype=bfloat16", "weight_dtype=bfloat16", "mu_dtype=bfloat16",
              "scan_layers=true", "gradient_accumulation_steps=1", "enable_checkpointing=false",
              "enable_tensorboard=false"]
GPU_ROWS = {
    "small": ["per_device_batch_size=16", "max_target_length=2048"],
    "k3-slice": ["per_device_batch_size=4", "max_target_length=2048"],
}
GPU_COLUMNS = [("config", "config", "s"), ("remat", "remat", "s"), ("B x T", "shape", "s"),
               ("params", "params_h", "s"), ("GFLOP/tok", "train_gflop_per_token", ".2f"),
               ("step ms", "step_ms", ".1f"), ("tokens/s", "tokens_per_s", ".0f"),
               ("TFLOP/s", "model_tflops", ".1f"), ("MFU %", "mfu_pct", ".1f"),
               ("compile s", "compile_and_first_step_s", ".1f"), ("error", "error", "s")]
COLUMNS = [("config", "config", "s"), ("B x T", "shape", "s"), ("params", "params_h", "s"),
           ("GFLOP/tok", "train_gflop_per_token", ".4f"), ("step ms", "step_ms", ".1f"),
           ("tokens/s", "tokens_per_s", ".0f"), ("TFLOP/s", "model_tflops", ".4f"),
           ("f32 peak TFLOP/s", "cpu_peak_tflops", ".4f"), ("peak spread %", "peak_spread_pct", ".1f"),
           ("vs peak %", "vs_peak_pct", ".2f"), ("NS GFLOP/step", "ns_gflop_per_step", ".3g"),
           ("with NS vs peak %", "with_ns_vs_peak_pct", ".2f"),
           ("compile s", "compile_and_first_step_s", ".1f")]


def row_overrides(name: str, extra: list[str], gpu: bool = False) -> list[str]:
    """Overrides of one row: COMMON and the row's sizes (GPU_COMMON / GPU_ROWS in GPU mode), then --set."""
    if gpu:
        return [*GPU_COMMON, *GPU_ROWS.get(name, []), *extra]
    return [*COMMON, *ROWS.get(name, []), *extra]


def load_config(name: str, extra: list[str], gpu: bool = False):
    """Config of one row: base.yml, the model yml, then row_overrides."""
    return C.load(overrides=[f"model_name={name}", *row_overrides(name, extra, gpu)])


def bench_config(name: str, extra: list[str], warmup: int, repeats: int, profile_dir: str | None = None,
                 gpu: bool = False) -> dict:
    """Build, compile and time one config's train step; returns one table row."""
    cfg = load_config(name, extra, gpu)
    mesh = make_mesh(cfg, devices=jax.devices()[:1])
    C.validate(cfg, num_devices=1)
    gb = cfg.global_batch_size(1)
    seq = cfg.train.max_target_length
    gdef, state, tx = init_state(cfg, mesh, optimizer=True)
    n_params = count_params(state["params"])
    ns_flops = newton_schulz_flops_per_step(state["params"], cfg.train)     # per step, any batch
    step = jit_train_step(cfg, gdef, tx, state)
    data = data_iterator(cfg, gb)
    n_prof = 2 if profile_dir else 0
    feed = host_feed(mesh, gb, seq)
    batches = [feed.put(next(data)) for _ in range(warmup + repeats + n_prof)]
    it = iter(batches)
    holder = {"state": state, "loss": []}

    def one_step():
        with jax.set_mesh(mesh):
            holder["state"], m = compiled(holder["state"], next(it))
        m = jax.block_until_ready(m)
        holder["loss"].append(float(m["loss"]))

    t0 = time.perf_counter()
    with jax.set_mesh(mesh):                     # compiled once, ahead of the calls: its HLO text
        compiled = step.lower(state, batches[0]).compile()   # names the profile's ops
    one_step()                                   # first step
    first_s = time.perf_counter() - t0
    # The CPU's f32 matmul rate, right now; GPU mode compares with the card's data-sheet peak.
    peak = None if gpu else measure_cpu_matmul_peak()
    sec, times = median_time(one_step, warmup=max(warmup - 1, 0), repeats=repeats)
    top = None
    if profile_dir:
        top = profile_top_ops(lambda: [one_step() for _ in range(n_prof)], os.path.join(profile_dir, name),
                              hlo_text=compiled.as_text())
    flops_tok = counts.train_flops_per_token(cfg.model, seq, cfg.kernel.kda_chunk_size)
    tok_s = gb * seq / sec
    tflops = flops_tok * tok_s / 1e12
    with_ns = tflops + ns_flops / sec / 1e12
    t = cfg.train
    card_peak = bf16_peak_tflops(jax.devices()[0].device_kind) if gpu else None
    return {"config": name, "remat": t.remat_policy, "device_kind": jax.devices()[0].device_kind,
            "mfu": tflops / card_peak if card_peak else None, "bf16_peak_tflops": card_peak, "batch": gb, "seq": seq, "params": n_params,
            "active_params": counts.param_counts(cfg.model)[1], "train_gflop_per_token": flops_tok / 1e9,
            "compile_and_first_step_s": first_s, "step_s": sec, "step_times_s": times, "tokens_per_s": tok_s,
            "model_tflops": tflops, "top_ops": top, "ns_gflop_per_step": ns_flops / 1e9, "with_ns_tflops": with_ns,
            **({} if gpu else {"cpu_peak_tflops": peak["tflops"], "cpu_peak_runs_tflops": peak["runs_tflops"],
                               "cpu_peak_spread": peak["spread"], "vs_peak": tflops / peak["tflops"],
                               "with_ns_vs_peak": with_ns / peak["tflops"]}),
            "loss_first": holder["loss"][0], "loss_last": holder["loss"][-1],
            "settings": {"opt_type": t.opt_type, "use_qk_clip": t.use_qk_clip, "dtype": t.dtype,
                         "weight_dtype": t.weight_dtype, "scan_layers": t.scan_layers,
                         "remat_policy": t.remat_policy, "per_device_batch_size": t.per_device_batch_size,
                         "max_target_length": seq, "mu_dtype": t.mu_dtype,
                         "overrides": row_overrides(name, extra, gpu)}}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", nargs="+", default=None,
                   help="model names under configs/models/ (default tiny small; --gpu: k3-slice small)")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                   help="config overrides applied to every row, after the row's own settings")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps, the first one compiles")
    p.add_argument("--repeats", type=int, default=None, help="timed steps (median; default 5, --gpu 8)")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="also trace two steps per config into DIR/<config> and print the top-15 ops")
    p.add_argument("--gpu", action="store_true", help="GPU mode: bf16, remat rows, MFU (module docstring)")
    p.add_argument("--dry-run", action="store_true", help="with --gpu: the GPU mode on the host CPU")
    p.add_argument("--remat", nargs="+", default=None, choices=["none", "full", "save_dot", "save_mixer_out"],
                   help="remat policies, one row each (default: --gpu none full; else the row's own)")
    p.add_argument("--out", default=result_path("train_step"))
    a = p.parse_args(argv)
    gpu = gpu_mode(argv)
    a.config = a.config or (["k3-slice", "small"] if gpu else ["tiny", "small"])
    a.repeats = a.repeats or (8 if gpu else 5)
    a.remat = a.remat or (["none", "full"] if gpu else [None])
    if a.warmup < 1 or a.repeats < 1:
        p.error("--warmup and --repeats must be >= 1")

    info = machine()
    rows = []

    def save():
        write_json(a.out, {"benchmark": "train_step", "mode": "gpu" if gpu else "cpu", "machine": info,
                           "warmup": a.warmup, "repeats": a.repeats, "rows": rows})

    for name in a.config:
        for remat in a.remat:
            extra = [*a.set, *([f"remat_policy={remat}"] if remat else [])]
            try:
                rows.append(bench_config(name, extra, a.warmup, a.repeats, a.profile, gpu))
            except C.ConfigError as e:
                raise SystemExit(f"error: {name}: {e}") from None
            except Exception as e:  # noqa: BLE001  GPU mode: one failing row (OOM) must not stop the rest
                if not gpu:
                    raise
                print(f"error: {name} remat={remat}: {type(e).__name__}: {str(e)[:400]}", flush=True)
                rows.append({"config": name, "remat": remat, "error": f"{type(e).__name__}: {str(e)[:2000]}"})
            if gpu:
                save()                            # a later row's crash or timeout keeps this one
    ok = [r for r in rows if "error" not in r]
    if gpu:
        peak = bf16_peak_tflops(info["device_kind"])
        print(f"\nTrain step (fwd + bwd + muon update) on one {info['device_kind']} ({info['backend']}), bfloat16 "
              f"weights / activations / mu, median of steps {a.warmup + 1}-{a.warmup + a.repeats}; MFU vs "
              + (f"{peak:.0f} TFLOP/s dense bf16" if peak else "no peak: this card is not in common.BF16_PEAK_TFLOPS, "
                 "so no MFU"))
        view = [dict(r, shape=f"{r['batch']} x {r['seq']}" if "batch" in r else None,
                     params_h=counts.human(r["params"]) if "params" in r else None,
                     step_ms=1e3 * r["step_s"] if "step_s" in r else None,
                     mfu_pct=100 * r["mfu"] if r.get("mfu") else None, error=r.get("error", "")[:60])
                for r in rows]
        print_table(view, GPU_COLUMNS)
        save()
        if len(ok) < len(rows):
            raise SystemExit(f"error: {len(rows) - len(ok)} of {len(rows)} rows failed (see 'error' in {a.out})")
        return
    print(f"\nTrain step (fwd + bwd + {rows[0]['settings']['opt_type']} update) on one {info['backend']} device "
          f"({info['cpu_count']} cores, load {info['load_avg_1min']:.1f}), float32, median of {a.repeats}")
    view = [dict(r, shape=f"{r['batch']} x {r['seq']}", params_h=counts.human(r["params"]),
                 step_ms=1e3 * r["step_s"], vs_peak_pct=100 * r["vs_peak"],
                 with_ns_vs_peak_pct=100 * r["with_ns_vs_peak"],
                 peak_spread_pct=100 * r["cpu_peak_spread"]) for r in rows]
    print_table(view, COLUMNS)
    save()


if __name__ == "__main__":
    main()
