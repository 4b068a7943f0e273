"""The one-shot prompt forward of a left-padded batch into a decode cache.

Not the serving path (the programs prefill each slot in chunks: ``inference.programs``): this is
the prompt forward the AOT planner compiles for long prompts under the training mesh (the
sequence split over the context axis, ``compile_step=prefill``), and the independent path the
tests check the programs' chunked prefill and slot cache against (with ``model.decode_step``
after it).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def left_pad(prompts: list[list[int]], pad_id: int = 0, multiple: int = 1, min_len: int = 1):
    """-> tokens [B,P] int32, segment_ids [B,P] (0 on padding, 1 on the prompt), start [B]; P is the
    longest prompt (at least ``min_len``) rounded up to ``multiple`` (a context axis splits P into
    equal slices)."""
    p = -(-max(min_len, *(len(x) for x in prompts)) // multiple) * multiple
    toks = np.full((len(prompts), p), pad_id, np.int32)
    seg = np.zeros((len(prompts), p), np.int32)
    for i, ids in enumerate(prompts):
        toks[i, p - len(ids):] = ids
        seg[i, p - len(ids):] = 1
    return toks, seg, np.array([p - len(x) for x in prompts], np.int32)


def prefill(model, tokens, segment_ids, start, total_len: int, media=None):
    """Prompt forward of a left-padded batch -> (last-position logits [B,V] f32, decode cache with
    room for total_len): the full forward with ``return_cache``, each cache leaf zero-padded to the
    shape ``model.cache_spec(B, total_len)`` gives it (KDA leaves have no length). With
    ``model.decode_step`` after it, the independent path the inference core's chunked prefill and
    slot cache are checked against. ``media``: ``MediaInputs.arrays()`` of the prompts' images."""
    positions = jnp.maximum(jnp.arange(tokens.shape[1])[None, :] - start[:, None], 0)
    h, _, caches = model.hidden(tokens, segment_ids, positions, return_cache=True, media=media)
    logits = jnp.einsum("bd,dv->bv", h[:, -1], model.head_weight().astype(h.dtype),
                        preferred_element_type=jnp.float32)
    spec = model.cache_spec(tokens.shape[0], total_len)
    pad = lambda x, s: jnp.pad(x.astype(s[1]), [(0, want - have) for have, want in zip(x.shape, s[0])])  # noqa: E731
    return logits, jax.tree.map(pad, caches, spec)
