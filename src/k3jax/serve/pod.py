"""Serving from several processes (a pod: K3 in MXFP4 does not fit one host).

Process 0 runs HTTP and the scheduler; every process holds its shards of the weights and of the
slot cache and runs the same compiled programs. Before each device step process 0 broadcasts the
step's inputs (``Step``: decode / prefill chunk / slot reset or copy / prefix cache copy, all fixed-shape numpy) as one int32
vector of a fixed size (``Wire``), with ``multihost_utils.broadcast_one_to_all``; the followers
(``follow``) decode it and run the step, so every process enters the same program with the same
inputs in the same order. While idle, process 0 sends a no-op every half second (a follower never
waits in a collective for long), and a stop when it shuts down.

The tower step (``Step.vision``: ``Programs.vision`` on the images of one or more requests) goes
out in two broadcasts: the vector carries the media id, the patch bucket and each image's grid and
token count; the packed patches follow as one float32 [bucket, 3*p*p] array, a shape per compiled
bucket (``Link.warm`` broadcasts each once at start, so no image compiles anything later). The
followers rebuild the images from the two and run the same tower program; ``prefill_media`` chunks
and ``drop_media`` are wire steps like the others.

In one process the broadcast is the identity, but the engine still sends every step through the
wire format, so the single-process tests exercise the encoding the pod depends on.
"""
from __future__ import annotations

import dataclasses
import signal
import sys

import jax
import numpy as np
from jax.experimental import multihost_utils

from k3jax.data.vision_processor import MediaItem

KINDS = ("stop", "noop", "decode", "prefill", "reset", "save_block", "save_state", "load_block", "load_state", "drop",
         "copy", "prefill_lp", "prefill_media", "drop_media", "prefill_rows", "decode_steps", "vision")
# steps whose inputs are a few ints (a slot, a position, a prefix cache id)
INT_KINDS = ("reset", "save_block", "save_state", "load_block", "load_state", "drop", "copy", "drop_media")


@dataclasses.dataclass
class Step:
    """One unit of device work with all its inputs, the same on every process."""
    kind: str
    args: tuple = ()

    @classmethod
    def decode(cls, tokens, pos, active, temperature, top_k, top_p, seeds, counters, ban=None, kind: str = "decode"):
        """One decode step (``kind="decode_steps"``: the programs' several steps in one). ``ban``: per
        row, how often it may still sample the programs' ``ban_token`` (-1 = always; None: -1 for all)."""
        ban = np.full(len(tokens), -1, np.int32) if ban is None else ban
        return cls(kind, (np.asarray(tokens, np.int32), np.asarray(pos, np.int32), np.asarray(active, bool),
                              np.asarray(temperature, np.float32), np.asarray(top_k, np.int32),
                              np.asarray(top_p, np.float32), np.asarray(seeds, np.uint32),
                              np.asarray(counters, np.int32), np.asarray(ban, np.int32)))

    @classmethod
    def prefill(cls, slot, tokens, pos, temperature, top_k, top_p, seed, counter, ban=-1):
        return cls("prefill", (int(slot), np.asarray(tokens, np.int32), int(pos), float(np.float32(temperature)),
                               int(top_k), float(np.float32(top_p)), int(seed) & 0xFFFFFFFF, int(counter), int(ban)))

    @classmethod
    def prefill_rows(cls, slots, tokens, pos, temperature, top_k, top_p, seeds, counters, ban=None):
        """A chunk of each of several prompts in one step: ``tokens`` a list of chunks, the rest one
        value per prompt."""
        ban = np.full(len(slots), -1, np.int32) if ban is None else ban
        return cls("prefill_rows", (np.asarray(slots, np.int32), [np.asarray(t, np.int32) for t in tokens],
                                    np.asarray(pos, np.int32), np.asarray(temperature, np.float32),
                                    np.asarray(top_k, np.int32), np.asarray(top_p, np.float32),
                                    np.asarray(seeds, np.uint32), np.asarray(counters, np.int32),
                                    np.asarray(ban, np.int32)))

    @classmethod
    def prefill_lp(cls, slot, tokens, pos, temperature, top_k, top_p, seed, counter, targets, ban=-1):
        """A prefill chunk that also scores the prompt (``targets``: the token after each of ``tokens``)."""
        return cls("prefill_lp", cls.prefill(slot, tokens, pos, temperature, top_k, top_p, seed, counter, ban).args
                   + (np.asarray(targets, np.int32),))

    @classmethod
    def prefill_media(cls, slot, tokens, pos, temperature, top_k, top_p, seed, counter, key, first, ban=-1):
        """A prefill chunk whose image pads take the rows kept as ``key`` from row ``first`` on."""
        return cls("prefill_media", cls.prefill(slot, tokens, pos, temperature, top_k, top_p, seed, counter,
                                                ban).args + (int(key), int(first)))

    @classmethod
    def vision(cls, key, bucket, items):
        """The tower on ``items`` (``MediaItem``s, packed into ``bucket`` patches), kept as ``key``."""
        return cls("vision", (int(key), int(bucket), tuple(items)))

    @classmethod
    def reset(cls, slot):
        return cls("reset", (int(slot),))

    @classmethod
    def ints(cls, kind, *args):
        """A reset or a prefix cache step (Programs.save_block / save_state / load_block / load_state / drop)."""
        return cls(kind, tuple(int(a) for a in args))

    def run(self, programs):
        if self.kind == "vision":
            key, _, items = self.args
            return programs.vision(key, items)
        return getattr(programs, self.kind)(*self.args)


