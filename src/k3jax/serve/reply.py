"""A request's choices through the engine and back to the client: ``answer`` submits them (all or
none), then streams server-sent events (``stream=true``) or collects one JSON body. Chat replies pass
through a ``ChatTurn``, which parses the generated tokens into content, reasoning and tool calls. A
client that disconnects (mid-stream or while waiting) cancels its choices, which frees their slots at
the engine's next iteration.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json

from fastapi import Request as HttpRequest
from fastapi.responses import StreamingResponse

from k3jax.data import k3_toolcalls
from k3jax.data import toolcalls
from k3jax.serve import protocol as proto
from k3jax.serve.engine import Draining, QueueFull, Request
from k3jax.serve.state import ServerState

RETRY_AFTER_S = 1


async def answer(st: ServerState, http: HttpRequest, body, prompts: list[list[int]], n: int, out: proto.Body,
                 parse: dict | None = None, echo: tuple[list[str], int | None] | None = None,
                 media: tuple | None = None, ban: tuple[int, int] = (-1, -1), boundaries: tuple = ()):
    """Submit the request (per prompt its n choices: the first with the others as its copies; choice
    i of prompt p has index p * n + i, as in OpenAI's API) and answer. ``n``: max tokens per choice.
    ``parse``: a chat request's parser options (None: a completion, its text as generated). ``echo``:
    (each prompt's text, the logprobs to score the prompts' tokens with, or None). ``media``: (the
    processed images, their prefix cache keys) of a chat prompt with images. ``ban``: a token and how
    often each choice may sample it (Request.ban_token / ban: the tool-call opener for
    tool_choice="none"). ``boundaries``: the prompt's turn ends (Request.boundaries)."""
    s = proto.sampling(body, st.max_n)
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()     # (choice index, Event)
    total = len(prompts) * s["n"]
    reqs = [Request(prompt=prompts[j // s["n"]], max_tokens=n, temperature=s["temperature"], top_p=s["top_p"],
                    top_k=s["top_k"], seed=proto.copy_seed(s["seed"], j % s["n"]), stop=s["stop"],
                    logprobs=out.logprobs, id=out.id if total == 1 else f"{out.id}-{j}", ignore_eos=s["ignore_eos"],
                    prompt_logprobs=echo[1] if echo is not None else None,
                    images=media[0] if media else (), media=media[1] if media else (),
                    ban_token=ban[0], ban=ban[1], boundaries=boundaries,
                    sink=lambda ev, j=j: loop.call_soon_threadsafe(events.put_nowait, (j, ev)))
            for j in range(total)]
    groups = [reqs[p:p + s["n"]] for p in range(0, total, s["n"])]
    for g in groups:
        g[0].copies = g[1:]
    _submit(st.engine, groups)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    turns = None
    if parse is not None:
        def parser():
            if st.k3:
                return k3_toolcalls.K3Parser(st.tokenizer, stop=s["stop"], **parse)
            return toolcalls.Parser(st.grammar, st.tokenizer, stop=s["stop"], **parse)
        turns = [ChatTurn(parser(), st.stop_ids, s["ignore_eos"], lambda r=r: st.engine.cancel(r), st.metrics)
                 for r in reqs]
    if body.stream:
        return StreamingResponse(_stream(st, reqs, events, out, include_usage, turns, s["n"]),
                                 media_type="text/event-stream")
    return await _collect(st, http, reqs, events, out, turns, echo, s["n"])


def _submit(engine, groups: list[list[Request]]) -> None:
    """Each group's first request (its copies ride along); a request is answered whole or not at all,
    so a refusal cancels what was already submitted. The engine's refusals -> 429 / 503."""
    submitted: list[Request] = []
    try:
        try:
            for g in groups:
                engine.submit(g[0])
                submitted += g
        except Exception:
            for r in submitted:
                engine.cancel(r)
            raise
    except QueueFull as e:
        raise proto.ApiError(429, f"{e}; retry later", type="rate_limit_error", code="rate_limit_exceeded",
                             headers={"Retry-After": str(RETRY_AFTER_S)}) from None
    except Draining as e:
        raise proto.ApiError(503, str(e), type="server_error", code="shutting_down") from None
    except RuntimeError as e:      # the engine thread died (its traceback is in the server log)
        raise proto.ApiError(503, str(e), type="server_error", code="engine_stopped") from None


async def _stream(st: ServerState, reqs: list[Request], events: asyncio.Queue, out: proto.Body,
                  include_usage: bool, turns: list[ChatTurn] | None, per: int):
    """Server-sent events of every choice as its tokens come (chat: parsed into deltas)."""
    finish: list[str | None] = [None] * len(reqs)
    last: list = [None] * len(reqs)
    first = [True] * len(reqs)
    try:
        while None in finish:
            i, ev = await events.get()
            if finish[i] is not None:       # after a choice that ended early (its cancel's event)
                continue
            if ev.finish_reason in ("cancelled", "error"):
                finish[i] = ev.finish_reason
                if ev.finish_reason == "error":
                    break
                continue
            if turns is None:
                last[i], finish[i] = ev, ev.finish_reason
                if ev.text or ev.logprobs or ev.finish_reason:
                    yield _sse(out.chunk(ev.text, ev.logprobs, ev.finish_reason, index=i))
                continue
            parsed, finish[i] = turns[i].step(ev)
            last[i] = turns[i].last
            deltas = toolcalls.deltas(parsed)
            if first[i]:
                deltas.insert(0, {"role": "assistant", "content": ""})
                first[i] = False
            if not deltas and (ev.logprobs or finish[i]):
                deltas = [{}]
            for j, d in enumerate(deltas):
                yield _sse(out.delta_chunk(d, ev.logprobs if j == 0 else [],
                                           finish[i] if j == len(deltas) - 1 else None, index=i))
        if "error" in finish:
            yield _sse(proto.ApiError(500, "the engine failed", type="server_error").body())
        elif include_usage and any(e is not None for e in last):
            completion = sum(e.completion_tokens for e in last if e is not None)
            yield _sse(out.usage_chunk(_prompt_tokens(reqs, per), completion))
        yield "data: [DONE]\n\n"
    finally:
        for r, f in zip(reqs, finish):
            if f is None:           # the client went away (the generator was closed): free the slot
                st.engine.cancel(r)
        if st.metrics is not None:
            st.metrics.finished(finish[0] or "disconnected")


async def _collect(st: ServerState, http: HttpRequest, reqs: list[Request], events: asyncio.Queue,
                   out: proto.Body, turns: list[ChatTurn] | None, echo: tuple[list[str], int | None] | None,
                   per: int):
    """One JSON body once every choice finished; a client that goes away meanwhile cancels them."""
    texts, entries, prompt_lp = [[] for _ in reqs], [[] for _ in reqs], [[] for _ in reqs]
    getter = asyncio.ensure_future(_drain(events, texts, entries, turns, prompt_lp))
    try:
        while not getter.done():
            await asyncio.wait({getter}, timeout=0.5)
            if not getter.done() and await http.is_disconnected():
                for r in reqs:
                    st.engine.cancel(r)
        finals = getter.result()
    finally:
        if not getter.done():
            getter.cancel()
            for r in reqs:
                st.engine.cancel(r)
    if st.metrics is not None:
        st.metrics.finished(finals[0].finish_reason)
    if any(ev.finish_reason == "error" for ev in finals):
        raise proto.ApiError(500, "the engine failed", type="server_error")
    choices, completion = [], 0
    for i, ev in enumerate(finals):
        if turns is not None:
            ev = dataclasses.replace(turns[i].last or ev, finish_reason=ev.finish_reason)
            choices.append(out.chat_choice(i, toolcalls.message(texts[i]), entries[i], ev.finish_reason))
        elif echo is not None:
            choices.append(out.text_choice(i, echo[0][i // per] + "".join(texts[i]),
                                           prompt_lp[i] + entries[i],
                                           ev.finish_reason))
        else:
            choices.append(out.text_choice(i, "".join(texts[i]), entries[i], ev.finish_reason))
        completion += ev.completion_tokens
    return out.response(choices, _prompt_tokens(reqs, per), completion)


class ChatTurn:
    """One chat request: engine events -> parser events (content, reasoning, tool calls) and the
    finish reason ("tool_calls" when calls were returned). With parallel_tool_calls=false the
    generation is cancelled at the first complete call."""

    def __init__(self, parser: toolcalls.Parser | k3_toolcalls.K3Parser, stop_ids, ignore_eos: bool, cancel,
                 metrics):
        self.parser, self.stop_ids, self.ignore_eos, self.cancel, self.metrics = (
            parser, stop_ids, ignore_eos, cancel, metrics)
        self.last = None            # the last engine event that counted (usage)

    def step(self, ev) -> tuple[list[tuple], str | None]:
        p = self.parser
        self.last = ev
        parsed: list[tuple] = []
        for t in ev.tokens:
            if ev.finish_reason == "stop" and t in self.stop_ids and not self.ignore_eos:
                continue            # the end-of-message token is not text
            parsed += p.feed(t)
        finish = ev.finish_reason
        if p.done:                  # parallel_tool_calls=false: the first call is complete
            self.cancel()
            finish = "tool_calls"
        elif finish is not None:
            parsed += p.finish()
            if p.released:
                finish = "tool_calls"
        if finish is not None and self.metrics is not None:
            self.metrics.parsed(p.released, p.failures)
        return parsed, finish


async def _drain(events: asyncio.Queue, texts: list, entries: list, turns: list[ChatTurn] | None,
                 prompt_lp: list) -> list:
    """(choice, event) pairs until every choice finished -> each choice's last event; per choice its
    text (or, for chat, parser events) and logprob entries appended; the prompt's (echo) to prompt_lp."""
    finals: list = [None] * len(texts)
    while None in finals:
        i, ev = await events.get()
        if finals[i] is not None:
            continue
        if ev.prompt_logprobs is not None:
            prompt_lp[i][:] = ev.prompt_logprobs
            continue
        entries[i].extend(ev.logprobs)
        if turns is not None:
            if ev.finish_reason in ("cancelled", "error"):
                finals[i] = ev
                continue
            parsed, finish = turns[i].step(ev)
            texts[i].extend(parsed)
            if finish is not None:
                finals[i] = dataclasses.replace(ev, finish_reason=finish)
            continue
        texts[i].append(ev.text)
        if ev.finish_reason is not None:
            finals[i] = ev
    return finals


def _prompt_tokens(reqs: list[Request], per: int) -> int:
    """usage.prompt_tokens: each prompt once (``per`` choices per prompt)."""
    return sum(len(r.prompt) for r in reqs[::per])


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
