"""MXFP4 quantization-aware training against plain training, both exported to MXFP4: held-out loss
before and after the export.

The tiny K3 (4 layers, routed-expert widths 32, so one E8M0 scale per 32 inputs) is fine-tuned on
the demo corpus (data/demo/alice.jsonl, the last 10% of its paragraphs held out) twice from the
same initial weights: with ``experts_qat=none`` and ``experts_qat=mxfp4``. Each run's eval loss
after its last step is the pre-export figure (the QAT run's forward already rounds its experts).
Each run is then exported with ``k3jax_to_hf --experts_format mxfp4 --dtype float32`` (only the
experts are quantized), converted back packed (``hf_to_k3jax --experts_format mxfp4``) and
evaluated on the same held-out batches with ``experts_format=mxfp4``: the post-export figure.

    .venv/bin/python benchmarks/qat_export.py [--steps 150]
Results: stdout table and benchmarks/results/qat_export.json (--out to change).
"""
from __future__ import annotations

import argparse
import os
import tempfile

from common import ROOT, cpu_only, machine, print_table, result_path, write_json

cpu_only()

import jax  # noqa: E402

from conversion.hf_to_k3jax import convert  # noqa: E402
from conversion.k3jax_to_hf import export  # noqa: E402
from k3jax import config as C  # noqa: E402
from k3jax.data.tokenizer import KimiTokenizer  # noqa: E402
from k3jax.evaluate import Evaluator  # noqa: E402
from k3jax.sharding import make_mesh  # noqa: E402
from k3jax.state import restore_state  # noqa: E402
from k3jax.train import train  # noqa: E402

TOKENIZER = os.path.join(ROOT, "data", "demo", "tokenizer")
MODEL = ["model_name=tiny", "vocab_size=1024", f"tokenizer_path={TOKENIZER}", "moe_latent_size=32",
         "moe_intermediate_size=32", "weight_dtype=float32", "num_layers=4", "mla_extra_layers=[]",
         "attn_res_block_size=2"]


def split_corpus(d: str) -> tuple[str, str]:
    lines = open(os.path.join(ROOT, "data", "demo", "alice.jsonl")).read().splitlines()
    cut = int(0.9 * len(lines))
    paths = os.path.join(d, "train.jsonl"), os.path.join(d, "eval.jsonl")
    for p, part in zip(paths, (lines[:cut], lines[cut:])):
        open(p, "w").write("\n".join(part) + "\n")
    return paths


def post_export_loss(ckpt: str, d: str, data: list[str]) -> float:
    hf, back = os.path.join(d, "hf"), os.path.join(d, "back")
    export(ckpt, hf, dtype="float32", experts_format="mxfp4", progress=False)
    convert(hf, back, dtype="float32", experts_format="mxfp4", progress=False)
    cfg = C.load(C.REPO_CONFIGS / "base.yml", [*MODEL, *data, f"load_parameters_path={back}", "experts_format=mxfp4"])
    mesh = make_mesh(cfg)
    gdef, state, _ = restore_state(cfg, mesh)
    return Evaluator(cfg, mesh, gdef, KimiTokenizer.from_dir(TOKENIZER)).run(state)["eval_loss"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--out", default=result_path("qat_export"))
    a = ap.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        train_path, eval_path = split_corpus(tmp)
        data = ["dataset_type=jsonl", f"dataset_path={train_path}", f"eval_dataset_path={eval_path}", "eval_steps=-1",
                "per_device_batch_size=8", "max_target_length=128"]
        for qat in ("none", "mxfp4"):
            run_args = [*MODEL, *data, f"experts_qat={qat}", f"steps={a.steps}", f"eval_interval={a.steps}",
                        f"checkpoint_period={a.steps}", "log_period=50", "enable_tensorboard=false",
                        f"base_output_directory={tmp}", f"run_name=qat-{qat}"]
            out = train(C.load(C.REPO_CONFIGS / "base.yml", run_args))
            before = out["history"][-1]["eval_loss"]
            after = post_export_loss(os.path.join(tmp, f"qat-{qat}", "checkpoints", str(a.steps)),
                                     os.path.join(tmp, f"export-{qat}"), data)
            results.append({"experts_qat": qat, "train_loss": out["history"][-1]["loss"], "eval_loss_before": before,
                            "eval_loss_after_mxfp4_export": after, "change": after - before})
    print_table(results, [("experts_qat", "experts_qat", "s"), ("train loss", "train_loss", ".4f"),
                          ("eval loss (trained)", "eval_loss_before", ".4f"),
                          ("eval loss (MXFP4 export)", "eval_loss_after_mxfp4_export", ".4f"),
                          ("change", "change", "+.4f")])
    write_json(a.out, {"machine": machine(), "steps": a.steps, "devices": jax.device_count(), "results": results})


if __name__ == "__main__":
    main()
