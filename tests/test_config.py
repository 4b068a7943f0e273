"""Config parsing: types, merge order, every user error, derived values, base.yml completeness."""
import dataclasses
import subprocess
import sys

import pytest
import yaml

from k3jax import config as C
from k3jax import counts

BASE = C.REPO_CONFIGS / "base.yml"


def load(*args):
    return C.load(BASE, list(args))


def test_base_yml_lists_every_key_exactly():
    keys = list(yaml.safe_load(BASE.read_text()))
    assert keys == C.all_keys(), "configs/base.yml must mirror the schema key for key, in order"
    text = BASE.read_text().splitlines()
    for k in C.KEYS:  # every key carries a comment
        line = next(l for l in text if l.startswith(f"{k}:"))
        assert "#" in line, k


def test_base_defaults_equal_schema_defaults():
    cfg = load()
    for k, (sec, f) in C.KEYS.items():
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        assert getattr(getattr(cfg, sec), k) == default, k


@pytest.mark.parametrize("name", C.available_models())
def test_every_model_file_loads(name):
    cfg = load(f"model_name={name}")
    assert cfg.model_name == name
    assert len(cfg.model.schedule) == cfg.model.num_layers


def test_merge_order_base_model_cli():
    assert load().model.hidden_size == 64
    assert load("model_name=tiny").model.hidden_size == 32
    assert load("model_name=tiny", "hidden_size=48").model.hidden_size == 48


def test_model_name_as_path(tmp_path):
    p = tmp_path / "m.yml"
    p.write_text("hidden_size: 40\n")
    assert load(f"model_name={p}").model.hidden_size == 40
    (tmp_path / "model.yml").write_text("hidden_size: 44\n")
    assert load(f"model_name={tmp_path}/").model.hidden_size == 44


@pytest.mark.parametrize("kv,key,expected", [
    ("steps=7", ("train", "steps"), 7),
    ("learning_rate=1e-4", ("train", "learning_rate"), 1e-4),
    ("learning_rate=2", ("train", "learning_rate"), 2.0),
    ("scan_layers=false", ("train", "scan_layers"), False),
    ("scan_layers=True", ("train", "scan_layers"), True),
    ("q_lora_rank=null", ("model", "q_lora_rank"), None),
    ("q_lora_rank=None", ("model", "q_lora_rank"), None),
    ("mla_extra_layers=[5,6]", ("model", "mla_extra_layers"), [5, 6]),
    ("freeze=embed,lm_head", ("train", "freeze"), ["embed", "lm_head"]),
    ("prompt=1 2 3", ("decode", "prompt"), "1 2 3"),
    ("run_name=007", ("checkpoint", "run_name"), "007"),
    ("dataset_path=null", ("data", "dataset_path"), None),
])
def test_types_are_coerced(kv, key, expected):
    cfg = load(kv)
    got = getattr(getattr(cfg, key[0]), key[1])
    assert got == expected and type(got) is type(expected)


@pytest.mark.parametrize("args,fragment", [
    (["no_such_key=1"], "unknown config key 'no_such_key'"),
    (["learning_rat=1"], "did you mean 'learning_rate' (peak learning rate)?"),
    # Other trainers' names point at the k3jax key, not at a look-alike (difflib alone answered
    # 'async_checkpointing' for load_checkpoint and 'seed' for seq_len).
    (["load_checkpoint=runs/demo"], "did you mean 'load_parameters_path' (start from these parameters"),
    (["seq_len=128"], "did you mean 'max_target_length'"),
    (["lr=1e-3"], "did you mean 'learning_rate'"),
    (["resume_from_checkpoint=true"], "resumes by itself from the latest checkpoint"),
    (["num_beams=4"], "no beam search"),
    (["tp=4"], "did you mean 'ici_tensor_parallelism'"),
    # No weak look-alike (difflib at 0.5 answered 'attention_impl'): the list of keys instead.
    (["repetition_penalty=1.1"], "to list keys"),
    (["steps=abc"], "steps='abc': expected int"),
    (["steps=1.5"], "expected int"),
    (["scan_layers=3"], "expected bool"),
    (["hidden_size=null"], "null is not allowed"),
    (["opt_type=sgd"], "must be one of muon, adamw"),
    (["model_name=nope"], "unknown model_name 'nope'; available: "),
    (["steps"], "not key=value"),
    (["mla_extra_layers=[40]"], "outside 0..12"),
    (["num_experts_per_token=99"], "exceeds num_experts"),
    (["steps=0"], "must be positive"),
    (["kda_chunk_size=40"], "power of two >= 16"),
    (["kda_chunk_size=48"], "power of two >= 16"),
    (["kda_chunk_size=8"], "power of two >= 16"),
    # The bounded gate's bound reaches the chunked core's relation form: a clear error, not a
    # traceback from inside the trace.
    (["kda_gate_lower_bound=0"], "must be a finite negative number"),
    (["kda_gate_lower_bound=nan"], "must be a finite negative number"),
    (["freeze=[wings]"], "unknown ['wings']"),
])
def test_user_errors_are_one_line(args, fragment):
    with pytest.raises(C.ConfigError) as e:
        load(*args)
    assert fragment in str(e.value)
    assert "\n" not in str(e.value)


