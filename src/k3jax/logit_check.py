"""Compare the model's logits with reference (golden) logits.

    python -m k3jax.logit_check configs/base.yml model_name=... load_parameters_path=CKPT golden=FILE.npz \
        [max_kl=0.01] [atol=1.0]

``golden`` is an .npz with ``tokens`` [B,T] int and ``logits`` [B,T,V] float (written by
``scripts/make_golden_logits.py`` from a Hugging Face checkpoint). One full forward of the loaded
model over ``tokens`` gives ours; the report has the max absolute logit error, the mean and max
per-token KL(golden || ours), top-1 agreement over tokens and over whole sequences. Exit status 1
when max KL > ``max_kl`` or max abs error > ``atol``, 2 on a usage error, 0 otherwise.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from k3jax import config as C, paths
from k3jax.cli import run_tool
from k3jax.runtime import sync_processes
from k3jax.sharding import make_mesh
from k3jax.state import restore_model


def log_softmax(x: np.ndarray) -> np.ndarray:
    """float64 log-softmax over the last axis of [..., V]."""
    x = x.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def compare(ours: np.ndarray, golden: np.ndarray) -> dict:
    """Metrics of ours vs golden logits, both [B,T,V]; computed in float64.

    kl[b,t] = sum_v p_gold * (log p_gold - log p_ours), the information lost by using ours in
    place of the reference distribution at that position.
    """
    if ours.shape != golden.shape:
        raise C.ConfigError(f"golden logits have shape {golden.shape} but the model gives {ours.shape}")
    lg, lo = log_softmax(golden), log_softmax(ours)
    kl = np.sum(np.exp(lg) * (lg - lo), axis=-1)  # [B,T]
    top1 = ours.argmax(-1) == golden.argmax(-1)  # [B,T]
    return {"max_abs_err": float(np.abs(ours.astype(np.float64) - golden).max()),
            "mean_kl": float(kl.mean()), "max_kl": float(kl.max()),
            "top1_token_agreement": float(top1.mean()), "top1_sequence_agreement": float(top1.all(-1).mean()),
            "tokens": int(kl.size)}


def load_golden(path: str | None, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens [B,T] int32, logits [B,T,V] float32) from the golden .npz, validated."""
    if not path:
        raise C.ConfigError("golden is not set; pass golden=FILE.npz (see scripts/make_golden_logits.py)")
    if not paths.path(path, "golden").is_file():
        raise C.ConfigError(f"golden={path}: no such file")
    with paths.open_binary(path) as f, np.load(f) as g:
        missing = {"tokens", "logits"} - set(g.files)
        if missing:
            raise C.ConfigError(f"golden={path}: missing arrays {sorted(missing)} (found {sorted(g.files)})")
        tokens, logits = np.asarray(g["tokens"]), np.asarray(g["logits"], np.float32)
    if tokens.ndim != 2 or logits.shape[:2] != tokens.shape or logits.ndim != 3:
        raise C.ConfigError(f"golden={path}: need tokens [B,T] and logits [B,T,V], got {tokens.shape} and "
                            f"{logits.shape}")
    if logits.shape[-1] != vocab_size:
        raise C.ConfigError(f"golden={path}: logits have vocabulary {logits.shape[-1]} but the model has "
                            f"vocab_size={vocab_size}; check model_name")
    if tokens.min() < 0 or tokens.max() >= vocab_size:
        raise C.ConfigError(f"golden={path}: token ids must lie in [0, {vocab_size})")
    return tokens.astype(np.int32), logits


def model_logits(cfg, tokens: np.ndarray) -> np.ndarray:
    """Logits [B,T,V] float32 of the model with load_parameters_path's weights."""
    if not cfg.checkpoint.load_parameters_path:
        raise C.ConfigError("load_parameters_path is not set; logit_check compares a checkpoint's logits")
    mesh = make_mesh(cfg)
    with jax.set_mesh(mesh):
        model = restore_model(cfg, mesh)
        if jax.process_count() == 1:
            logits = _forward()(model, jnp.asarray(tokens))
        else:   # compile first, then start together (runtime.sync_processes)
            gdef, state = nnx.split(model)
            fwd = jax.jit(lambda s, t: nnx.merge(gdef, s)(t)[0]).lower(state, jnp.asarray(tokens)).compile()
            sync_processes("compiled the logit_check forward")
            logits = fwd(state, jnp.asarray(tokens))
    if not logits.is_fully_addressable:   # several processes: every one gets the whole array
        logits = multihost_utils.process_allgather(logits, tiled=True)
    return np.asarray(logits, np.float32)


@functools.cache
def _forward():
    """One jitted forward per process, so repeated checks of one model shape compile once."""
    return nnx.jit(lambda m, t: m(t)[0])


def run(cfg) -> tuple[dict, bool]:
    """(metrics, passed) for a loaded config."""
    tokens, golden = load_golden(cfg.check.golden, cfg.model.vocab_size)
    metrics = compare(model_logits(cfg, tokens), golden)
    ok = metrics["max_kl"] <= cfg.check.max_kl and metrics["max_abs_err"] <= cfg.check.atol
    return metrics, ok


def _run(cfg) -> int:
    metrics, ok = run(cfg)
    c = cfg.check
    print(f"{'tokens':<28}{metrics['tokens']}")
    print(f"{'max |logit error|':<28}{metrics['max_abs_err']:.6g}   (atol {c.atol:g})")
    print(f"{'mean KL per token':<28}{metrics['mean_kl']:.6g}")
    print(f"{'max KL per token':<28}{metrics['max_kl']:.6g}   (max_kl {c.max_kl:g})")
    print(f"{'top-1 agreement, tokens':<28}{metrics['top1_token_agreement']:.4f}")
    print(f"{'top-1 agreement, sequences':<28}{metrics['top1_sequence_agreement']:.4f}")
    print("PASS" if ok else "FAIL: beyond thresholds")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    return run_tool("logit_check", _run, argv, __doc__, local_devices=True)


if __name__ == "__main__":
    raise SystemExit(main())
