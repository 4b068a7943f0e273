"""Host-side image and video processor for the MoonViT3d tower (numpy + Pillow; no jax, no torch).

Spec: docs/vision.md section 1 (geometry, compositing, video), 5 and 7 (the media prompt). One
media item (an image, or a K2.5 video chunk of <= 4 frames) becomes:

    patches   float32 [t*gh*gw, 3*p*p]   rows ordered frame, patch row, patch col (raster, NOT the
              2x2 merge windows contiguous as in Qwen2-VL: the tower's sd2_tpool merge reshapes
              [t, gh/2, 2, gw/2, 2, D] itself); each row flattened (c, y, x), the order of the patch
              embedding's conv weight reshaped to [D, 3*p*p]
    grid_thw  (t, gh, gw) in patches; gh, gw even and <= side_limit
    tokens    gh*gw/4 LM slots (after the 2x2 merge; frames are pooled, so t does not count)
    prompt    "<|media_begin|>image {W}x{H}<|media_content|>" + tokens x "<|media_pad|>" + "<|media_end|>"
              (K3; K2.5 writes "image" alone; a video chunk is "HH:MM:SS.mmm<|media_begin|>video...")

The steps follow Moonshot's media_utils as vLLM, SGLang and the checkpoints ship it: the navit scale
rule in Python float64 with int() truncation, Pillow BICUBIC (an RGBA/LA image is premultiplied by
Pillow; under K3 a palette image is resized NEAREST, as Pillow does for mode P), K3's chessboard under
transparent pixels after the resize in float32 with truncation to uint8, black zero padding
bottom/right to multiples of p*merge, and (u8/255 -> float32, - mean, * 1/std).

Patch counts vary per image; ``patch_bucket`` rounds a step's total to a few configured sizes and
``pack_media`` pads to it, the padding rows in segment 0 (media i is segment i+1) for the tower to
drop, so train and prefill compile a few shapes. ``check_media_limit`` is the per-example /
per-request image limit.

Video: frames as a list of PIL images or a uint8 [n, H, W, 3] array with their fps, or an animated
GIF/PNG/WebP read by Pillow (``load_video``); decoding other video files is out of scope.
"""
from __future__ import annotations

import dataclasses
import io
import math
import os
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from PIL import Image, ImageSequence, UnidentifiedImageError

from k3jax.errors import UserError
from k3jax.schema import ConfigError

MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_END, MEDIA_PAD = (
    "<|media_begin|>", "<|media_content|>", "<|media_end|>", "<|media_pad|>")


class VisionInputError(UserError, ValueError):
    """An image or video the processor cannot take (unreadable, too many, out of the bucket
    range); the message is one line naming the file or the key to change."""


@dataclasses.dataclass(frozen=True)
class ProcessorConfig:
    """The processor's switches (vision.md section 1 and 9). ``K3`` and ``K25`` below are the
    released checkpoints' values; ``from_config`` reads them from a k3jax config."""
    patch_size: int = 14
    merge: int = 2                       # 2x2 merge: pad to multiples of patch_size * merge
    in_patch_limit: int = 65536          # patch budget of one image, before padding (K2.5: 16384)
    side_limit: int = 512                # patches per side
    mean: tuple = (0.5, 0.5, 0.5)
    std: tuple = (0.5, 0.5, 0.5)
    transparent_bg: str = "chessboard"   # chessboard (K3) | none (K2.5: alpha dropped by RGB convert)
    chessboard_square: int = 8
    chessboard_white: int = 255
    chessboard_gray: int = 180
    image_prompt_size: bool = True       # K3 writes "image {W}x{H}" (the size given), K2.5 "image"
    video: bool = False                  # K2.5 video chunks; K3's processor is image-only
    frame_patch_limit: int = 4096        # patch budget of one video frame
    sample_fps: float = 2.0              # video frames kept per second (at most the source fps)
    frames_per_chunk: int = 4            # sampled frames per media item (K2.5's temporal_merge_kernel_size,
                                         # = the tower's vision_pos_emb_time, the most frames it takes)
    max_images: int = 16                 # images + videos per example / request (0 = no limit)
    patch_buckets: tuple = ()            # packed patch counts; () = powers of two >= min_bucket
    min_bucket: int = 256

    def __post_init__(self):
        if self.transparent_bg not in ("chessboard", "none"):
            raise ConfigError(f"vision_transparent_bg={self.transparent_bg!r}: use chessboard or none")
        for name in ("patch_size", "merge", "in_patch_limit", "side_limit", "frame_patch_limit",
                     "frames_per_chunk", "min_bucket"):
            if getattr(self, name) < 1:
                raise ConfigError(f"vision processor {name}={getattr(self, name)}: must be >= 1")
        if self.side_limit % self.merge:
            raise ConfigError(f"vision_side_limit={self.side_limit}: must be a multiple of the merge size {self.merge}")
        if not self.sample_fps > 0 or self.max_images < 0:
            raise ConfigError(f"vision_sample_fps={self.sample_fps} must be > 0 and vision_max_images="
                              f"{self.max_images} >= 0")
        if list(self.patch_buckets) != sorted(set(self.patch_buckets)) or any(
                b < 1 for b in self.patch_buckets):
            raise ConfigError(f"vision_patch_buckets={list(self.patch_buckets)}: must be increasing positive counts")

    @property
    def patch_dim(self) -> int:
        return 3 * self.patch_size * self.patch_size


