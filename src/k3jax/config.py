"""Typed configuration: one frozen dataclass tree, one entry syntax.

    python -m k3jax.<tool> configs/base.yml model_name=kimi-k3 key=value ...

Merge order: base.yml < model yml (``model_name``: a name under ``configs/models/`` or a path to a
``.yml``) < command line. Keys are flat and globally unique (MaxText style); each belongs to one
section dataclass, and modules receive their section (``cfg.model``, ``cfg.train``, ...). Every
value is type-checked and coerced from strings. Errors a user can act on are ``ConfigError``s with
one-line messages; ``main`` entry points print them without a traceback.

Derived quantities (global batch, layer schedule, AttnRes blocks, parameter counts, FLOPs per token)
are methods here or in ``k3jax.counts``, computed from the config alone. The consistency checks
(``validate``, ``mesh_shape``) live in ``k3jax.validation`` and are re-exported here.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import sys
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from k3jax import counts
from k3jax.errors import guard, usage, wants_help
from k3jax.validation import (  # noqa: F401 - re-exported: callers use config.validate, config.mesh_shape
    FREEZABLE, PATH_KEYS, VOCAB_PARALLEL_AXES, check_path_scheme, mesh_shape, validate)
from k3jax.schema import (  # noqa: F401 - the schema's names are part of this module's interface
    MESH_AXES, SECTIONS, TOP_LEVEL, CheckConfig, CheckpointConfig, CompileConfig, Config, ConfigError, DataConfig,
    DecodeConfig, EvalConfig, KernelConfig, MeshConfig, ModelConfig, RLConfig, ServeConfig, TrainConfig)

REPO_CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _key_index() -> dict[str, tuple[str, dataclasses.Field]]:
    idx = {}
    for sec, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            assert f.name not in idx, f"duplicate config key {f.name}"
            idx[f.name] = (sec, f)
    return idx


KEYS = _key_index()


def all_keys() -> list[str]:
    return list(TOP_LEVEL) + list(KEYS)


def _type_name(tp) -> str:
    return getattr(tp, "__name__", str(tp)).replace("typing.", "")


def coerce(key: str, value: Any) -> Any:
    """Coerce ``value`` (a YAML value or a command-line string) to the declared type of ``key``."""
    sec, f = KEYS[key]
    tp = typing.get_type_hints(SECTIONS[sec])[key]
    if isinstance(value, str) and tp is not str:
        try:
            value = yaml.safe_load(value) if value.strip() else None
        except yaml.YAMLError:
            raise ConfigError(f"{key}={value!r}: cannot parse the value") from None
    optional = typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in typing.get_args(tp)
    base = next((a for a in typing.get_args(tp) if a is not type(None)), tp) if optional else tp
    if value is None or (isinstance(value, str) and value.lower() in ("null", "none") and base is not str):
        if optional:
            return None
        raise ConfigError(f"{key}: null is not allowed (expected {_type_name(base)})")
    ok = True
    if base is bool:
        ok = isinstance(value, bool)
    elif base is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif base is float:
        if isinstance(value, str):  # YAML 1.1 reads "1e-4" as a string
            try:
                value = float(value)
            except ValueError:
                pass
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif base is str:
        value = value if isinstance(value, str) else str(value)
    elif base is list:
        if isinstance(value, str):
            value = [v for v in value.split(",") if v]
        ok = isinstance(value, list)
        value = list(value) if ok else value
    if not ok:
        raise ConfigError(f"{key}={value!r}: expected {_type_name(base)}, got {type(value).__name__}")
    choices = f.metadata.get("choices")
    if choices and value not in choices:
        raise ConfigError(f"{key}={value!r}: must be one of {', '.join(choices)}")
    return value


# MaxText's names for keys users type every day. They are read as the k3jax key with a one-line
# notice (so a MaxText command line works and says what it became); giving both names in one place
# is an error, since which one should win is a guess. Saved configs use the k3jax names only.
ALIASES = {
    "max_num_checkpoints_to_keep": "max_checkpoints_to_keep",
    "max_prefill_predict_length": "max_prefill_length",
    "decode_sampling_strategy": "sampling",
    "decode_sampling_temperature": "temperature",
    "decode_sampling_top_k": "top_k",
    "decode_sampling_nucleus_p": "top_p",
    "z_loss_multiplier": "z_loss_weight",
    "learning_rate_final_fraction": "lr_final_fraction",
    "num_experts_per_tok": "num_experts_per_token",
    "data_shuffle_seed": "data_seed",
    "ici_pipeline_parallelism": "ici_stage_parallelism",
    "dcn_pipeline_parallelism": "dcn_stage_parallelism",
}
# MaxText's decode_sampling_strategy values: every strategy but greedy samples; which tokens are
# eligible is then set by top_k / top_p (decode_sampling_top_k / decode_sampling_nucleus_p).
MAXTEXT_SAMPLING = {"greedy": "greedy", "weighted": "sample", "nucleus": "sample", "topk": "sample",
                    "composite": "sample"}


def canonical_keys(values: dict, where: str) -> dict:
    """``values`` with MaxText aliases renamed to k3jax keys (order kept), one notice per alias on
    stderr; ConfigError when an alias and its k3jax key are both given in ``where``."""
    out = {}
    for key, val in values.items():
        canon = ALIASES.get(key)
        if canon is None:
            out[key] = val
            continue
        if canon in values:
            raise ConfigError(f"both '{key}' (MaxText's name) and '{canon}' are set ({where}); keep one of them")
        if key == "decode_sampling_strategy":
            if str(val) not in MAXTEXT_SAMPLING:
                raise ConfigError(f"decode_sampling_strategy={val!r}: must be one of {', '.join(MAXTEXT_SAMPLING)}")
            val = MAXTEXT_SAMPLING[str(val)]
        print(f"note: '{key}' is MaxText's name for '{canon}'; read as {canon}={val}", file=sys.stderr)
        out[canon] = val
    return out


# Names other trainers (Hugging Face Trainer, NeMo, torchtitan, nanoGPT) use for a k3jax key. Not
# aliases: their meanings differ in details (units, what a path may point at), so they are refused,
# but the error names the key to use instead of a merely similar-looking one.
OTHER_NAMES = {
    **dict.fromkeys(("load_checkpoint", "checkpoint", "checkpoint_path", "ckpt", "ckpt_path", "model_path",
                     "init_checkpoint", "init_from", "pretrained", "pretrained_model_name_or_path"),
                    "load_parameters_path"),
    **dict.fromkeys(("warmup", "warmup_steps", "warmup_ratio"), "warmup_steps_fraction"),
    **dict.fromkeys(("batch_size", "micro_batch_size", "per_device_train_batch_size", "train_batch_size"),
                    "per_device_batch_size"),
    **dict.fromkeys(("lr", "max_lr", "peak_lr"), "learning_rate"),
    **dict.fromkeys(("max_steps", "num_steps", "train_steps", "total_steps", "training_steps", "iters",
                     "max_iters"), "steps"),
    **dict.fromkeys(("seq_len", "seq_length", "max_seq_len", "max_seq_length", "sequence_length", "block_size",
                     "context_length"), "max_target_length"),
    **dict.fromkeys(("output_dir", "out_dir", "save_dir", "checkpoint_dir", "run_dir"), "base_output_directory"),
    **dict.fromkeys(("save_steps", "save_every", "save_interval", "checkpoint_interval", "checkpoint_every"),
                    "checkpoint_period"),
    **dict.fromkeys(("logging_steps", "log_every", "log_interval"), "log_period"),
    **dict.fromkeys(("eval_every", "eval_steps_interval"), "eval_interval"),
    **dict.fromkeys(("grad_clip", "max_grad_norm", "clip_grad_norm", "gradient_clip_val"),
                    "gradient_clipping_threshold"),
    **dict.fromkeys(("data_path", "train_data", "train_file", "dataset", "data_dir"), "dataset_path"),
    **dict.fromkeys(("tokenizer", "tokenizer_name", "tokenizer_dir"), "tokenizer_path"),
    **dict.fromkeys(("max_tokens", "max_new_tokens_to_generate", "num_tokens", "gen_len"), "max_new_tokens"),
    **dict.fromkeys(("model", "model_type", "model_config"), "model_name"),
    **dict.fromkeys(("optimizer", "optim"), "opt_type"),
    **dict.fromkeys(("epochs", "num_epochs", "num_train_epochs", "max_epochs"), "num_epoch"),
    **dict.fromkeys(("vocab", "vocabulary_size", "n_vocab"), "vocab_size"),
    **dict.fromkeys(("bf16", "fp16", "precision", "mixed_precision", "compute_dtype"), "dtype"),
    "do_sample": "sampling",
    **dict.fromkeys(("tp", "tensor_parallel", "tensor_parallel_size", "tensor_model_parallel_size"),
                    "ici_tensor_parallelism"),
    **dict.fromkeys(("ep", "expert_parallel", "expert_parallel_size", "expert_model_parallel_size"),
                    "ici_expert_parallelism"),
    **dict.fromkeys(("dp", "data_parallel", "data_parallel_size"), "ici_data_parallelism"),
    **dict.fromkeys(("fsdp", "fsdp_size"), "ici_fsdp_parallelism"),
}

# Names with no k3jax key of their own: the error says what k3jax does instead.
RESUME_HINT = ("a run resumes by itself from the latest checkpoint under <base_output_directory>/<run_name> "
               "(run the same command again); load_parameters_path= starts a new run from saved parameters")
NO_KEY = {
    **dict.fromkeys(("resume", "resume_from_checkpoint", "restore", "restore_from", "auto_resume"), RESUME_HINT),
    **dict.fromkeys(("num_beams", "beam_size", "num_beam", "beam_width"),
                    "k3jax has no beam search; it decodes greedily or samples (sampling=greedy|sample, "
                    "temperature, top_k, top_p)"),
}


def _unknown(key: str, where: str) -> ConfigError:
    low = key.lower()
    if low in NO_KEY:
        return ConfigError(f"unknown config key '{key}' ({where}); {NO_KEY[low]}")
    near = OTHER_NAMES.get(low)             # tests/test_config.py keeps every target an existing key
    if near is None:
        # 0.7: typos score 0.8-0.96; below that difflib offered look-alikes such as kda_num_heads for
        # num_beams or attention_impl for repetition_penalty.
        close = difflib.get_close_matches(key, all_keys() + list(ALIASES), n=1, cutoff=0.7)
        near = close[0] if close else None
    if near is None:
        hint = "; run `python -m k3jax.config configs/base.yml` to list keys"
    else:
        canon = ALIASES.get(near, near)
        about = KEYS[canon][1].metadata.get("help", "").split(";")[0] if canon in KEYS else ""
        if len(about) > 90:
            about = about[:90].rsplit(" ", 1)[0] + " ..."
        hint = f"; did you mean '{near}'" + (f" ({about})" if about else "") + "?"
    return ConfigError(f"unknown config key '{key}' ({where}){hint}")


def _read_yaml(path: Path) -> dict:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of key: value")
    return data


def available_models() -> list[str]:
    return sorted(p.stem for p in (REPO_CONFIGS / "models").glob("*.yml"))


def resolve_model_path(model_name: str, base_dir: Path) -> Path:
    if model_name.endswith((".yml", ".yaml")) or os.sep in model_name:
        p = Path(model_name)
        if p.is_dir():
            p = p / "model.yml"
        if not p.exists():
            raise ConfigError(f"model_name={model_name}: file not found")
        return p
    for root in (base_dir / "models", REPO_CONFIGS / "models"):
        if (root / f"{model_name}.yml").exists():
            return root / f"{model_name}.yml"
    raise ConfigError(f"unknown model_name '{model_name}'; available: {', '.join(available_models())}")


def parse_overrides(args: list[str]) -> dict[str, str]:
    out = {}
    for a in args:
        if "=" not in a:
            raise ConfigError(f"argument '{a}' is not key=value")
        k, v = a.split("=", 1)
        out[k.strip().lstrip("-")] = v
    return out


def load(base: str | Path = REPO_CONFIGS / "base.yml", overrides: list[str] | dict | None = None) -> Config:
    """Load base.yml, then the model yml named by ``model_name``, then ``overrides``; validate."""
    base = Path(base)
    cli = parse_overrides(overrides) if isinstance(overrides, list) else dict(overrides or {})
    cli = canonical_keys(cli, "command line")
    values: dict[str, Any] = {}
    for k, v in canonical_keys(_read_yaml(base), str(base)).items():
        if k not in KEYS and k not in TOP_LEVEL:
            raise _unknown(k, str(base))
        values[k] = v
    model_name = str(cli.get("model_name", values.get("model_name", "default")))
    if model_name not in ("", "default"):
        mpath = resolve_model_path(model_name, base.parent)
        for k, v in canonical_keys(_read_yaml(mpath), str(mpath)).items():
            if k not in KEYS:
                raise _unknown(k, str(mpath))
            values[k] = v
    for k, v in cli.items():
        if k not in KEYS and k not in TOP_LEVEL:
            raise _unknown(k, "command line")
        values[k] = v
    values["model_name"] = model_name
    sections = {sec: {} for sec in SECTIONS}
    for k, v in values.items():
        if k in TOP_LEVEL:
            continue
        sections[KEYS[k][0]][k] = coerce(k, v)
    cfg = Config(model_name=model_name, **{s: SECTIONS[s](**kw) for s, kw in sections.items()})
    validate(cfg)
    return cfg


def override(cfg: Config, values: dict[str, Any]) -> Config:
    """``cfg`` with ``values`` ({key: value}; typed values or command-line strings) replaced and the
    result validated, as if they had been given on the command line (``model_name`` excepted)."""
    sections: dict[str, dict] = {}
    for key, val in canonical_keys(values, "override").items():
        if key not in KEYS:
            raise _unknown(key, "override")
        sections.setdefault(KEYS[key][0], {})[key] = coerce(key, val)
    out = dataclasses.replace(cfg, **{s: dataclasses.replace(getattr(cfg, s), **kw) for s, kw in sections.items()})
    validate(out)
    return out



def describe(cfg: Config) -> str:
    """Human-readable resolved config with the derived quantities."""
    lines = [f"# resolved config: model_name={cfg.model_name}"]
    for sec in SECTIONS:
        lines.append(f"## {sec}")
        for key, val in dataclasses.asdict(getattr(cfg, sec)).items():
            lines.append(f"{key}: {val!r}")
    m = cfg.model
    sched = cfg.model.schedule
    n_mla = sum(1 for mx, _ in sched if mx == "mla")
    total, active = counts.param_counts(m)
    lines += ["## derived",
              f"layers: {m.num_layers} = {m.num_layers - n_mla} KDA + {n_mla} MLA; "
              f"dense FFN layers: {m.first_k_dense}; MoE layers: {m.num_layers - m.first_k_dense}",
              f"MLA layers (0-based): {sorted(m.mla_layer_set)}",
              f"AttnRes block starts: {m.attn_res_block_starts or 'off'}",
              f"parameters: total {counts.human(total)} ({total:,}), active per token {counts.human(active)} ({active:,})",
              f"training FLOPs per token at T={cfg.train.max_target_length}: "
              f"{counts.human(counts.train_flops_per_token(m, cfg.train.max_target_length, cfg.kernel.kda_chunk_size))}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m k3jax.config configs/base.yml key=value ...``: print the resolved config."""
    argv = sys.argv[1:] if argv is None else argv
    if wants_help(argv):
        print(usage("config", main.__doc__))
        return 0
    return guard(lambda: print(describe(load_from_argv(argv))))


def load_from_argv(argv: list[str]) -> Config:
    """``configs/base.yml key=value ...`` (the base path may be omitted)."""
    if argv and "=" not in argv[0]:
        return load(argv[0], argv[1:])
    return load(REPO_CONFIGS / "base.yml", argv)


if __name__ == "__main__":
    raise SystemExit(main())
