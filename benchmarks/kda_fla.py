"""fla's Triton ``chunk_kda`` on the inputs benchmarks/kda.py --gpu --save-io saved: timings and outputs compared.

The torch side of the KDA comparison (scripts/gpu_check.sh part c), run in its own process after
the JAX one has exited (JAX holds most of the card's memory while it lives). For each length the
JAX run saved (DIR/T<T>_*.npy: q, k, v, the gate pre-activation f, beta, the f32 initial state h0,
the cotangents co / cs, and k3jax's chunked o, S and gradients), on the same card:

  fla       fla.ops.kda.chunk_kda(q, k, v, f, beta, initial_state=h0, output_final_state=True,
            use_gate_in_kernel=True, safe_gate=True, lower_bound=-5.0): K3's bounded gate
            g = -5 sigmoid(f) computed in the kernel (A_log and dt_bias None, as k3jax's side has
            a_log = 0 and dt_bias = 0), q, k, v, f, beta bfloat16, h0 float32, chunk 64, scale
            K^-0.5, q and k already l2-normalised (as kda.py makes them)
  fwd       one call under torch.no_grad()
  fwd+bwd   the call, then torch.autograd.grad of sum(o * co) + sum(S * cs) wrt q, k, v, f, beta
            and h0 (kda.py's loss)
  timing    3 untimed calls first (Triton's autotuning runs in them), then the median of
            --repeats calls, each ended by torch.cuda.synchronize()
  compared  relative L2 error ||fla - k3jax|| / ||k3jax|| of o, S and the six gradients; each
            must be <= BOUND (2e-2: two bf16 kernels, each within 1e-2 of the exact result by
            ../shared/docs/kda.md's bf16 threshold); the script exits 1 after writing its JSON
            when one is not
  ratio     k3jax / fla time (from kda.py's JSON, --kda-json): below 1 = k3jax faster

    python benchmarks/kda.py --gpu --save-io /tmp/kda_io --out /tmp/kda_gpu.json
    python benchmarks/kda_fla.py /tmp/kda_io --kda-json /tmp/kda_gpu.json --out /tmp/kda_fla.json
Results: a table on stdout and the JSON of --out.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import statistics
import time

import numpy as np

BOUND = 2e-2
NAMES = ("o", "S", "dq", "dk", "dv", "df", "dbeta", "dh0")


def rel_l2(a: np.ndarray, b: np.ndarray) -> float:
    """||a - b|| / ||b|| in float64."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def lengths_in(io_dir: str) -> list[int]:
    found = sorted(int(m.group(1)) for p in glob.glob(os.path.join(io_dir, "T*_q.npy"))
                   if (m := re.search(r"T(\d+)_q\.npy$", p)))
    if not found:
        raise SystemExit(f"error: no T<T>_q.npy in {io_dir}; run benchmarks/kda.py --gpu --save-io {io_dir} first")
    return found


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("io_dir")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--kda-json", default=None, help="kda.py --gpu's JSON, for the k3jax / fla ratios")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "kda_fla.json"))
    a = p.parse_args(argv)

    import torch
    from fla.ops.kda import chunk_kda
    if not torch.cuda.is_available():
        raise SystemExit("error: fla's chunk_kda needs a CUDA card; torch sees none")
    dev = torch.device("cuda")
    k3 = {}
    if a.kda_json:
        with open(a.kda_json) as fh:
            k3 = {r["T"]: r["chunked"] for r in json.load(fh)["rows"]}

    def load(T, name, dtype):
        return torch.from_numpy(np.load(os.path.join(a.io_dir, f"T{T}_{name}.npy"))).to(dev, dtype)

    def timed(fn):
        for _ in range(3):                      # autotuning happens in the first calls
            fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    rows = []
    for T in lengths_in(a.io_dir):
        bf = torch.bfloat16
        q, k, v, f, beta = (load(T, n, bf) for n in ("q", "k", "v", "f", "beta"))
        h0, co, cs = load(T, "h0", torch.float32), load(T, "co", bf), load(T, "cs", torch.float32)
        leaves = [x.clone().requires_grad_(True) for x in (q, k, v, f, beta, h0)]

        def call(q, k, v, f, beta, h0):
            return chunk_kda(q, k, v, f, beta, initial_state=h0, output_final_state=True, use_gate_in_kernel=True,
                             safe_gate=True, lower_bound=-5.0, A_log=None, dt_bias=None)

        def fwd():
            with torch.no_grad():
                return call(q, k, v, f, beta, h0)

        def fwd_bwd():
            o, S = call(*leaves)
            loss = (o * co).sum() + (S * cs).sum()
            return (o, S), torch.autograd.grad(loss, leaves)

        t_f, t_b = timed(fwd), timed(fwd_bwd)
        (o, S), grads = fwd_bwd()
        ours = dict(zip(NAMES, [o, S, *grads]))
        errors = {n: rel_l2(ours[n].float().cpu().numpy(), np.load(os.path.join(a.io_dir, f"T{T}_{n}.npy")))
                  for n in NAMES}
        row = {"T": T, "fla_fwd_s": t_f, "fla_fwd_bwd_s": t_b, "rel_l2_vs_k3jax": errors,
               "within_bound": all(e <= BOUND for e in errors.values())}
        if T in k3:
            row |= {"k3jax_fwd_s": k3[T]["fwd_s"], "k3jax_fwd_bwd_s": k3[T]["fwd_bwd_s"],
                    "ratio_fwd": k3[T]["fwd_s"] / t_f, "ratio_fwd_bwd": k3[T]["fwd_bwd_s"] / t_b}
        rows.append(row)

    import fla
    card = torch.cuda.get_device_name(0)
    print(f"\nKDA, B=1 H={q.shape[2]} K=V={q.shape[3]} bf16, K3 gate (lower_bound -5): fla {getattr(fla, '__version__', '?')} "
          f"chunk_kda vs k3jax chunked on {card}, median of {a.repeats}; ratio = k3jax / fla time")
    print(f"{'T':>6} {'fla fwd ms':>10} {'fla f+b ms':>10} {'k3 fwd ms':>10} {'k3 f+b ms':>10} "
          f"{'x fwd':>6} {'x f+b':>6} {'max rel L2':>10}  worst")
    for r in rows:
        worst = max(r["rel_l2_vs_k3jax"], key=r["rel_l2_vs_k3jax"].get)
        ms = lambda key: f"{1e3 * r[key]:10.2f}" if key in r else f"{'-':>10}"  # noqa: E731
        x = lambda key: f"{r[key]:6.2f}" if key in r else f"{'-':>6}"  # noqa: E731
        print(f"{r['T']:>6} {ms('fla_fwd_s')} {ms('fla_fwd_bwd_s')} {ms('k3jax_fwd_s')} {ms('k3jax_fwd_bwd_s')} "
              f"{x('ratio_fwd')} {x('ratio_fwd_bwd')} {r['rel_l2_vs_k3jax'][worst]:10.2e}  {worst}")
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as fh:
        json.dump({"benchmark": "kda_fla", "device_kind": card, "torch": torch.__version__, "fla": getattr(fla, "__version__", None),
                   "dtype": "bfloat16", "gate": "lower_bound * sigmoid(f), lower_bound -5, in-kernel",
                   "bound_rel_l2": BOUND, "repeats": a.repeats, "timing": "median", "rows": rows}, fh, indent=2)
    print(f"\nwrote {a.out}")
    if not all(r["within_bound"] for r in rows):
        raise SystemExit(f"error: fla and k3jax differ by more than {BOUND} relative L2 (rel_l2_vs_k3jax in {a.out})")


if __name__ == "__main__":
    main()
