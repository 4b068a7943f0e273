"""Media in the text model, the device half (docs/vision.md §5): the projected features spliced
into the token embeddings, and no loss on targets that are media slots.

The host half (``k3jax.data.media``) packs a batch's media and gives the ``slots``: flat positions
[M] in the token batch [B, T] (row * T + column), or, grouped per row, positions within each row
[B, M]; a padding token's slot is ``DROP`` (``k3jax.data.media_layout``), past any batch, so every
scatter here drops it (``mode="drop"``).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from k3jax.data.media_layout import DROP


def splice(x, features, slots):
    """x [B, T, D] token embeddings, features [M, D], slots [M] flat positions -> x with row
    ``slots[j]`` replaced by ``features[j]``; slots out of range (padding) are dropped.

    Media grouped per row (features [B, M, D], slots [B, M] positions within the row): each row
    scatters its own features, a scatter batched over the rows that stays split over the batch
    axes; a flat scatter into [B*T, D] cannot be partitioned by rows and would gather the whole
    batch's embeddings on each device."""
    b, t, d = x.shape
    if slots.ndim == 2:
        return jax.vmap(lambda xr, fr, sr: xr.at[sr].set(fr.astype(x.dtype), mode="drop", unique_indices=True))(
            x, features, slots)
    flat = x.reshape(b * t, d).at[slots].set(features.astype(x.dtype), mode="drop",
                                             unique_indices=True)
    return flat.reshape(b, t, d)


def slot_loss_mask(loss_mask, slots):
    """loss_mask [B, T] with 0 at every position whose target (the next token) is a media slot:
    position slot - 1 unless the slot starts a row (padding slots are dropped). ``slots`` flat
    positions [M] or, grouped, positions within each row [B, M]."""
    b, t = loss_mask.shape
    if slots.ndim == 2:
        prev = jnp.where(slots == 0, DROP, slots - 1)
        return jax.vmap(lambda mr, pr: mr.at[pr].set(0, mode="drop"))(loss_mask, prev)
    prev = jnp.where(slots % t == 0, DROP, slots - 1)
    return loss_mask.reshape(-1).at[prev].set(0, mode="drop").reshape(b, t)
