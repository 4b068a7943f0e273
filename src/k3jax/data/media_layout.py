"""Host-side (numpy) description of a packed batch of media, computed from ``grid_thw`` alone
(docs/vision.md §9): everything shape-dependent is decided here, so the device program sees fixed
shapes for a given (patch bucket, token bucket) and nothing about the grids at trace time.

Patches of all media are packed in order into one sequence of ``num_patches`` rows (frame, row,
col inside each media item); rows past the real patches are padding. Per row:

- ``segment_ids``: media item + 1, 0 for padding (attention stays inside a segment);
- ``rows`` / ``cols``: the patch's grid position inside its frame (the 2-D RoPE angles);
- ``frames``: index into the temporal table, frame + 1 for media with t > 1, else 0 (a zero row);
- ``pos_index`` / ``pos_weight`` [N, taps]: the learned position table resampled to the media's
  grid (align_corners=False, taps clamped to the edge, no antialias) as indices into the flat
  table and weights: 2 x 2 taps for bilinear, 4 x 4 for bicubic (Keys a = -0.75); padding rows
  have zero weights.

Per merged token (``num_tokens`` rows, the real ones first, media in order, row-major):
``merge_index`` / ``merge_weight`` [M, k*k, t_max]: the k x k sub-patches (order (0,0), (0,1), ...)
of every frame, weight 1/t (sd2_tpool's mean over frames); padding tokens have zero weights.
"""
from __future__ import annotations


import numpy as np

KEYS_A = -0.75  # torch's bicubic (Keys) coefficient; jax.image.resize uses -0.5, hence these taps
DROP = 2 ** 30  # the slot of a padding token (k3jax.data.media): out of range of any [B, T] batch


def _keys(d: np.ndarray, a: float = KEYS_A) -> np.ndarray:
    d = np.abs(d)
    near = (a + 2) * d ** 3 - (a + 3) * d ** 2 + 1
    far = a * d ** 3 - 5 * a * d ** 2 + 8 * a * d - 4 * a
    return np.where(d <= 1, near, np.where(d < 2, far, 0.0))


def resample_taps(n: int, src: int, mode: str) -> tuple[np.ndarray, np.ndarray]:
    """1-D resampling of ``src`` table rows to ``n`` output rows: (indices [n, taps] int, weights
    [n, taps] float64). Output i samples source (i + 0.5) * src / n - 0.5; clamped taps keep their
    weight (so the edge row accumulates it). n == src is the identity."""
    s = (np.arange(n) + 0.5) * src / n - 0.5
    base = np.floor(s).astype(np.int64)
    offsets = np.arange(0, 2) if mode == "bilinear" else np.arange(-1, 3)
    taps = base[:, None] + offsets[None, :]
    d = s[:, None] - taps
    w = np.maximum(0.0, 1 - np.abs(d)) if mode == "bilinear" else _keys(d)
    return np.clip(taps, 0, src - 1), w


