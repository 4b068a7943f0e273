"""Next-token choice from logits, per row: greedy, temperature, top-k, top-p, and log-probabilities.

Every parameter is an array over the rows, so one compiled program serves a batch whose rows want
different sampling (the server's slots) as well as a batch that shares one setting (``generate``).
Each row draws from its own key: a row's samples depend only on its key and its logits, never on
which other rows share the step.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def argmax_rows(logits):
    """logits [B,V] -> the index of each row's largest logit [B] int32: ``jnp.argmax``'s answer
    (the first index on ties, the first NaN if a row has one), taken as a max and a min.

    Why not ``jnp.argmax``: XLA:CPU lowers it to a (value, index) pair reduction that runs scalar,
    1.2 ms for [32, 8192] f32 on one core (a decode step's lm head logits), where a max, a compare
    and a min over the iota are vectorised loops: 0.2 ms (docs/benchmarks.md)."""
    v = logits.shape[-1]
    top = jnp.max(logits, -1, keepdims=True)
    hit = (logits == top) | jnp.isnan(logits)   # a NaN row: max is NaN, argmax its first NaN
    return jnp.min(jnp.where(hit, jnp.arange(v, dtype=jnp.int32), v), -1).astype(jnp.int32)


def sample_rows(logits, keys, temperature, top_k, top_p):
    """logits [B,V] f32; keys [B] (typed PRNG keys); temperature [B] f32 (<= 0 = greedy);
    top_k [B] int32 (0 = off); top_p [B] f32 (1 = off) -> token ids [B] int32.

    A sampled row keeps the top_k most likely tokens, then the smallest head of them whose
    probability reaches top_p (the most likely token always stays), and draws from the remaining
    softmax(logits / temperature). Tokens tied with the cut-off value stay. The full-vocabulary
    sort runs only when some row samples (a ``lax.cond``), so an all-greedy batch pays an argmax.
    """
    first = argmax_rows(logits)
    hot = temperature > 0

    def draw():
        v = logits.shape[-1]
        x = logits / jnp.where(hot, temperature, 1.0)[:, None]
        srt = -jnp.sort(-x, axis=-1)                                            # descending
        k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)
        srt = jnp.where(jnp.arange(v)[None, :] < k[:, None], srt, -jnp.inf)    # top-k
        probs = jax.nn.softmax(srt, axis=-1)
        keep = jnp.cumsum(probs, -1) - probs < top_p[:, None]                  # always keeps the top token
        cutoff = jnp.min(jnp.where(keep, srt, jnp.inf), -1, keepdims=True)
        x = jnp.where(x < cutoff, -jnp.inf, x)
        return jax.vmap(jax.random.categorical)(keys, x).astype(jnp.int32)

    drawn = jax.lax.cond(jnp.any(hot), draw, lambda: first)
    return jnp.where(hot, drawn, first)


def sample(logits, key, *, greedy: bool, temperature: float, top_k: int, top_p: float):
    """logits [B,V] f32 and one key for the batch, one setting for every row -> token ids [B]."""
    if greedy:
        return argmax_rows(logits)
    b = logits.shape[0]
    full = lambda v, dt: jnp.full((b,), v, dt)  # noqa: E731
    return sample_rows(logits, jax.random.split(key, b), full(max(temperature, 1e-6), jnp.float32),
                       full(top_k, jnp.int32), full(top_p, jnp.float32))


def logprobs(logits, tokens, k: int):
    """Log-probabilities under the model's distribution (softmax of the raw logits, before any
    temperature or truncation, as OpenAI-compatible servers report them): logits [B,V] f32, the
    chosen tokens [B] -> (chosen [B] f32, top ids [B,k] int32, top log-probabilities [B,k] f32)."""
    lp = jax.nn.log_softmax(logits, axis=-1)
    chosen = jnp.take_along_axis(lp, tokens[:, None], axis=-1)[:, 0]
    top_lp, top_ids = jax.lax.top_k(lp, k)
    return chosen, top_ids.astype(jnp.int32), top_lp
