"""The vision side of Kimi K2.5 / K3 (docs/vision.md): the MoonViT3d tower and the projector.

layout.py     host-side numpy from grid_thw: segment ids, RoPE positions, position-table taps,
              merge gather (everything shape-dependent, so the device sees bucketed shapes)
attention.py  bidirectional attention within each media item of a packed sequence (segment ids)
tower.py      VisionTower, Projector, VisionEncoder (both under the checkpoint's roots)

Imports config/schema, sharding, kernels and layers.common; nothing there imports this package.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax.vision.layout import ARRAY_KEYS, bucket, counts, media_layout  # noqa: F401
from k3jax.vision.tower import Projector, VisionEncoder, VisionTower, merge_patches  # noqa: F401


def build_vision(cfg, rngs: nnx.Rngs | int = 0) -> VisionEncoder:
    """The tower + projector of a full Config (vision section, text width, init std, dtypes)."""
    rngs = nnx.Rngs(rngs) if isinstance(rngs, int) else rngs
    return VisionEncoder(cfg.vision, cfg.model.hidden_size, rngs, std=cfg.model.initializer_range,
                         dtype=jnp.dtype(cfg.train.weight_dtype), compute_dtype=jnp.dtype(cfg.train.dtype),
                         interpret=cfg.kernel.pallas_interpret)


def layout_arrays(layout: dict) -> dict:
    """The device inputs of a ``media_layout`` (its arrays, without the Python counts)."""
    return {k: jnp.asarray(layout[k]) for k in ARRAY_KEYS}


@nnx.jit
def _encode(encoder, patches, arrays):
    return encoder(patches, arrays)


def encode_media(encoder: VisionEncoder, patches, grid_thw, *, num_patches: int | None = None,
                 num_tokens: int | None = None):
    """patches [n, 3, p, p] or [n, 3*p*p] (all media packed, frame/row/col order) and grid_thw
    [media, 3] -> features [merged tokens, text_hidden], media in order.

    The device program is compiled once per (num_patches, num_tokens) bucket (default: the exact
    counts): patches are zero-padded to num_patches rows in a padding segment of their own and
    the padded tokens dropped after."""
    lay = media_layout(encoder.vision_tower.vcfg, grid_thw, num_patches, num_tokens)
    x = np.asarray(patches, np.float32).reshape(len(patches), -1)
    if len(x) != lay["real_patches"]:
        raise ValueError(f"{len(x)} patches given but grid_thw describes {lay['real_patches']}")
    x = np.pad(x, ((0, len(lay["segment_ids"]) - len(x)), (0, 0)))
    return _encode(encoder, jnp.asarray(x), layout_arrays(lay))[:lay["real_tokens"]]
