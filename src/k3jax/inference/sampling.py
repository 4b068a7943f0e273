"""Next-token choice from logits, per row: greedy, temperature, top-k, top-p, and log-probabilities.

Every parameter is an array over the rows, so one compiled program serves a batch whose rows want
different sampling (the server's slots, ``generate``'s rows, RL's samples).
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


BAN_ID_BITS = 20            # a ban packs (times still allowed << BAN_ID_BITS) | token id; vocabularies < 2^20


def pack_ban(token: int, allowed: int) -> int:
    """One row's ban as an int32: ``token`` may be sampled ``allowed`` more times, then never; -1 (no
    ban) when either is negative. The server bans the tool-call section's opening token for
    ``tool_choice="none"``."""
    if token < 0 or allowed < 0:
        return -1
    if token >= 1 << BAN_ID_BITS or allowed >= 1 << (31 - BAN_ID_BITS):
        raise ValueError(f"ban of token {token} after {allowed}: out of range")
    return allowed << BAN_ID_BITS | token


def ban_left(ban, tokens):
    """The bans [B] after the rows sampled ``tokens`` [B]: sampling the banned token uses one of the
    times still allowed."""
    token, allowed = ban & ((1 << BAN_ID_BITS) - 1), ban >> BAN_ID_BITS
    return jnp.where((ban >= 0) & (allowed > 0) & (tokens == token), ban - (1 << BAN_ID_BITS), ban)


def sample_rows(logits, keys, temperature, top_k, top_p, ban=None):
    """logits [B,V] f32; keys [B] (typed PRNG keys); temperature [B] f32 (<= 0 = greedy);
    top_k [B] int32 (0 = off); top_p [B] f32 (1 = off) -> token ids [B] int32.

    ``ban`` [B] int32 (``pack_ban``; None or -1 = none): a row whose ban allows its token no more
    times cannot sample it, greedy or not.

    A sampled row keeps the top_k most likely tokens, then the smallest head of them whose
    probability reaches top_p (the most likely token always stays), and draws from the remaining
    softmax(logits / temperature). Tokens tied with the cut-off value stay. The full-vocabulary
    sort runs only when some row samples (a ``lax.cond``), so an all-greedy batch pays an argmax.
    """
    return sample_rows_lp(logits, keys, temperature, top_k, top_p, ban)[0]


def sample_rows_lp(logits, keys, temperature, top_k, top_p, ban=None):
    """``sample_rows`` -> (token ids [B] int32, behaviour log-probabilities [B] f32): each token's
    log-probability under the distribution it was actually drawn from, softmax(logits /
    temperature) over the tokens top-k, top-p and the ban left, renormalised (what an RL trainer
    needs as pi_rollout). A greedy row draws from a point mass: 0."""
    if ban is not None:
        rows, token = jnp.arange(logits.shape[0]), jnp.where(ban >= 0, ban & ((1 << BAN_ID_BITS) - 1), 0)
        banned = (ban >= 0) & (ban >> BAN_ID_BITS == 0)
        logits = logits.at[rows, token].set(jnp.where(banned, -jnp.inf, logits[rows, token]))
    first = argmax_rows(logits)
    hot = temperature > 0

    def draw():
        v = logits.shape[-1]
        x = logits / jnp.where(hot, temperature, 1.0)[:, None]
        srt = -jnp.sort(-x, axis=-1)                                            # descending
        k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)
        in_k = jnp.arange(v)[None, :] < k[:, None]
        srt = jnp.where(in_k, srt, -jnp.inf)                                   # top-k
        probs = jax.nn.softmax(srt, axis=-1)
        # always keeps the top token; ``in_k`` too, since past the k-th the sum before a token can
        # round to just under 1 (then the cut-off would be -inf and top-k would keep everything)
        keep = (jnp.cumsum(probs, -1) - probs < top_p[:, None]) & in_k
        cutoff = jnp.min(jnp.where(keep, srt, jnp.inf), -1, keepdims=True)
        x = jnp.where(x < cutoff, -jnp.inf, x)
        tok = jax.vmap(jax.random.categorical)(keys, x).astype(jnp.int32)
        lp = jnp.take_along_axis(jax.nn.log_softmax(x, axis=-1), tok[:, None], axis=-1)[:, 0]
        return tok, lp

    drawn, lp = jax.lax.cond(jnp.any(hot), draw, lambda: (first, jnp.zeros(first.shape, jnp.float32)))
    return jnp.where(hot, drawn, first), jnp.where(hot, lp, 0.0)


def logprobs(logits, tokens, k: int):
    """Log-probabilities under the model's distribution (softmax of the raw logits, before any
    temperature or truncation, as OpenAI-compatible servers report them): logits [B,V] f32, the
    chosen tokens [B] -> (chosen [B] f32, top ids [B,k] int32, top log-probabilities [B,k] f32)."""
    lp = jax.nn.log_softmax(logits, axis=-1)
    chosen = jnp.take_along_axis(lp, tokens[:, None], axis=-1)[:, 0]
    if k == 0:       # no alternatives asked for: skip the top-k over the vocabulary
        return chosen, jnp.zeros((*tokens.shape, 0), jnp.int32), jnp.zeros((*tokens.shape, 0), lp.dtype)
    top_lp, top_ids = jax.lax.top_k(lp, k)
    return chosen, top_ids.astype(jnp.int32), top_lp
