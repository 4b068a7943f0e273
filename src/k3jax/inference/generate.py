"""Generation over the inference programs: a batch ``generate`` and the ``Generator`` that drives
slots (start a prompt, decode until a stop, continue a live slot with more tokens).

``generate(model, prompts, ...)`` keeps one ``Programs`` per model and shape (batch, cache length,
prefill chunk, mesh, weights' shapes and shardings; the last ``PROGRAMS_PER_MODEL``), built with
one slot per prompt, so a later call with the same shapes compiles nothing; sampling settings, stop
ids and seeds are arguments of the programs, not part of their shape. A prompt prefills in chunks
from position 0 of its own slot (no left padding: each row's cache is what it would be alone);
several text prompts prefill a chunk each per step (``prefill_rows``), a prompt with images alone
(the tower runs once on its images, ``prefill_media`` splices the rows at its pads). Decoding runs
up to ``DECODE_STEPS`` tokens per program call for every live row; a row that samples a stop id
stops on the device, so its slot holds exactly its tokens.

A continued slot (``Generator.extend``): the token the slot last sampled and the new tokens (a
tool's result, the next user turn) prefill after what it holds, and decoding goes on from there:
the tokens equal those of the whole conversation prefilled from scratch, without prefilling it.
"""
from __future__ import annotations

import collections
import dataclasses
import math
import time
import weakref

import jax
import numpy as np
from flax import nnx

from k3jax.inference.programs import MIN_BUCKET, Programs
from k3jax.layers.context import context_size
from k3jax.sharding import MESH_AXES

PROGRAMS_PER_MODEL = 8
MEDIA_PROMPT_MULTIPLE = 64    # with media, the cache length rounds the prompt up to this: other image sizes reuse
MAX_CHUNK = 512               # longest prefill chunk generate() compiles (longer prompts take several)
DECODE_STEPS = 32             # tokens per decode call at most (the host checks budgets and streams between calls)

# Programs per model object, most recent last. Weak keys: a dropped model drops its programs.
_PROGRAMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclasses.dataclass(frozen=True)
class Sampling:
    """One row's sampling: temperature <= 0 is greedy; top_k 0 and top_p 1 are off."""
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0


@dataclasses.dataclass
class Result:
    """``Generator.run``: per row, the new tokens (-1 after a stop, which is kept), their
    log-probabilities under the model (softmax of the raw logits) and under the distribution
    sampled from (0 for a greedy row), and the timing of the call."""
    tokens: np.ndarray
    logprobs: np.ndarray
    sampled_logprobs: np.ndarray
    timing: dict


def _mesh_of(state):
    """The concrete mesh the model's arrays live on: a sharded model's, else a one-device mesh."""
    for x in jax.tree.leaves(state):
        mesh = getattr(getattr(x, "sharding", None), "mesh", None)
        if isinstance(mesh, jax.sharding.Mesh):
            return mesh
    dev = next(iter(jax.tree.leaves(state)[0].devices()))
    return jax.sharding.Mesh(np.array([dev]).reshape((1,) * len(MESH_AXES)), MESH_AXES)


def programs_for(model, *, batch: int, length: int, chunk: int, rows: int, steps: int, media=None):
    """-> (the cached ``Programs`` of ``model`` at these shapes, its weights brought up to the
    model's current arrays (no copy when unchanged), whether it was built now)."""
    gdef, params, rest = nnx.split(model, nnx.Param, ...)
    mesh = _mesh_of((params, rest))
    spec = (batch, length, chunk, rows, steps, mesh, None if media is None else (media[0], media[1]),
            tuple((x.shape, x.dtype, getattr(x, "sharding", None)) for x in jax.tree.leaves((params, rest))))
    cached = _PROGRAMS.setdefault(model, collections.OrderedDict())
    progs = cached.get(spec)
    if progs is not None and progs.gdef == gdef:
        cached.move_to_end(spec)
        if any(a is not b for a, b in zip(jax.tree.leaves((params, rest)), jax.tree.leaves(progs.state))):
            progs.update_weights(params, rest)
        return progs, False
    progs = Programs(model, mesh, slots=batch, length=length, chunk=chunk, decode_sizes=[batch],
                     prefill_rows=rows, decode_steps=steps, media=media, top_logprobs=0)
    progs._one["reset"]        # compiled with the rest of the first call: a reuse resets its slots
    cached[spec] = progs
    while len(cached) > PROGRAMS_PER_MODEL:
        cached.popitem(last=False)
    return progs, True


