"""Shared set-up of the entry points: the process (multi-host, before any device is touched) and
the tokenizer. (Which platforms jax starts on is chosen earlier, when k3jax is imported:
``k3jax.jax_platforms``.)

Tokenizer policy: a tool reads ``tokenizer_path`` when it is given, else the tokenizer recorded
with the weights of ``load_parameters_path`` (a converter output holds it beside ``params``; a
training run records its own in ``<run>/tokenizer``); with neither it stops with one line, never
guessing one. Training records the tokenizer it used in ``<run>/tokenizer``; a run on synthetic
token ids without a ``tokenizer_path`` records the built-in tiny Kimi-layout tokenizer sized to the
vocabulary, so its checkpoints decode like any other.
"""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import jax
from orbax.checkpoint import multihost

from k3jax import paths
from k3jax.checkpoint import CheckpointError
from k3jax.data import tiny_tokenizer
from k3jax.data.tokenizer import KimiTokenizer, TokenizerError
from k3jax.schema import ConfigError
from k3jax.sharding import maybe_initialize_distributed

# The files of a Kimi tokenizer directory a run records (those present are copied).
TOKENIZER_FILES = ("tiktoken.model", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                   "generation_config.json")


def prepare(cfg) -> None:
    """Process set-up every tool runs first, before anything queries devices: the persistent
    compilation cache (``jax_cache_dir``), then the multi-process job (``enable_distributed``).
    In a job of several processes only process 0 prints (its stdout is the job's log; the others'
    stdout goes to /dev/null, their stderr, where errors go, stays). Idempotent."""
    if cfg.mesh.jax_cache_dir:
        jax.config.update("jax_compilation_cache_dir", cfg.mesh.jax_cache_dir)
    maybe_initialize_distributed(cfg)
    if cfg.mesh.enable_distributed and jax.process_index() != 0 and sys.stdout is sys.__stdout__:
        sys.stdout = open(os.devnull, "w")


def sync_processes(name: str, timeout_s: int = 3600) -> None:
    """Wait until every process of the job got here (a barrier of the coordination service, not a
    device collective; nothing in one process). Called after compiling: hosts finish compiling at
    different times (a compilation-cache hit on one, a compile on another), and the CPU collectives
    (gloo) give a peer only 30 s to join a collective's first use."""
    if jax.process_count() == 1:
        return
    multihost.get_barrier_sync_fn()(key=f"k3jax: {name}", timeout_ms=timeout_s * 1000)


def recorded_tokenizer(path) -> Path | None:
    """The tokenizer recorded with the checkpoint at ``path`` (any form ``load_parameters_path``
    takes: a converter output, a run directory, its ``checkpoints`` directory, a step or a
    ``params`` directory; local or gs://), as a local directory, or None."""
    p = paths.path(path, "load_parameters_path")
    if p.name == "params":
        p = p.parent
    candidates = [p, p / "tokenizer"]
    if p.name == "checkpoints":
        candidates.append(p.parent / "tokenizer")
    if p.parent.name == "checkpoints":
        candidates.append(p.parent.parent / "tokenizer")
    found = next((c for c in candidates if (c / "tiktoken.model").is_file()), None)
    return None if found is None else paths.local_dir(str(found), "load_parameters_path")


def tokenizer_dir(cfg) -> Path:
    """``tokenizer_path`` (a gs:// one is copied to a local cache), else the tokenizer recorded
    with ``load_parameters_path``; TokenizerError naming both keys when there is neither."""
    if cfg.data.tokenizer_path:
        return paths.local_dir(cfg.data.tokenizer_path, "tokenizer_path")
    path = cfg.checkpoint.load_parameters_path
    if path and not paths.path(path, "load_parameters_path").exists():
        raise CheckpointError(f"load_parameters_path={path}: no such directory")
    found = recorded_tokenizer(path) if path else None
    if found is not None:
        return found
    where = (f"; load_parameters_path={path} has none recorded (no tiktoken.model there or in its run's "
             f"tokenizer/ directory)" if path else "")
    raise TokenizerError(f"no tokenizer: set tokenizer_path to a directory with tiktoken.model and "
                         f"tokenizer_config.json{where}")


def load_tokenizer(cfg, directory: Path | None = None):
    d = tokenizer_dir(cfg) if directory is None else directory
    tok = KimiTokenizer.from_dir(d)
    if tok.vocab_size > cfg.model.vocab_size:
        raise ConfigError(f"tokenizer at {d} has {tok.vocab_size} ids but the model's vocab_size is "
                          f"{cfg.model.vocab_size}")
    return tok


def record_tokenizer(cfg, run_dir, *, write: bool = True):
    """The training run's tokenizer, loaded and recorded in ``<run_dir>/tokenizer`` (local or
    gs://): ``tokenizer_path``'s files copied, or, for synthetic data without one, the built-in tiny
    tokenizer sized to the vocabulary. Only a ``write``-ing process (process 0 of a job) records;
    the others build the tiny one in a private temporary directory (it is deterministic)."""
    dst = run_dir / "tokenizer"
    try:
        src = tokenizer_dir(cfg)
    except TokenizerError:
        if cfg.data.dataset_type != "synthetic":
            raise
        src = Path(dst) if write and not paths.is_remote(dst) else Path(tempfile.mkdtemp(prefix="k3jax-tokenizer-"))
        if not (src / "tiktoken.model").is_file():
            v = cfg.model.vocab_size
            tiny_tokenizer.build(src, vocab_size=v, num_reserved=256 if v >= 4096 else tiny_tokenizer.MIN_RESERVED)
    tok = load_tokenizer(cfg, src)   # checked before anything is copied
    if write and (paths.is_remote(dst) or src.resolve() != Path(dst).resolve()):
        dst.mkdir(parents=True, exist_ok=True)
        for name in TOKENIZER_FILES:
            if (src / name).is_file():
                (dst / name).write_bytes((src / name).read_bytes())
    return tok
