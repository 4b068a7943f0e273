"""The operator's side of a run, in-process: MaxText key aliases, the step line's per-chip figures
and ETA, checkpoint notices, SFT conversations that do not fit a row, and evaluation-set limits."""
import json

import numpy as np
import pytest
import yaml

from k3jax import config as C
from k3jax.console import Console, duration
from k3jax.data import pipeline as P
from k3jax.data import sft, tiny_tokenizer
from k3jax.data.tokenizer import KimiTokenizer

BASE = C.REPO_CONFIGS / "base.yml"


# ---- MaxText aliases ------------------------------------------------------------------------------

@pytest.mark.parametrize("alias,value,key,expected", [
    ("max_num_checkpoints_to_keep", "5", "max_checkpoints_to_keep", 5),
    ("max_prefill_predict_length", "128", "max_prefill_length", 128),
    ("decode_sampling_strategy", "nucleus", "sampling", "sample"),
    ("decode_sampling_strategy", "greedy", "sampling", "greedy"),
    ("decode_sampling_temperature", "0.7", "temperature", 0.7),
    ("decode_sampling_top_k", "40", "top_k", 40),
    ("decode_sampling_nucleus_p", "0.9", "top_p", 0.9),
    ("z_loss_multiplier", "1e-4", "z_loss_weight", 1e-4),
    ("learning_rate_final_fraction", "0.05", "lr_final_fraction", 0.05),
    ("num_experts_per_tok", "4", "num_experts_per_token", 4),
    ("data_shuffle_seed", "7", "data_seed", 7),
])
def test_maxtext_alias_is_read_with_one_notice(alias, value, key, expected, capsys):
    cfg = C.load(BASE, [f"{alias}={value}"])
    assert cfg.flat()[key] == expected
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and alias in err[0] and key in err[0], err
    assert alias not in cfg.flat()


def test_alias_and_its_key_together_is_an_error():
    with pytest.raises(C.ConfigError, match="both 'z_loss_multiplier'.*'z_loss_weight'"):
        C.load(BASE, ["z_loss_multiplier=1e-4", "z_loss_weight=1e-3"])


def test_alias_in_a_model_file_and_overrides(tmp_path):
    (tmp_path / "m.yml").write_text("num_experts_per_tok: 4\n")
    cfg = C.load(BASE, [f"model_name={tmp_path / 'm.yml'}"])
    assert cfg.model.num_experts_per_token == 4
    assert C.override(cfg, {"data_shuffle_seed": 3}).data.data_seed == 3


def test_bad_sampling_strategy_names_the_alias():
    with pytest.raises(C.ConfigError, match="decode_sampling_strategy='beam'"):
        C.load(BASE, ["decode_sampling_strategy=beam"])


def test_saved_run_config_uses_canonical_names(tmp_path):
    cfg = C.load(BASE, ["max_num_checkpoints_to_keep=2", "num_experts_per_tok=1"])
    saved = yaml.safe_load(yaml.safe_dump(cfg.flat(), sort_keys=False))
    assert saved["max_checkpoints_to_keep"] == 2 and saved["num_experts_per_token"] == 1
    assert not set(saved) & set(C.ALIASES)
    assert C.load(BASE, {k: v for k, v in saved.items() if k != "model_name"}).flat() == cfg.flat()


@pytest.mark.parametrize("kv,fragment", [
    ("eval_interval=0", "eval_interval=0"), ("eval_steps=0", "eval_steps=0"), ("num_epoch=-1", "num_epoch=-1"),
    ("eval_dataset_path=x.jsonl", "dataset_type=synthetic"), ("sft_overlong=split", "sft_overlong='split'"),
])
def test_eval_and_sft_keys_are_checked(kv, fragment):
    with pytest.raises(C.ConfigError, match=fragment.replace("(", r"\(")):
        C.load(BASE, [kv])


# ---- the step line -------------------------------------------------------------------------------

def _console(chip_devices, **kw):
    cfg = C.load(BASE, ["steps=100", "log_period=10"])
    return Console(cfg, num_devices=8, start_step=0, tokens_per_step=8192.0, flops_per_token=6e9,
                   peak_tflops_per_device=100.0, chip_devices=chip_devices, **kw)


def test_per_chip_figures_count_two_devices_per_chip_on_tpu7x():
    metrics = {"loss": 2.5, "grad_norm": 1.0, "accuracy": 0.5, "finite": True, "qk_clipped_heads": 3,
               "max_logit": 120.0, "expert_load_max_over_mean": 1.5}
    one, two = _console(1), _console(2)
    r1, r2 = one.record(1, metrics, 2.0, 1e-3), two.record(1, metrics, 2.0, 1e-3)
    assert r1["tokens_per_s"] == r2["tokens_per_s"] == 4096.0
    assert r1["tokens_per_s_per_chip"] == 512.0 and r2["tokens_per_s_per_chip"] == 1024.0
    assert r2["tflops_per_chip"] == pytest.approx(2 * r2["tflops_per_device"])
    assert r1["mfu"] == r2["mfu"] == pytest.approx(4096 * 6e9 / 8 / 1e12 / 100.0)
    line = two.line(r2)
    for part in ("step 1/100", "loss 2.5000", "acc 0.500", "tok/s/chip 1,024", "TFLOP/s/chip 6.144", "MFU 3.07%",
                 "experts max/mean 1.50", "qk-clip 3 heads (max logit 120.0)", "ETA 3m18s"):
        assert part in line, (part, line)