def _bits(x, dtype):
    return np.asarray(x, dtype).view(np.int32)


class Wire:
    """Step <-> int32[size] for ``slots`` decode rows, prefill chunks of at most ``max_chunk``,
    batched prefills of at most ``rows`` chunks and tower steps of at most ``media_items`` images
    (their patches, ``patch_dim`` wide, travel apart: ``payload`` / ``attach``)."""

    def __init__(self, slots: int, max_chunk: int, rows: int = 1, media_items: int = 0, patch_dim: int = 0):
        self.b, self.c, self.r = slots, max_chunk, rows
        self.media_items, self.patch_dim = media_items, patch_dim
        self.size = 2 + max(9 * slots, 11 + 2 * max_chunk, rows * (9 + max_chunk), 2 + 4 * media_items)

    def pack(self, step: Step) -> np.ndarray:
        out = np.zeros(self.size, np.int32)
        out[0] = KINDS.index(step.kind)
        if step.kind in ("decode", "decode_steps"):
            tokens, pos, active, temperature, top_k, top_p, seeds, counters, ban = step.args
            cols = [tokens, pos, active.astype(np.int32), _bits(temperature, np.float32), top_k,
                    _bits(top_p, np.float32), _bits(seeds, np.uint32), counters, ban]
            out[2:2 + 9 * self.b] = np.concatenate([np.asarray(c, np.int32) for c in cols])
        elif step.kind in ("prefill", "prefill_lp"):
            slot, tokens, pos, temperature, top_k, top_p, seed, counter, ban = step.args[:9]
            out[1] = len(tokens)
            targets = step.args[9] if step.kind == "prefill_lp" else ()
            out[2:11] = [slot, pos, _bits(temperature, np.float32), top_k, _bits(top_p, np.float32),
                         _bits(seed, np.uint32), counter, len(targets), ban]
            out[11:11 + len(tokens)] = tokens
            out[11 + self.c:11 + self.c + len(targets)] = targets
        elif step.kind == "prefill_media":
            slot, tokens, pos, temperature, top_k, top_p, seed, counter, ban, key, first = step.args
            out[1] = len(tokens)
            out[2:11] = [slot, pos, _bits(temperature, np.float32), top_k, _bits(top_p, np.float32),
                         _bits(seed, np.uint32), counter, 0, ban]
            out[11:11 + len(tokens)] = tokens
            out[11 + self.c:13 + self.c] = [key, first]
        elif step.kind == "prefill_rows":
            slots, tokens, pos, temperature, top_k, top_p, seeds, counters, ban = step.args
            n, r = len(slots), self.r
            lengths = [len(t) for t in tokens]
            cols = [slots, pos, lengths, _bits(temperature, np.float32), top_k, _bits(top_p, np.float32),
                    _bits(seeds, np.uint32), counters, ban]
            out[1] = n
            for j, c in enumerate(cols):
                out[2 + j * r:2 + j * r + n] = np.asarray(c, np.int32)
            for i, t in enumerate(tokens):
                at = 2 + 9 * r + i * self.c
                out[at:at + len(t)] = t
        elif step.kind == "vision":
            key, bucket, items = step.args
            if len(items) > self.media_items:
                raise ValueError(f"a tower step of {len(items)} images; the wire holds {self.media_items}")
            out[1], out[2], out[3] = len(items), key, bucket
            for i, it in enumerate(items):
                out[4 + 4 * i:8 + 4 * i] = [*it.grid_thw, it.tokens]
        elif step.kind in INT_KINDS:
            out[1] = len(step.args)
            out[2:2 + len(step.args)] = step.args
        return out

    def payload(self, step: Step | None, bucket: int) -> np.ndarray:
        """A tower step's images packed into float32 [bucket, patch_dim] (zeros on a follower,
        ``step`` None: what the broadcast overwrites)."""
        out = np.zeros((bucket, self.patch_dim), np.float32)
        if step is not None:
            at = 0
            for it in step.args[2]:
                out[at:at + len(it.patches)] = it.patches
                at += len(it.patches)
        return out

    def attach(self, step: Step, patches: np.ndarray) -> Step:
        """The tower step as received (its images' grids and token counts) with the patches."""
        key, bucket, heads = step.args
        items, at = [], 0
        for t, h, w, tokens in heads:
            n = t * h * w
            items.append(MediaItem(np.asarray(patches[at:at + n]), (t, h, w), tokens, ""))
            at += n
        return Step("vision", (key, bucket, tuple(items)))

    def unpack(self, arr: np.ndarray) -> Step:
        arr = np.asarray(arr, np.int32)
        kind = KINDS[int(arr[0])]
        if kind in ("decode", "decode_steps"):
            c = arr[2:2 + 9 * self.b].reshape(9, self.b)
            return Step.decode(c[0], c[1], c[2].astype(bool), c[3].view(np.float32), c[4], c[5].view(np.float32),
                               c[6].view(np.uint32), c[7], c[8], kind=kind)
        if kind in ("prefill", "prefill_lp"):
            n = int(arr[1])
            h = arr[2:11]
            step = Step.prefill(h[0], arr[11:11 + n], h[1], h[2:3].view(np.float32)[0], h[3],
                                h[4:5].view(np.float32)[0], h[5:6].view(np.uint32)[0], h[6], h[8])
            if kind == "prefill":
                return step
            return Step("prefill_lp", step.args + (arr[11 + self.c:11 + self.c + int(h[7])].copy(),))
        if kind == "prefill_media":
            h = arr[2:11]
            return Step.prefill_media(h[0], arr[11:11 + int(arr[1])], h[1], h[2:3].view(np.float32)[0], h[3],
                                      h[4:5].view(np.float32)[0], h[5:6].view(np.uint32)[0], h[6],
                                      arr[11 + self.c], arr[12 + self.c], ban=h[8])
        if kind == "prefill_rows":
            n, r = int(arr[1]), self.r
            c = arr[2:2 + 9 * r].reshape(9, r)[:, :n]
            tokens = [arr[2 + 9 * r + i * self.c:2 + 9 * r + i * self.c + int(c[2, i])] for i in range(n)]
            return Step.prefill_rows(c[0], tokens, c[1], c[3].view(np.float32), c[4], c[5].view(np.float32),
                                     c[6].view(np.uint32), c[7], c[8])
        if kind in INT_KINDS:
            return Step.ints(kind, *arr[2:2 + int(arr[1])])
        if kind == "vision":     # the images' heads only: ``attach`` adds the patches
            n = int(arr[1])
            heads = tuple(tuple(int(v) for v in arr[4 + 4 * i:8 + 4 * i]) for i in range(n))
            return Step("vision", (int(arr[2]), int(arr[3]), heads))
        return Step(kind)


