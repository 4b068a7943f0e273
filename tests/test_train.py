"""Training loop: checkpoints, exact resume after SIGKILL, metrics, decode from the checkpoint, CLI
errors. Runs real subprocesses of ``python -m k3jax.train`` / ``k3jax.decode`` on one CPU device."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from helpers import TINY_TRAIN as TINY, tool_env as env, run_tool as run


def losses(run_dir):
    recs = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in recs}


def test_killed_run_resumes_with_identical_losses(tmp_path):
    # The tiny model cut to 4 layers (KDA, MLA, dense, MoE, AttnRes all present): three processes
    # compile and run it, and resume exactness does not depend on depth.
    common = TINY + ["num_layers=4", "mla_every=4", "mla_extra_layers=[]", "attn_res_block_size=2",
                     f"base_output_directory={tmp_path}", "steps=10", "checkpoint_period=3"]
    run("train", *common, "run_name=straight")
    want = losses(tmp_path / "straight")
    assert sorted(want) == list(range(1, 11))

    # Start again and SIGKILL the process while an async save is being written: orbax writes a step
    # into "<step>.orbax-checkpoint-tmp-*" and commits it by a rename, so the kill lands while such a
    # directory of step 6 or later exists (an earlier checkpoint is then complete). Then resume.
    cmd = [sys.executable, "-m", "k3jax.train", "configs/base.yml", *common, "run_name=killed"]
    proc = subprocess.Popen(cmd, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            cwd=os.path.dirname(os.path.dirname(__file__)))
    ckpts = tmp_path / "killed" / "checkpoints"

    def saving():
        names = [p.name for p in ckpts.iterdir()] if ckpts.is_dir() else []
        return [n for n in names if ".orbax-checkpoint-tmp" in n and int(n.split(".")[0]) >= 6]
    deadline = time.time() + 500
    while time.time() < deadline and proc.poll() is None and not saving():
        time.sleep(0.005)
    assert proc.poll() is None, "the run finished before a save of step >= 6 could be interrupted"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    torn = saving()
    assert torn, "the save finished before the kill landed"
    resumed = run("train", *common, "run_name=killed")
    assert "resumed from" in resumed.stdout
    # It resumed from a complete checkpoint, never from the interrupted one.
    step = int(resumed.stdout.split("at step")[1].split()[0])
    assert step < int(torn[0].split(".")[0]), (step, torn)
    got = losses(tmp_path / "killed")  # resumed steps overwrite the killed run's later entries
    assert sorted(got) == sorted(want)
    # Same batches and state after the resume: bit-identical losses.
    assert got == want, {s: (got[s], want[s]) for s in want if got[s] != want[s]}


def test_metrics_checkpoint_and_decode(tiny_run):
    # The run recorded its tokenizer (synthetic data: the built-in tiny one); decode reads it from there.
    assert (tiny_run.run / "tokenizer" / "tiktoken.model").is_file()
    assert not any(a.startswith("tokenizer_path=") for a in tiny_run.args)
    rec = json.loads((tiny_run.run / "metrics.jsonl").read_text().splitlines()[-1])
    for key in ("step", "loss", "tokens_per_s", "tflops_per_device", "mfu", "grad_norm", "learning_rate",
                "expert_load_max_over_mean"):
        assert key in rec
    assert (tiny_run.run / "config.yml").exists()
    assert sorted(p.name for p in (tiny_run.run / "checkpoints").iterdir() if p.name.isdigit()) == ["2", "4"]
    out = run("decode", *tiny_run.args, f"load_parameters_path={tiny_run.checkpoint}", "prompt=I love to",
              "max_new_tokens=5")
    assert "decode" in out.stdout and "tokens/s" in out.stdout
    assert "RANDOM" not in out.stderr
    # Streaming (incremental UTF-8 over token bytes) prints the same greedy text as the batch path.
    batch = run("decode", *tiny_run.args, "stream=false", f"load_parameters_path={tiny_run.checkpoint}",
                "prompt=I love to", "max_new_tokens=5")
    assert batch.stdout.rsplit("\nprefill ", 1)[0] == "I love to" + out.stdout.rsplit("\nprefill ", 1)[0], \
        (batch.stdout, out.stdout)


@pytest.mark.parametrize("args,fragment", [
    (["prompt="], "prompt is empty"),
    (["prompt=" + "word " * 200, "max_target_length=16", "tokenizer_path=data/demo/tokenizer", "vocab_size=1024"],
     "shorten the prompt"),
    (["prompt=hello"], "no tokenizer: set tokenizer_path"),
    (["sampling=beam"], "sampling='beam': must be one of greedy, sample"),
    (["load_parameters_path=/nonexistent/x"], "no such directory"),
])
def test_decode_cli_errors(tmp_path, args, fragment):
    p = run("decode", *TINY, f"base_output_directory={tmp_path}", *args, check=False)
    assert p.returncode == 2
    assert fragment in p.stderr and "Traceback" not in p.stderr
    assert p.stderr.strip().count("\n") == 0, p.stderr
