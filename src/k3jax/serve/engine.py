"""Continuous batching: a queue, a fixed set of slots, and one thread that drives the programs.

The scheduler loop, one iteration at a time:

1. drop cancelled requests (a client that went away) and free their slots (``reset``);
2. move queued requests into free slots (a request with n choices takes n slots at once); with a
   prefix cache, restore into the slot the longest cached prefix of each new prompt
   (``prefix_cache``, keyed by token ids and image digests), which then prefills only the rest;
3. prefill ONE chunk (``serve_prefill_chunk`` tokens) of the oldest request still prefilling, and
   in the same step one chunk of each of the next oldest text prompts, up to ``serve_prefill_batch``
   (``Programs.prefill_rows``; a prompt with images or echo log-probabilities prefills alone): a
   long prompt advances a chunk per iteration, between decode steps, so it never stalls the
   requests that are generating, and a burst of prompts prefills a batch of chunks per decode step;
   a prompt's last chunk yields its first token; the chunk that ends the prompt's last full block
   before its last token saves the prefix into the cache. Before the
   first chunk of a request with images whose pads the cache did not restore, the vision tower runs
   once on its images and on those of every other admitted request still waiting for the tower,
   packed together while they fit the largest compiled patch bucket (``Programs.vision``); each
   request's chunks splice its own rows of that output in (``prefill_media``), and the rows are
   freed when the last of those requests has prefilled (or gone);
4. one decode step for every generating slot at once (``Programs.decode``, in the smallest
   compiled decode bucket that holds them); the new request joins it at the next iteration. During
   a burst (prompt chunks still to prefill after this iteration's, or queued requests that free
   slots could take) the decode step waits, at most ``serve_max_decode_wait`` iterations in a row:
   a decode step costs about the same for few rows as for all (it reads every weight), so the
   rows of a burst start decoding together instead of paying a step each time a few join. While
   no prompt is queued or prefilling, ``serve_decode_steps`` steps run as one program
   (``Programs.decode_steps``), each row's tokens then go through the stop checks one by one (a
   row that stops mid-way drops the rest; its slot is reset anyway).

Each step's work is a ``pod.Step`` (numpy arrays of fixed shapes) sent through ``pod.Link``: in a
multi-process server process 0 plans the steps and broadcasts each one, and every process runs the
same compiled program on it, so only process 0 needs the requests, the text and HTTP.

Tokens become text on this thread (``TextState``), which also applies the stop strings; each
request's ``sink`` receives ``Event`` objects and must be thread-safe (the HTTP layer hands them to
its event loop). A request is finished by an EOS / end-of-message token, a stop string,
``max_tokens``, or the slot's context (max_target_length) running out.

The n choices of one request: the first (with the others in ``copies``) prefills the prompt but its
last token, its slot is copied into theirs (``copy``), and each then decodes the last prompt token
as its first step, so every choice draws its first token with its own seed. A request with
``prompt_logprobs`` (completions echo) prefills with ``prefill_lp``, which also scores the prompt.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import threading
import time
from typing import Callable

import numpy as np

from k3jax.data.reply_text import TextState
from k3jax.inference.sampling import pack_ban
from k3jax.serve.pod import Link, Step, Wire
from k3jax.serve.prefix_cache import PrefixCache


class QueueFull(Exception):
    """Every slot is busy and the queue holds serve_max_queue requests (HTTP 429)."""


class Draining(Exception):
    """The server is shutting down and takes no new requests (HTTP 503)."""


@dataclasses.dataclass
class Event:
    text: str                                  # new text (stop strings held back until resolved)
    tokens: list[int]                          # the token ids this event covers
    logprobs: list[dict]                       # one entry per token when requested (see _logprob_entry)
    finish_reason: str | None = None           # "stop" | "length" | "cancelled" on the last event
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prompt_logprobs: list[dict] | None = None  # echo: one entry per prompt token, the first None


@dataclasses.dataclass(eq=False)
class Request:
    prompt: list[int]
    max_tokens: int
    sink: Callable[[Event], None]
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop: tuple[str, ...] = ()
    logprobs: int | None = None               # alternatives per token (0 = the chosen token only)
    id: str = ""
    ignore_eos: bool = False                  # stop tokens do not end it (fixed-length benchmarks)
    media: tuple = ()                         # (token position, content digest) per media item: prefix cache keys
    images: tuple = ()                        # processed images (vision_processor.MediaItem), pads in prompt
    prompt_logprobs: int | None = None        # echo: alternatives per prompt token (None = not scored)
    ban_token: int = -1                       # a token it may sample only ``ban`` more times (-1: none), counted
    ban: int = -1                             # down as it is sampled; the tool-call opener for tool_choice="none"
                                              # (K3: <|open|> once, the response channel after thinking; K2: 0)
    boundaries: tuple = ()                    # prompt positions where a turn ends: prefix cache snapshot points
    copies: list = dataclasses.field(default_factory=list)   # n > 1: the other choices (they share r's prefill)
    # engine state
    slot: int = -1
    prefilled: int = 0
    media_id: int = -1                        # its image rows in Programs.media: -1 not yet, -2 done or not needed
    media_row: int = 0                        # where its rows start in them (the tower ran on several requests)
    reused: int = 0                           # prompt tokens restored from the prefix cache
    waiting: bool = False                     # a copy whose leader has not finished its prefill
    prompt_entries: list = dataclasses.field(default_factory=list)
    generated: list[int] = dataclasses.field(default_factory=list)
    cancelled: bool = False
    done: bool = False
    submitted: float = 0.0
    first_token_at: float = 0.0
    text: TextState | None = None


class Engine:
    """Owns the slots and the scheduler thread. ``submit`` / ``cancel`` may be called from any
    thread; everything else happens on the engine thread."""

    def __init__(self, programs, tokenizer, *, max_queue: int, stop_ids=(), metrics=None, prefix_cache_bytes: int = 0,
                 max_decode_wait: int = 0):
        self.p, self.tok = programs, tokenizer
        self.max_decode_wait = max_decode_wait   # iterations the decode step may wait for a burst's prefills
        self._decode_waited = 0
        self.slots: list[Request | None] = [None] * programs.slots
        self.queue: collections.deque[Request] = collections.deque()
        self.max_queue, self.stop_ids = max_queue, frozenset(stop_ids)
        self.chunk = programs.buckets[-1]
        self.metrics = metrics
        self.rows = max(programs.row_sizes, default=1)    # prompts one prefill step takes
        media = getattr(programs, "pcfg", None) is not None
        # each step, as every process receives it
        self.link = Link(Wire(programs.slots, self.chunk, self.rows, media_items=programs.media_items if media else 0,
                              patch_dim=programs.pcfg.patch_dim if media else 0))
        if media:
            self.link.warm(programs.patch_buckets)
        self._cv = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._ids = itertools.count()
        self._media_ids = itertools.count()
        self._media_freed: list[int] = []      # rows of requests dropped mid-prefill
        self.tower_runs = 0                    # tower calls (each on the images of one or more requests)
        self.tower_requests = 0                # requests whose images went through the tower
        self._media_refs: dict[int, int] = {}  # rows kept on device -> requests still to splice them
        self.iteration = 0
        self.decode_waits = 0                  # iterations whose decode step waited for prefills
        # (iteration, request ids active in that iteration's decode step) and (iteration, request
        # id) for each first token: how tests see that a request joined a running batch.
        self.decode_log: collections.deque = collections.deque(maxlen=10_000)
        self.prefill_log: collections.deque = collections.deque(maxlen=10_000)     # (iteration, ids of one step)
        self.multi_steps = 0                   # decode_steps programs run (serve_decode_steps tokens each)
        self.first_token_log: collections.deque = collections.deque(maxlen=10_000)
        self.finished_log: collections.deque = collections.deque(maxlen=10_000)   # (id, reason, tokens)
        self.error: BaseException | None = None
        self._weights = None                   # (params, rest, done event, result) waiting to be applied
        # Prefix cache (host index; the pieces live in programs.store). Off without its programs:
        # serve_prefix_cache_bytes = 0, or a block as long as the context.
        self.prefix = (PrefixCache(prefix_cache_bytes, programs.prefix_block, programs.block_bytes,
                                   programs.state_bytes) if prefix_cache_bytes and programs.prefix_block else None)

    # -- any thread -----------------------------------------------------------------------------
    def submit(self, req: Request) -> None:
        with self._cv:
            if self._stopping:
                raise Draining("the server is shutting down")
            if self.error is not None:
                raise RuntimeError(f"the engine stopped: {self.error!r}")
            # Queued requests first fill the free slots (the engine thread admits them at its
            # next iteration); only those beyond the free slots are waiting.
            waiting = sum(1 + len(r.copies) for r in self.queue) - sum(s is None for s in self.slots)
            if waiting + len(req.copies) >= self.max_queue:
                raise QueueFull(f"all {len(self.slots)} slots are busy and {len(self.queue)} requests are queued")
            for i, r in enumerate([req, *req.copies]):
                r.id = r.id or f"req-{next(self._ids)}"
                r.submitted = time.perf_counter()
                r.text = TextState(self.tok, r.stop)
                r.waiting = i > 0
            self.queue.append(req)
            self._cv.notify()

    def cancel(self, req: Request) -> None:
        with self._cv:
            req.cancelled = True
            self._cv.notify()

    def update_weights(self, params, rest=None, timeout: float | None = None) -> int:
        """New parameters for every later step (``Programs.update_weights``: no recompilation),
        applied on the engine thread between two iterations (tokens a running request generates
        after it come from the new weights); the prefix cache moves to the new weight version, so
        nothing computed with the old weights is restored. Blocks until applied -> the new
        version. A multi-process server's other processes hold their own programs: there each
        process updates its programs in the same step, which this single-process call cannot do."""
        if self.link.multi:
            raise RuntimeError("update_weights on a multi-process server: every process must update its own "
                               "programs in the same step; call Programs.update_weights on each")
        done, box = threading.Event(), {}
        with self._cv:
            self._weights = (params, rest, done, box)
            self._cv.notify()
        if self._thread is None or not self._thread.is_alive():
            self._apply_weights()
        if not done.wait(timeout):
            raise TimeoutError(f"the engine did not apply the weights within {timeout} s")
        if "error" in box:
            raise box["error"]
        return box["version"]

    def _apply_weights(self) -> None:
        with self._cv:
            pending, self._weights = self._weights, None
        if pending is None:
            return
        params, rest, done, box = pending
        try:
            box["version"] = version = self.p.update_weights(params, rest)
            if self.prefix is not None:
                for key in self.prefix.set_version(version):
                    self._run_step(Step.ints("drop", key))
        except Exception as e:     # noqa: BLE001 - a wrong tree goes back to the caller, the engine goes on
            box["error"] = e
        finally:
            done.set()

    def stats(self) -> dict:
        with self._cv:
            return {"queue": len(self.queue), "active": sum(s is not None for s in self.slots),
                    "slots": len(self.slots), "prefix_cache_bytes": self.prefix.bytes if self.prefix else 0}

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="k3jax-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Finish every queued and running request, then end the thread."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    # -- engine thread --------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while self._iterate():
                pass
        except BaseException as e:     # noqa: BLE001 - reported to every waiting request
            self.error = e
            with self._cv:
                pending = [r for r in self.slots if r is not None] + list(self.queue)
            for r in pending:
                r.sink(Event("", [], [], finish_reason="error"))
            raise
        finally:
            self.link.send(Step("stop"))   # followers (other processes) stop

    def _iterate(self) -> bool:
        if self._weights is not None:
            self._apply_weights()
        with self._cv:
            freed = self._drop_cancelled()
            admitted = self._admit()
            if not (freed or any(r is not None for r in self.slots)):
                if self._stopping and not self.queue:
                    return False
                self._cv.wait(0.5)
                idle = True
            else:
                idle = False
        if idle:
            self.link.heartbeat()
            return True
        self.iteration += 1
        for slot in freed:
            self._run_step(Step.reset(slot))
        while self._media_freed:
            self._run_step(Step.ints("drop_media", self._media_freed.pop()))
        for r in admitted:
            self._restore(r)
            self._start_copies(r)
        prefilling = [r for r in self.slots if r is not None and not r.waiting and r.prefilled < self._end(r)]
        decoding = [r for r in self.slots if r is not None and not r.waiting and r.prefilled >= self._end(r)]
        if prefilling:
            self._prefill(sorted(prefilling, key=lambda r: r.submitted))
        if decoding and prefilling and self._decode_waited < self.max_decode_wait and self._burst():
            self._decode_waited += 1
            self.decode_waits += 1
        elif decoding:
            self._decode_waited = 0
            self._decode(decoding, steady=not prefilling and not self.queue)
        return True

    def _burst(self) -> bool:
        """Prefill work is left for the next iteration: a prompt still prefilling, or a queued
        request that a free slot could take."""
        if any(r is not None and not r.waiting and r.prefilled < self._end(r) for r in self.slots):
            return True
        with self._cv:
            return bool(self.queue) and 1 + len(self.queue[0].copies) <= sum(s is None for s in self.slots)

    def _drop_cancelled(self) -> list[int]:
        for r in [r for r in self.queue if r.cancelled]:
            self.queue.remove(r)
            for c in [r, *r.copies]:
                self._finish(c, "cancelled")
        freed = []
        for i, r in enumerate(self.slots):
            if r is not None and (r.cancelled or r.done):
                self._release_media(r, later=True)
                if not r.done:
                    self._finish(r, "cancelled")
                    for c in r.copies:      # copies that never started go with their leader
                        c.cancelled = c.cancelled or c.waiting
                self.slots[i] = None
                freed.append(i)
        return freed

    def _admit(self) -> list[Request]:
        out = []
        free = [i for i, s in enumerate(self.slots) if s is None]
        # A request and its n - 1 copies take their slots together; first come, first served.
        while self.queue and 1 + len(self.queue[0].copies) <= len(free):
            r = self.queue.popleft()
            for c in [r, *r.copies]:
                c.slot = free.pop(0)
                self.slots[c.slot] = c
            out.append(r)
        return out

    @staticmethod
    def _end(r: Request) -> int:
        """Prompt tokens r prefills. The copies of an n > 1 request (which share its state) start
        from a copy of its slot before its last prompt token, which each one then decodes itself
        (its own first sample), so the leader stops one short."""
        return len(r.prompt) - 1 if r.copies and r.max_tokens > 0 else len(r.prompt)

    def _start_copies(self, r: Request) -> None:
        """r (with copies) prefilled up to its end: its slot state goes into each copy's slot."""
        if not r.copies or r.prefilled < self._end(r) or not r.copies[0].waiting:
            return
        for c in r.copies:
            if self.slots[c.slot] is c and not c.cancelled:
                self._run_step(Step.ints("copy", r.slot, c.slot))
            # in the cache: the prompt but its last token, which the copy's first decode step feeds
            c.prefilled, c.reused, c.waiting = len(c.prompt), r.reused, False

    def _restore(self, r: Request) -> None:
        """Copy the longest cached prefix of r's prompt into its (zeroed) slot."""
        if self.prefix is None or r.prompt_logprobs is not None:   # echo scores every prompt token
            return
        m = self.prefix.lookup(r.prompt, r.media)
        if m is not None:
            for i, key in enumerate(m.blocks):
                self._run_step(Step.ints("load_block", r.slot, i * self.prefix.block, key))
            self._run_step(Step.ints("load_state", r.slot, m.state))
            r.prefilled = r.reused = m.tokens
        if self.metrics is not None:
            self.metrics.prefix_lookup(r.reused)

    def _start_media(self, r: Request) -> None:
        """Run the tower once on r's images and on those of the other admitted requests waiting for
        it (oldest first, while the packed patches fit a compiled bucket); a request whose pads the
        prefix cache restored needs none."""
        waiting = sorted((q for q in self.slots if q is not None and q is not r and not q.waiting and q.images
                          and q.media_id == -1), key=lambda q: q.submitted)
        group, items = [], []
        for q in [r, *waiting]:
            if self._pads(q)[-1] < q.prefilled:
                q.media_id = -2
            elif not group or (self.p.fits(items + list(q.images))
                               and len(items) + len(q.images) <= self.link.wire.media_items):
                group.append(q)
                items += q.images
        if not group:
            return
        key, row = next(self._media_ids), 0
        self._run_step(Step.vision(key, self.p.media_bucket(items), items))
        for q in group:
            q.media_id, q.media_row = key, row
            row += sum(it.tokens for it in q.images)
        self._media_refs[key] = len(group)
        self.tower_runs += 1
        self.tower_requests += len(group)

    def _release_media(self, r: Request, later: bool = False) -> None:
        """r no longer needs its image rows; the last request holding them frees them (``later``:
        at the next iteration, from the request-dropping path)."""
        if r.media_id < 0:
            return
        key, r.media_id = r.media_id, -2
        self._media_refs[key] -= 1
        if self._media_refs[key] == 0:
            del self._media_refs[key]
            if later:
                self._media_freed.append(key)
            else:
                self._run_step(Step.ints("drop_media", key))

    def _pads(self, r: Request) -> np.ndarray:
        return np.flatnonzero(np.asarray(r.prompt) == self.p.media_pad)

    def _chunk_end(self, r: Request) -> int:
        """Where r's next prefill chunk ends: a chunk on, the end of its prompt, or first its next
        prefix-cache point (a chunk longer than the block stops there so the snapshot can be taken)."""
        end = min(r.prefilled + self.chunk, self._end(r))
        if self.prefix is not None and r.prompt_logprobs is None:
            end = min([end] + [p for p in self.prefix.points(len(r.prompt), r.boundaries) if p > r.prefilled])
        return end

    def _save_prefix(self, r: Request) -> None:
        """r's prefill just ended a chunk: if that is one of its prompt's cache points, save an entry."""
        if self.prefix is None or r.prefilled not in self.prefix.points(len(r.prompt), r.boundaries):
            return
        plan = self.prefix.plan_save(r.prompt, r.media, r.reused, tokens=r.prefilled)
        if plan is None:
            return
        for key in plan.drops:
            self._run_step(Step.ints("drop", key))
        for start, key in plan.blocks:
            self._run_step(Step.ints("save_block", r.slot, start, key))
        self._run_step(Step.ints("save_state", r.slot, plan.state))
        if self.metrics is not None and plan.evicted:
            self.metrics.prefix_evicted(plan.evicted)

    def _sampling(self, r: Request):
        """(temperature, top_k, top_p, seed, counter, ban) of r's next sample."""
        return r.temperature, r.top_k, r.top_p, r.seed & 0xFFFFFFFF, len(r.generated), pack_ban(r.ban_token, r.ban)

    def _prefill(self, prefilling: list[Request]) -> None:
        """One prefill step: the oldest prompt's next chunk, batched with the next oldest text prompts'."""
        text = [r for r in prefilling if not r.images and r.prompt_logprobs is None]
        if self.rows < 2 or len(text) < 2 or text[0] is not prefilling[0]:
            return self._prefill_chunk(prefilling[0])
        group = text[:self.rows]
        pieces = [r.prompt[r.prefilled:self._chunk_end(r)] for r in group]
        sampling = list(zip(*(self._sampling(r) for r in group)))
        self.prefill_log.append((self.iteration, tuple(r.id for r in group)))
        out = self._run_step(Step.prefill_rows([r.slot for r in group], pieces, [r.prefilled for r in group],
                                               *sampling))
        for i, (r, piece) in enumerate(zip(group, pieces)):
            r.prefilled += len(piece)
            self._chunk_done(r, tuple(o[i] for o in out))

    def _prefill_chunk(self, r: Request) -> None:
        self.prefill_log.append((self.iteration, (r.id,)))
        start = r.prefilled
        piece = r.prompt[start:self._chunk_end(r)]
        if r.images and r.media_id == -1:
            self._start_media(r)
        if r.media_id >= 0:       # the k-th pad of the prompt takes row k of its image rows
            first = r.media_row + int(np.searchsorted(self._pads(r), start))
            *sampling, ban = self._sampling(r)
            out = self._run_step(Step.prefill_media(r.slot, piece, start, *sampling, r.media_id, first, ban=ban))
        elif r.prompt_logprobs is None:
            out = self._run_step(Step.prefill(r.slot, piece, start, *self._sampling(r)))
        else:
            targets = r.prompt[start + 1:start + len(piece) + 1]
            *sampling, ban = self._sampling(r)
            out = self._run_step(Step.prefill_lp(r.slot, piece, start, *sampling, targets, ban=ban))
            for t, lp, ids, lps in zip(targets, *out[4:7]):
                r.prompt_entries.append(self._logprob_entry(t, lp, ids, lps, r.prompt_logprobs))
        r.prefilled += len(piece)
        self._chunk_done(r, out)

    def _chunk_done(self, r: Request, out) -> None:
        """r's prefill advanced a chunk (``out``: the sample after its last token): the prefix cache,
        and at the prompt's end its first token, its copies or its echo."""
        self._save_prefix(r)
        if r.prefilled < self._end(r):
            return
        self._release_media(r)
        if r.prompt_logprobs is not None:
            first = {"id": r.prompt[0], "token": self._piece(r.prompt[0]), "logprob": None, "top": None,
                     "bytes": list(self.tok.decode_bytes([r.prompt[0]]))}
            for c in [r, *r.copies]:
                c.sink(Event("", [], [], prompt_logprobs=[first, *r.prompt_entries]))
        if r.max_tokens == 0:           # echo only: the prompt's log-probabilities, nothing generated
            for c in [r, *r.copies]:
                self._finish(c, "length")
        elif r.copies:
            self._start_copies(r)
        else:
            self._accept(r, out[0], out[1], out[2], out[3])

    def _decode(self, rows: list[Request], steady: bool = False) -> None:
        """One decode step for ``rows``; ``steady`` (nothing waits to prefill): the programs' several
        steps in one, when every row has the positions for them and one of them wants more than
        one token."""
        b = len(self.slots)
        tokens, pos, counters, top_k = (np.zeros(b, np.int32) for _ in range(4))
        ban = np.full(b, -1, np.int32)
        seeds = np.zeros(b, np.uint32)
        temperature, top_p = np.zeros(b, np.float32), np.ones(b, np.float32)
        active = np.zeros(b, bool)
        for r in rows:
            i = r.slot
            last = r.generated[-1] if r.generated else r.prompt[-1]    # a copy's first step: the last prompt token
            tokens[i], pos[i], active[i] = last, len(r.prompt) + len(r.generated) - 1, True
            temperature[i], top_k[i], top_p[i], seeds[i], counters[i], ban[i] = self._sampling(r)
        k = self.p.steps
        many = (steady and k > 1 and all(pos[r.slot] + k <= self.p.length for r in rows)
                and any(r.max_tokens - len(r.generated) > 1 for r in rows))
        self.decode_log.append((self.iteration, tuple(sorted(r.id for r in rows))))
        self.multi_steps += many
        out = self._run_step(Step.decode(tokens, pos, active, temperature, top_k, top_p, seeds, counters, ban,
                                         kind="decode_steps" if many else "decode"))
        for j in range(k if many else 1):
            tok, lp, top_ids, top_lp, _ = (o[j] for o in out) if many else out
            for r in rows:
                if not r.done:
                    self._accept(r, tok[r.slot], lp[r.slot], top_ids[r.slot], top_lp[r.slot])

    def _run_step(self, step: Step):
        return self.link.send(step).run(self.p)

    def _accept(self, r: Request, token, lp, top_ids, top_lp) -> None:
        """One new token of request r: text, stop checks, the event to its sink."""
        token = int(token)
        if not r.generated:
            r.first_token_at = time.perf_counter()
            self.first_token_log.append((self.iteration, r.id))
            if self.metrics is not None:
                self.metrics.first_token(r.first_token_at - r.submitted)
        r.generated.append(token)
        if r.ban > 0 and token == r.ban_token:      # one of the times it may sample it is used
            r.ban -= 1
        if self.metrics is not None:
            self.metrics.tokens(1)
        entries = [self._logprob_entry(token, lp, top_ids, top_lp, r.logprobs)] if r.logprobs is not None else []
        finish = None
        if token in self.stop_ids and not r.ignore_eos:
            text, finish = r.text.finish(), "stop"
        else:
            text, hit = r.text.add(token)
            if hit:
                finish = "stop"
        if finish is None and (len(r.generated) >= r.max_tokens
                               or len(r.prompt) + len(r.generated) >= self.p.length):
            text, finish = text + r.text.finish(), "length"
        r.sink(Event(text, [token], entries, finish, len(r.prompt), len(r.generated)))
        if finish is not None:
            r.done = True
            self.finished_log.append((r.id, finish, len(r.generated)))

    def _finish(self, r: Request, reason: str) -> None:
        r.done = True
        self.finished_log.append((r.id, reason, len(r.generated)))
        r.sink(Event("", [], [], reason, len(r.prompt), len(r.generated)))

    def _logprob_entry(self, token, lp, top_ids, top_lp, k: int) -> dict:
        alts = [(int(i), self._piece(int(i)), float(v)) for i, v in zip(top_ids[:k], top_lp[:k])]
        return {"id": token, "token": self._piece(token), "bytes": list(self.tok.decode_bytes([token])),
                "logprob": float(lp), "top": alts}

    def _piece(self, token: int) -> str:
        return self.tok.decode_bytes([token]).decode("utf-8", errors="replace")
