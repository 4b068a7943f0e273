"""The vision side of the inference programs: the tower on one request's images, and prefill chunks
whose ``<|media_pad|>`` embeddings take the tower's rows.

``tower[N]`` runs the vision tower and projector on images packed into N patches, for each N in
the patch buckets (``media_buckets``), and keeps the projected rows on device (``self.media``)
under an id the caller chooses; ``prefill_media[C]`` is ``prefill[C]`` whose token embeddings take
those rows at the chunk's pads (the chunk's first pad takes row ``first``, the next pad the next
row). The rows are freed with ``drop_media``.
"""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.data.media import media_inputs
from k3jax.data.vision_processor import VisionInputError, patch_bucket
from k3jax.inference.lazy import Lazy


def media_buckets(pcfg, length: int) -> list[int]:
    """Patch counts the server compiles the tower for: ``vision_patch_buckets`` if given, else the
    powers of two from the processor's smallest bucket up to the first that holds ``length`` merged
    tokens (a request's images cannot fill more than its context)."""
    if pcfg.patch_buckets:
        return list(pcfg.patch_buckets)
    top = length * pcfg.merge * pcfg.merge
    out = [pcfg.min_bucket]
    while out[-1] < top:
        out.append(out[-1] * 2)
    return out


class MediaPrograms:
    """Mixed into ``Programs`` for a vision model (``media=`` given): uses its slot cache, state
    and ``_compile``."""

    def _init_media(self, model):
        vcfg = model.vision.vision_tower.vcfg
        self.patch_buckets = media_buckets(self.pcfg, self.length)
        self.media_rows = self.patch_buckets[-1] // self.pcfg.merge ** 2
        # images one tower call takes (the pod's wire carries each one's grid): four requests' worth,
        # or without a per-request limit as many as the largest bucket holds (merge^2 patches each)
        self.media_items = 4 * self.pcfg.max_images or self.media_rows
        dtype, d = model.compute_dtype, model.embed_tokens[...].shape[1]
        feats = jax.ShapeDtypeStruct((self.media_rows, d), dtype, sharding=self.replicated)
        # the tower's inputs (patches and layout) of the images packed into n patches; the token batch
        # is only their pads (the rows go to the prompt's pads by order, in prefill_media)
        self._media_layout = lambda items, n: media_inputs(
            vcfg, self.pcfg, items, np.full((1, sum(it.tokens for it in items) or 1),
                                            self.media_pad if items else 0, np.int32), self.media_pad, n)
        i32 = jax.ShapeDtypeStruct((), jnp.int32)
        self._tower = Lazy(self._compile_tower)
        self._prefill_media = Lazy(lambda c: self._compile(self._prefill_media_fn, self._prefill_args(c) + [i32],
                                                            [feats]))

    def _compile_tower(self, n):
        t0 = time.perf_counter()
        mi = self._media_layout([], n)
        inputs = {"patches": mi.patches, **mi.layout}
        abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=self.replicated) for k, v in inputs.items()}
        state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), self.state)
        with jax.set_mesh(self.mesh):
            tower = jax.jit(self._tower_fn, out_shardings=self.replicated).lower(state, abstract).compile()
        self.compile_s += time.perf_counter() - t0
        return tower

    def _warm_media(self):
        for n in self.patch_buckets:
            self._tower[n]
        for c in self.buckets:
            self._prefill_media[c]

    def _tower_fn(self, state, inputs):
        """One request's packed images -> its projected rows [media_rows, D] (zeros past its count)."""
        m = self._model(state)
        feats = m.vision(inputs["patches"], inputs)
        return jnp.pad(feats.astype(m.compute_dtype), ((0, self.media_rows - feats.shape[0]), (0, 0)))

    def _prefill_media_fn(self, state, cache, slot, tokens, pos, length, temperature, top_k, top_p, seed, counter,
                          ban, first, feats):
        """``_prefill_fn`` with image rows at the chunk's pads: the k-th pad of the chunk takes row
        first + k of ``feats`` (the chunk's embeddings go to ``model.extend`` spliced)."""
        m = self._model(state)
        toks = tokens[None]
        x = m.embed(toks)
        is_pad = (toks == self.media_pad) & (jnp.arange(toks.shape[1]) < length)[None]
        rows = jnp.clip(first + jnp.cumsum(is_pad, axis=1) - 1, 0, feats.shape[0] - 1)
        x = jnp.where(is_pad[..., None], jnp.take(feats, rows, axis=0).astype(x.dtype), x)
        row = [jax.lax.dynamic_slice_in_dim(c, slot, 1, ax) for c, ax in zip(cache, self._batch_axis)]
        logits, new = m.extend(toks, jax.tree.unflatten(self._tdef, row), pos[None], length[None], embeddings=x)
        cache = [jax.lax.dynamic_update_slice_in_dim(c, r.astype(c.dtype), slot, ax)
                 for c, r, ax in zip(cache, jax.tree.leaves(new), self._batch_axis)]
        out = self._sample(logits, seed[None], counter[None], temperature[None], top_k[None], top_p[None], ban[None])
        return out, cache

    def vision(self, key: int, items):
        """Run the tower on one request's images (``MediaItem``s) and keep their rows as ``key``. Over
        the largest patch bucket is a VisionInputError (the HTTP layer checks first: ``fits``)."""
        n = sum(len(it.patches) for it in items)
        if not self.fits(items):
            raise VisionInputError(f"the images make {n} patches, over the largest compiled bucket "
                                   f"{self.patch_buckets[-1]}")
        mi = self._media_layout(list(items), self.media_bucket(items))
        inputs = {k: self._put(v) for k, v in {"patches": mi.patches, **mi.layout}.items()}
        self.media[key] = self._tower[len(mi.patches)](self.state, inputs)

    def media_bucket(self, items) -> int:
        """The tower bucket the packed patches of ``items`` take."""
        return patch_bucket(sum(len(it.patches) for it in items), self.pcfg)

    def fits(self, items) -> bool:
        """The images' packed patches fit a compiled tower bucket."""
        n = sum(len(it.patches) for it in items)
        return n <= self.patch_buckets[-1] and patch_bucket(n, self.pcfg) in self.patch_buckets

    def prefill_media(self, slot, tokens, pos, temperature, top_k, top_p, seed, counter, ban, key, first):
        """``prefill`` of a chunk holding image pads: pad k of the chunk takes row first + k of the
        rows ``vision`` kept as ``key``."""
        c, args = self._chunk_args(slot, tokens, pos, temperature, top_k, top_p, seed, counter, ban, first)
        out, self.cache = self._prefill_media[c](self.state, self.cache, *args, self.media[key])
        return tuple(self._get(o)[0] for o in out)

    def drop_media(self, key: int):
        self.media.pop(key, None)
