"""Shared set-up of the entry points: the process (multi-host, before any device is touched) and
the tokenizer."""
from __future__ import annotations

import os
import sys
from pathlib import Path


def prepare(cfg) -> None:
    """Process set-up every tool runs first, before anything queries devices: the persistent
    compilation cache (``jax_cache_dir``), then the multi-process job (``enable_distributed``).
    In a job of several processes only process 0 prints (its stdout is the job's log; the others'
    stdout goes to /dev/null, their stderr, where errors go, stays). Idempotent."""
    import jax

    from k3jax.sharding import maybe_initialize_distributed
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
    import jax
    if jax.process_count() == 1:
        return
    from orbax.checkpoint import multihost
    multihost.get_barrier_sync_fn()(key=f"k3jax: {name}", timeout_ms=timeout_s * 1000)


def tokenizer_dir(cfg) -> Path:
    """``tokenizer_path`` or a tiny Kimi-layout tokenizer sized to the model's vocabulary, built
    once under the run root (tests and CPU demos need no downloaded files)."""
    from k3jax import paths
    if cfg.data.tokenizer_path:
        return paths.local_dir(cfg.data.tokenizer_path, "tokenizer_path")
    from k3jax.data import tiny_tokenizer
    v = cfg.model.vocab_size
    root = cfg.checkpoint.base_output_directory
    if paths.is_remote(root):   # built locally: it is a deterministic function of the vocabulary size
        root = os.environ.get("K3JAX_CACHE", Path.home() / ".cache" / "k3jax")
    d = Path(root) / f"tiny-tokenizer-{v}"
    if not (d / "tiktoken.model").exists():
        reserved = 256 if v >= 4096 else tiny_tokenizer.MIN_RESERVED
        tiny_tokenizer.build(d, vocab_size=v, num_reserved=reserved)
    return d


def load_tokenizer(cfg):
    from k3jax.data.tokenizer import KimiTokenizer
    tok = KimiTokenizer.from_dir(tokenizer_dir(cfg))
    if tok.vocab_size > cfg.model.vocab_size:
        from k3jax.config import ConfigError
        raise ConfigError(f"tokenizer at {tokenizer_dir(cfg)} has {tok.vocab_size} ids but the model's "
                          f"vocab_size is {cfg.model.vocab_size}")
    return tok