K3 = ProcessorConfig()
K25 = ProcessorConfig(in_patch_limit=16384, transparent_bg="none", image_prompt_size=False, video=True)


def from_config(cfg: Any) -> ProcessorConfig:
    """ProcessorConfig from a k3jax Config's ``vision_*`` keys (its ``vision`` section)."""
    v = cfg.vision
    return ProcessorConfig(
        patch_size=v.vision_patch_size, merge=v.vision_merge_kernel_size,
        in_patch_limit=v.vision_in_patch_limit, side_limit=v.vision_side_limit,
        transparent_bg=v.vision_transparent_bg, image_prompt_size=v.vision_image_prompt_size,
        video=v.vision_video, frame_patch_limit=v.vision_frame_patch_limit,
        sample_fps=v.vision_sample_fps, frames_per_chunk=v.vision_pos_emb_time, max_images=v.vision_max_images,
        patch_buckets=tuple(v.vision_patch_buckets))


@dataclasses.dataclass(frozen=True)
class ResizePlan:
    """Where the navit rule puts a W x H image: resized to (new_w, new_h), then padded."""
    new_w: int
    new_h: int
    pad_w: int
    pad_h: int
    grid_h: int                          # patches
    grid_w: int
    tokens: int                          # after the merge


def resize_plan(width: int, height: int, pcfg: ProcessorConfig = K3,
                patch_limit: int | None = None) -> ResizePlan:
    """The navit rule (vision.md 1.1): scale s = min(1, sqrt(L / (max(1, W//p) * max(1, H//p))),
    S*p/W, S*p/H) in float64, never upscaling, then int() truncation, at least 1 pixel and at most
    S*p a side; pad to multiples of p*merge. The budget L bounds the patches before padding, so the
    padded grid can exceed it slightly."""
    if width < 1 or height < 1:
        raise VisionInputError(f"image of {width}x{height} pixels has no area")
    p, side = pcfg.patch_size, pcfg.side_limit
    limit = pcfg.in_patch_limit if patch_limit is None else patch_limit
    s1 = math.sqrt(limit / (max(1.0, width // p) * max(1.0, height // p)))
    scale = min(1.0, s1, side * p / width, side * p / height)
    new_w = min(max(1, int(width * scale)), side * p)
    new_h = min(max(1, int(height * scale)), side * p)
    factor = p * pcfg.merge
    pad_w, pad_h = -new_w % factor, -new_h % factor
    gh, gw = (new_h + pad_h) // p, (new_w + pad_w) // p
    return ResizePlan(new_w, new_h, pad_w, pad_h, gh, gw, gh * gw // (pcfg.merge * pcfg.merge))


@dataclasses.dataclass(frozen=True)
class MediaItem:
    """One processed media item (an image or a video chunk)."""
    patches: np.ndarray                  # float32 [t*gh*gw, 3*p*p], (c, y, x) inside a row
    grid_thw: tuple                      # (t, gh, gw)
    tokens: int                          # LM slots: gh*gw / merge^2
    prompt_prefix: str                   # text before the pads, e.g. "<|media_begin|>image 40x30<|media_content|>"

    @property
    def prompt(self) -> str:
        """The whole media prompt with its pads expanded (vision.md 5, convention (a))."""
        return self.prompt_prefix + MEDIA_PAD * self.tokens + MEDIA_END


def load_image(src, name: str | None = None) -> Image.Image:
    """Open and fully decode an image from a path, bytes or a binary file object; a missing or
    unreadable file is a one-line VisionInputError naming it. Decoding happens here (PIL opens
    lazily), so a truncated file fails now, not in the middle of a batch."""
    label = name or (os.fspath(src) if isinstance(src, (str, os.PathLike)) else "<image bytes>")
    try:
        img = Image.open(io.BytesIO(src) if isinstance(src, (bytes, bytearray)) else src)
        img.load()
    except FileNotFoundError:
        raise VisionInputError(f"{label}: image file not found") from None
    except (OSError, UnidentifiedImageError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise VisionInputError(f"{label}: unreadable image ({msg})") from None
    return img


def _chessboard(height: int, width: int, pcfg: ProcessorConfig) -> np.ndarray:
    """uint8 [H, W, 3] background: white where (y//sq + x//sq) is even (white on the top-left)."""
    sq = pcfg.chessboard_square
    odd = (np.arange(height)[:, None] // sq + np.arange(width)[None, :] // sq) % 2 == 1
    bg = np.where(odd, pcfg.chessboard_gray, pcfg.chessboard_white).astype(np.uint8)
    return np.repeat(bg[:, :, None], 3, axis=2)


def _has_alpha(img: Image.Image) -> bool:
    return "A" in img.getbands() or "transparency" in img.info


def to_rgb(img: Image.Image, pcfg: ProcessorConfig) -> np.ndarray:
    """uint8 [H, W, 3] of an already resized image: RGB as is; with transparent_bg=chessboard an
    image with alpha (RGBA, LA, PA, P or L with a transparency key) is composited onto the
    chessboard as floor(a*rgb + (1-a)*bg) in float32, a = A/255; everything else converts to RGB."""
    if img.mode == "RGB":
        return np.asarray(img)
    if pcfg.transparent_bg == "none" or not _has_alpha(img):
        return np.asarray(img.convert("RGB"))
    rgba = np.asarray(img.convert("RGBA"))
    alpha = (rgba[:, :, 3:4].astype(np.float32) / 255.0).astype(np.float32)
    bg = _chessboard(rgba.shape[0], rgba.shape[1], pcfg)
    return (alpha * rgba[:, :, :3] + (1 - alpha) * bg).astype(np.uint8)


def _resized_frame(img: Image.Image, plan: ResizePlan, pcfg: ProcessorConfig) -> np.ndarray:
    """uint8 [gh*p, gw*p, 3]: resize (bicubic), composite or convert, zero-pad bottom/right."""
    if pcfg.transparent_bg == "none":
        img = img.convert("RGB")        # K2.5 drops alpha before the resize
    if img.size != (plan.new_w, plan.new_h):
        img = img.resize((plan.new_w, plan.new_h), resample=Image.Resampling.BICUBIC)
    rgb = to_rgb(img, pcfg)
    return np.pad(rgb, ((0, plan.pad_h), (0, plan.pad_w), (0, 0)))


def patchify(pixels: np.ndarray, pcfg: ProcessorConfig) -> np.ndarray:
    """uint8 [T, H, W, 3] -> normalised float32 [T*(H/p)*(W/p), 3*p*p], rows frame-major raster,
    each row (c, y, x). Normalisation as the reference: float32(u/255), then - mean, * (1/std),
    each result float32; done once for the 256 x 3 possible inputs and gathered in patch order
    (the same values, without a float64 copy of the image)."""
    t, h, w, c = pixels.shape
    p = pcfg.patch_size
    lut = (np.arange(256)[:, None] / 255.0).astype(np.float32).repeat(c, axis=1)   # [256, c]
    lut -= np.asarray(pcfg.mean, np.float64)
    lut *= 1.0 / np.asarray(pcfg.std, np.float64)
    u = pixels.reshape(t, h // p, p, w // p, p, c).transpose(0, 1, 3, 5, 2, 4)     # uint8 view
    x = lut[u, np.arange(c)[:, None, None]]                                         # [t, gh, gw, c, p, p]
    return x.reshape(t * (h // p) * (w // p), c * p * p)


def image_prompt_prefix(width: int, height: int, pcfg: ProcessorConfig) -> str:
    size = f" {width}x{height}" if pcfg.image_prompt_size else ""
    return f"{MEDIA_BEGIN}image{size}{MEDIA_CONTENT}"


def process_image(img, pcfg: ProcessorConfig = K3,
                  prompt_size: tuple[int, int] | None = None) -> MediaItem:
    """One image (a PIL image, or a path / bytes for ``load_image``) -> MediaItem (vision.md
    1.1-1.2). ``prompt_size`` is the (W, H) the K3 prompt names when the caller knows an original
    upload size the image no longer has (vision.md 7); by default the image's own size."""
    if not isinstance(img, Image.Image):
        img = load_image(img)
    w, h = img.size
    plan = resize_plan(w, h, pcfg)
    try:
        frame = _resized_frame(img, plan, pcfg)
    except (ValueError, OSError) as e:
        raise VisionInputError(f"image of mode {img.mode}: cannot resize or convert it to RGB ({e})") from None
    pw, ph = prompt_size or (w, h)
    return MediaItem(patchify(frame[None], pcfg), (1, plan.grid_h, plan.grid_w), plan.tokens,
                     image_prompt_prefix(pw, ph, pcfg))


def timestamp_text(seconds: float) -> str:
    """HH:MM:SS.mmm of a chunk's first frame, as the K2.5 processor writes it (gmtime, so hours
    wrap at 24; milliseconds truncated)."""
    return time.strftime("%H:%M:%S", time.gmtime(seconds)) + f".{int(seconds % 1 * 1000):03d}"


def sample_frame_indices(n_frames: int, fps: float, sample_fps: float) -> list[int]:
    """vision.md 1.3: n' = max(round(n * min(sample_fps, fps) / fps), 1) frames at
    round(linspace(0, n-1, n')) (numpy's round-half-even, as the reference)."""
    if n_frames < 1 or not fps > 0:
        raise VisionInputError(f"a video needs >= 1 frame and fps > 0 (got {n_frames} frames at {fps} fps)")
    n = max(round(n_frames * min(sample_fps, fps) / fps), 1)
    return np.linspace(0, n_frames - 1, n).round().astype(int).tolist()


def _frame_image(frame) -> Image.Image:
    if isinstance(frame, Image.Image):
        return frame
    a = np.asarray(frame)
    if a.dtype != np.uint8 or a.ndim != 3 or a.shape[2] != 3:
        raise VisionInputError(f"video frames must be PIL images or uint8 [H, W, 3] arrays, got {a.dtype} {a.shape}")
    return Image.fromarray(a)


def process_video(frames, fps: float, pcfg: ProcessorConfig = K25) -> list[MediaItem]:
    """K2.5 video (vision.md 1.3): sample frames at min(sample_fps, fps), cut them into chunks of
    ``frames_per_chunk`` consecutive sampled frames (the last may be shorter); each chunk is one
    media item of grid (t, gh, gw), sized by the navit rule with ``frame_patch_limit`` on the
    first frame, and prompted "HH:MM:SS.mmm<|media_begin|>video<|media_content|>...". ``frames``:
    a list of PIL images or a uint8 [n, H, W, 3] array, all of one size."""
    if not pcfg.video:
        raise VisionInputError("video input needs vision_video=true (K2.5); K3's processor is image-only")
    frames = list(frames)
    idx = sample_frame_indices(len(frames), fps, pcfg.sample_fps)
    images = [_frame_image(frames[i]) for i in idx]
    size = images[0].size
    if any(im.size != size for im in images):
        raise VisionInputError(f"video frames differ in size ({sorted({im.size for im in images})}); "
                               "one size per video")
    plan = resize_plan(size[0], size[1], pcfg, patch_limit=pcfg.frame_patch_limit)
    k = pcfg.frames_per_chunk
    chunks = []
    for start in range(0, len(images), k):
        pix = np.stack([_resized_frame(im, plan, pcfg) for im in images[start:start + k]])
        prefix = f"{timestamp_text(idx[start] / fps)}{MEDIA_BEGIN}video{MEDIA_CONTENT}"
        chunks.append(MediaItem(patchify(pix, pcfg), (len(pix), plan.grid_h, plan.grid_w),
                                plan.tokens, prefix))
    return chunks


def load_video(src, name: str | None = None) -> tuple[list[Image.Image], float]:
    """Frames and fps of an animated GIF / PNG / WebP that Pillow reads (fps from the mean frame
    duration); other video formats are out of scope: decode them elsewhere and pass frames."""
    img = load_image(src, name)
    label = name or (os.fspath(src) if isinstance(src, (str, os.PathLike)) else "<video bytes>")
    frames, ms = [], 0
    for f in ImageSequence.Iterator(img):
        frames.append(f.convert("RGB"))
        ms += f.info.get("duration", 0) or 0
    if not ms:
        raise VisionInputError(f"{label}: no frame durations, so no fps; pass its frames and fps to process_video")
    return frames, 1000.0 * len(frames) / ms


def check_media_limit(n_media: int, pcfg: ProcessorConfig, where: str = "example") -> None:
    """The per-example / per-request media limit (vLLM's limit_mm_per_prompt): images plus
    videos in one ``where``; ``max_images`` 0 means no limit."""
    if pcfg.max_images and n_media > pcfg.max_images:
        raise VisionInputError(f"{where} has {n_media} images/videos, over vision_max_images="
                               f"{pcfg.max_images}; raise vision_max_images or split the {where}")


def patch_bucket(n_patches: int, pcfg: ProcessorConfig) -> int:
    """The padded patch count a step compiles for: the smallest of ``patch_buckets`` >= n, or
    (no list) the smallest power of two >= max(n, min_bucket). Over the largest bucket is an error."""
    if pcfg.patch_buckets:
        for b in pcfg.patch_buckets:
            if b >= n_patches:
                return b
        raise VisionInputError(f"{n_patches} patches exceed the largest vision_patch_buckets entry "
                               f"{pcfg.patch_buckets[-1]}; add a larger bucket or fewer/smaller images")
    return max(pcfg.min_bucket, 1 << max(n_patches - 1, 0).bit_length())


@dataclasses.dataclass(frozen=True)
class PackedMedia:
    """Media items packed into one bucket-sized array for the tower."""
    patches: np.ndarray                  # float32 [bucket, 3*p*p]; padding rows are 0
    segment_ids: np.ndarray              # int32 [bucket]: media i -> i+1, padding -> 0 (dropped)
    grid_thw: np.ndarray                 # int32 [n_media, 3]
    tokens: np.ndarray                   # int32 [n_media]: LM slots per media item


def pack_media(items: Sequence[MediaItem], pcfg: ProcessorConfig, bucket: int | None = None) -> PackedMedia:
    """Concatenate the items' patches in order and pad to ``bucket`` (default ``patch_bucket`` of
    the total). Attention runs within a segment; the padding's own segment 0 keeps its softmax
    finite and the tower drops it before the merge."""
    n = sum(len(it.patches) for it in items)
    bucket = patch_bucket(n, pcfg) if bucket is None else bucket
    if n > bucket:
        raise VisionInputError(f"{n} patches do not fit a bucket of {bucket}")
    patches = np.zeros((bucket, pcfg.patch_dim), np.float32)
    seg = np.zeros(bucket, np.int32)
    at = 0
    for i, it in enumerate(items):
        patches[at:at + len(it.patches)] = it.patches
        seg[at:at + len(it.patches)] = i + 1
        at += len(it.patches)
    grid = np.array([it.grid_thw for it in items], np.int32).reshape(len(items), 3)
    return PackedMedia(patches, seg, grid, np.array([it.tokens for it in items], np.int32))
