"""One mistake at a time, across every command-line tool: each must exit 2, print no traceback and
say on one ``error:`` line which key, file or value is at fault (the README's promise).

The cases run in-process through each tool's ``main(argv)`` (stderr captured by capsys); the last
few run as real subprocesses, to check the exit status a shell sees. Every case stops before a
model is compiled, so the whole table takes seconds.
"""
from __future__ import annotations

import importlib
import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
import yaml

from helpers import REPO, tool_env

KIMI = REPO / "tests" / "assets" / "kimi_linear_tiny"
DEMO_TOK = REPO / "data" / "demo" / "tokenizer"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Broken inputs, one mistake each, and the paths the cases refer to as {name}."""
    d = tmp_path_factory.mktemp("mistakes")

    def w(name, data):
        (d / name).write_bytes(data)
        return str(d / name)
    f = {"tmp": str(d),
         "empty": w("empty.jsonl", b""),
         "nofield": w("nofield.jsonl", b'{"content": "a"}\n{"content": "b"}\n{"content": "c"}\n'),
         "notjson": w("notjson.jsonl", b"plain text\nmore text\n"),
         "good": w("good.jsonl", b'{"text": "hello there"}\n{"text": "general kenobi"}\n'),
         "mostlybad": w("mostlybad.jsonl", b'{"text": "ok"}\n' + b'{"txt": "x"}\n' * 5),
         "notparquet": w("data.parquet", b"this is not parquet"),
         "notarray": w("data.arrayrecord", b"this is not an ArrayRecord file"),
         "badyaml": w("bad.yml", b"steps: [1\n"),
         "listyaml": w("list.yml", b"- steps\n"),
         "modelyml": w("model.yml", b"hidden_sizee: 64\n")}
    for name in ("notok", "badtokcfg", "badbpe", "nochattok", "noparams", "garbage", "llama", "badcfg",
                 "noshards", "truncated", "nocfg"):
        (d / name).mkdir()
        f[name] = str(d / name)
    for name in ("badtokcfg", "badbpe", "nochattok"):
        shutil.copy(DEMO_TOK / "tiktoken.model", d / name)
        shutil.copy(DEMO_TOK / "tokenizer_config.json", d / name)
    (d / "badtokcfg" / "tokenizer_config.json").write_text("{not json")
    (d / "badbpe" / "tiktoken.model").write_text("@@@ not base64\n")
    # A tokenizer with neither K2's chat tokens nor K3's markers, and no chat template (its stop token
    # <|end_of_msg|>, K3's name): it cannot render a chat. (A K3 tokenizer renders K3's format natively.)
    cfg = json.loads((DEMO_TOK / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    rename = {"<|im_end|>": "<|end_of_msg|>", "<|im_user|>": "<|reserved_token_x|>"}
    for entry in cfg["added_tokens_decoder"].values():
        entry["content"] = rename.get(entry["content"], entry["content"])
    (d / "nochattok" / "tokenizer_config.json").write_text(json.dumps(cfg))
    (d / "garbage" / "params").mkdir()
    (d / "garbage" / "params" / "junk.txt").write_text("not orbax")
    (d / "llama" / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2}))
    (d / "badcfg" / "config.json").write_text("{")
    shutil.copy(KIMI / "config.json", d / "noshards")
    shutil.copy(KIMI / "config.json", d / "truncated")
    (d / "truncated" / "model.safetensors").write_bytes((KIMI / "model.safetensors").read_bytes()[:5000])
    np.savez(d / "notokens.npz", logits=np.zeros((1, 4, 512), np.float32))
    np.savez(d / "vocab.npz", tokens=np.zeros((1, 4), np.int32), logits=np.zeros((1, 4, 100), np.float32))
    f["notokens"], f["vocab"] = str(d / "notokens.npz"), str(d / "vocab.npz")
    # A run directory with a checkpoint, written by the default config.
    from k3jax import config as C
    run = d / "runs" / "r"
    (run / "checkpoints" / "5").mkdir(parents=True)
    (run / "config.yml").write_text(yaml.safe_dump(C.load(C.REPO_CONFIGS / "base.yml", []).flat(), sort_keys=False))
    f["demo_tok"] = str(DEMO_TOK)
    f["kimi"] = str(KIMI)
    return f


TRAIN = ["steps=1", "enable_tensorboard=false"]
JSONL = ["dataset_type=jsonl", "tokenizer_path={demo_tok}", "vocab_size=1024"]
DECODE = ["tokenizer_path={demo_tok}", "vocab_size=1024"]

# (id, module, argv, the fragment the one error line must contain)
CASES = [
    # --- config: keys, types, values, files ---------------------------------------------------------
    ("unknown-key", "k3jax.config", ["learning_rat=0.1"], "'learning_rat'"),
    ("wrong-type", "k3jax.config", ["steps=abc"], "steps='abc'"),
    ("bad-choice", "k3jax.config", ["lr_schedule=linear"], "lr_schedule='linear'"),
    ("not-key-value", "k3jax.config", ["configs/base.yml", "steps"], "'steps'"),
    ("missing-base", "k3jax.config", ["{tmp}/nothere.yml"], "nothere.yml"),
    ("invalid-yaml", "k3jax.config", ["{tmp}/bad.yml"], "bad.yml"),
    ("yaml-not-mapping", "k3jax.config", ["{tmp}/list.yml"], "list.yml"),
    ("unknown-model", "k3jax.config", ["model_name=kimi-k9"], "kimi-k9"),
    ("model-yml-typo", "k3jax.config", ["model_name={tmp}/model.yml"], "'hidden_sizee'"),
    ("alias-and-key", "k3jax.config", ["max_num_checkpoints_to_keep=2", "max_checkpoints_to_keep=3"],
     "max_checkpoints_to_keep"),
    ("negative-steps", "k3jax.config", ["steps=-5"], "steps=-5"),
    ("topk-over-experts", "k3jax.config", ["num_experts_per_token=20"], "num_experts_per_token=20"),
    ("mla-layer-outside", "k3jax.config", ["mla_extra_layers=[99]"], "mla_extra_layers"),
    ("freeze-unknown", "k3jax.config", ["freeze=embed,brain"], "brain"),
    ("eval-synthetic", "k3jax.config", ["eval_dataset_path=x.jsonl"], "eval_dataset_path"),
    ("port", "k3jax.config", ["serve_port=70000"], "serve_port=70000"),
    # --- config: sampling ranges, mesh divisibility without devices -----------------------------------
    ("top-p-above-1", "k3jax.config", ["top_p=1.5"], "top_p=1.5"),
    ("top-p-zero", "k3jax.config", ["top_p=0"], "top_p=0"),
    ("temperature-negative", "k3jax.config", ["temperature=-1"], "temperature=-1"),
    ("top-k-negative", "k3jax.config", ["top_k=-3"], "top_k=-3"),
    ("max-new-tokens-zero", "k3jax.config", ["max_new_tokens=0"], "max_new_tokens=0"),
    ("experts-over-ep", "k3jax.config", ["model_name=kimi-k3", "ici_expert_parallelism=100"],
     "ici_expert_parallelism=100"),
    ("heads-over-tp", "k3jax.config", ["ici_tensor_parallelism=3"], "ici_tensor_parallelism=3"),
    ("two-fill-axes", "k3jax.config", ["ici_data_parallelism=-1"], "ici_*_parallelism"),
    ("dcn-zero", "k3jax.config", ["dcn_expert_parallelism=0"], "dcn_expert_parallelism=0"),
    ("bad-data-fraction", "k3jax.config", ["bad_data_max_fraction=2"], "bad_data_max_fraction=2"),
    ("no-dataset-path", "k3jax.train", ["dataset_type=jsonl"], "dataset_path"),
    # --- devices ------------------------------------------------------------------------------------
    ("mesh-over-devices", "k3jax.train", ["ici_fsdp_parallelism=3", *TRAIN], "ici_*_parallelism"),
    ("pallas-off-tpu", "k3jax.train", ["kda_impl=pallas_tpu", *TRAIN], "kda_impl=pallas_tpu"),
    ("grad-accum", "k3jax.train", ["gradient_accumulation_steps=3", *TRAIN], "gradient_accumulation_steps=3"),
    # --- data: files, formats, fields -----------------------------------------------------------------
    ("glob-matches-nothing", "k3jax.train", [*JSONL, "dataset_path={tmp}/nope*.jsonl", *TRAIN], "nope*.jsonl"),
    ("empty-jsonl", "k3jax.train", [*JSONL, "dataset_path={empty}", *TRAIN], "empty.jsonl"),
    ("field-missing", "k3jax.train", [*JSONL, "dataset_path={nofield}", *TRAIN], "text_key='text'"),
    ("not-json", "k3jax.train", [*JSONL, "dataset_path={notjson}", *TRAIN], "notjson.jsonl:1"),
    ("mostly-bad", "k3jax.train", [*JSONL, "dataset_path={mostlybad}", *TRAIN], "bad_data_max_fraction"),
    ("fatal-bad-record", "k3jax.train", [*JSONL, "dataset_path={mostlybad}", "bad_data=fatal", *TRAIN],
     "mostlybad.jsonl:2"),
    ("not-parquet", "k3jax.train", [*JSONL, "dataset_type=parquet", "dataset_path={notparquet}", *TRAIN],
     "data.parquet"),
    ("parquet-given-jsonl", "k3jax.train", [*JSONL, "dataset_type=parquet", "dataset_path={good}", *TRAIN],
     "good.jsonl"),
    ("not-arrayrecord", "k3jax.train", [*JSONL, "dataset_type=arrayrecord", "dataset_path={notarray}", *TRAIN],
     "data.arrayrecord"),
    ("sft-no-messages", "k3jax.train", [*JSONL, "dataset_type=sft", "dataset_path={good}", *TRAIN], "'messages'"),
    ("eval-field-missing", "k3jax.train", [*JSONL, "dataset_path={good}", "eval_dataset_path={nofield}", *TRAIN],
     "nofield.jsonl"),
    # --- tokenizer ----------------------------------------------------------------------------------
    ("tokenizer-dir-missing", "k3jax.train", [*JSONL, "dataset_path={good}", "tokenizer_path={tmp}/none", *TRAIN],
     "tiktoken.model"),
    ("tokenizer-no-model", "k3jax.train", [*JSONL, "dataset_path={good}", "tokenizer_path={notok}", *TRAIN],
     "notok/tiktoken.model"),
    ("tokenizer-bad-json", "k3jax.train", [*JSONL, "dataset_path={good}", "tokenizer_path={badtokcfg}", *TRAIN],
     "badtokcfg/tokenizer_config.json"),
    ("tokenizer-bad-bpe", "k3jax.train", [*JSONL, "dataset_path={good}", "tokenizer_path={badbpe}", *TRAIN],
     "badbpe/tiktoken.model"),
    ("tokenizer-over-vocab", "k3jax.train", [*JSONL, "dataset_path={good}", "vocab_size=512", *TRAIN],
     "vocab_size is 512"),
    # --- checkpoints --------------------------------------------------------------------------------
    ("params-path-missing", "k3jax.train", ["load_parameters_path={tmp}/nothere", *TRAIN], "nothere"),
    ("params-path-empty", "k3jax.decode", [*DECODE, "load_parameters_path={noparams}"], "noparams"),
    ("params-not-orbax", "k3jax.decode", [*DECODE, "load_parameters_path={garbage}"], "garbage/params"),
    ("no-tokenizer-decode", "k3jax.decode", ["load_parameters_path={noparams}"], "tokenizer_path"),
    ("no-tokenizer-serve", "k3jax.serve.main", ["load_parameters_path={noparams}"], "tokenizer_path"),
    ("no-tokenizer-random-weights", "k3jax.decode", [], "no tokenizer"),
    ("no-tokenizer-jsonl", "k3jax.train", ["dataset_type=jsonl", "dataset_path={good}", *TRAIN], "tokenizer_path"),
    ("resume-other-dtype", "k3jax.train", ["base_output_directory={tmp}/runs", "run_name=r", "weight_dtype=bfloat16",
                                           *TRAIN], "weight_dtype: checkpoint 'float32' vs now 'bfloat16'"),
    ("resume-other-model", "k3jax.train", ["base_output_directory={tmp}/runs", "run_name=r", "model_name=tiny",
                                           *TRAIN], "hidden_size"),
    # --- decode and sampling ------------------------------------------------------------------------
    ("empty-prompt", "k3jax.decode", [*DECODE, "prompt="], "prompt"),
    ("prompt-too-long", "k3jax.decode", [*DECODE, "prompt=" + "word " * 40, "max_prefill_length=8"],
     "max_prefill_length"),
    ("chat-no-markup", "k3jax.decode", ["tokenizer_path={nochattok}", "vocab_size=1024", "chat=true"], "chat=true"),
    ("decode-top-p", "k3jax.decode", [*DECODE, "sampling=sample", "top_p=2"], "top_p=2"),
    # --- logit_check, compile, plan -----------------------------------------------------------------
    ("golden-unset", "k3jax.logit_check", ["load_parameters_path={garbage}"], "golden"),
    ("golden-missing", "k3jax.logit_check", ["golden={tmp}/none.npz"], "none.npz"),
    ("golden-no-tokens", "k3jax.logit_check", ["golden={notokens}"], "notokens.npz"),
    ("golden-vocab", "k3jax.logit_check", ["golden={vocab}"], "vocab_size=512"),
    ("compile-no-topology", "k3jax.compile", [], "compile_topology"),
    ("compile-bad-topology", "k3jax.compile", ["compile_topology=v9z-8"], "v9z-8"),
    ("compile-bad-step", "k3jax.compile", ["compile_topology=v5p-8", "compile_step=eval"], "compile_step='eval'"),
    ("plan-no-topology", "k3jax.plan", [], "topology"),
    # --- conversion ---------------------------------------------------------------------------------
    ("hf-missing-out", "conversion.hf_to_k3jax", ["--hf_dir", "{kimi}"], "--out"),
    ("hf-bad-dtype", "conversion.hf_to_k3jax", ["--hf_dir", "{kimi}", "--out", "{tmp}/o", "--dtype", "fp7"],
     "fp7"),
    ("hf-no-dir", "conversion.hf_to_k3jax", ["--hf_dir", "{tmp}/none", "--out", "{tmp}/o"], "none/config.json"),
    ("hf-no-config", "conversion.hf_to_k3jax", ["--hf_dir", "{nocfg}", "--out", "{tmp}/o"], "nocfg"),
    ("hf-bad-config", "conversion.hf_to_k3jax", ["--hf_dir", "{badcfg}", "--out", "{tmp}/o"], "badcfg/config.json"),
    ("hf-llama", "conversion.hf_to_k3jax", ["--hf_dir", "{llama}", "--out", "{tmp}/o"], "'llama'"),
    ("hf-no-shards", "conversion.hf_to_k3jax", ["--hf_dir", "{noshards}", "--out", "{tmp}/o"], "noshards"),
    ("hf-truncated", "conversion.hf_to_k3jax", ["--hf_dir", "{truncated}", "--out", "{tmp}/o"], "model.safetensors"),
    ("hf-wrong-model", "conversion.hf_to_k3jax", ["--hf_dir", "{kimi}", "--out", "{tmp}/o", "--model_name",
                                                  "kimi-linear-48b"], "model_name=kimi-linear-48b"),
    ("export-no-ckpt", "conversion.k3jax_to_hf", ["--ckpt", "{tmp}/none", "--out", "{tmp}/e"], "none"),
    ("export-missing-out", "conversion.k3jax_to_hf", ["--ckpt", "{tmp}"], "--out"),
]


def _check(rc, err, fragment):
    assert rc == 2, f"exit {rc}, stderr:\n{err[-2000:]}"
    assert "Traceback" not in err, err[-2000:]
    lines = [line for line in err.splitlines() if line.startswith("error:") or ": error:" in line]
    assert len(lines) == 1, f"want one error line, got:\n{err[-2000:]}"
    assert fragment in lines[0], f"{fragment!r} not in {lines[0]!r}"


@pytest.mark.parametrize("mod,argv,fragment", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_one_mistake(mod, argv, fragment, files, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(REPO)
    args = [a.format(**files) for a in argv]
    if mod.startswith("k3jax.") and mod != "k3jax.config" and not any("base_output_directory" in a for a in args):
        args.append(f"base_output_directory={tmp_path}")
    rc = importlib.import_module(mod).main(args)
    err = capsys.readouterr().err
    print(err)
    _check(rc, err, fragment.format(**files))


def test_case_count():
    assert len(CASES) >= 40 and len({c[0] for c in CASES}) == len(CASES)


# The exit status a shell sees, from real processes (the other cases call main in-process).
SUBPROCESS = [
    ("k3jax.config", ["configs/base.yml", "top_p=1.5"], "top_p=1.5"),
    ("k3jax.train", ["configs/base.yml", "dataset_type=jsonl", "dataset_path={nofield}", "tokenizer_path={demo_tok}",
                     "vocab_size=1024", "base_output_directory={tmp}/runs"], "nofield.jsonl"),
    ("conversion.hf_to_k3jax", [], "--hf_dir"),
    # a process of its own: joining a job changes process-wide jax settings (gloo collectives)
    ("k3jax.decode", ["configs/base.yml", "enable_distributed=true"], "enable_distributed=true"),
]


@pytest.mark.parametrize("mod,argv,fragment", SUBPROCESS, ids=[s[0] for s in SUBPROCESS])
def test_exit_status_of_the_process(mod, argv, fragment, files):
    p = subprocess.run([sys.executable, "-m", mod, *[a.format(**files) for a in argv]], env=tool_env(), cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    _check(p.returncode, p.stderr, fragment)


@pytest.mark.parametrize("mod", ["k3jax.config", "k3jax.train", "k3jax.decode", "k3jax.compile", "k3jax.plan",
                                 "k3jax.logit_check", "k3jax.serve.main", "conversion.hf_to_k3jax",
                                 "conversion.k3jax_to_hf"])
def test_help(mod, capsys):
    try:
        rc = importlib.import_module(mod).main(["--help"])
    except SystemExit as e:   # argparse prints the usage and exits 0
        rc = e.code
    out = capsys.readouterr().out
    assert rc == 0 and ("usage" in out.lower() or "configs/base.yml" in out), out