class Link:
    """Process 0's steps to every process (the identity in a single process)."""

    def __init__(self, wire: Wire):
        self.wire = wire
        self.multi = jax.process_count() > 1

    def _broadcast(self, arr: np.ndarray) -> Step:
        return self.wire.unpack(multihost_utils.broadcast_one_to_all(arr))

    def send(self, step: Step) -> Step:
        """Process 0: the step as every process received it."""
        got = self._broadcast(self.wire.pack(step))
        if got.kind == "vision":
            got = self.wire.attach(got, multihost_utils.broadcast_one_to_all(self.wire.payload(step, got.args[1])))
        return got

    def heartbeat(self) -> None:
        if self.multi:
            self.send(Step("noop"))

    def receive(self) -> Step:
        got = self._broadcast(np.zeros(self.wire.size, np.int32))
        if got.kind == "vision":
            got = self.wire.attach(got, multihost_utils.broadcast_one_to_all(self.wire.payload(None, got.args[1])))
        return got

    def warm(self, buckets) -> None:
        """Every process at start, in the same order: one broadcast of each tower bucket's patch array,
        so the first image of a bucket compiles nothing (the broadcast is a program per shape)."""
        if self.multi:
            for n in buckets:
                multihost_utils.broadcast_one_to_all(self.wire.payload(None, n))


def follow(programs, link: Link) -> int:
    """A process other than 0: run every step process 0 sends until it sends stop. SIGTERM and
    Ctrl-C are left to process 0 (the pod launcher signals every process): it drains its requests,
    and its stop ends this loop, so no collective is left waiting on a process that went away."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: print(f"process {jax.process_index()}: draining with process 0",
                                            file=sys.stderr, flush=True))
    while True:
        step = link.receive()
        if step.kind == "stop":
            return 0
        if step.kind != "noop":
            step.run(programs)