def temporal_table(width: int, max_frames: int) -> np.ndarray:
    """[max_frames + 1, width] float32: row 0 zero (t = 1 media and padding), row f + 1 =
    concat(sin(f w), cos(f w)), w_j = 10000^(-2j/width) (the "divided_fixed" temporal term)."""
    omega = 10000.0 ** (-2 * np.arange(width // 2) / width)
    ang = np.arange(max_frames)[:, None] * omega[None, :]
    rows = np.concatenate([np.sin(ang), np.cos(ang)], axis=1)
    return np.concatenate([np.zeros((1, width)), rows], axis=0).astype(np.float32)


def check_grid(vcfg, grid_thw) -> np.ndarray:
    """grid_thw as an int64 [n, 3] array; ValueError naming the first impossible grid."""
    grid = np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3)
    k, tmax = vcfg.vision_merge_kernel_size, vcfg.vision_pos_emb_time
    for i, (t, h, w) in enumerate(grid.tolist()):
        if not (1 <= t <= tmax and h > 0 and w > 0 and h % k == 0 and w % k == 0):
            raise ValueError(f"media {i}: grid_thw ({t}, {h}, {w}) is impossible: t must be in 1..{tmax} "
                             f"(vision_pos_emb_time) and h, w positive multiples of {k} (vision_merge_kernel_size)")
    return grid


def counts(vcfg, grid_thw) -> tuple[int, int]:
    """(patches, merged tokens) of the media: sum t*h*w and sum (h/k)*(w/k)."""
    grid = check_grid(vcfg, grid_thw)
    k = vcfg.vision_merge_kernel_size
    return int((grid.prod(1)).sum()), int((grid[:, 1] // k * (grid[:, 2] // k)).sum())


def media_layout(vcfg, grid_thw, num_patches: int | None = None, num_tokens: int | None = None,
                 max_frames: int | None = None) -> dict:
    """The packed layout of ``grid_thw`` as numpy arrays (module docstring), padded to
    ``num_patches`` rows and ``num_tokens`` merged tokens (default: exactly the real counts).
    ``max_frames`` sizes the merge gather's frame axis (default vision_pos_emb_time; 1 for
    image-only batches such as K3's, a quarter of the gather). Also returns the real counts as
    Python ints under "real_patches" and "real_tokens"."""
    grid = check_grid(vcfg, grid_thw)
    real_p, real_t = counts(vcfg, grid)
    n = real_p if num_patches is None else num_patches
    m = real_t if num_tokens is None else num_tokens
    if n < real_p or m < real_t:
        raise ValueError(f"the media need {real_p} patches and {real_t} tokens but the buckets hold {n} and {m}")
    k, tmax = vcfg.vision_merge_kernel_size, max_frames or vcfg.vision_pos_emb_time
    if grid[:, 0].max(initial=1) > tmax:
        raise ValueError(f"a media item has {grid[:, 0].max()} frames but max_frames={tmax}")
    th, tw = vcfg.vision_pos_emb_height, vcfg.vision_pos_emb_width
    mode = vcfg.vision_pos_interp
    ntap = 2 if mode == "bilinear" else 4
    seg = np.zeros(n, np.int32)
    rows = np.zeros(n, np.int32)
    cols = np.zeros(n, np.int32)
    frames = np.zeros(n, np.int32)
    pos_index = np.zeros((n, ntap * ntap), np.int32)
    pos_weight = np.zeros((n, ntap * ntap), np.float32)
    merge_index = np.zeros((m, k * k, tmax), np.int32)
    merge_weight = np.zeros((m, k * k, tmax), np.float32)
    start = tok = 0
    for i, (t, h, w) in enumerate(grid.tolist()):
        hw = h * w
        sl = slice(start, start + t * hw)
        seg[sl] = i + 1
        r, c = np.divmod(np.arange(hw), w)
        rows[sl], cols[sl] = np.tile(r, t), np.tile(c, t)
        if t > 1:
            frames[sl] = np.repeat(np.arange(t) + 1, hw)
        ri, rw = resample_taps(h, th, mode)                              # [h, ntap]
        ci, cw = resample_taps(w, tw, mode)                              # [w, ntap]
        idx = ri[:, None, :, None] * tw + ci[None, :, None, :]          # [h, w, ntap, ntap]
        wgt = rw[:, None, :, None] * cw[None, :, None, :]
        pos_index[sl] = np.tile(idx.reshape(hw, -1), (t, 1))
        pos_weight[sl] = np.tile(wgt.reshape(hw, -1), (t, 1))
        # merged token (a, b) of this media = sub-patches (a*k + dy, b*k + dx) of every frame
        a, b = np.divmod(np.arange((h // k) * (w // k)), w // k)
        dy, dx = np.divmod(np.arange(k * k), k)
        sub = (a[:, None] * k + dy[None, :]) * w + (b[:, None] * k + dx[None, :])   # [tokens, k*k]
        ntok = sub.shape[0]
        merge_index[tok:tok + ntok, :, :t] = start + sub[:, :, None] + hw * np.arange(t)[None, None, :]
        merge_weight[tok:tok + ntok, :, :t] = 1.0 / t
        start += t * hw
        tok += ntok
    return {"segment_ids": seg, "rows": rows, "cols": cols, "frames": frames, "pos_index": pos_index,
            "pos_weight": pos_weight, "merge_index": merge_index, "merge_weight": merge_weight,
            "real_patches": real_p, "real_tokens": real_t}


ARRAY_KEYS = ("segment_ids", "rows", "cols", "frames", "pos_index", "pos_weight", "merge_index", "merge_weight")

