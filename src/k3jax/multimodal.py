"""Media in the text model (docs/vision.md §5, docs/architecture.md "Media"): host-side inputs
for the tower and where its features go, and the in-graph splice.

Convention (a) of vision.md §5: every media item's ``<|media_pad|>`` run is already in the
token ids (the chat template writes the processor's prompt, ``chat_template.chat_ids(media=)``),
and the j-th pad of the batch (row-major over rows, then positions) takes feature row j.

``MediaInputs`` (numpy, built by ``media_inputs``) holds everything the device needs, at shapes
fixed by the patch bucket alone:

- ``patches`` [N, 3*p*p] and the ``k3jax.vision.layout`` arrays of the packed media (N = the
  patch bucket, padding rows in their own segment);
- ``slots`` [M] int32: the flat position (row * T + column) of each merged token's pad in the
  token batch [B, T], M = N // k^2 (the most tokens N patches can make); the padding tokens' slot
  is ``DROP``, past any batch, so the scatter drops them (``mode="drop"``).

So every image set whose packed patches fit the same bucket runs one compiled program. The model
(``K3Model.embed_media``) runs the tower once on the packed media and scatters the projected rows
into the token embeddings; the train step also zeroes the loss at the positions whose target is a
pad (``media_loss_mask`` masks the whole media markup on the host).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.data.vision_processor import (MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_END, MEDIA_PAD, MediaItem,
                                         VisionInputError, load_image, patch_bucket)
from k3jax.vision.layout import ARRAY_KEYS, media_layout

DROP = 2 ** 30          # the slot of a padding token: out of range of any [B, T] batch
MEDIA_TOKENS = (MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_PAD, MEDIA_END)


@dataclasses.dataclass(frozen=True)
class MediaInputs:
    """The device inputs of a batch's media (module docstring)."""
    patches: np.ndarray                  # float32 [N, 3*p*p]
    layout: dict                         # ARRAY_KEYS -> numpy arrays (k3jax.vision.layout)
    slots: np.ndarray                    # int32 [M]

    def arrays(self) -> dict:
        """The pytree the model takes (``K3Model.hidden(media=)``), as jax arrays."""
        return {"patches": jnp.asarray(self.patches), "slots": jnp.asarray(self.slots),
                **{k: jnp.asarray(self.layout[k]) for k in ARRAY_KEYS}}

    def key(self) -> tuple:
        """The shapes a compiled program depends on (the patch and token buckets)."""
        return (self.patches.shape, self.slots.shape, self.layout["merge_index"].shape)