class Generator:
    """Drives the slots of one ``Programs``. Per slot it keeps the tokens its cache holds
    (``pos``), the token it sampled last and has not fed yet (``pending``), how many it sampled
    (the key counter) and its sampling; every call is on the host, numpy in and out."""

    def __init__(self, programs: Programs):
        self.p = programs
        b = programs.slots
        self.pos = np.zeros(b, np.int64)
        self.pending: list[int | None] = [None] * b
        self.counter = np.zeros(b, np.int64)
        self.sampling = [Sampling() for _ in range(b)]
        self._media_key = 0

    def _cols(self, slots):
        s = [self.sampling[i] for i in slots]
        return ([x.temperature for x in s], [x.top_k for x in s], [x.top_p for x in s],
                [x.seed & 0xFFFFFFFF for x in s], [int(self.counter[i]) for i in slots])

    def start(self, slots, prompts, sampling, media=None) -> dict:
        """Reset ``slots`` and prefill ``prompts`` (one per slot) from position 0 -> {slot: (first
        token, logprob, behaviour logprob)}. ``media``: per prompt, its processed images (or None);
        a prompt with images prefills alone."""
        for slot, smp in zip(slots, sampling):
            if slot in self.p.dirty:       # a fresh cache is zeros: no reset (nor its compile) needed
                self.p.reset(slot)
            self.p.dirty.add(slot)
            self.pos[slot], self.pending[slot], self.counter[slot], self.sampling[slot] = 0, None, 0, smp
        media = media or [None] * len(slots)
        text = [(s, p) for s, p, m in zip(slots, prompts, media) if not m]
        out = self._prefill_text(text)
        for s, p, m in zip(slots, prompts, media):
            if m:
                out[s] = self._prefill_media(s, p, m)
        return out

    def extend(self, slot: int, tokens) -> tuple:
        """Continue a live slot: its pending token and ``tokens`` prefill after what it holds ->
        (next token, logprob, behaviour logprob), sampled with the slot's sampling."""
        ids = ([] if self.pending[slot] is None else [self.pending[slot]]) + list(tokens)
        if not ids:
            raise ValueError(f"slot {slot}: nothing to continue with (no pending token and no new tokens)")
        return self._prefill_text([(slot, ids)])[slot]

    def _check_room(self, slot, n):
        if self.pos[slot] + n > self.p.length:
            raise ValueError(f"slot {slot} holds {self.pos[slot]} tokens; {n} more exceed its "
                             f"{self.p.length} positions")

    def _prefill_text(self, items) -> dict:
        """Prefill each (slot, ids) after the slot's ``pos``, a chunk per row per step (rows
        batched through ``prefill_rows`` when the programs have row buckets)."""
        c = self.p.buckets[-1]
        for slot, ids in items:
            self._check_room(slot, len(ids))
        left = {slot: list(ids) for slot, ids in items}
        result = {}
        while left:
            batch = list(left)[:max(self.p.row_sizes, default=1)]
            chunks = [left[s][:c] for s in batch]
            pos = [int(self.pos[s]) for s in batch]
            if self.p.row_sizes:
                out = self.p.prefill_rows(batch, chunks, pos, *self._cols(batch), [-1] * len(batch))
                outs = [tuple(o[i] for o in out) for i in range(len(batch))]
            else:
                cols = [x[0] for x in self._cols(batch)]
                outs = [self.p.prefill(batch[0], chunks[0], pos[0], *cols, -1)]
            for s, ch, o in zip(batch, chunks, outs):
                self.pos[s] += len(ch)
                left[s] = left[s][len(ch):]
                if not left[s]:
                    del left[s]
                    result[s] = self._sampled(s, o)
        return result

    def _prefill_media(self, slot, ids, items) -> tuple:
        """One prompt with images: the tower on its images once, then its chunks, each pad taking
        the next row of the tower's output."""
        self._check_room(slot, len(ids))
        key, self._media_key = self._media_key, self._media_key + 1
        self.p.vision(key, items)
        pads = np.flatnonzero(np.asarray(ids) == self.p.media_pad)
        c, start = self.p.buckets[-1], 0
        try:
            while start < len(ids):
                chunk = ids[start:start + c]
                first = int(np.searchsorted(pads, start))
                cols = [x[0] for x in self._cols([slot])]
                out = self.p.prefill_media(slot, chunk, int(self.pos[slot]), *cols[:5], -1, key, first)
                self.pos[slot] += len(chunk)
                start += len(chunk)
        finally:
            self.p.drop_media(key)
        return self._sampled(slot, out)

    def _sampled(self, slot, out) -> tuple:
        tok = int(out[0])
        self.pending[slot] = tok
        self.counter[slot] += 1
        return tok, float(out[1]), float(out[4])

    def decode(self, slots, budgets, stop_ids=(), on_step=None) -> dict:
        """Decode each slot until it samples a stop id or has sampled its budget of new tokens
        (counting the one its prefill sampled) -> {slot: (tokens, logprobs, behaviour logprobs)}
        of the tokens sampled here. ``on_step(tokens [B])``: each step's token per slot (-1 for a
        slot not generating), in order."""
        got = {s: ([], [], []) for s in slots}
        live = [s for s, n in zip(slots, budgets) if n > 0 and self.pending[s] not in stop_ids]
        budget = dict(zip(slots, budgets))
        b = self.p.slots
        while live:
            steps = min(self.p.steps, *(budget[s] - len(got[s][0]) for s in live))
            for s in live:
                self._check_room(s, steps)
            tokens, pos, ctr, topk = (np.zeros(b, np.int32) for _ in range(4))
            temp, topp, seeds = np.zeros(b, np.float32), np.ones(b, np.float32), np.zeros(b, np.uint32)
            active = np.zeros(b, bool)
            for s in live:
                tokens[s], pos[s], active[s], ctr[s] = self.pending[s], self.pos[s], True, self.counter[s]
                sm = self.sampling[s]
                temp[s], topk[s], topp[s], seeds[s] = sm.temperature, sm.top_k, sm.top_p, sm.seed & 0xFFFFFFFF
            tok, lp, _, _, blp = self.p.decode_steps(tokens, pos, active, temp, topk, topp, seeds, ctr,
                                                     np.full(b, -1, np.int32), steps=steps, stop=tuple(stop_ids))
            for j in range(steps):
                row = np.full(b, -1, np.int32)
                for s in list(live):
                    t = int(tok[j, s])
                    self.pos[s] += 1          # the pending token went into the cache
                    self.pending[s] = t
                    self.counter[s] += 1
                    got[s][0].append(t)
                    got[s][1].append(float(lp[j, s]))
                    got[s][2].append(float(blp[j, s]))
                    row[s] = t
                    if t in stop_ids or len(got[s][0]) >= budget[s]:
                        live.remove(s)
                if on_step is not None:
                    on_step(row)
        return got

    def run(self, prompts, *, max_new_tokens: int, sampling: Sampling | list[Sampling] = Sampling(),
            stop_ids=(), media=None, on_tokens=None) -> Result:
        """Prompts into slots 0..B-1, each decoded to ``max_new_tokens`` or a stop id."""
        b = len(prompts)
        sampling = sampling if isinstance(sampling, list) else [
            dataclasses.replace(sampling, seed=(sampling.seed * 0x9E3779B1 + i) & 0xFFFFFFFF) for i in range(b)]
        stop = tuple(int(t) for t in stop_ids)
        c0 = self.p.compile_s
        t0 = time.perf_counter()
        first = self.start(list(range(b)), prompts, sampling, media)
        c1 = self.p.compile_s
        t1 = time.perf_counter()
        out = np.full((b, max_new_tokens), -1, np.int32)
        lps, blps = np.zeros((b, max_new_tokens), np.float32), np.zeros((b, max_new_tokens), np.float32)
        for i in range(b):
            out[i, 0], lps[i, 0], blps[i, 0] = first[i]
        if on_tokens is not None:
            on_tokens(0, out[:, 0].copy())
        step = [0]

        def on_step(row):
            step[0] += 1
            if on_tokens is not None:
                on_tokens(step[0], row)

        more = self.decode(list(range(b)), [max_new_tokens - 1] * b, stop, on_step)
        for i, (t, lp, blp) in more.items():
            out[i, 1:1 + len(t)], lps[i, 1:1 + len(t)], blps[i, 1:1 + len(t)] = t, lp, blp
        t2 = time.perf_counter()
        c2 = self.p.compile_s
        n_new = int((out >= 0).sum())
        t_prefill, t_decode = max(t1 - t0 - (c1 - c0), 1e-9), max(t2 - t1 - (c2 - c1), 1e-9)
        timing = {"prefill_tokens_per_s": sum(map(len, prompts)) / t_prefill, "decode_tokens_per_s": n_new / t_decode,
                  "prefill_s": t_prefill, "decode_s": t_decode, "new_tokens": n_new, "compile_s": c2 - c0}
        return Result(out, lps, blps, timing)


