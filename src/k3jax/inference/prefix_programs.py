"""The prefix cache's device moves: one slot's MLA rows of one block and its KDA recurrent + conv
state, copied out of the slot cache into pieces kept on device (``self.store``, under ids the
caller chooses; every process of a pod holds its shards of them) and back into a slot.
"""
from __future__ import annotations

import jax


class PrefixPrograms:
    """Mixed into ``Programs`` when ``prefix_block`` > 0: uses its slot cache and ``_compile``."""

    def _prefix_builders(self, leaves, i32) -> dict:
        """The prefix programs' builders by name ({} without a prefix block); sets the byte sizes
        of a block's MLA rows and of a KDA snapshot (``block_bytes``, ``state_bytes``)."""
        if not self.prefix_block:
            return {}
        block = [self._piece(shape, dt, axes, ax, self.prefix_block)
                 for (shape, dt, axes), ax, rec in zip(leaves, self._batch_axis, self._recurrent) if not rec]
        snap = [self._piece(shape, dt, axes, ax)
                for (shape, dt, axes), ax, rec in zip(leaves, self._batch_axis, self._recurrent) if rec]
        self.block_bytes = sum(x.size * x.dtype.itemsize for x in block)
        self.state_bytes = sum(x.size * x.dtype.itemsize for x in snap)
        return {"save_block": lambda: self._compile(self._save_block_fn, [i32, i32], out=[x.sharding for x in block]),
                "save_state": lambda: self._compile(self._save_state_fn, [i32], out=[x.sharding for x in snap]),
                "load_block": lambda: self._compile(self._load_block_fn, [i32, i32], block, out="cache"),
                "load_state": lambda: self._compile(self._load_state_fn, [i32], snap, out="cache")}

    def _save_block_fn(self, state, cache, slot, start):
        del state
        return [jax.lax.dynamic_slice_in_dim(jax.lax.dynamic_slice_in_dim(x, slot, 1, ax), start, self.prefix_block,
                                             ax + 1)
                for x, ax, rec in zip(cache, self._batch_axis, self._recurrent) if not rec]

    def _save_state_fn(self, state, cache, slot):
        del state
        return [jax.lax.dynamic_slice_in_dim(x, slot, 1, ax)
                for x, ax, rec in zip(cache, self._batch_axis, self._recurrent) if rec]

    def _load_block_fn(self, state, cache, slot, start, *block):
        del state
        block, out = iter(block), []
        for x, ax, rec in zip(cache, self._batch_axis, self._recurrent):
            if not rec:
                at = [0] * x.ndim
                at[ax], at[ax + 1] = slot, start
                x = jax.lax.dynamic_update_slice(x, next(block).astype(x.dtype), at)
            out.append(x)
        return out

    def _load_state_fn(self, state, cache, slot, *snap):
        del state
        snap = iter(snap)
        return [jax.lax.dynamic_update_slice_in_dim(x, next(snap).astype(x.dtype), slot, ax) if rec else x
                for x, ax, rec in zip(cache, self._batch_axis, self._recurrent)]

    def save_block(self, slot: int, start: int, key: int):
        """Keep slot ``slot``'s MLA rows of positions start .. start + prefix_block as ``key``."""
        self.store[key] = self._one["save_block"](self.state, self.cache, *self._ints(slot, start))

    def save_state(self, slot: int, key: int):
        """Keep slot ``slot``'s KDA recurrent and conv state as ``key``."""
        self.store[key] = self._one["save_state"](self.state, self.cache, *self._ints(slot))

    def load_block(self, slot: int, start: int, key: int):
        self.cache = self._one["load_block"](self.state, self.cache, *self._ints(slot, start), *self.store[key])

    def load_state(self, slot: int, key: int):
        self.cache = self._one["load_state"](self.state, self.cache, *self._ints(slot), *self.store[key])

    def drop(self, key: int):
        del self.store[key]
