"""Media in the text model, the host half (docs/vision.md §5, docs/architecture.md "Media"): the
tower's inputs and where its features go, built with numpy from image files and token ids. The
device half, the in-graph splice and the slot loss mask, is ``k3jax.vision.splice``.

Convention (a) of vision.md §5: every media item's ``<|media_pad|>`` run is already in the
token ids (the chat template writes the processor's prompt, ``chat_template.chat_ids(media=)``),
and the j-th pad of the batch (row-major over rows, then positions) takes feature row j.

``MediaInputs`` (numpy, built by ``media_inputs``) holds everything the device needs, at shapes
fixed by the patch bucket alone:

- ``patches`` [N, 3*p*p] and the ``k3jax.data.media_layout`` arrays of the packed media (N = the
  patch bucket, padding rows in their own segment);
- ``slots`` [M] int32: the flat position (row * T + column) of each merged token's pad in the
  token batch [B, T], M = N // k^2 (the most tokens N patches can make); the padding tokens' slot
  is ``DROP`` (``k3jax.data.media_layout``), past any batch, so the scatter drops them (``mode="drop"``).

So every image set whose packed patches fit the same bucket runs one compiled program. The model
(``K3Model.embed_media``) runs the tower once on the packed media and scatters the projected rows
into the token embeddings; the train step also zeroes the loss at the positions whose target is a
pad (``media_loss_mask`` masks the whole media markup on the host).

Grouped per row (``grouped_media_inputs``, what training feeds: one packed sequence per batch row,
every array led by the rows and split over the batch axes like the tokens, so each device encodes
its own rows' media): the patch bucket is one row's, and ``slots`` [B, M] are positions *within*
the row (a column; ``DROP`` for padding), so a process builds its rows without knowing where they
sit in the global batch. Padding rows and tokens are zeros in every layout array, so a grouped
batch grows to a larger bucket by zero padding alone (``pad_grouped``: processes agree on one).
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from k3jax import paths
from k3jax.data.vision_processor import (MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_END, MEDIA_PAD, MediaItem,
                                         VisionInputError, load_image, patch_bucket)
from k3jax.data.media_layout import ARRAY_KEYS, DROP, media_layout

MEDIA_TOKENS = (MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_PAD, MEDIA_END)


@dataclasses.dataclass(frozen=True)
class MediaInputs:
    """The device inputs of a batch's media (module docstring)."""
    patches: np.ndarray                  # float32 [N, 3*p*p]
    layout: dict                         # ARRAY_KEYS -> numpy arrays (k3jax.data.media_layout)
    slots: np.ndarray                    # int32 [M]

    def arrays(self) -> dict:
        """The pytree the model takes (``K3Model.hidden(media=)``), as jax arrays."""
        return {"patches": jnp.asarray(self.patches), "slots": jnp.asarray(self.slots),
                **{k: jnp.asarray(self.layout[k]) for k in ARRAY_KEYS}}

    def key(self) -> tuple:
        """The shapes a compiled program depends on (the patch and token buckets)."""
        return (self.patches.shape, self.slots.shape, self.layout["merge_index"].shape)


def media_inputs(vcfg, pcfg, items: list[MediaItem], tokens: np.ndarray, pad_id: int,
                 bucket: int | None = None, max_frames: int | None = None) -> MediaInputs:
    """Pack ``items`` (in order of appearance) for a token batch [B, T] holding their pad runs.

    The number of ``pad_id`` tokens must equal the items' token count (a mismatch is a
    VisionInputError naming both). ``bucket``: the patch bucket (default
    ``vision_processor.patch_bucket`` of the total); the token bucket is bucket // k^2.
    ``max_frames``: the merge gather's frame axis (default 1 for images only, else
    vision_pos_emb_time)."""
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
    if max_frames is None:
        max_frames = 1 if max((g[0] for g in grid), default=1) == 1 else vcfg.vision_pos_emb_time
    lay = media_layout(vcfg, np.asarray(grid, np.int64).reshape(-1, 3), bucket, bucket // k2,
                       max_frames=max_frames)
    patches = np.zeros((bucket, pcfg.patch_dim), np.float32)
    if items:
        patches[:n] = np.concatenate([it.patches for it in items])
    slots = np.full(bucket // k2, DROP, np.int32)
    slots[:want] = where
    return MediaInputs(patches, {k: lay[k] for k in ARRAY_KEYS}, slots)


def grouped_media_inputs(vcfg, pcfg, rows: list[list[MediaItem]], tokens: np.ndarray, pad_id: int) -> dict:
    """Media grouped per row (module docstring): ``rows[r]`` are row r's items in the order of their
    pads in ``tokens[r]``. -> numpy {"patches" [B, N, 3pp], "slots" [B, M], layout arrays [B, ...]}:
    N the patch bucket of the fullest row (``patch_bucket``), M = N // k^2, the merge gather's frame
    axis 1 unless some row holds a video."""
    tokens = np.asarray(tokens)
    n = patch_bucket(max((sum(len(it.patches) for it in items) for items in rows), default=0), pcfg)
    video = any(it.grid_thw[0] > 1 for items in rows for it in items)
    frames = vcfg.vision_pos_emb_time if video else 1
    out = [media_inputs(vcfg, pcfg, items, tokens[r:r + 1], pad_id, bucket=n, max_frames=frames)
           for r, items in enumerate(rows)]
    return {"patches": np.stack([m.patches for m in out]), "slots": np.stack([m.slots for m in out]),
            **{k: np.stack([m.layout[k] for m in out]) for k in ARRAY_KEYS}}


PATCH_KEYS = ("patches", "segment_ids", "rows", "cols", "frames", "pos_index", "pos_weight")


def pad_grouped(media: dict, merge: int, patches: int, frames: int) -> dict:
    """Grouped media (``grouped_media_inputs``) padded to a patch bucket of ``patches`` per row (and
    ``patches // merge^2`` tokens) and a merge frame axis of ``frames``: zeros everywhere (padding
    rows are zeros in every layout array), ``DROP`` for the new slots."""
    n, m = media["patches"].shape[1], media["slots"].shape[1]
    if patches < n or frames < media["merge_index"].shape[-1]:
        raise ValueError(f"cannot pad grouped media of {n} patches and {media['merge_index'].shape[-1]} frames "
                         f"to {patches} and {frames}")
    tokens = patches // merge ** 2
    out = {}
    for k, v in media.items():
        widths = [(0, 0)] * v.ndim
        widths[1] = (0, (patches - n) if k in PATCH_KEYS else (tokens - m))
        if k.startswith("merge_"):
            widths[-1] = (0, frames - v.shape[-1])
        out[k] = np.pad(v, widths, constant_values=DROP if k == "slots" else 0)
    return out


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
