"""What each process feeds of a global [rows, T] batch: its rows and its sequence slices.

A batch is sharded rows over the batch axes (data, fsdp, expert) and positions over the context
axis (logical ("batch", "seq")). A process feeds exactly the block its own devices hold:

  * rows: the processes whose devices hold the same rows form a *data shard* (with the context
    axis inside each host, every process is its own shard; with the context axis spanning hosts,
    the hosts of one context group share rows). Shard i of n reads records i, i+n, ... through
    the data pipeline (``data.iterator.data_iterator``), so the shard's processes read the same records and
    build the same packed rows, and no record is read by two shards;
  * positions: each process then keeps only its devices' sequence slices of every array (tokens,
    targets, segment ids, positions, loss mask) before the device put, so no process puts, or
    holds on device, another process's slices. Packing is sequential along a row, so the host
    packs the whole row first (numpy, T values per row and array) and slices it.

``jax.make_array_from_process_local_data`` assembles the global arrays from these local blocks
(a dimension's local block is the process's index ranges along it, concatenated in order).

Image batches (``dataset_type=mm_sft``) also carry ``"media"``, grouped per row
(``media.grouped_media_inputs``: [rows, ...] arrays, split over the batch axes like the rows,
whole along every other axis). Each process packs its own rows to its fullest row's patch bucket,
so before the put the processes agree on the largest (``agree_media``: one all-gather of three
numbers) and pad to it.
"""
from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding

from k3jax.config import ConfigError
from k3jax.data.media import pad_grouped
from k3jax.sharding import batch_sharding, logical_to_spec


def token_sharding(mesh: Mesh) -> NamedSharding:
    """Sharding of a [rows, T] batch array: rows over the batch axes, positions over context."""
    return NamedSharding(mesh, logical_to_spec(("batch", "seq")))


def _range(s: slice, n: int) -> tuple[int, int]:
    return (s.start or 0, n if s.stop is None else s.stop)


def _merged(ranges) -> tuple[tuple[int, int], ...]:
    """Sorted ranges with touching neighbours joined (one slice per contiguous run)."""
    out: list[list[int]] = []
    for a, b in sorted(ranges):
        if out and out[-1][1] == a:
            out[-1][1] = b
        else:
            out.append([a, b])
    return tuple((a, b) for a, b in out)


