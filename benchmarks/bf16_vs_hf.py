"""bfloat16 numerics beside Hugging Face transformers: how far each stack's bf16 logits fall from float32.

For each golden asset (tests/assets/kimi_linear_tiny: KDA + NoPE MLA + sigmoid MoE;
tests/assets/deepseek_v3_tiny: MLA + YaRN + grouped MoE; large random weights, scripts/make_goldens.py)
the golden prompt's logits are computed

  transformers  the asset loaded with ``dtype=torch.bfloat16`` (eager attention and experts, one
                torch thread), in the golden venv (Python 3.11 + torch CPU) as a subprocess
  k3jax         the asset converted by ``conversion.hf_to_k3jax --dtype float32`` and run with
                ``dtype=bfloat16 weight_dtype=bfloat16`` (and float32 for the baseline)

and compared with the golden float32 logits by relative RMS error (RMS of the difference / RMS of
the golden logits). A k3jax bf16 error far above transformers' would point at an op kept in bf16
that the reference keeps wider; errors of the same size say the gap is the model's conditioning
(these weights are deliberately large) and bf16 itself.

    .venv/bin/python benchmarks/bf16_vs_hf.py [--hf-python .venv-golden/bin/python]

Results: a table on stdout and benchmarks/results/bf16_vs_hf.json.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ASSETS = ("kimi_linear_tiny", "deepseek_v3_tiny")
HERE = os.path.dirname(os.path.abspath(__file__))
ASSET_DIR = os.path.join(os.path.dirname(HERE), "tests", "assets")


def rel_rms(got, want) -> float:
    import numpy as np

    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.sqrt(np.mean((got - want) ** 2)) / np.sqrt(np.mean(want ** 2)))


def hf_side(out: str) -> None:
    """Run in the golden venv: each asset's bf16 logits from transformers -> ``out`` (.npz)."""
    sys.modules.setdefault("fla", None)      # never bind fla's triton kernels on a CPU host
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    res = {}
    for name in ASSETS:
        d = os.path.join(ASSET_DIR, name)
        ids = torch.tensor(np.load(os.path.join(d, "golden.npz"))["input_ids"])
        m = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16, attn_implementation="eager",
                                                 experts_implementation="eager").eval()
        with torch.no_grad():
            res[name] = m(input_ids=ids, use_cache=False).logits.float().numpy()
    np.savez(out, **res)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hf-python", default=os.path.join(os.path.dirname(HERE), ".venv-golden", "bin", "python"),
                   help="the golden venv's Python (torch + transformers 5.25; scripts/make_goldens.py)")
    p.add_argument("--hf-side", metavar="OUT", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.hf_side:
        hf_side(a.hf_side)
        return 0

    from common import cpu_only, machine, print_table, result_path, write_json
    cpu_only()
    import numpy as np

    from k3jax import config as C
    from k3jax import logit_check

    with tempfile.TemporaryDirectory() as work:
        hf_out = os.path.join(work, "hf_bf16.npz")
        subprocess.run([a.hf_python, os.path.abspath(__file__), "--hf-side", hf_out], check=True,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
        hf = np.load(hf_out)
        rows = []
        for name in ASSETS:
            g = np.load(os.path.join(ASSET_DIR, name, "golden.npz"))
            conv = os.path.join(work, name)
            subprocess.run([sys.executable, "-m", "conversion.hf_to_k3jax", "--hf_dir", os.path.join(ASSET_DIR, name),
                            "--out", conv, "--dtype", "float32"], check=True, capture_output=True,
                           cwd=os.path.dirname(HERE))
            ours = {}
            for dt in ("float32", "bfloat16"):
                cfg = C.load(C.REPO_CONFIGS / "base.yml", [f"model_name={conv}/model.yml",
                                                           f"load_parameters_path={conv}", f"dtype={dt}",
                                                           f"weight_dtype={dt}"])
                ours[dt] = np.asarray(logit_check.model_logits(cfg, g["input_ids"].astype(np.int32)))
            rows.append({"asset": name, "k3jax_f32": rel_rms(ours["float32"], g["logits"]),
                         "k3jax_bf16": rel_rms(ours["bfloat16"], g["logits"]),
                         "hf_bf16": rel_rms(hf[name], g["logits"]),
                         "k3jax_bf16_vs_hf_bf16": rel_rms(ours["bfloat16"], hf[name])})
    print_table(rows, [("asset", "asset", "s"), ("k3jax f32", "k3jax_f32", ".2e"),
                       ("k3jax bf16", "k3jax_bf16", ".3f"), ("transformers bf16", "hf_bf16", ".3f"),
                       ("k3jax bf16 vs tf bf16", "k3jax_bf16_vs_hf_bf16", ".3f")])
    print("relative RMS error of the logits against the golden float32 logits (last column: between the two bf16 runs)")
    write_json(result_path("bf16_vs_hf"), {"machine": machine(), "rows": rows})
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
