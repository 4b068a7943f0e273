"""Greedy decode side by side with Hugging Face transformers on the same random Kimi Linear model.

A random 8-layer Kimi Linear-shaped model (hidden 512, 4 KDA heads of 128, NoPE MLA every 4th
layer, 32 experts top-4 + 1 shared, vocab 8192; benchmarks/hf_decode_side.py) is made in
transformers, run in the golden venv (Python 3.11, torch CPU, as scripts/make_goldens.py) as a
subprocess, and converted with ``conversion.hf_to_k3jax --dtype float32``. For each batch size the
same random prompts (--prompt-len tokens) go through

  transformers  eager ``generate`` (attention and experts "eager"): prefill = generate of 1 new
                token; decode time = inside the generate of --new-tokens, from its first new
                token to its last (a streamer notes when each comes out: the new-tokens - 1
                decode steps, not the difference of two separately timed calls); at each
                torch thread count of --hf-threads (default 1: on the shared 2-core host, 2
                threads ran 21x slower at batch 1), keeping the fastest per batch
  k3jax         ``k3jax.decode.generate`` (compile excluded): its prefill and decode-loop times;
                from the second round on it reuses the programs the first round compiled, so
                those rounds time warm executions, as transformers' side is after its warm-up

greedy, no stop token; the new tokens must be identical (the script fails otherwise). New tokens/s
= batch x new tokens / decode time; the ratios are k3jax / transformers. The two stacks run one
after the other, never at once (the cores are shared), alternating batch by batch over --rounds
rounds (2); each side keeps its fastest round.

    .venv/bin/python benchmarks/decode_vs_hf.py                       # batch 1, 8, 32
    .venv/bin/python benchmarks/decode_vs_hf.py --set moe_gather_max_tokens=0   # dropless only
    .venv/bin/python benchmarks/decode_vs_hf.py --cores 1                 # k3jax on one core
    .venv/bin/python benchmarks/decode_vs_hf.py --set moe_impl=ragged_dot  # the TPU grouped matmul

GPU mode (--gpu; scripts/gpu_check.sh part d): both stacks on the CUDA card, one after the other
(jax limited to half the card's memory, XLA_PYTHON_CLIENT_MEM_FRACTION=0.5, so torch fits beside
it), transformers from this Python (--hf-python defaults to sys.executable), batch 1, 8 and 32:
  tokens    float32 on both sides, jax's matmuls at precision "highest" and torch's TF32 off,
            transformers eager (attention and experts) without fla: the new tokens must be
            identical (the script fails otherwise, after writing its JSON)
  speed     bfloat16 weights and activations on both sides, transformers with its default
            attention / experts implementations and fla's Triton KDA kernels where importable (its
            fastest GPU path), warm-up generate first; k3jax as above (best of --rounds)
--hf-model DIR uses an existing Kimi Linear checkpoint instead of making one; --dry-run (with --gpu)
runs k3jax's side of it on the host CPU and skips transformers (CI: tests/test_gpu_check.py).

    python benchmarks/decode_vs_hf.py --gpu --out /tmp/decode_vs_hf_gpu.json
Results: a table on stdout and benchmarks/results/decode_vs_hf.json (--out).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from common import ROOT, gpu_mode, machine, print_table, result_path, select_platform, write_json

select_platform(mem_fraction=0.5)

import jax  # noqa: E402
import numpy as np  # noqa: E402

from k3jax import config as C  # noqa: E402
from k3jax.inference.generate import generate  # noqa: E402
from k3jax.sharding import make_mesh  # noqa: E402
from k3jax.state import load_model  # noqa: E402

SIDE = os.path.join(ROOT, "benchmarks", "hf_decode_side.py")
DEFAULT_HF_PYTHON = "/work/venv-golden/bin/python"


ALL_CORES = sorted(os.sched_getaffinity(0))


def hf(python: str, *args: str, keep_path: bool = False, fla: bool = False) -> None:
    """Run hf_decode_side.py; ``keep_path`` keeps PYTHONPATH (GPU mode: the carried wheels), ``fla``
    lets transformers bind fla's kernels."""
    drop = ("JAX_PLATFORMS",) if keep_path else ("PYTHONPATH", "JAX_PLATFORMS")
    env = {k: v for k, v in os.environ.items() if k not in drop} | {"K3JAX_HF_FLA": "1" if fla else "0"}
    # transformers gets every core back whatever --cores pinned k3jax to (it sets its own threads).
    subprocess.run([python, SIDE, *args], check=True, env=env, preexec_fn=lambda: os.sched_setaffinity(0, ALL_CORES))


