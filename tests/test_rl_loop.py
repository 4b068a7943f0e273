"""``python -m k3jax.rl`` end to end on the shared tiny checkpoint: two GRPO steps with rollouts from
the inference core and a user reward with spread inside each group, so the policy gradient is not
zero; metrics (loss, rewards, weight_sync_s) in metrics.jsonl, the last parameters saved and
different from the starting ones, and the unsupported settings refused with one error line."""
import json
import os
import subprocess
import sys

import numpy as np

from helpers import REPO, tool_env

DIGITS = [[3, 8, 5, 1], [2, 2, 9, 4], [7, 1, 0, 6], [5, 5, 5, 2]]


def length_reward(record, text, tool_calls):
    """A user reward with spread inside a group (the test needs nonzero advantages)."""
    return float(len(text) % 7)


def rl(tmp_path, tiny_run, *extra):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Largest digit: {' '.join(map(str, d))}? ", "answer": str(max(d))})
                            + "\n" for d in DIGITS))
    env = dict(tool_env(), PYTHONPATH=os.pathsep.join([str(REPO / "tests"), tool_env().get("PYTHONPATH", "")]))
    args = [*tiny_run.args, f"load_parameters_path={tiny_run.checkpoint}", "dataset_type=jsonl",
            f"dataset_path={data}", "steps=2", "per_device_batch_size=4", "rl_num_generations=2",
            "rl_max_new_tokens=6", "max_target_length=32", f"base_output_directory={tmp_path}", "run_name=rl",
            "rl_rewards=[test_rl_loop:length_reward,exact_match]", *extra]
    return subprocess.run([sys.executable, "-m", "k3jax.rl", "configs/base.yml", *args], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=1200)


def test_two_rl_steps_update_the_policy_and_the_programs(tmp_path, tiny_run):
    p = rl(tmp_path, tiny_run)
    assert p.returncode == 0, p.stderr[-3000:]
    recs = [json.loads(line) for line in (tmp_path / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2]
    for r in recs:
        assert np.isfinite(r["loss"]) and r["completion_tokens"] > 0 and r["weight_sync_s"] >= 0
        assert "reward/exact_match" in r and any(k.startswith("reward/") and "length_reward" in k for k in r), r
    assert any(r["advantage_abs_mean"] > 0 for r in recs), recs     # the reward spread reached the gradient
    saved = tmp_path / "rl" / "checkpoints" / "2"
    assert saved.is_dir()
    from k3jax import config as C
    from k3jax.checkpoint import load_params
    from k3jax.sharding import make_mesh
    from k3jax.state import abstract_state
    import jax
    cfg = C.load(C.REPO_CONFIGS / "base.yml", tiny_run.args)
    _, abstract, _ = abstract_state(cfg, make_mesh(cfg, jax.devices()[:1]))
    before = jax.tree.leaves(load_params(tiny_run.checkpoint, abstract["params"]))
    after = jax.tree.leaves(load_params(saved, abstract["params"]))
    assert any(not np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(before, after))


def test_unsupported_settings_are_one_error_line(tmp_path, tiny_run):
    for extra, word in ((["rl_beta=0.5"], "rl_beta"), (["rl_num_iterations=2"], "rl_num_iterations")):
        p = rl(tmp_path, tiny_run, *extra)
        assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
        errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and word in errors[0], p.stderr[-2000:]