def _split_media(prompts, media, pad_id):
    """The flat list of images (in order over the rows) -> each row's images, by its pad count."""
    per_row, items = [], list(media)
    for p in prompts:
        want, row = int(np.sum(np.asarray(p) == pad_id)), []
        while want > 0 and items:
            row.append(items.pop(0))
            want -= row[-1].tokens
        if want != 0:
            raise ValueError(f"a prompt's {int(np.sum(np.asarray(p) == pad_id))} media pads do not match its images")
        per_row.append(row or None)
    if items:
        raise ValueError(f"{len(items)} images left over: the prompts hold fewer media pads than the images need")
    return per_row


def generator_for(model, prompts, max_new_tokens: int, *, media=None, media_pad_id=None, processor=None):
    """-> a ``Generator`` over the cached programs for this batch's shapes: one slot per prompt, a
    cache of the longest prompt plus ``max_new_tokens`` (rounded up to ``MEDIA_PROMPT_MULTIPLE``
    with images, and to the context axis), a prefill chunk of the longest prompt (a power of two
    from ``MIN_BUCKET``, at most ``MAX_CHUNK``)."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens is {max_new_tokens}; generate at least 1")
    b, p = len(prompts), max(len(x) for x in prompts)
    if min(len(x) for x in prompts) < 1:
        raise ValueError("an empty prompt: every prompt needs at least one token")
    cp = context_size()
    if media is not None:
        p = -(-p // MEDIA_PROMPT_MULTIPLE) * MEDIA_PROMPT_MULTIPLE
    length = -(-(p + max_new_tokens) // cp) * cp
    chunk = min(MAX_CHUNK, max(MIN_BUCKET, 1 << math.ceil(math.log2(max(p, 1)))))
    steps = max(1, min(DECODE_STEPS, max_new_tokens - 1))
    progs, _ = programs_for(model, batch=b, length=length, chunk=chunk, rows=b, steps=steps,
                            media=None if media is None else (processor, media_pad_id))
    return Generator(progs)


def generate(model, prompts: list[list[int]], *, max_new_tokens: int, stop_ids=(), greedy=True,
             temperature=1.0, top_k=0, top_p=1.0, seed=0, on_tokens=None, pad_id=0, media=None,
             media_pad_id=None, processor=None):
    """Returns (new tokens [B, max_new_tokens] with -1 after a row stopped (the stop token kept),
    timing dict). Call it under ``jax.set_mesh(mesh)`` for a sharded model.

    The timing dict: prefill and decode seconds and tokens/s (compilation excluded), and
    ``compile_s``, the seconds this call spent compiling: 0 when an earlier call on the same model
    object had the same batch size, cache length and prefill chunk (see ``generator_for``) and
    mesh. ``on_tokens(i, tokens [B])``: step i's tokens (-1 for a row that stopped), in order.

    ``media``: the prompts' processed images (``vision_processor.MediaItem``s, in order over the
    rows), whose ``media_pad_id`` runs the prompts already hold; ``processor`` is the
    ProcessorConfig that bucketed them. Image sets in the same patch bucket share the programs.
    ``pad_id`` is unused (no row is padded) and kept for callers of the left-padded path."""
    del pad_id
    gen = generator_for(model, prompts, max_new_tokens, media=media, media_pad_id=media_pad_id, processor=processor)
    per_row = None if media is None else _split_media(prompts, media, media_pad_id)
    smp = Sampling(0.0 if greedy else max(temperature, 1e-6), top_k, top_p, seed)
    res = gen.run(prompts, max_new_tokens=max_new_tokens, sampling=smp, stop_ids=stop_ids, media=per_row,
                  on_tokens=on_tokens)
    return res.tokens, res.timing