def test_other_trainers_names_point_at_real_keys():
    """Each name in the table leads to a key that exists (a rename must update it) and is not
    itself a key or a MaxText alias (it would never be looked up)."""
    keys = set(C.all_keys())
    assert all(v in keys for v in C.OTHER_NAMES.values())
    assert not ((set(C.OTHER_NAMES) | set(C.NO_KEY)) & (keys | set(C.ALIASES)))
    assert not set(C.OTHER_NAMES) & set(C.NO_KEY)


def test_unknown_key_inside_model_file(tmp_path):
    p = tmp_path / "bad.yml"
    p.write_text("hiden_size: 3\n")
    with pytest.raises(C.ConfigError, match=r"unknown config key 'hiden_size' \(.*bad.yml\); did you mean 'hidden_size'"):
        load(f"model_name={p}")


def test_invalid_yaml_file(tmp_path):
    p = tmp_path / "broken.yml"
    p.write_text("a: [1,\n")
    with pytest.raises(C.ConfigError, match="invalid YAML"):
        load(f"model_name={p}")


def test_k3_schedule_and_counts():
    m = load("model_name=kimi-k3").model
    sched = m.schedule
    assert [l for l, (mx, _) in enumerate(sched) if mx == "mla"] == list(range(3, 92, 4)) + [92]
    assert sum(mx == "kda" for mx, _ in sched) == 69
    assert sched[0] == ("kda", "dense") and all(f == "moe" for _, f in sched[1:])
    assert m.attn_res_block_starts == [0, 12, 24, 36, 48, 60, 72, 84]
    total, active = counts.param_counts(m)
    assert abs(total / 2.78e12 - 1) < 0.005, total
    assert abs(active / 104.2e9 - 1) < 0.005, active
    # Component sizes quoted in k3-architecture.md §1.
    assert abs(counts.kda_params(m) / 443.7e6 - 1) < 0.001
    assert abs(counts.mla_params(m) / 232.2e6 - 1) < 0.001
    assert abs(counts.expert_params(m) / 33.0e6 - 1) < 0.002


def test_kimi_linear_counts():
    m = load("model_name=kimi-linear-48b").model
    assert sorted(m.mla_layer_set) == [3, 7, 11, 15, 19, 23, 26]
    total, _ = counts.param_counts(m)
    assert abs(total / 49.1e9 - 1) < 0.01


def test_cli_prints_counts_and_errors_cleanly():
    out = subprocess.run([sys.executable, "-m", "k3jax.config", str(BASE), "model_name=kimi-k3"],
                         capture_output=True, text=True, check=True).stdout
    assert "total 2.78T" in out and "active per token 104.19B" in out
    bad = subprocess.run([sys.executable, "-m", "k3jax.config", str(BASE), "no_such_key=1"],
                         capture_output=True, text=True)
    assert bad.returncode == 2
    assert bad.stderr.strip().count("\n") == 0 and "no_such_key" in bad.stderr
    assert "Traceback" not in bad.stderr