@dataclasses.dataclass(frozen=True)
class HostFeed:
    """One process's block of a [rows, length] batch (see the module docstring)."""
    sharding: NamedSharding
    rows: int                                   # global rows
    length: int                                 # T
    shard: int                                  # this process's data shard ...
    num_shards: int                             # ... of this many (row groups)
    row_ranges: tuple[tuple[int, int], ...]     # global rows this process holds, in order
    seq_ranges: tuple[tuple[int, int], ...]     # positions this process holds, in order
    shards: tuple[tuple[int, int], ...]         # (shard, num_shards) of every process, by process index

    @property
    def local_rows(self) -> int:
        """Rows of this process's pipeline batches (= global rows / num_shards)."""
        return sum(b - a for a, b in self.row_ranges)

    @property
    def local_length(self) -> int:
        return sum(b - a for a, b in self.seq_ranges)

    def describe(self) -> str:
        """One line: which shard this process reads and which block of the batch it feeds."""
        span = lambda rs: ",".join(f"{a}..{b}" for a, b in rs)  # noqa: E731
        return (f"feeding data shard {self.shard} of {self.num_shards}: rows {span(self.row_ranges)} of {self.rows}, "
                f"positions {span(self.seq_ranges)} of {self.length}")

    def local(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """This shard's [local_rows, T] rows -> the [local_rows, local_length] block this process feeds."""
        out = {}
        for k, v in batch.items():
            v = np.asarray(v)
            if v.shape[:2] != (self.local_rows, self.length):
                raise ValueError(f"batch[{k!r}] is {v.shape}, expected this data shard's "
                                 f"({self.local_rows}, {self.length}, ...)")
            parts = [v[:, a:b] for a, b in self.seq_ranges]
            out[k] = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=1)
        return out

    def put(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """This shard's rows -> global [rows, T] arrays sharded like ``token_sharding``."""
        return {k: jax.make_array_from_process_local_data(self.sharding, v, (self.rows, self.length) + v.shape[2:])
                for k, v in self.local(batch).items()}

    def put_batch(self, raw: dict) -> dict[str, jax.Array]:
        """A pipeline batch onto the devices: the [rows, T] arrays by ``put``; ``"media"`` (grouped
        per row, on the bucket every process uses: ``agree_media``) split over the batch axes like
        the rows, each process giving its own; host-only ``"media_grids"`` stays behind."""
        media = raw.get("media")
        batch = self.put({k: v for k, v in raw.items() if k not in ("media", "media_grids")})
        if media is not None:
            mesh = self.sharding.mesh
            batch["media"] = {k: jax.make_array_from_process_local_data(batch_sharding(mesh, v.ndim), np.asarray(v),
                                                                        (self.rows, *v.shape[1:]))
                              for k, v in media.items()}
        return batch

    def agree_media(self, raw: dict, merge: int, extra: float = 0.0) -> tuple[dict, float]:
        """Several processes: -> (``raw`` with its media padded to the largest patch bucket and frame
        axis of any process, ``extra`` summed over the data shards: processes of one shard hold the
        same rows). One process, or no media: (raw, extra)."""
        media = raw.get("media")
        if media is None or jax.process_count() == 1:
            return raw, extra
        mine = np.asarray([media["patches"].shape[1], media["merge_index"].shape[-1], extra], np.float32)
        every = np.asarray(multihost_utils.process_allgather(mine)).reshape(-1, 3)
        n, frames = int(every[:, 0].max()), int(every[:, 1].max())
        total = float(every[:, 2].sum()) * self.num_shards / jax.process_count()
        if (n, frames) != (media["patches"].shape[1], media["merge_index"].shape[-1]):
            raw = {**raw, "media": pad_grouped(media, merge, n, frames)}
        return raw, total


def host_feed(mesh: Mesh, rows: int, length: int, process: int | None = None,
              process_of=lambda d: d.process_index) -> HostFeed:
    """The block of a [rows, length] batch that ``process`` (default this one) feeds on ``mesh``.

    ``process_of`` maps a device to its process (tests pretend one process's devices are several
    hosts'). Computed from the mesh alone, so every process derives the same shards without
    talking to the others."""
    process = jax.process_index() if process is None else process
    sharding = token_sharding(mesh)
    try:
        index = sharding.devices_indices_map((rows, length))
    except ValueError as e:   # rows or positions that the mesh axes do not divide
        raise ConfigError(f"a batch of {rows} rows x {length} tokens does not split over the mesh "
                          f"{dict(mesh.shape)} (rows over data x fsdp x expert, tokens over context): {e}; "
                          f"change per_device_batch_size or max_target_length") from None
    blocks: dict[int, set] = {}
    for d, (r, s) in index.items():
        blocks.setdefault(process_of(d), set()).add((_range(r, rows), _range(s, length)))
    if process not in blocks:
        raise ValueError(f"process {process} holds no device of the mesh")

    def grid(p):
        rr = tuple(sorted({r for r, _ in blocks[p]}))
        ss = tuple(sorted({s for _, s in blocks[p]}))
        if len(blocks[p]) != len(rr) * len(ss):
            raise ConfigError(f"the mesh {dict(mesh.shape)} gives process {p} a batch block that is not a grid of "
                              f"rows x sequence slices; order the mesh so each host's devices hold whole "
                              f"row ranges x context slices")
        return _merged(rr), _merged(ss)

    groups = sorted({grid(p)[0] for p in blocks})
    flat = sorted(r for g in groups for r in g)
    if any(a[1] > b[0] for a, b in zip(flat, flat[1:])) or len({sum(b - a for a, b in g) for g in groups}) != 1:
        raise ConfigError(f"the mesh {dict(mesh.shape)} splits the {rows} batch rows over the processes unevenly "
                          f"or with overlaps; every host must hold whole, equal row ranges")
    row_ranges, seq_ranges = grid(process)
    shards = tuple((groups.index(grid(p)[0]), len(groups)) for p in sorted(blocks))
    return HostFeed(sharding, rows, length, groups.index(row_ranges), len(groups), row_ranges, seq_ranges, shards)
