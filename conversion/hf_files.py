"""The files of a Hugging Face checkpoint that are not weights but travel with them.

A model directory is usable only with its tokenizer (``tiktoken.model`` + ``tokenizer_config.json``
for Kimi; ``tokenizer.json`` for others), its chat template (inside tokenizer_config.json or in
``chat_template.jinja``) and its generation settings (``generation_config.json``: stop ids,
sampling defaults). ``hf_to_k3jax`` copies them beside the converted parameters, so the converter
output is both ``load_parameters_path`` and ``tokenizer_path``; ``k3jax_to_hf`` copies them into the
export, so ``transformers`` loads the fine-tuned model as it loaded the original and
``apply_chat_template`` renders the same ids.

A multimodal checkpoint adds its processor settings (``preprocessor_config.json``: the patch
limits, resize and normalisation vLLM's and transformers' processors read; ``processor_config.json``,
``video_preprocessor_config.json``).

Remote-code modules (``tokenization_kimi.py``, a K2.5 / K3 image processor) are copied as files
when a copied JSON names them in ``auto_map`` (``"AutoProcessor": "kimi_k25_processor.KimiK25Processor"``
names ``kimi_k25_processor.py``), so the copy loads where the original did; nothing here imports or
runs them.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import yaml

SIDE_FILES = ("tiktoken.model", "tokenizer_config.json", "tokenizer.json", "tokenizer.model",
              "special_tokens_map.json", "added_tokens.json", "chat_template.jinja", "chat_template.json",
              "generation_config.json", "preprocessor_config.json", "processor_config.json",
              "video_preprocessor_config.json")
CODE_PATTERN = "tokenization_*.py"


def auto_map_modules(json_file: Path) -> set[str]:
    """The module files a JSON's ``auto_map`` names (``"a.B"`` or ``["a.B", null]`` or
    ``"repo--a.B"`` -> ``a.py``); empty for a file without one or that does not parse."""
    try:
        auto = json.loads(json_file.read_text()).get("auto_map") or {}
    except (OSError, ValueError, AttributeError):
        return set()
    refs = [r for v in auto.values() for r in (v if isinstance(v, list) else [v]) if isinstance(r, str)]
    mods = {r.split("--")[-1].rsplit(".", 1)[0] for r in refs if "." in r}
    return {m + ".py" for m in mods if m.isidentifier()}     # a plain module name, never a path


def side_files(directory) -> list[Path]:
    """The tokenizer / chat template / generation / processor files present in ``directory``, with
    the remote-code modules they name, sorted."""
    d = Path(directory)
    found = [d / n for n in SIDE_FILES if (d / n).is_file()]
    code = set(d.glob(CODE_PATTERN))
    for f in found:
        if f.suffix == ".json":
            code |= {d / m for m in auto_map_modules(f) if (d / m).is_file()}
    return sorted(found + sorted(code))


def has_tokenizer(directory) -> bool:
    d = Path(directory)
    return (d / "tiktoken.model").is_file() or (d / "tokenizer.json").is_file()


def copy_side_files(src, dst) -> list[str]:
    """Copy ``src``'s side files into ``dst`` (byte for byte); returns their names."""
    Path(dst).mkdir(parents=True, exist_ok=True)
    names = []
    for f in side_files(src):
        shutil.copyfile(f, Path(dst) / f.name)
        names.append(f.name)
    return names


def find_source(params_dir: Path) -> Path | None:
    """Where the side files of a checkpoint live: beside a converter output's ``params``; for a
    training checkpoint ``<run>/checkpoints/<step>/params``, the run's recorded tokenizer
    (``<run>/tokenizer``) or the ``tokenizer_path`` / ``load_parameters_path`` of ``<run>/config.yml``
    (a fine-tuning run started from a converter output). None when no candidate has a tokenizer."""
    candidates = [params_dir.parent]
    run = params_dir.parent.parent.parent if params_dir.parent.parent.name == "checkpoints" else None
    if run is not None:
        candidates.append(run / "tokenizer")
        cfg_file = run / "config.yml"
        if cfg_file.is_file():
            cfg = yaml.safe_load(cfg_file.read_text()) or {}
            for key in ("tokenizer_path", "load_parameters_path"):
                if cfg.get(key):
                    # a relative path was relative to where training ran: here, or the run root's parent
                    p = Path(cfg[key])
                    candidates += [p] if p.is_absolute() else [Path.cwd() / p, run.parent.parent / p]
    return next((c for c in candidates if c.is_dir() and has_tokenizer(c)), None)
