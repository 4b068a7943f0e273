"""The prefix cache's index: which prompt prefixes the server can restore instead of prefilling.

K3's per-request state is MLA latent rows (one per token) plus, per KDA layer, a fixed-size
recurrent state and a short-conv tail. The KDA state after a prefix cannot be rebuilt from the
MLA rows, so the cache keeps:

- MLA rows per block of ``block`` tokens, keyed by a hash chain: a block's key hashes the previous
  block's key (the first block's: the weights' version), the block's token ids and the digests of
  the media (images, ...) whose placeholder tokens fall in the block, so equal keys mean equal
  prefixes up to the block's end under the same weights;
- KDA/conv snapshots ("entries") at a few points per cached prompt: the end of its last full block
  before its last token (a prompt of exactly k blocks keeps k - 1, so the same prompt sent again
  still has a token left to prefill, whose logits give the first sampled token), and its turn
  boundaries (the end of the tool declaration, of the system turn and of each earlier message,
  given by the HTTP layer), each rounded down to a block: where chat and agent requests that share
  a system prompt or a conversation's earlier turns diverge.

A new request restores the longest prefix that ends at an entry (all the entry's blocks are held
while it is) and prefills the rest. ``capacity`` bounds the bytes of blocks plus snapshots; the
least recently used entry is evicted first, and a block goes when the last entry using it does.

This module only keeps the index (keys, ids, sizes, LRU order). The pieces themselves live on the
device in ``Programs.store`` under the integer ids handed out here; the engine runs the steps that
copy them (``save_block``, ``save_state``, ``load_block``, ``load_state``, ``drop``).
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
import itertools

import numpy as np


def chain_keys(tokens, block: int, n_blocks: int, media=(), version: int = 0) -> list[bytes]:
    """Keys of the first ``n_blocks`` blocks of ``tokens``. ``media``: (token position, digest
    bytes) pairs; a block's key covers the digests whose position is inside it. ``version``: the
    weights' version (``Programs.weight_version``), which starts the chain, so a prefix computed
    with other weights never matches."""
    keys, prev = [], int(version).to_bytes(8, "little")
    for i in range(n_blocks):
        h = hashlib.blake2b(prev, digest_size=16)
        h.update(np.asarray(tokens[i * block:(i + 1) * block], np.int64).tobytes())
        for pos, digest in media:
            if i * block <= pos < (i + 1) * block:
                h.update(int(pos).to_bytes(8, "little") + bytes(digest))
        prev = h.digest()
        keys.append(prev)
    return keys


@dataclasses.dataclass
class Match:
    tokens: int                   # prompt tokens restored (a multiple of the block)
    blocks: list[int]             # store ids of the MLA blocks, in order
    state: int                    # store id of the KDA/conv snapshot at ``tokens``


@dataclasses.dataclass
class Save:
    """What to copy out of a slot once its prefill reaches ``tokens``."""
    tokens: int
    blocks: list[tuple[int, int]]   # (start position, new store id) of blocks not held yet
    state: int                      # new store id of the snapshot
    drops: list[int]                # store ids freed to make room
    evicted: int                    # entries evicted to make room


class PrefixCache:
    def __init__(self, capacity: int, block: int, block_bytes: int, state_bytes: int):
        self.capacity, self.block = capacity, block
        self.block_bytes, self.state_bytes = block_bytes, state_bytes
        self.blocks: dict[bytes, list] = {}    # key -> [store id, number of entries using it]
        # key of an entry's last block -> (store id of its snapshot, keys of its blocks); LRU order
        self.entries: collections.OrderedDict[bytes, tuple[int, list[bytes]]] = collections.OrderedDict()
        self.bytes = 0
        self._ids = itertools.count()
        self.version = 0

    def set_version(self, version: int) -> list[int]:
        """The weights changed: later keys chain from ``version``, so no entry kept so far can
        match again; they are all dropped -> the store ids freed."""
        self.version = version
        freed = []
        while self.entries:
            freed += self._evict()
        return freed

    def usable_blocks(self, n_tokens: int) -> int:
        """Blocks a prompt of n_tokens can restore or save: full blocks before its last token."""
        return (n_tokens - 1) // self.block

    def lookup(self, prompt, media=()) -> Match | None:
        """The longest cached prefix of ``prompt`` that ends at an entry (marked most recently used)."""
        keys = chain_keys(prompt, self.block, self.usable_blocks(len(prompt)), media, self.version)
        for n in range(len(keys), 0, -1):
            if keys[n - 1] in self.entries:
                self.entries.move_to_end(keys[n - 1])
                return Match(n * self.block, [self.blocks[k][0] for k in keys[:n]], self.entries[keys[n - 1]][0])
        return None

    def points(self, n_tokens: int, boundaries=()) -> list[int]:
        """Where a prompt of n_tokens keeps snapshots: its turn ``boundaries`` (token positions where
        a message or the tool declaration ends) rounded down to a block, and the end of its last
        usable block; ascending, each > 0."""
        last = self.usable_blocks(n_tokens) * self.block
        return sorted({min(b // self.block * self.block, last) for b in boundaries} - {0} | ({last} - {0}))

    def plan_save(self, prompt, media=(), restored: int = 0, tokens: int | None = None) -> Save | None:
        """The entry this prompt adds at ``tokens`` (a block multiple, default the end of its last
        usable block; None: already cached, nothing to save, or it cannot fit). Evicts entries to
        make room and records the new ones, so call it once per point and then run the returned
        copies (drops first)."""
        n = self.usable_blocks(len(prompt)) if tokens is None else min(tokens // self.block,
                                                                      self.usable_blocks(len(prompt)))
        if n == 0 or n * self.block <= restored:
            return None
        keys = chain_keys(prompt, self.block, n, media, self.version)
        if keys[-1] in self.entries:
            self.entries.move_to_end(keys[-1])
            return None

        def need():
            return self.state_bytes + self.block_bytes * len({k for k in keys if k not in self.blocks})

        if need() > self.capacity:
            return None
        drops, evicted = [], 0
        while self.bytes + need() > self.capacity:
            drops += self._evict()
            evicted += 1
        new = []
        for i, k in enumerate(keys):
            if k not in self.blocks:
                self.blocks[k] = [next(self._ids), 0]
                self.bytes += self.block_bytes
                new.append((i * self.block, self.blocks[k][0]))
            self.blocks[k][1] += 1
        state = next(self._ids)
        self.entries[keys[-1]] = (state, keys)
        self.bytes += self.state_bytes
        return Save(n * self.block, new, state, drops, evicted)

    def _evict(self) -> list[int]:
        """Drop the least recently used entry -> the store ids freed."""
        _, (state, keys) = self.entries.popitem(last=False)
        freed = [state]
        self.bytes -= self.state_bytes
        for k in keys:
            self.blocks[k][1] -= 1
            if self.blocks[k][1] == 0:
                freed.append(self.blocks.pop(k)[0])
                self.bytes -= self.block_bytes
        return freed
