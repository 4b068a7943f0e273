"""The vision side of Kimi K2.5 / K3 (docs/vision.md): the MoonViT3d tower and the projector.

attention.py  bidirectional attention within each media item of a packed sequence (segment ids)
tower.py      VisionTower, Projector, VisionEncoder (both under the checkpoint's roots)
splice.py     the features spliced into the token embeddings, no loss on targets that are media
              slots (the device half of media in the text model; the host half is k3jax.data.media)

The host-side arrays the tower reads (segment ids, RoPE positions, position-table taps, merge
gather: everything shape-dependent, so the device sees bucketed shapes) are computed from grid_thw
by k3jax.data.media_layout. Imports config/schema, sharding, kernels, layers.common and
data.media_layout; nothing there imports this package.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax.layers.common import CountingSampler, FlatSampler
from k3jax.data.media_layout import ARRAY_KEYS, media_layout
from k3jax.vision.tower import VisionEncoder


FLAT_INIT_MAX_PARAMS = 2 ** 28   # as k3jax.model: below this, init draws from two flat buffers


def _construct(cfg, rngs):
    return VisionEncoder(cfg.vision, cfg.model.hidden_size, rngs, std=cfg.model.initializer_range,
                         dtype=jnp.dtype(cfg.train.weight_dtype), compute_dtype=jnp.dtype(cfg.train.dtype),
                         interpret=cfg.kernel.pallas_interpret)


def build_vision(cfg, rngs: nnx.Rngs | int = 0) -> VisionEncoder:
    """The tower + projector of a full Config (vision section, text width, init std, dtypes). An
    int seed draws small towers from two flat buffers (one RNG op each, quick to compile on CPU)
    and the released ones (~0.45B) with a key per parameter, as ``k3jax.model.build`` does."""
    if isinstance(rngs, int):
        counter = CountingSampler()
        nnx.eval_shape(lambda: _construct(cfg, counter))
        total = counter.n_normal + counter.n_uniform
        rngs = nnx.Rngs(rngs) if total > FLAT_INIT_MAX_PARAMS else \
            FlatSampler(jax.random.key(rngs), counter.n_normal, counter.n_uniform)
    return _construct(cfg, rngs)


def layout_arrays(layout: dict) -> dict:
    """The device inputs of a ``media_layout`` (its arrays, without the Python counts)."""
    return {k: jnp.asarray(layout[k]) for k in ARRAY_KEYS}


@nnx.jit
def _encode(encoder, patches, arrays):
    return encoder(patches, arrays)


def encode_media(encoder: VisionEncoder, patches, grid_thw, *, num_patches: int | None = None,
                 num_tokens: int | None = None, max_frames: int | None = None):
    """patches [n, 3, p, p] or [n, 3*p*p] (all media packed, frame/row/col order) and grid_thw
    [media, 3] -> features [num_tokens, text_hidden]: the merged tokens of the media in order,
    then padding rows (``counts(vcfg, grid_thw)[1]`` real ones).

    Without buckets the result is exactly the real tokens. With them, patches are zero-padded to
    ``num_patches`` rows in a padding segment of their own, and every grid set fitting the same
    (num_patches, num_tokens) runs one compiled program: the caller drops the padding rows inside
    its own program (a host-side slice here would compile a slice per token count).
    ``max_frames``: as in ``media_layout`` (1 for image-only batches)."""
    lay = media_layout(encoder.vision_tower.vcfg, grid_thw, num_patches, num_tokens, max_frames)
    x = np.asarray(patches, np.float32).reshape(len(patches), -1)
    if len(x) != lay["real_patches"]:
        raise ValueError(f"{len(x)} patches given but grid_thw describes {lay['real_patches']}")
    x = np.pad(x, ((0, len(lay["segment_ids"]) - len(x)), (0, 0)))
    return _encode(encoder, jnp.asarray(x), layout_arrays(lay))
