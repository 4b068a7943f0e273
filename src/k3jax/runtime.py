"""Shared set-up of the entry points: the process (multi-host, before any device is touched) and
the tokenizer.

Tokenizer policy: a tool reads ``tokenizer_path`` when it is given, else the tokenizer recorded
with the weights of ``load_parameters_path`` (a converter output holds it beside ``params``; a
training run records its own in ``<run>/tokenizer``); with neither it stops with one line, never
guessing one. Training records the tokenizer it used in ``<run>/tokenizer``; a run on synthetic
token ids without a ``tokenizer_path`` records the built-in tiny Kimi-layout tokenizer sized to the
vocabulary, so its checkpoints decode like any other.
"""
from __future__ import annotations

import shutil
from pathlib import Path

# The files of a Kimi tokenizer directory a run records (those present are copied).
TOKENIZER_FILES = ("tiktoken.model", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                   "generation_config.json")


def prepare(cfg) -> None:
    """Process set-up every tool runs first, before anything queries devices: joins the multi-host
    job (``enable_distributed``). Idempotent."""
    from k3jax.sharding import maybe_initialize_distributed
    maybe_initialize_distributed(cfg)


def recorded_tokenizer(path) -> Path | None:
    """The tokenizer recorded with the checkpoint at ``path`` (any form ``load_parameters_path``
    takes: a converter output, a run directory, its ``checkpoints`` directory, a step or a
    ``params`` directory), or None."""
    p = Path(path)
    if p.name == "params":
        p = p.parent
    candidates = [p, p / "tokenizer"]
    if p.name == "checkpoints":
        candidates.append(p.parent / "tokenizer")
    if p.parent.name == "checkpoints":
        candidates.append(p.parent.parent / "tokenizer")
    return next((c for c in candidates if (c / "tiktoken.model").is_file()), None)


def tokenizer_dir(cfg) -> Path:
    """``tokenizer_path``, else the tokenizer recorded with ``load_parameters_path``; TokenizerError
    naming both keys when there is neither."""
    from k3jax.data.tokenizer import TokenizerError
    if cfg.data.tokenizer_path:
        return Path(cfg.data.tokenizer_path)
    path = cfg.checkpoint.load_parameters_path
    if path and not Path(path).exists():
        from k3jax.checkpoint import CheckpointError
        raise CheckpointError(f"load_parameters_path={path}: no such directory")
    found = recorded_tokenizer(path) if path else None
    if found is not None:
        return found
    where = (f"; load_parameters_path={path} has none recorded (no tiktoken.model there or in its run's "
             f"tokenizer/ directory)" if path else "")
    raise TokenizerError(f"no tokenizer: set tokenizer_path to a directory with tiktoken.model and "
                         f"tokenizer_config.json{where}")


def load_tokenizer(cfg, directory: Path | None = None):
    from k3jax.data.tokenizer import KimiTokenizer
    d = tokenizer_dir(cfg) if directory is None else directory
    tok = KimiTokenizer.from_dir(d)
    if tok.vocab_size > cfg.model.vocab_size:
        from k3jax.config import ConfigError
        raise ConfigError(f"tokenizer at {d} has {tok.vocab_size} ids but the model's vocab_size is "
                          f"{cfg.model.vocab_size}")
    return tok


def record_tokenizer(cfg, run_dir: Path):
    """The training run's tokenizer, copied into (or, for synthetic data without one, built in)
    ``<run_dir>/tokenizer`` and loaded from there."""
    from k3jax.data.tokenizer import TokenizerError
    dst = Path(run_dir) / "tokenizer"
    try:
        src = tokenizer_dir(cfg)
    except TokenizerError:
        if cfg.data.dataset_type != "synthetic":
            raise
        src = None
    if src is None:
        if not (dst / "tiktoken.model").is_file():
            from k3jax.data import tiny_tokenizer
            v = cfg.model.vocab_size
            tiny_tokenizer.build(dst, vocab_size=v, num_reserved=256 if v >= 4096 else tiny_tokenizer.MIN_RESERVED)
    else:
        tok = load_tokenizer(cfg, src)   # checked before anything is copied
        if src.resolve() != dst.resolve():
            dst.mkdir(parents=True, exist_ok=True)
            for name in TOKENIZER_FILES:
                if (src / name).is_file():
                    shutil.copyfile(src / name, dst / name)
        return tok
    return load_tokenizer(cfg, dst)
