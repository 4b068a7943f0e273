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

How the code is laid out: the routes are module-level functions (``routes_chat.py``: chat;
``routes.py``: the others) that read one ``state.ServerState`` (engine, tokenizer, settings) from
their request; ``reply.py`` submits a request's choices to the engine and streams or collects the
answer. This module builds the app: the state, the routes and the error handlers.
"""
from __future__ import annotations

from fastapi import FastAPI, Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from k3jax.serve import protocol as proto
from k3jax.serve import routes, routes_chat
from k3jax.serve.state import ServerState, server


def create_app(engine, tokenizer, *, model_name: str, context: int, api_key: str | None = None,
               metrics=None, images: dict | None = None) -> FastAPI:
    """The ASGI app. ``context`` = cache positions per slot (prompt + completion must fit).
    ``images``: a vision model's image settings (``pcfg``, ``pad_id``, ``domains``, ``max_bytes``,
    ``timeout``); None = text only (an image part is a 400)."""
    app = FastAPI(title="k3jax", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = ServerState.of(engine, tokenizer, model_name=model_name, context=context, api_key=api_key,
                                      metrics=metrics, images=images)
    app.add_exception_handler(proto.ApiError, api_error)
    app.add_exception_handler(RequestValidationError, invalid)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.include_router(routes.router)
    app.include_router(routes_chat.router)
    return app


async def api_error(request: HttpRequest, e: proto.ApiError) -> JSONResponse:
    """Every error in OpenAI's body; counted in the metrics by its status."""
    metrics = server(request).metrics
    if metrics is not None:
        metrics.finished(str(e.status))
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def invalid(request: HttpRequest, e: RequestValidationError) -> JSONResponse:
    """A body pydantic rejects (or JSON that does not parse) -> 400 naming the first bad field."""
    first = (e.errors() or [{}])[0]
    loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
    msg = "the request body is not valid JSON" if first.get("type") == "json_invalid" else \
        f"{loc or 'body'}: {first.get('msg', 'invalid')}"
    return await api_error(request, proto.ApiError(400, msg, param=loc or None))


async def http_error(request: HttpRequest, e: StarletteHTTPException) -> JSONResponse:
    """Starlette's own errors (an unknown path, a wrong method) in OpenAI's body."""
    return await api_error(request, proto.ApiError(e.status_code, str(e.detail), code=None))
