"""The OpenAI-compatible HTTP API over an ``Engine`` (FastAPI on uvicorn).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (server-sent events with
``stream=true``, ``stream_options.include_usage``), ``GET /v1/models``, ``GET /health``,
``GET /metrics`` (Prometheus text), and vLLM's ``POST /tokenize``, ``POST /detokenize``,
``GET /tokenizer_info``. ``n`` choices share one prefill (the engine copies the slot); completions
``echo`` returns the prompt (and, with ``logprobs``, its tokens' log-probabilities) first. With
``serve_api_key`` set, every route but /health and /metrics wants ``Authorization: Bearer <key>``
(401 otherwise).

Errors have OpenAI's body ``{"error": {"message", "type", "param", "code"}}``: 400 for bad
parameters, malformed JSON and a prompt that does not fit the context (``context_length_exceeded``),
401 for a missing or wrong key, 404 for another model's name, 429 with ``Retry-After`` when the
queue is full, 503 while shutting down. A client that disconnects (mid-stream or while waiting)
cancels its request, which frees its slot at the engine's next iteration.

Chat messages may hold ``image_url`` parts on a vision model (``k3jax.serve.media``: base64 data:
URIs, http(s) URLs from ``serve_image_url_domains``); each image misuse is a 400.
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

from k3jax.data import k3_chat
from k3jax.data.chat_template import chat_ids, k3_template_kwargs
from k3jax.serve import k3_toolcalls
from k3jax.serve import media as mediaio
from k3jax.serve import protocol as proto
from k3jax.serve import toolcalls
from k3jax.serve.engine import Draining, QueueFull, Request

RETRY_AFTER_S = 1


def _error(e: proto.ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def create_app(engine, tokenizer, *, model_name: str, context: int, api_key: str | None = None,
               metrics=None, images: dict | None = None) -> FastAPI:
    """The ASGI app. ``context`` = cache positions per slot (prompt + completion must fit).
    ``images``: a vision model's image settings (``pcfg``, ``pad_id``, ``domains``, ``max_bytes``,
    ``timeout``); None = text only (an image part is a 400)."""
    app = FastAPI(title="k3jax", docs_url=None, redoc_url=None, openapi_url=None)
    k3 = k3_chat.is_k3(tokenizer)                 # K3's XTML format (data/k3_chat.py, serve/k3_toolcalls.py)
    grammar = None if k3 else toolcalls.Grammar.of(tokenizer)    # K2 / K2.5 / Kimi Linear markup, if any
    ban_token = toolcalls.ban_token(tokenizer)
    think_tag = k3_chat.encode(tokenizer, k3_chat.open_tag("think"))[0] if k3 else []
    max_n = engine.stats()["slots"]       # n may ask for up to every slot (serve_max_batch)
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
        prompts = _prompts(body.prompt, tokenizer)
        k = body.logprobs
        if k is not None and not 0 <= k <= proto.MAX_LOGPROBS:
            raise proto.ApiError(400, f"logprobs={k}: must be between 0 and {proto.MAX_LOGPROBS}", param="logprobs")
        echo = None
        if body.echo:
            if body.stream:
                raise proto.ApiError(400, "echo: not supported with stream=true; send the request without stream",
                                     param="echo")
            echo = ([text if text is not None else tokenizer.decode(ids) for text, ids in prompts], k)
        n = max(proto.max_tokens(body.max_tokens, len(ids), context, default=16, param="max_tokens",
                                 allow_zero=bool(body.echo)) for _, ids in prompts)
        out = proto.Body("completion", model_name, k, bool(body.return_tokens_as_token_ids))
        return await _serve(request, body, [ids for _, ids in prompts], n, out, echo=echo)

    @app.post("/v1/chat/completions")
    async def chat(body: proto.ChatRequest, request: HttpRequest):
        check_key(request)
        check_model(body.model)
        # K3's format has a response-format turn (an instruction, not constrained decoding); K2's has none.
        proto.check_unsupported(body, allow=("response_format",) if k3 else ())
        if not body.messages:
            raise proto.ApiError(400, "messages: must contain at least one message", param="messages")
        proto.check_tool_messages(body.messages)
        choice, name, names = proto.tool_choice(body)
        if choice in ("required", "named") and grammar is None and not k3:
            raise proto.ApiError(400, f"tool_choice={body.tool_choice!r}: this model's tokenizer has no tool-call "
                                 "markup", param="tool_choice")
        items = await _images(body.messages)
        if k3:   # K3 keeps its tools declared and says "none" / "required" in a tool-choice turn
            try:
                k3_template_kwargs(body.chat_template_kwargs)
            except ValueError as e:
                raise proto.ApiError(400, f"chat_template_kwargs: {e}", param="chat_template_kwargs") from None
            k3_options = {"tool_choice": body.tool_choice if body.tool_choice in ("none", "required") else None,
                          "response_format": proto.response_format(body)}
            ids = _chat_prompt(body.messages, body.tools, proto.template_kwargs(body),
                               media=[it.prompt for it in items] if items else None, **k3_options)
            bounds = _boundaries(body.messages, body.tools, proto.template_kwargs(body), ids, items, k3_options)
            forced, prime = k3_toolcalls.forced_tokens(tokenizer, ids, choice, name)
        else:
            ids = _chat_prompt(body.messages, body.tools if choice != "none" else None, proto.template_kwargs(body),
                               media=[it.prompt for it in items] if items else None)
            bounds = _boundaries(body.messages, body.tools if choice != "none" else None, proto.template_kwargs(body),
                                 ids, items, {})
            forced, prime = ([], []) if grammar is None else toolcalls.forced_tokens(
                grammar, ids, choice, name, index=sum(len(m.get("tool_calls") or []) for m in body.messages
                                                      if isinstance(m, dict) and m.get("role") == "assistant"))
        ids = ids + forced
        # tool_choice="none" (or no tools): the tool-call section cannot be opened. K2: its opening token
        # is banned; K3: <|open|> is banned once the reply has opened the channels it must (its response
        # channel after the think channel the prompt opened), so a tools channel never starts.
        ban = (-1, -1)                 # (token, times allowed): Request.ban_token / ban
        if choice == "none" and ban_token >= 0:
            ban = (ban_token, int(bool(think_tag) and ids[-len(think_tag):] == think_tag))
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
        media = (tuple(items), mediaio.media_keys(ids, items, images["pad_id"])) if items else None
        return await _serve(request, body, [ids], n, out, parse, media=media, ban=ban, boundaries=bounds)

    def _boundaries(messages, tools, kwargs, ids, items, k3_options) -> tuple:
        """Where the prompt's turns end (the tool declaration, each earlier message): the prefix
        cache keeps snapshots there, so requests sharing a system prompt, tools or earlier turns
        reuse them. A prefix counts only if its own rendering is a token prefix of ``ids``; with
        images none is computed (a prefix would need its own images' prompts). At most the first
        three and the last four boundaries of a long conversation (each is one more rendering)."""
        if getattr(engine, "prefix", None) is None or items:
            return ()
        n = len(messages)
        out = []
        for i in sorted(set(range(min(n, 3))) | set(range(max(0, n - 4), n))):
            try:
                pre = chat_ids(tokenizer, messages[:i], tools=tools, template_kwargs=kwargs,
                               add_generation_prompt=False, **k3_options)
            except Exception:     # noqa: BLE001 - a prefix the template cannot render alone has no boundary
                continue
            if 0 < len(pre) < len(ids) and ids[:len(pre)] == pre:
                out.append(len(pre))
        return tuple(out)

    async def _images(messages) -> list:
        """The request's images, fetched and processed off the event loop ([] without image parts)."""
        urls = mediaio.image_urls(messages)
        if not urls:
            return []
        if images is None:
            raise proto.ApiError(400, f"messages: {len(urls)} image part(s), but this model has no vision tower "
                                 "(vision_enabled=false); send text only", param="messages", code="images_not_supported")
        items = await asyncio.to_thread(mediaio.load_images, urls, images["pcfg"], domains=images["domains"],
                                        max_bytes=images["max_bytes"], timeout=images["timeout"])
        if len(items) > engine.p.media_items:    # only without vision_max_images (media.load_images checks it)
            raise proto.ApiError(400, f"messages: {len(items)} images, over the {engine.p.media_items} one tower call "
                                 "takes; send fewer", param="messages", code="too_many_images")
        if not engine.p.fits(items):
            raise proto.ApiError(400, f"messages: the images make {sum(len(it.patches) for it in items)} patches, "
                                 f"over the {engine.p.patch_buckets[-1]} the server compiled for (vision_patch_buckets); "
                                 "send fewer or smaller images", param="messages", code="images_too_large")
        return items

    def _chat_prompt(messages, tools, kwargs, add_generation_prompt: bool = True, media=None,
                     **k3_options) -> list[int]:
        try:
            return chat_ids(tokenizer, messages, tools=tools, template_kwargs=kwargs,
                            add_generation_prompt=add_generation_prompt, media=media, **k3_options)
        except (ValueError, KeyError, TypeError) as e:
            raise proto.ApiError(400, f"messages: {e}", param="messages") from None

    # -- vLLM's tokenizer routes (lm-eval's tokenizer_backend=remote) ----------------------------
    @app.post("/tokenize")
    async def tokenize(body: proto.TokenizeRequest, request: HttpRequest):
        check_key(request)
        check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise proto.ApiError(400, "tokenize: send either prompt or messages", param="prompt")
        if body.messages is not None:
            ids = _chat_prompt(body.messages, body.tools, proto.template_kwargs(body), body.add_generation_prompt)
        else:   # special-token strings are the special tokens here, as with Hugging Face tokenizers
            ids = tokenizer.encode_with_special_tokens(body.prompt)
        strs = [tokenizer.decode_bytes([t]).decode("utf-8", errors="replace") for t in ids] \
            if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": context, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(body: proto.DetokenizeRequest, request: HttpRequest):
        check_key(request)
        check_model(body.model)
        bad = [t for t in body.tokens if not 0 <= t < tokenizer.vocab_size]
        if bad:
            raise proto.ApiError(400, f"tokens: ids {bad[:5]} are outside the vocabulary", param="tokens")
        return {"prompt": tokenizer.decode(body.tokens)}

    @app.get("/tokenizer_info")
    async def tokenizer_info(request: HttpRequest):
        check_key(request)
        name = {i: s for s, i in tokenizer.special_ids.items()}
        return {"tokenizer_class": type(tokenizer).__name__, "vocab_size": tokenizer.vocab_size,
                "model_max_length": context, "bos_token": name.get(tokenizer.bos_id),
                "eos_token": name.get(tokenizer.eos_id), "pad_token": name.get(tokenizer.pad_id),
                "bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id, "pad_token_id": tokenizer.pad_id,
                "special_tokens": tokenizer.special_ids, "chat_template": getattr(tokenizer, "chat_template", None)}

    async def _serve(http: HttpRequest, body, prompts: list[list[int]], n: int, out: proto.Body,
                     parse: dict | None = None, echo: tuple[list[str], int | None] | None = None,
                     media: tuple | None = None, ban: tuple[int, int] = (-1, -1), boundaries: tuple = ()):
        """Submit the request (per prompt its n choices: the first with the others as its copies; choice
        i of prompt p has index p * n + i, as in OpenAI's API) and answer. ``echo``: (each prompt's text,
        the logprobs to score the prompts' tokens with, or None). ``media``: (the processed images, their
        prefix cache keys) of a chat prompt with images. ``ban``: a token and how often each choice may
        sample it (Request.ban_token / ban: the tool-call opener for tool_choice="none")."""
        s = proto.sampling(body, max_n)
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
        submitted: list[Request] = []
        try:
            try:
                for g in groups:
                    engine.submit(g[0])
                    submitted += g
            except Exception:
                for r in submitted:     # a request is answered whole or not at all
                    engine.cancel(r)
                raise
        except QueueFull as e:
            raise proto.ApiError(429, f"{e}; retry later", type="rate_limit_error", code="rate_limit_exceeded",
                                 headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except Draining as e:
            raise proto.ApiError(503, str(e), type="server_error", code="shutting_down") from None
        except RuntimeError as e:      # the engine thread died (its traceback is in the server log)
            raise proto.ApiError(503, str(e), type="server_error", code="engine_stopped") from None
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        turns = None
        if parse is not None:
            def parser():
                if k3:
                    return k3_toolcalls.K3Parser(tokenizer, stop=s["stop"], **parse)
                return toolcalls.Parser(grammar, tokenizer, stop=s["stop"], **parse)
            turns = [_ChatTurn(parser(), stop_ids, s["ignore_eos"], lambda r=r: engine.cancel(r), metrics)
                     for r in reqs]
        if body.stream:
            return StreamingResponse(_stream(reqs, events, out, include_usage, turns, s["n"]),
                                     media_type="text/event-stream")
        return await _collect(http, reqs, events, out, turns, echo, s["n"])

    async def _stream(reqs: list[Request], events: asyncio.Queue, out: proto.Body, include_usage: bool,
                      turns: list[_ChatTurn] | None, per: int):
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
                    engine.cancel(r)
            if metrics is not None:
                metrics.finished(finish[0] or "disconnected")

    async def _collect(http: HttpRequest, reqs: list[Request], events: asyncio.Queue, out: proto.Body,
                       turns: list[_ChatTurn] | None, echo: tuple[list[str], int | None] | None, per: int):
        texts, entries, prompt_lp = [[] for _ in reqs], [[] for _ in reqs], [[] for _ in reqs]
        getter = asyncio.ensure_future(_drain(events, texts, entries, turns, prompt_lp))
        try:
            while not getter.done():
                await asyncio.wait({getter}, timeout=0.5)
                if not getter.done() and await http.is_disconnected():
                    for r in reqs:
                        engine.cancel(r)
            finals = getter.result()
        finally:
            if not getter.done():
                getter.cancel()
                for r in reqs:
                    engine.cancel(r)
        if metrics is not None:
            metrics.finished(finals[0].finish_reason)
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

    return app


class _ChatTurn:
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


async def _drain(events: asyncio.Queue, texts: list, entries: list, turns: list[_ChatTurn] | None,
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


def _prompts(prompt, tokenizer) -> list[tuple[str | None, list[int]]]:
    """A completions prompt (a string or a list of token ids) or a list of them -> per prompt (its text
    or None for token ids, its ids)."""
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        return [(p if isinstance(p, str) else None, _prompt_ids(p, tokenizer)) for p in prompt]
    return [(prompt if isinstance(prompt, str) else None, _prompt_ids(prompt, tokenizer))]


def _prompt_ids(prompt, tokenizer) -> list[int]:
    """One completions prompt: a string or a list of token ids."""
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt)
    elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        ids = list(prompt)
        bad = [t for t in ids if not 0 <= t < tokenizer.vocab_size]
        if bad:
            raise proto.ApiError(400, f"prompt: token ids {bad[:5]} are outside the vocabulary", param="prompt")
    else:
        raise proto.ApiError(400, "prompt: a string, a list of token ids, or a list of either", param="prompt")
    if not ids:
        raise proto.ApiError(400, "prompt: empty", param="prompt")
    return ids
