"""The fine-tuning journey of docs/fine-tuning.md, on the tiny golden Kimi Linear model: convert the
transformers checkpoint, SFT on a chat JSONL with evaluation, export back to Hugging Face; then what
a user relies on is checked: the exported tensors, config, tokenizer files and chat template.

The "released" checkpoint is tests/assets/kimi_linear_tiny (made by transformers) plus a tiny Kimi
tokenizer and a generation_config.json, as a real Kimi-Linear directory carries them. Training runs
in-process on the tests' 8 CPU devices (fsdp=8)."""
import contextlib
import io
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from conversion.hf_files import SIDE_FILES
from conversion.hf_to_k3jax import convert, model_overrides_from_hf
from conversion.k3jax_to_hf import export
from k3jax import config as C
from k3jax.data import tiny_tokenizer
from k3jax.data.chat_template import render
from k3jax.data.tokenizer import KimiTokenizer
from k3jax.train import train

ASSETS = Path(__file__).parent / "assets"
CHAT = ASSETS / "chat_tiny"
STEPS = 10
MESSAGES = [{"role": "user", "content": "What is 3 plus 4?"}, {"role": "assistant", "content": "3 plus 4 is 7."}]


def released_checkpoint(d: Path) -> Path:
    """tests/assets/kimi_linear_tiny + the files a released Kimi directory has beside its weights."""
    d.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copyfile(ASSETS / "kimi_linear_tiny" / name, d / name)
    tiny_tokenizer.build(d, vocab_size=512, num_reserved=tiny_tokenizer.MIN_RESERVED)
    tok = KimiTokenizer.from_dir(d)
    (d / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": tok.bos_id, "eos_token_id": [tok.eos_id, tok.im_end_id], "do_sample": False}))
    return d


def sft_args(conv, root):
    """The SFT settings of the journey (the keys docs/fine-tuning.md explains), tiny-model sized."""
    return [f"model_name={conv / 'model.yml'}", f"load_parameters_path={conv}", f"tokenizer_path={conv}",
            "dataset_type=sft", f"dataset_path={CHAT / 'train.jsonl'}", "max_target_length=128",
            "per_device_batch_size=1", "weight_dtype=float32", "opt_type=adamw", "learning_rate=3e-3",
            "warmup_steps_fraction=0", "lr_schedule=constant", "freeze=[embed]", "router_bias_update_rate=0",
            "checkpoint_period=5", "async_checkpointing=false", "log_period=5", f"base_output_directory={root}",
            "remat_policy=none"]


@pytest.fixture(scope="module")
def journey(tmp_path_factory):
    root = tmp_path_factory.mktemp("journey")
    hf = released_checkpoint(root / "Kimi-Linear-tiny")
    conv = root / "converted"
    convert(str(hf), str(conv), dtype="float32", progress=False)
    cfg = C.load(C.REPO_CONFIGS / "base.yml", sft_args(conv, root) + [
        f"eval_dataset_path={CHAT / 'eval.jsonl'}", "eval_interval=5", "eval_steps=2",
        "eval_per_device_batch_size=1", f"steps={STEPS}", "run_name=sft"])
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        out = train(cfg)
    exported = root / "exported"
    export(str(root / "sft" / "checkpoints" / str(STEPS)), str(exported), dtype="float32", progress=False)
    return {"hf": hf, "conv": conv, "root": root, "run": root / "sft", "export": exported,
            "stdout": stdout.getvalue(), "history": out["history"]}


def test_converter_output_carries_the_tokenizer(journey):
    copied = sorted(p.name for p in journey["conv"].iterdir() if p.name in SIDE_FILES)
    assert copied == ["generation_config.json", "tiktoken.model", "tokenizer_config.json"]
    for name in copied:
        assert (journey["conv"] / name).read_bytes() == (journey["hf"] / name).read_bytes(), name


def test_sft_logs_evaluation_and_the_operator_console(journey):
    recs = [json.loads(l) for l in (journey["run"] / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == list(range(1, STEPS + 1))
    assert all(r["bad_records"] == 0 and r["records_read"] > 0 for r in recs)   # the bad-data counters
    evals = {r["step"]: r for r in recs if "eval_loss" in r}
    assert sorted(evals) == [5, 10]
    for r in evals.values():
        assert np.isfinite(r["eval_loss"]) and 0 <= r["eval_accuracy"] <= 1 and r["eval_tokens"] > 0
    # Ten steps of lr 3e-3 on 48 sums must teach something the held-out sums show.
    assert evals[10]["eval_loss"] < evals[5]["eval_loss"] < recs[0]["loss"], evals
    tb = b"".join(p.read_bytes() for p in (journey["run"] / "tensorboard").iterdir())
    assert b"eval_loss" in tb and b"eval_accuracy" in tb
    out = journey["stdout"]
    assert "compiling the train step ..." in out and "compiled the train step in" in out
    assert "compiled the eval step in" in out and out.count("compiling the eval step") == 1
    assert "checkpoint 5 saved in" in out and f"checkpoint {STEPS} saved in" in out
    line = next(l for l in out.splitlines() if l.startswith(f"step {STEPS}/{STEPS}"))
    for part in ("loss", "tok/s/chip", "TFLOP/s/chip", "MFU", "experts max/mean", "eval loss", "ETA"):
        assert part in line, (part, line)
    # The over-long conversation was cut to the row, not split into question-less pieces (it is
    # counted each time it is read: ten steps read the file more than twice).
    truncated = re.search(r"sft: (\d+) conversations truncated and 0 dropped", out)
    assert truncated and int(truncated.group(1)) >= 1, out


def test_export_tensors_config_tokenizer_and_template(journey):
    hf, exp = journey["hf"], journey["export"]
    original, exported = load_file(hf / "model.safetensors"), {}
    for f in sorted(exp.glob("*.safetensors")):
        exported.update(load_file(f))
    assert sorted(exported) == sorted(original)
    for name, t in original.items():
        assert exported[name].shape == t.shape and exported[name].dtype == t.dtype, name
    # freeze=[embed] kept the embedding bit for bit; the layers the SFT trained moved.
    assert np.array_equal(exported["model.embed_tokens.weight"], original["model.embed_tokens.weight"])
    assert not np.array_equal(exported["lm_head.weight"], original["lm_head.weight"])
    hf_cfg, exp_cfg = (json.loads((d / "config.json").read_text()) for d in (hf, exp))
    assert model_overrides_from_hf(exp_cfg) == model_overrides_from_hf(hf_cfg)
    assert exp_cfg["model_type"] == "kimi_linear" and exp_cfg["architectures"] == ["KimiLinearForCausalLM"]
    for name in ("tiktoken.model", "tokenizer_config.json", "generation_config.json"):
        assert (exp / name).read_bytes() == (hf / name).read_bytes(), name


def test_exported_chat_template_renders_the_training_ids(journey):
    """transformers loads the export's tokenizer as it loads the original's, and its chat template
    gives the ids k3jax trained on."""
    from transformers import AutoTokenizer

    def ids(d):
        out = AutoTokenizer.from_pretrained(str(d)).apply_chat_template(MESSAGES, tokenize=True)
        return list(out["input_ids"] if hasattr(out, "keys") else out)

    ours, _ = render(KimiTokenizer.from_dir(journey["export"]), MESSAGES, add_generation_prompt=False)
    assert ids(journey["export"]) == ids(journey["hf"]) == ours


def test_export_round_trips_into_the_trained_parameters(journey, tmp_path):
    """hf -> k3jax of the export gives back the checkpoint's float32 parameters bit for bit."""
    import orbax.checkpoint as ocp
    import jax
    back = tmp_path / "back"
    convert(str(journey["export"]), str(back), dtype="float32", progress=False)
    ckptr = ocp.StandardCheckpointer()
    want = ckptr.restore(journey["run"] / "checkpoints" / str(STEPS) / "params")
    got = ckptr.restore(back / "params")
    flat_w, flat_g = (dict(jax.tree_util.tree_flatten_with_path(t)[0]) for t in (want, got))
    assert flat_w.keys() == flat_g.keys()
    for k in flat_w:
        assert np.array_equal(np.asarray(flat_w[k]), np.asarray(flat_g[k])), k


def test_num_epoch_stops_early_with_a_checkpoint(journey):
    """One pass over the 51 conversations takes a few steps of 8 rows: the run stops there, says so
    and keeps a checkpoint of the step reached. (The same program as the journey's train step, so
    the persistent compilation cache serves it.)"""
    cfg = C.load(C.REPO_CONFIGS / "base.yml", sft_args(journey["conv"], journey["root"]) +
                 ["num_epoch=1", "steps=50", "run_name=one_epoch", "checkpoint_period=100"])
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        out = train(cfg)
    last = out["history"][-1]["step"]
    assert 1 < last < 50
    assert f"the training data ran out after num_epoch=1 passes at step {last} of 50" in stdout.getvalue()
    assert sorted(int(p.name) for p in (journey["root"] / "one_epoch" / "checkpoints").iterdir()
                  if p.name.isdigit()) == [last]