def test_eta_follows_the_recent_step_time():
    c = _console(1)
    m = {"loss": 1.0, "grad_norm": 1.0, "finite": True}
    for s in range(1, 51):
        rec = c.record(s, m, 10.0 if s <= 25 else 1.0, 1e-3)
    assert rec["eta_s"] == pytest.approx(50 * 1.0)   # the last 20 steps took 1 s each
    assert [c.due(s) for s in (1, 2, 10, 11, 100)] == [True, False, True, False, True]
    assert [duration(s) for s in (4.4, 187, 7500)] == ["4s", "3m07s", "2h05m"]


def test_checkpoint_notices(capsys):
    c = _console(1)
    c.checkpoint_started(10, 0.0, async_save=False)
    assert "checkpoint 10 saved in" in capsys.readouterr().out
    c.checkpoint_started(20, 0.0, async_save=True)
    c.poll_checkpoints(saving=True)
    assert capsys.readouterr().out == ""         # still being written: not "saved" yet
    c.poll_checkpoints(saving=False)
    assert "checkpoint 20 saved in" in capsys.readouterr().out


# ---- SFT conversations longer than a row -------------------------------------------------------------

def test_fit_to_length_keeps_the_prompt_or_drops():
    tokens = np.arange(10, dtype=np.int32)
    weights = np.array([0, 0, 0, 0, 1, 1, 1, 1, 1, 1], np.float32)     # prompt 0..3, answer 4..9
    assert sft.fit_to_length(tokens, weights, 10, "truncate")[0] is tokens
    t, w = sft.fit_to_length(tokens, weights, 6, "truncate")
    assert t.tolist() == [0, 1, 2, 3, 4, 5] and w.tolist() == [0, 0, 0, 0, 1, 1]
    assert sft.fit_to_length(tokens, weights, 6, "drop") is None
    assert sft.fit_to_length(tokens, weights, 4, "truncate") is None   # the prompt alone fills the row


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    tiny_tokenizer.build(d, vocab_size=512, num_reserved=tiny_tokenizer.MIN_RESERVED)
    return KimiTokenizer.from_dir(d)


def _sft_batches(tok, path, seq_len=48, **kw):
    it = P.make_pipeline(dataset_type="sft", paths=str(path), tokenizer=tok, seq_len=seq_len, batch_size=1, seed=0,
                         shuffle=False, process_index=0, process_count=1, num_epochs=1, **kw)
    return list(it), it.stats


@pytest.mark.parametrize("policy", ["truncate", "drop"])
def test_pipeline_never_splits_a_conversation(tok, tmp_path, policy):
    long = {"messages": [{"role": "user", "content": "Count."},
                         {"role": "assistant", "content": " ".join(map(str, range(60)))}]}
    short = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps(long) + "\n" + json.dumps(short) + "\n")
    batches, stats = _sft_batches(tok, path, sft_overlong=policy, sft_default_system=None)
    segments = sum(int(b["segment_ids"].max()) for b in batches)
    if policy == "truncate":
        assert (stats.sft_truncated, stats.sft_dropped, segments) == (1, 0, 2)
        user_id = tok.encode("Count.")[0]
        first = next(b for b in batches if user_id in b["tokens"][0])
        assert first["loss_mask"][0].sum() > 0      # the answer's start, with its question in the row
    else:
        assert (stats.sft_truncated, stats.sft_dropped, segments) == (0, 1, 1)


def test_default_system_prompt_switch(tok, tmp_path):
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"messages": msgs}) + "\n")
    n = lambda batches: int((batches[0]["segment_ids"] > 0).sum())  # noqa: E731
    with_sys, without = _sft_batches(tok, path, 96)[0], _sft_batches(tok, path, 96, sft_default_system=None)[0]
    assert n(with_sys) == len(sft.conversation_to_example(tok, msgs)[0])
    assert n(without) == len(sft.conversation_to_example(tok, msgs, default_system=None)[0]) < n(with_sys)


def test_extra_flops_of_an_image_batch_count_in_tflops_and_mfu():
    """An mm_sft step's tower and projector FLOPs (``extra_flops``) add to the tokens' in TFLOP/s and MFU."""
    metrics = {"loss": 2.5, "grad_norm": 1.0, "finite": True}
    c = _console(1)
    plain, with_images = c.record(1, metrics, 2.0, 1e-3), c.record(1, metrics, 2.0, 1e-3, extra_flops=8e14)
    assert with_images["tflops_per_device"] == pytest.approx(plain["tflops_per_device"] + 8e14 / 2.0 / 8 / 1e12)
    assert with_images["mfu"] > plain["mfu"] and with_images["tokens_per_s"] == plain["tokens_per_s"]
