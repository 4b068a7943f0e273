"""Serving from several processes (a pod: K3 in MXFP4 does not fit one host).

Process 0 runs HTTP and the scheduler; every process holds its shards of the weights and of the
slot cache and runs the same compiled programs. Before each device step process 0 broadcasts the
step's inputs (``Step``: decode / prefill chunk / slot reset or copy / prefix cache copy, all fixed-shape numpy) as one int32
vector of a fixed size (``Wire``), with ``multihost_utils.broadcast_one_to_all``; the followers
(``follow``) decode it and run the step, so every process enters the same program with the same
inputs in the same order. While idle, process 0 sends a no-op every half second (a follower never
waits in a collective for long), and a stop when it shuts down.

Images are served by one process only: a request's packed patches are far larger than a step's
vector, so the tower step (``Programs.vision``) is not broadcast, and a pod answers image requests
with a 400 (their ``prefill_media`` chunks and ``drop_media`` are wire steps like the others).

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

KINDS = ("stop", "noop", "decode", "prefill", "reset", "save_block", "save_state", "load_block", "load_state", "drop",
         "copy", "prefill_lp", "prefill_media", "drop_media", "prefill_rows", "decode_steps")
# steps whose inputs are a few ints (a slot, a position, a prefix cache id)
INT_KINDS = ("reset", "save_block", "save_state", "load_block", "load_state", "drop", "copy", "drop_media")


@dataclasses.dataclass
class Step:
    """One unit of device work with all its inputs, the same on every process."""
    kind: str
    args: tuple = ()

    @classmethod
    def decode(cls, tokens, pos, active, temperature, top_k, top_p, seeds, counters, kind: str = "decode"):
        """One decode step (``kind="decode_steps"``: the programs' several steps in one)."""
        return cls(kind, (np.asarray(tokens, np.int32), np.asarray(pos, np.int32), np.asarray(active, bool),
                              np.asarray(temperature, np.float32), np.asarray(top_k, np.int32),
                              np.asarray(top_p, np.float32), np.asarray(seeds, np.uint32),
                              np.asarray(counters, np.int32)))

    @classmethod
    def prefill(cls, slot, tokens, pos, temperature, top_k, top_p, seed, counter):
        return cls("prefill", (int(slot), np.asarray(tokens, np.int32), int(pos), float(np.float32(temperature)),
                               int(top_k), float(np.float32(top_p)), int(seed) & 0xFFFFFFFF, int(counter)))

    @classmethod
    def prefill_rows(cls, slots, tokens, pos, temperature, top_k, top_p, seeds, counters):
        """A chunk of each of several prompts in one step: ``tokens`` a list of chunks, the rest one
        value per prompt."""
        return cls("prefill_rows", (np.asarray(slots, np.int32), [np.asarray(t, np.int32) for t in tokens],
                                    np.asarray(pos, np.int32), np.asarray(temperature, np.float32),
                                    np.asarray(top_k, np.int32), np.asarray(top_p, np.float32),
                                    np.asarray(seeds, np.uint32), np.asarray(counters, np.int32)))

    @classmethod
    def prefill_lp(cls, slot, tokens, pos, temperature, top_k, top_p, seed, counter, targets):
        """A prefill chunk that also scores the prompt (``targets``: the token after each of ``tokens``)."""
        return cls("prefill_lp", cls.prefill(slot, tokens, pos, temperature, top_k, top_p, seed, counter).args
                   + (np.asarray(targets, np.int32),))

    @classmethod
    def prefill_media(cls, slot, tokens, pos, temperature, top_k, top_p, seed, counter, key, first):
        """A prefill chunk whose image pads take the rows kept as ``key`` from row ``first`` on."""
        return cls("prefill_media", cls.prefill(slot, tokens, pos, temperature, top_k, top_p, seed, counter).args
                   + (int(key), int(first)))

    @classmethod
    def reset(cls, slot):
        return cls("reset", (int(slot),))

    @classmethod
    def ints(cls, kind, *args):
        """A reset or a prefix cache step (Programs.save_block / save_state / load_block / load_state / drop)."""
        return cls(kind, tuple(int(a) for a in args))

    def run(self, programs):
        return getattr(programs, self.kind)(*self.args)


def _bits(x, dtype):
    return np.asarray(x, dtype).view(np.int32)


class Wire:
    """Step <-> int32[size] for ``slots`` decode rows, prefill chunks of at most ``max_chunk`` and
    batched prefills of at most ``rows`` chunks."""

    def __init__(self, slots: int, max_chunk: int, rows: int = 1):
        self.b, self.c, self.r = slots, max_chunk, rows
        self.size = 2 + max(8 * slots, 10 + 2 * max_chunk, rows * (8 + max_chunk))

    def pack(self, step: Step) -> np.ndarray:
        out = np.zeros(self.size, np.int32)
        out[0] = KINDS.index(step.kind)
        if step.kind in ("decode", "decode_steps"):
            tokens, pos, active, temperature, top_k, top_p, seeds, counters = step.args
            cols = [tokens, pos, active.astype(np.int32), _bits(temperature, np.float32), top_k,
                    _bits(top_p, np.float32), _bits(seeds, np.uint32), counters]
            out[2:2 + 8 * self.b] = np.concatenate([np.asarray(c, np.int32) for c in cols])
        elif step.kind in ("prefill", "prefill_lp"):
            slot, tokens, pos, temperature, top_k, top_p, seed, counter = step.args[:8]
            out[1] = len(tokens)
            targets = step.args[8] if step.kind == "prefill_lp" else ()
            out[2:10] = [slot, pos, _bits(temperature, np.float32), top_k, _bits(top_p, np.float32),
                         _bits(seed, np.uint32), counter, len(targets)]
            out[10:10 + len(tokens)] = tokens
            out[10 + self.c:10 + self.c + len(targets)] = targets
        elif step.kind == "prefill_media":
            slot, tokens, pos, temperature, top_k, top_p, seed, counter, key, first = step.args
            out[1] = len(tokens)
            out[2:10] = [slot, pos, _bits(temperature, np.float32), top_k, _bits(top_p, np.float32),
                         _bits(seed, np.uint32), counter, 0]
            out[10:10 + len(tokens)] = tokens
            out[10 + self.c:12 + self.c] = [key, first]
        elif step.kind == "prefill_rows":
            slots, tokens, pos, temperature, top_k, top_p, seeds, counters = step.args
            n, r = len(slots), self.r
            lengths = [len(t) for t in tokens]
            cols = [slots, pos, lengths, _bits(temperature, np.float32), top_k, _bits(top_p, np.float32),
                    _bits(seeds, np.uint32), counters]
            out[1] = n
            for j, c in enumerate(cols):
                out[2 + j * r:2 + j * r + n] = np.asarray(c, np.int32)
            for i, t in enumerate(tokens):
                at = 2 + 8 * r + i * self.c
                out[at:at + len(t)] = t
        elif step.kind in INT_KINDS:
            out[1] = len(step.args)
            out[2:2 + len(step.args)] = step.args
        return out

    def unpack(self, arr: np.ndarray) -> Step:
        arr = np.asarray(arr, np.int32)
        kind = KINDS[int(arr[0])]
        if kind in ("decode", "decode_steps"):
            c = arr[2:2 + 8 * self.b].reshape(8, self.b)
            return Step.decode(c[0], c[1], c[2].astype(bool), c[3].view(np.float32), c[4], c[5].view(np.float32),
                               c[6].view(np.uint32), c[7], kind=kind)
        if kind in ("prefill", "prefill_lp"):
            n = int(arr[1])
            h = arr[2:10]
            step = Step.prefill(h[0], arr[10:10 + n], h[1], h[2:3].view(np.float32)[0], h[3],
                                h[4:5].view(np.float32)[0], h[5:6].view(np.uint32)[0], h[6])
            if kind == "prefill":
                return step
            return Step("prefill_lp", step.args + (arr[10 + self.c:10 + self.c + int(h[7])].copy(),))
        if kind == "prefill_media":
            h = arr[2:10]
            return Step.prefill_media(h[0], arr[10:10 + int(arr[1])], h[1], h[2:3].view(np.float32)[0], h[3],
                                      h[4:5].view(np.float32)[0], h[5:6].view(np.uint32)[0], h[6],
                                      arr[10 + self.c], arr[11 + self.c])
        if kind == "prefill_rows":
            n, r = int(arr[1]), self.r
            c = arr[2:2 + 8 * r].reshape(8, r)[:, :n]
            tokens = [arr[2 + 8 * r + i * self.c:2 + 8 * r + i * self.c + int(c[2, i])] for i in range(n)]
            return Step.prefill_rows(c[0], tokens, c[1], c[3].view(np.float32), c[4], c[5].view(np.float32),
                                     c[6].view(np.uint32), c[7])
        if kind in INT_KINDS:
            return Step.ints(kind, *arr[2:2 + int(arr[1])])
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
        return self._broadcast(self.wire.pack(step))

    def heartbeat(self) -> None:
        if self.multi:
            self.send(Step("noop"))

    def receive(self) -> Step:
        return self._broadcast(np.zeros(self.wire.size, np.int32))


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
