"""It learns: a tiny K3 with the tiny tower, trained by ``k3jax.train`` on ``dataset_type=mm_sft``
(scripts/make_shapes_data.py: coloured shapes on plain backgrounds, 28x28, captions "a red circle"),
captions held-out images right, and does no better than chance on the same backgrounds without the
shape (the caption has to come from the image, not from the text or the background).

One training run (in-process, the 8 test devices) and one decode batch per image set; the run is
``scripts/demo_vision.sh`` at CI size."""
import importlib.util

import jax
import pytest
from flax import nnx

from k3jax import config as C
from k3jax import model as M
from k3jax.data.vision_processor import from_config
from k3jax.runtime import load_tokenizer
from k3jax.train import train

from helpers import REPO

spec = importlib.util.spec_from_file_location("make_shapes_data", REPO / "scripts" / "make_shapes_data.py")
shapes = importlib.util.module_from_spec(spec)
spec.loader.exec_module(shapes)

# A one-layer (MLA, dense FFN) tiny K3 with a one-block tiny tower (width 32); every row (one
# caption, one image of 4 patches) fits the 4-patch bucket, so one train step compiles, and the
# captioning's generate() batches of 16 images (packed into one sequence) the 64-patch one. No
# QK-clip (max logits stay < 5 here): a smaller program to compile.
ARGS = ["model_name=tiny", "vocab_size=1024", f"tokenizer_path={REPO / 'data' / 'demo' / 'tokenizer'}",
        "num_layers=1", "mla_extra_layers=[0]", "first_k_dense=1", "attn_res=false",
        "vision_enabled=true", "vision_num_layers=1", "vision_patch_buckets=[4,64]", "vision_attention_block=64",
        "max_target_length=48", "per_device_batch_size=2", "dataset_type=mm_sft", "sft_default_system_prompt=false",
        "steps=150", "learning_rate=0.01", "remat_policy=none", "use_qk_clip=false", "log_period=50",
        "enable_checkpointing=false",
        "enable_tensorboard=false", "peak_tflops=0.1"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("shapes")
    data = shapes.make(root / "data", n_train=480, n_test=48, size=28, seed=0)
    # the held-out conversations as eval data, evaluated once, after the last step
    cfg = C.load(C.REPO_CONFIGS / "base.yml", ARGS + [f"dataset_path={data / 'train.json'}",
                                                      f"eval_dataset_path={data / 'test.json'}", "eval_interval=150",
                                                      f"base_output_directory={root}", "run_name=r"])
    out = train(cfg)
    model = M.build(cfg, 0)
    nnx.update(model, out["state"]["params"])
    nnx.update(model, out["state"]["rest"])
    return cfg, data, model, out["history"]


def _captions(cfg, model, paths):
    from k3jax.sharding import make_mesh
    with jax.set_mesh(make_mesh(cfg)):
        return shapes.captions(model, load_tokenizer(cfg), from_config(cfg), paths)


def test_captions_name_colour_and_shape_of_held_out_images(trained):
    cfg, data, model, history = trained
    assert history[-1]["loss"] < history[0]["loss"] / 5
    paths, want = shapes.test_records(data)
    got = _captions(cfg, model, paths)
    acc = shapes.accuracy(got, want)
    print(f"held-out accuracy {acc:.0%}; e.g. {list(zip(got, want))[:3]}")
    assert acc >= 0.8, list(zip(got, want))
    blank, _ = shapes.test_records(data, blank=True)
    blank_got = _captions(cfg, model, blank)
    blank_acc = shapes.accuracy(blank_got, want)
    print(f"blank-image control {blank_acc:.0%}: {blank_got[:4]}")
    assert blank_acc <= 1 / 12 + 0.10, list(zip(blank_got, want))


def test_eval_loss_of_held_out_image_conversations(trained):
    """eval_dataset_path with dataset_type=mm_sft: the run's evaluation after its last step scores the
    48 held-out conversations with their images (3 batches of 16); the same conversations with the
    blank backgrounds, evaluated by the same Evaluator code, score far worse, so the images reach
    the eval step."""
    import json
    from pathlib import Path

    from k3jax.evaluate import Evaluator
    from k3jax.layers.common import REST
    from k3jax.sharding import make_mesh
    cfg, data, model, history = trained
    rec = history[-1]
    assert rec["eval_tokens"] > 0 and "eval_loss" not in history[-2]
    recs = json.loads((data / "test.json").read_text())
    (data / "blank.json").write_text(json.dumps([{**r, "images": ["blank/" + Path(r["images"][0]).name]} for r in recs]))
    gdef, params, rest = nnx.split(model, nnx.Param, REST)
    blank = Evaluator(C.override(cfg, {"eval_dataset_path": str(data / "blank.json")}), make_mesh(cfg), gdef,
                      load_tokenizer(cfg)).run({"params": params, "rest": rest})
    print(f"held-out eval loss {rec['eval_loss']:.4f} accuracy {rec['eval_accuracy']:.3f}; blank images "
          f"{blank['eval_loss']:.4f} / {blank['eval_accuracy']:.3f}")
    assert blank["eval_tokens"] == rec["eval_tokens"]
    assert rec["eval_accuracy"] >= 0.9 and rec["eval_loss"] < 0.5 * blank["eval_loss"], (rec, blank)


@pytest.mark.parametrize("extra,fragment", [
    (["vision_enabled=false"], "dataset_type=mm_sft trains on images but vision_enabled=false"),
    (["eval_dataset_path={tmp}/broken.json", "dataset_path={tmp}/ok.json", "bad_data=fatal"],
     "broken.json:2: {tmp}/gone.png: image file not found"),
    (["dataset_path={tmp}/none.json"], "no file matches"),
    (["bad_data=fatal"], "broken.json:2: {tmp}/gone.png: image file not found"),
])
def test_mm_sft_mistakes_are_one_line(extra, fragment, tmp_path, capsys):
    """Each mistake stops ``k3jax.train`` before any compile with one ``error:`` line and exit 2."""
    import json
    recs = [{"images": ["gone.png"], "messages": [{"role": "user", "content": "<image>"},
                                                  {"role": "assistant", "content": "x"}]}]
    (tmp_path / "broken.json").write_text(json.dumps(recs, indent=1))
    shapes.draw("red", "circle", 28, __import__("numpy").random.default_rng(0)).save(tmp_path / "ok.png")
    (tmp_path / "ok.json").write_text(json.dumps([{**recs[0], "images": ["ok.png"]}], indent=1))
    argv = [str(C.REPO_CONFIGS / "base.yml"), *ARGS, f"dataset_path={tmp_path / 'broken.json'}",
            f"base_output_directory={tmp_path}", "run_name=r", *[a.replace("{tmp}", str(tmp_path)) for a in extra]]
    from k3jax.train import main
    rc = main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err[-2000:]
    assert fragment.replace("{tmp}", str(tmp_path)) in lines[0], lines[0]


def test_mm_sft_on_a_pod_of_two_processes_equals_one(tmp_path):
    """dataset_type=mm_sft on a pod of 2 processes x 4 CPU devices (scripts/local_pod.sh, gloo):
    each process reads its data shard (records i, i + 2, ...: the even ones hold a 28x28 image, 4
    patches; the odd ones 56x28, 8), packs its own rows to its own per-row patch bucket (4 and 8),
    the processes agree on 8, and each puts only its rows. Its losses and gradient norms equal one
    process on 8 devices reading the same records (rows in another order: 1e-6).

    The evaluation after the last step reads held-out conversations whose shards are uneven: 8 of
    process 0's 20 records are too long to keep (dropped), so its shard holds 3 eval batches of 4
    rows and process 1's 5. The processes evaluate in step (k3jax.evaluate: process 0 repeats a
    masked batch twice) instead of process 1 waiting for ever in the eval step's collectives, and
    the eval loss, accuracy and token count equal one process's over the same 32 conversations."""
    import json
    import subprocess
    import sys

    import numpy as np
    from PIL import Image

    from helpers import tool_env
    rng = np.random.default_rng(0)
    (tmp_path / "img").mkdir()
    recs = []
    for i in range(16):
        w, h = (28, 28) if i % 2 == 0 else (56, 28)
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(tmp_path / "img" / f"{i}.png")
        recs.append({"images": [f"img/{i}.png"], "messages": [{"role": "user", "content": f"<image> what is {i}?"},
                                                              {"role": "assistant", "content": f"number {i}"}]})
    (tmp_path / "train.json").write_text(json.dumps(recs, indent=1))
    held_out = []
    for i in range(40):
        question = f"<image> which number is {i}?" + (" and then" * 40 if i % 2 == 0 and i < 16 else "")
        held_out.append({"images": [f"img/{i % 16}.png"], "messages": [{"role": "user", "content": question},
                                                                       {"role": "assistant", "content": f"number {i}"}]})
    (tmp_path / "eval.json").write_text(json.dumps(held_out, indent=1))
    args = [a for a in ARGS if not a.startswith(("steps=", "per_device_batch_size=", "log_period=",
                                                 "vision_patch_buckets="))]
    args += ["steps=3", "per_device_batch_size=1", "log_period=1", "vision_patch_buckets=[4,8]", "data_shuffle=false",
             f"dataset_path={tmp_path / 'train.json'}", f"base_output_directory={tmp_path}",
             f"eval_dataset_path={tmp_path / 'eval.json'}", "eval_steps=-1", "eval_interval=3"]
    pod = subprocess.run(["bash", str(REPO / "scripts" / "local_pod.sh"), "2", "4", sys.executable, "-m", "k3jax.train",
                          str(C.REPO_CONFIGS / "base.yml"), *args, "run_name=pod"],
                         cwd=REPO, env=tool_env(), capture_output=True, text=True, timeout=600)
    assert pod.returncode == 0, pod.stdout[-4000:]
    assert "[0] compiling the train step for 8 image patches per row" in pod.stdout, pod.stdout[-4000:]
    one = train(C.load(C.REPO_CONFIGS / "base.yml", args + ["run_name=one"]))["history"]
    got = [json.loads(line) for line in (tmp_path / "pod" / "metrics.jsonl").read_text().splitlines()]
    assert len(got) == len(one) == 3
    for g, w in zip(got, one):
        for k in ("loss", "grad_norm"):
            assert abs(g[k] - w[k]) <= 1e-6 * abs(w[k]), (k, g[k], w[k])
    assert "eval_loss" in got[-1] and "eval_loss" in one[-1], (got[-1], one[-1])
    assert got[-1]["eval_tokens"] == one[-1]["eval_tokens"] > 0, (got[-1], one[-1])
    for k in ("eval_loss", "eval_accuracy"):
        assert abs(got[-1][k] - one[-1][k]) <= 1e-6 * abs(one[-1][k]), (k, got[-1][k], one[-1][k])