def prepare(work: str, python: str, hf_model: str | None = None, keep_path: bool = False) -> str:
    """The HF model in work/hf (or ``hf_model``) and its k3jax conversion in work/ckpt (made once, then reused)."""
    hf_dir, ckpt = hf_model or os.path.join(work, "hf"), os.path.join(work, "ckpt")
    if not os.path.exists(os.path.join(hf_dir, "config.json")):
        hf(python, "make", hf_dir, keep_path=keep_path)
    if not os.path.exists(os.path.join(ckpt, "model.yml")):
        from conversion import hf_to_k3jax
        hf_to_k3jax.convert(hf_dir, ckpt, dtype="float32", progress=False)
    return ckpt


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "k3jax_decode_vs_hf"),
                   help="where the HF model and its conversion are kept between runs")
    p.add_argument("--hf-python", default=DEFAULT_HF_PYTHON,
                   help="a Python with torch + transformers (>= 5) and no fla")
    p.add_argument("--hf-threads", type=int, nargs="+", default=[1],
                   help="torch thread counts to try; the fastest generate per batch is kept")
    p.add_argument("--cores", type=int, default=0,
                   help="pin k3jax to this many cores before jax starts (XLA:CPU sizes its thread pool "
                        "from them; 1 = one thread, as transformers' default --hf-threads 1); 0 = all")
    p.add_argument("--set", nargs="*", default=[], help="extra k3jax key=value overrides")
    p.add_argument("--reuse-hf", action="store_true",
                   help="reuse the transformers timings in --work from an earlier run of the same prompts "
                        "(to compare k3jax settings; transformers' side does not depend on them)")
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds; each side keeps its fastest")
    p.add_argument("--gpu", action="store_true", help="GPU mode (module docstring)")
    p.add_argument("--dry-run", action="store_true", help="with --gpu: k3jax's side on the host CPU, no transformers")
    p.add_argument("--hf-model", default=None, help="an existing Kimi Linear HF checkpoint to convert and compare")
    p.add_argument("--out", default=result_path("decode_vs_hf"))
    a = p.parse_args(argv)
    if gpu_mode(argv):
        return main_gpu(a)
    if a.cores:
        # Before the first jax call: the CPU client reads the affinity when it starts. On a shared
        # host a pool of 2 threads waits for whichever is descheduled at every parallel op.
        os.sched_setaffinity(0, ALL_CORES[:a.cores])
    os.makedirs(a.work, exist_ok=True)
    ckpt = prepare(a.work, a.hf_python)
    try:
        cfg = C.load(overrides=[f"model_name={ckpt}/model.yml", f"load_parameters_path={ckpt}", "dtype=float32",
                                "weight_dtype=float32", *a.set])
    except C.ConfigError as e:
        raise SystemExit(f"error: --set: {e}") from None
    rng = np.random.default_rng(0)
    prompts = {b: rng.integers(3, cfg.model.vocab_size, (b, a.prompt_len)).tolist() for b in a.batch}

    spec = os.path.join(a.work, "prompts.json")
    res = os.path.join(a.work, "hf_result.json")
    want = {"new_tokens": a.new_tokens, "threads": a.hf_threads, "batches": [{"prompts": prompts[b]} for b in a.batch]}
    saved = None
    if a.reuse_hf and os.path.exists(res) and os.path.exists(spec):
        with open(spec) as fh:
            if json.load(fh) == want:
                with open(res) as fh:
                    saved = json.load(fh)
            else:
                print("note: --reuse-hf: the saved transformers run used other prompts; running it again")

    def run_hf(b: int) -> dict:
        one = os.path.join(a.work, f"prompts_b{b}.json")
        out = os.path.join(a.work, f"hf_result_b{b}.json")
        with open(one, "w") as fh:
            json.dump({**want, "batches": [{"prompts": prompts[b]}]}, fh)
        hf(a.hf_python, "time", os.path.join(a.work, "hf"), one, out)
        with open(out) as fh:
            return json.load(fh)["rows"][0]

    mesh = make_mesh(cfg, devices=jax.devices()[:1])
    model = load_model(cfg, mesh)
    # Rounds alternate the two stacks batch by batch (transformers, then k3jax, on the same
    # prompts) and each side keeps its fastest round: the host is shared, and a neighbour's burst
    # during one side's turn would otherwise decide the ratio.
    best_hf, best_k3 = {}, {}
    for _ in range(1 if saved else a.rounds):
        for i, b in enumerate(a.batch):
            h = saved["rows"][i] if saved else run_hf(b)
            if b not in best_hf or h["generate_s"] < best_hf[b]["generate_s"]:
                best_hf[b] = h
            with jax.set_mesh(mesh):
                out, t = generate(model, prompts[b], max_new_tokens=a.new_tokens)
            if b not in best_k3 or t["decode_s"] + t["prefill_s"] < sum(best_k3[b][1][k] for k in ("decode_s", "prefill_s")):
                best_k3[b] = (out, t)
    hf_out = {"rows": [best_hf[b] for b in a.batch], "reused_from_earlier_run": saved is not None}
    if not saved:
        with open(spec, "w") as fh:
            json.dump(want, fh)
        with open(res, "w") as fh:
            json.dump(hf_out, fh)
    rows = []
    for b, h in zip(a.batch, hf_out["rows"]):
        out, t = best_k3[b]
        same = out.tolist() == h["tokens"]
        agree = float(np.mean(np.asarray(out) == np.asarray(h["tokens"])))
        # Timed inside the full generate; saved results from before it was (--reuse-hf) give the
        # older estimate, the full generate less the separately timed prefill.
        hf_decode_s = h.get("decode_s", h["generate_s"] - h["prefill_s"])
        n_new = b * a.new_tokens
        # transformers' decode part makes new_tokens - 1 tokens (the first comes with its prefill).
        hf_tps = b * (a.new_tokens - 1) / hf_decode_s
        rows.append({"batch": b, "tokens_identical": same, "token_agreement": agree,
                     "k3jax_prefill_s": t["prefill_s"], "hf_prefill_s": h["prefill_s"],
                     "prefill_ratio": h["prefill_s"] / t["prefill_s"],
                     "k3jax_new_tokens_per_s": n_new / t["decode_s"], "hf_new_tokens_per_s": hf_tps,
                     "decode_ratio": (n_new / t["decode_s"]) / hf_tps,
                     "k3jax_total_s": t["prefill_s"] + t["decode_s"], "hf_total_s": h["generate_s"],
                     "end_to_end_ratio": h["generate_s"] / (t["prefill_s"] + t["decode_s"])})
    info = machine()
    print(f"\nGreedy decode, random Kimi Linear-shaped model (8 layers, hidden 512, 32 experts top-4, vocab "
          f"8192), float32, prompt {a.prompt_len}, {a.new_tokens} new tokens; {info['cpu_count']} cores "
          f"(k3jax on {a.cores or len(ALL_CORES)}), "
          f"load {info['load_avg_1min']:.1f}; overrides {a.set or 'none'}")
    for r, h in zip(rows, hf_out["rows"]):
        r["hf_threads"] = h.get("threads")
    print_table(rows, [("batch", "batch", "d"), ("same tokens", "tokens_identical", ""),
                       ("HF threads", "hf_threads", "d"), ("k3jax new tok/s", "k3jax_new_tokens_per_s", ".1f"),
                       ("HF new tok/s", "hf_new_tokens_per_s", ".1f"), ("decode x", "decode_ratio", ".2f"),
                       ("k3jax prefill s", "k3jax_prefill_s", ".3f"), ("HF prefill s", "hf_prefill_s", ".3f"),
                       ("prefill x", "prefill_ratio", ".2f"), ("end-to-end x", "end_to_end_ratio", ".2f")])
    write_json(a.out, {"benchmark": "decode_vs_hf", "machine": info, "settings": vars(a),
                       "transformers_side": {"reused_from_earlier_run": hf_out["reused_from_earlier_run"],
                                             "rows": [{k: v for k, v in h.items() if k != "tokens"}
                                                      for h in hf_out["rows"]]}, "rows": rows})
    if not all(r["tokens_identical"] for r in rows):
        raise SystemExit("error: greedy tokens differ between k3jax and transformers (see token_agreement)")