def media_inputs(vcfg, pcfg, items: list[MediaItem], tokens: np.ndarray, pad_id: int,
                 bucket: int | None = None) -> MediaInputs:
    """Pack ``items`` (in order of appearance) for a token batch [B, T] holding their pad runs.

    The number of ``pad_id`` tokens must equal the items' token count (a mismatch is a
    VisionInputError naming both). ``bucket``: the patch bucket (default
    ``vision_processor.patch_bucket`` of the total); the token bucket is bucket // k^2."""
    tokens = np.asarray(tokens)
    where = np.flatnonzero(tokens.reshape(-1) == pad_id)
    want = sum(it.tokens for it in items)
    if len(where) != want:
        raise VisionInputError(f"the prompt holds {len(where)} {MEDIA_PAD} tokens but its {len(items)} "
                               f"images make {want}; render it with the images' prompts (chat_ids(media=))")
    n = sum(len(it.patches) for it in items)
    bucket = patch_bucket(n, pcfg) if bucket is None else bucket
    k2 = vcfg.vision_merge_kernel_size ** 2
    grid = [it.grid_thw for it in items]
    frames = max((g[0] for g in grid), default=1)
    lay = media_layout(vcfg, np.asarray(grid, np.int64).reshape(-1, 3), bucket, bucket // k2,
                       max_frames=1 if frames == 1 else None)
    patches = np.zeros((bucket, pcfg.patch_dim), np.float32)
    if items:
        patches[:n] = np.concatenate([it.patches for it in items])
    slots = np.full(bucket // k2, DROP, np.int32)
    slots[:want] = where
    return MediaInputs(patches, {k: lay[k] for k in ARRAY_KEYS}, slots)


def splice(x, features, slots):
    """x [B, T, D] token embeddings, features [M, D], slots [M] flat positions -> x with row
    ``slots[j]`` replaced by ``features[j]``; slots out of range (padding) are dropped.

    Media grouped per row (features [B, M, D], slots [B, M] holding row b's positions only, as
    the pod compile feeds them): each row scatters its own features, a scatter batched over the
    rows that stays split over the batch axes; a flat scatter into [B*T, D] from [B, M] indices
    cannot be partitioned by rows and would gather the whole batch's embeddings on each device."""
    b, t, d = x.shape
    if slots.ndim == 2 and slots.shape[0] == b:
        local = slots - t * jnp.arange(b)[:, None]
        local = jnp.where((local >= 0) & (local < t), local, DROP)   # padding, or another row's slot
        return jax.vmap(lambda xr, fr, sr: xr.at[sr].set(fr.astype(x.dtype), mode="drop", unique_indices=True))(
            x, features, local)
    flat = x.reshape(b * t, d).at[slots].set(features.astype(x.dtype), mode="drop",
                                             unique_indices=True)
    return flat.reshape(b, t, d)


def slot_loss_mask(loss_mask, slots):
    """loss_mask [B, T] with 0 at every position whose target (the next token) is a media slot,
    i.e. flat position slot - 1 unless the slot starts a row (padding slots are dropped)."""
    b, t = loss_mask.shape
    prev = jnp.where(slots % t == 0, DROP, slots - 1)
    return loss_mask.reshape(-1).at[prev].set(0, mode="drop").reshape(b, t)


def media_loss_mask(tokens: np.ndarray, loss_mask: np.ndarray, media_ids) -> np.ndarray:
    """Host side: ``loss_mask`` [B, T] (weight of target t = tokens[t + 1]) with 0 wherever the
    target lies in a media span, ``<|media_begin|>`` through ``<|media_end|>`` inclusive (the
    "image WxH" text and the pads included). ``media_ids``: (begin, content, pad, end) ids."""
    begin, _, _, end = media_ids
    tokens = np.asarray(tokens)
    inside = np.zeros(tokens.shape, bool)
    for r in range(tokens.shape[0]):
        open_at = None
        for i, tok in enumerate(tokens[r].tolist()):
            if tok == begin:
                open_at = i
            if open_at is not None:
                inside[r, i] = True
            if tok == end:
                open_at = None
    out = np.asarray(loss_mask).copy()
    out[:, :-1] *= ~inside[:, 1:]
    return out


def read_image(p: str):
    """A decoded PIL image from a local or gs:// path; a missing or unreadable file is a
    one-line VisionInputError naming it."""
    from k3jax import paths
    try:
        with paths.open_binary(p) as f:
            data = f.read()
    except FileNotFoundError:
        raise VisionInputError(f"{p}: image file not found") from None
    except (IsADirectoryError, PermissionError) as e:
        raise VisionInputError(f"{p}: cannot read the image file ({type(e).__name__})") from None
    return load_image(data, name=p)


def media_token_ids(tokenizer) -> tuple[int, int, int, int]:
    """(begin, content, pad, end) ids of a tokenizer; a tokenizer without them is a one-line error."""
    missing = [t for t in MEDIA_TOKENS if t not in tokenizer.special_ids]
    if missing:
        raise VisionInputError(f"the tokenizer lacks the media tokens {missing}; images need a Kimi "
                               f"K2.5 / K3 tokenizer")
    return tuple(tokenizer.token_id(t) for t in MEDIA_TOKENS)
