"""The OpenAI-compatible HTTP API over an ``Engine`` (FastAPI on uvicorn).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (server-sent events with
``stream=true``, ``stream_options.include_usage``), ``GET /v1/models``, ``GET /health``,
``GET /metrics`` (Prometheus text). With ``serve_api_key`` set, every /v1 route wants
``Authorization: Bearer <key>`` (401 otherwise); /health and /metrics stay open for probes.

Errors have OpenAI's body ``{"error": {"message", "type", "param", "code"}}``: 400 for bad
parameters, malformed JSON and a prompt that does not fit the context (``context_length_exceeded``),
401 for a missing or wrong key, 404 for another model's name, 429 with ``Retry-After`` when the
queue is full, 503 while shutting down. A client that disconnects (mid-stream or while waiting)
cancels its request, which frees its slot at the engine's next iteration.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import secrets

from fastapi import FastAPI, Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from k3jax.data.chat_template import chat_ids
from k3jax.serve import protocol as proto
from k3jax.serve import toolcalls
from k3jax.serve.engine import Draining, QueueFull, Request

RETRY_AFTER_S = 1


def _error(e: proto.ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def create_app(engine, tokenizer, *, model_name: str, context: int, api_key: str | None = None,
               metrics=None) -> FastAPI:
    """The ASGI app. ``context`` = cache positions per slot (prompt + completion must fit)."""
    app = FastAPI(title="k3jax", docs_url=None, redoc_url=None, openapi_url=None)
    grammar = toolcalls.Grammar.of(tokenizer)
    stop_ids = frozenset(getattr(engine, "stop_ids", ()))

    @app.exception_handler(proto.ApiError)
    async def api_error(_, e: proto.ApiError):
        if metrics is not None:
            metrics.finished(str(e.status))
        return _error(e)

    @app.exception_handler(RequestValidationError)
    async def invalid(_, e: RequestValidationError):
        first = (e.errors() or [{}])[0]
        loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        msg = "the request body is not valid JSON" if first.get("type") == "json_invalid" else \
            f"{loc or 'body'}: {first.get('msg', 'invalid')}"
        return await api_error(None, proto.ApiError(400, msg, param=loc or None))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_, e: StarletteHTTPException):
        return await api_error(None, proto.ApiError(e.status_code, str(e.detail), code=None))

    def check_key(request: HttpRequest) -> None:
        if api_key is None:
            return
        got = request.headers.get("authorization", "")
        if not (got.startswith("Bearer ") and secrets.compare_digest(got[7:].encode(), api_key.encode())):
            raise proto.ApiError(401, "Incorrect API key provided.", code="invalid_api_key")

    def check_model(name: str | None) -> None:
        if name not in (None, model_name):
            raise proto.ApiError(404, f"The model '{name}' does not exist; this server serves '{model_name}'.",
                                 param="model", code="model_not_found")

    @app.get("/health")
    async def health():
        if engine.error is not None:
            return PlainTextResponse("engine stopped", status_code=503)
        return PlainTextResponse("ok")

    @app.get("/metrics")
    async def prometheus():
        body = metrics.render() if metrics is not None else b""
        return PlainTextResponse(body, media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: HttpRequest):
        check_key(request)
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                            "owned_by": "k3jax", "max_model_len": context}]}

    @app.post("/v1/completions")
    async def completions(body: proto.CompletionRequest, request: HttpRequest):
        check_key(request)
        check_model(body.model)
        proto.check_unsupported(body)
        ids = _prompt_ids(body.prompt, tokenizer)
        k = body.logprobs
        if k is not None and not 0 <= k <= proto.MAX_LOGPROBS:
            raise proto.ApiError(400, f"logprobs={k}: must be between 0 and {proto.MAX_LOGPROBS}", param="logprobs")
        n = proto.max_tokens(body.max_tokens, len(ids), context, default=16, param="max_tokens")
        out = proto.Body("completion", model_name, k, bool(body.return_tokens_as_token_ids))
        return await _serve(request, body, ids, n, out)

    @app.post("/v1/chat/completions")
    async def chat(body: proto.ChatRequest, request: HttpRequest):
        check_key(request)
        check_model(body.model)
        proto.check_unsupported(body)
        if not body.messages:
            raise proto.ApiError(400, "messages: must contain at least one message", param="messages")
        choice, name, names = proto.tool_choice(body)
        if choice in ("required", "named") and grammar is None:
            raise proto.ApiError(400, f"tool_choice={body.tool_choice!r}: this model's tokenizer has no tool-call "
                                 "markup", param="tool_choice")
        try:
            ids = chat_ids(tokenizer, body.messages, tools=body.tools if choice != "none" else None,
                           template_kwargs=proto.template_kwargs(body))
        except (ValueError, KeyError, TypeError) as e:
            raise proto.ApiError(400, f"messages: {e}", param="messages") from None
        forced, prime = ([], []) if grammar is None else toolcalls.forced_tokens(
            grammar, ids, choice, name, index=sum(len(m.get("tool_calls") or []) for m in body.messages
                                                  if isinstance(m, dict) and m.get("role") == "assistant"))
        ids = ids + forced
        parse = dict(tools=names if choice != "none" else None, prime=prime,
                     parallel=body.parallel_tool_calls is not False and choice != "named")
        k = None
        if body.logprobs:
            k = body.top_logprobs or 0
            if not 0 <= k <= proto.MAX_LOGPROBS:
                raise proto.ApiError(400, f"top_logprobs={k}: must be between 0 and {proto.MAX_LOGPROBS}",
                                     param="top_logprobs")
        want = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        n = proto.max_tokens(want, len(ids), context, default=None, param=param)
        out = proto.Body("chat", model_name, k, bool(body.return_tokens_as_token_ids))
        return await _serve(request, body, ids, n, out, parse)

    async def _serve(http: HttpRequest, body, ids: list[int], n: int, out: proto.Body, parse: dict | None = None):
        s = proto.sampling(body)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        req = Request(prompt=ids, max_tokens=n, sink=lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev),
                      temperature=s["temperature"], top_p=s["top_p"], top_k=s["top_k"], seed=s["seed"],
                      stop=s["stop"], logprobs=out.logprobs, id=out.id, ignore_eos=s["ignore_eos"])
        try:
            engine.submit(req)
        except QueueFull as e:
            raise proto.ApiError(429, f"{e}; retry later", type="rate_limit_error", code="rate_limit_exceeded",
                                 headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except Draining as e:
            raise proto.ApiError(503, str(e), type="server_error", code="shutting_down") from None
        except RuntimeError as e:      # the engine thread died (its traceback is in the server log)
            raise proto.ApiError(503, str(e), type="server_error", code="engine_stopped") from None
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        if parse is not None:
            turn = _ChatTurn(toolcalls.Parser(grammar, tokenizer, stop=s["stop"], **parse), stop_ids,
                             s["ignore_eos"], lambda: engine.cancel(req), metrics)
            if body.stream:
                return StreamingResponse(_chat_stream(req, events, out, include_usage, turn),
                                         media_type="text/event-stream")
            return await _collect(http, req, events, out, turn)
        if body.stream:
            return StreamingResponse(_stream(req, events, out, include_usage), media_type="text/event-stream")
        return await _collect(http, req, events, out)

    async def _chat_stream(req: Request, events: asyncio.Queue, out: proto.Body, include_usage: bool,
                           turn: _ChatTurn):
        first, finish, ev = True, None, None
        try:
            while finish is None:
                ev = await events.get()
                if ev.finish_reason in ("cancelled", "error"):
                    finish = ev.finish_reason
                    break
                parsed, finish = turn.step(ev)
                deltas = toolcalls.deltas(parsed)
                if first:
                    deltas.insert(0, {"role": "assistant", "content": ""})
                    first = False
                if not deltas and (ev.logprobs or finish):
                    deltas = [{}]
                for i, d in enumerate(deltas):
                    yield _sse(out.delta_chunk(d, ev.logprobs if i == 0 else [],
                                               finish if i == len(deltas) - 1 else None))
            if finish == "error":
                yield _sse(proto.ApiError(500, "the engine failed", type="server_error").body())
            elif include_usage and turn.last is not None:
                yield _sse(out.usage_chunk(turn.last.prompt_tokens, turn.last.completion_tokens))
            yield "data: [DONE]\n\n"
        finally:
            if finish is None:          # the client went away (the generator was closed): free the slot
                engine.cancel(req)
            if metrics is not None:
                metrics.finished(finish or "disconnected")

    async def _stream(req: Request, events: asyncio.Queue, out: proto.Body, include_usage: bool):
        first, finish, ev = out.kind == "chat", None, None
        try:
            while finish is None:
                ev = await events.get()
                finish = ev.finish_reason
                if finish in ("cancelled", "error"):
                    break
                if ev.text or ev.logprobs or finish or first:
                    yield _sse(out.chunk(ev.text, ev.logprobs, finish, first=first))
                    first = False
            if finish == "error":
                yield _sse(proto.ApiError(500, "the engine failed", type="server_error").body())
            elif include_usage and ev is not None:
                yield _sse(out.usage_chunk(ev.prompt_tokens, ev.completion_tokens))
            yield "data: [DONE]\n\n"
        finally:
            if finish is None:          # the client went away (the generator was closed): free the slot
                engine.cancel(req)
            if metrics is not None:
                metrics.finished(finish or "disconnected")

    async def _collect(http: HttpRequest, req: Request, events: asyncio.Queue, out: proto.Body,
                       turn: _ChatTurn | None = None):
        text, entries, ev = [], [], None
        getter = asyncio.ensure_future(_drain(events, text, entries, turn))
        try:
            while not getter.done():
                await asyncio.wait({getter}, timeout=0.5)
                if not getter.done() and await http.is_disconnected():
                    engine.cancel(req)
            ev = getter.result()
        finally:
            if not getter.done():
                getter.cancel()
                engine.cancel(req)
        if metrics is not None:
            metrics.finished(ev.finish_reason)
        if ev.finish_reason == "error":
            raise proto.ApiError(500, "the engine failed", type="server_error")
        if turn is not None:
            last = turn.last or ev
            return out.chat_full(toolcalls.message(text), entries, ev.finish_reason, last.prompt_tokens,
                                 last.completion_tokens)
        return out.full("".join(text), entries, ev.finish_reason, ev.prompt_tokens, ev.completion_tokens)

    return app


class _ChatTurn:
    """One chat request: engine events -> parser events (content, reasoning, tool calls) and the
    finish reason ("tool_calls" when calls were returned). With parallel_tool_calls=false the
    generation is cancelled at the first complete call."""

    def __init__(self, parser: toolcalls.Parser, stop_ids, ignore_eos: bool, cancel, metrics):
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


async def _drain(events: asyncio.Queue, text: list, entries: list, turn: _ChatTurn | None = None):
    """Events until the finish -> the last event; text (or, for chat, parser events) and logprob entries
    appended."""
    while True:
        ev = await events.get()
        entries.extend(ev.logprobs)
        if turn is not None:
            if ev.finish_reason in ("cancelled", "error"):
                return ev
            parsed, finish = turn.step(ev)
            text.extend(parsed)
            if finish is not None:
                return dataclasses.replace(ev, finish_reason=finish)
            continue
        text.append(ev.text)
        if ev.finish_reason is not None:
            return ev


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _prompt_ids(prompt, tokenizer) -> list[int]:
    """A completions prompt: a string, a list of token ids, or one of either in a list."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt)
    elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        ids = list(prompt)
        bad = [t for t in ids if not 0 <= t < tokenizer.vocab_size]
        if bad:
            raise proto.ApiError(400, f"prompt: token ids {bad[:5]} are outside the vocabulary", param="prompt")
    else:
        raise proto.ApiError(400, "prompt: one prompt per request (a string or a list of token ids)", param="prompt")
    if not ids:
        raise proto.ApiError(400, "prompt: empty", param="prompt")
    return ids
