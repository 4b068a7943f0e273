"""Shared set-up of the entry points: the process (multi-host, before any device is touched) and
the tokenizer."""
from __future__ import annotations

from pathlib import Path


def prepare(cfg) -> None:
    """Process set-up every tool runs first, before anything queries devices: joins the multi-host
    job (``enable_distributed``). Idempotent."""
    from k3jax.sharding import maybe_initialize_distributed
    maybe_initialize_distributed(cfg)


def tokenizer_dir(cfg) -> Path:
    """``tokenizer_path`` or a tiny Kimi-layout tokenizer sized to the model's vocabulary, built
    once under the run root (tests and CPU demos need no downloaded files)."""
    if cfg.data.tokenizer_path:
        return Path(cfg.data.tokenizer_path)
    from k3jax.data import tiny_tokenizer
    v = cfg.model.vocab_size
    d = Path(cfg.checkpoint.base_output_directory) / f"tiny-tokenizer-{v}"
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