def main_gpu(a) -> None:
    """GPU mode (module docstring): tokens in float32, speed in bfloat16, both stacks on the card."""
    hf_python = a.hf_python if a.hf_python != DEFAULT_HF_PYTHON else sys.executable
    os.makedirs(a.work, exist_ok=True)
    ckpt = prepare(a.work, hf_python, a.hf_model, keep_path=True)
    hf_dir = a.hf_model or os.path.join(a.work, "hf")
    base = [f"model_name={ckpt}/model.yml", f"load_parameters_path={ckpt}", *a.set]
    try:
        cfgs = {dt: C.load(overrides=[*base, f"dtype={dt}", f"weight_dtype={dt}"]) for dt in ("float32", "bfloat16")}
    except C.ConfigError as e:
        raise SystemExit(f"error: --set: {e}") from None
    rng = np.random.default_rng(0)
    vocab = cfgs["float32"].model.vocab_size
    prompts = {b: rng.integers(3, vocab, (b, a.prompt_len)).tolist() for b in a.batch}
    info = machine()
    mesh = make_mesh(cfgs["float32"], devices=jax.devices()[:1])

    def k3(dt: str) -> dict:
        """k3jax's generate at each batch, best of --rounds (the first compiles)."""
        model = load_model(cfgs[dt], mesh)
        best = {}
        with jax.default_matmul_precision("highest" if dt == "float32" else "default"):
            for _ in range(a.rounds):
                for b in a.batch:
                    with jax.set_mesh(mesh):
                        out, t = generate(model, prompts[b], max_new_tokens=a.new_tokens)
                    if b not in best or t["decode_s"] < best[b]["decode_s"]:
                        best[b] = {"tokens": np.asarray(out).tolist(), **{k: t[k] for k in ("prefill_s", "decode_s")}}
        del model
        return best

    def transformers_side(dt: str, fla: bool) -> dict:
        spec = os.path.join(a.work, f"prompts_{dt}.json")
        out = os.path.join(a.work, f"hf_result_{dt}.json")
        with open(spec, "w") as fh:
            json.dump({"new_tokens": a.new_tokens, "device": "cuda", "dtype": dt, "default_impl": dt != "float32",
                       "batches": [{"prompts": prompts[b]} for b in a.batch]}, fh)
        hf(hf_python, "time", hf_dir, spec, out, keep_path=True, fla=fla)
        with open(out) as fh:
            res = json.load(fh)
        return {r["batch"]: r for r in res["rows"]} | {"_meta": {k: v for k, v in res.items() if k != "rows"}}

    k3_side = {dt: k3(dt) for dt in ("float32", "bfloat16")}
    hf_side, fla_error = {}, None
    if not a.dry_run:
        hf_side["float32"] = transformers_side("float32", fla=False)
        try:
            hf_side["bfloat16"] = transformers_side("bfloat16", fla=True)
        except subprocess.CalledProcessError as e:
            # Said in the table's title and the JSON: transformers' speed without fla's kernels.
            fla_error = f"transformers with fla failed (exit {e.returncode}); timed without fla"
            print(f"note: {fla_error}", flush=True)
            hf_side["bfloat16"] = transformers_side("bfloat16", fla=False)
    rows = []
    for b in a.batch:
        r = {"batch": b}
        k32, k16 = k3_side["float32"][b], k3_side["bfloat16"][b]
        r["k3jax_new_tokens_per_s"] = b * a.new_tokens / k16["decode_s"]
        r["k3jax_prefill_s"] = k16["prefill_s"]
        if hf_side:
            h32, h16 = hf_side["float32"][b], hf_side["bfloat16"][b]
            r["tokens_identical_f32"] = k32["tokens"] == h32["tokens"]
            r["token_agreement_f32"] = float(np.mean(np.asarray(k32["tokens"]) == np.asarray(h32["tokens"])))
            r["token_agreement_bf16"] = float(np.mean(np.asarray(k16["tokens"]) == np.asarray(h16["tokens"])))
            r["hf_new_tokens_per_s"] = b * (a.new_tokens - 1) / h16["decode_s"]
            r["hf_prefill_s"] = h16["prefill_s"]
            r["decode_ratio"] = r["k3jax_new_tokens_per_s"] / r["hf_new_tokens_per_s"]
            r["hf_impl"] = h16.get("impl")
        rows.append(r)
    print(f"\nGreedy decode on {info['device_kind']} ({info['backend']}): converted random Kimi Linear-shaped model, "
          f"prompt {a.prompt_len}, {a.new_tokens} new tokens; tokens compared in float32, speed in bfloat16"
          + (" (dry run: transformers skipped)" if a.dry_run else "") + (f"; NOTE: {fla_error}" if fla_error else ""))
    print_table(rows, [("batch", "batch", "d"), ("same tokens f32", "tokens_identical_f32", ""),
                       ("agree bf16", "token_agreement_bf16", ".3f"),
                       ("k3jax new tok/s", "k3jax_new_tokens_per_s", ".1f"),
                       ("HF new tok/s", "hf_new_tokens_per_s", ".1f"), ("decode x", "decode_ratio", ".2f"),
                       ("k3jax prefill s", "k3jax_prefill_s", ".4f"), ("HF prefill s", "hf_prefill_s", ".4f")])
    write_json(a.out, {"benchmark": "decode_vs_hf", "mode": "gpu", "dry_run": a.dry_run, "machine": info,
                       "settings": vars(a), "transformers_side": {dt: h["_meta"] for dt, h in hf_side.items()},
                       "transformers_fla_error": fla_error,
                       "rows": rows})
    if hf_side and not all(r["tokens_identical_f32"] for r in rows):
        raise SystemExit("error: float32 greedy tokens differ between k3jax and transformers (token_agreement_f32)")


if __name__ == "__main__":
    main()
