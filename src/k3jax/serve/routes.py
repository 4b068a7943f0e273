"""The routes besides chat: ``POST /v1/completions``, ``GET /v1/models``, ``GET /health``,
``GET /metrics`` (Prometheus text) and vLLM's tokenizer routes (``POST /tokenize``,
``POST /detokenize``, ``GET /tokenizer_info``: lm-eval's ``tokenizer_backend=remote``).
"""
from __future__ import annotations

from fastapi import APIRouter, Request as HttpRequest
from fastapi.responses import PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST

from k3jax.serve import protocol as proto
from k3jax.serve.reply import answer
from k3jax.serve.routes_chat import chat_prompt
from k3jax.serve.state import server

router = APIRouter()


@router.get("/health")
async def health(request: HttpRequest):
    if server(request).engine.error is not None:
        return PlainTextResponse("engine stopped", status_code=503)
    return PlainTextResponse("ok")


@router.get("/metrics")
async def prometheus(request: HttpRequest):
    metrics = server(request).metrics
    body = metrics.render() if metrics is not None else b""
    return PlainTextResponse(body, media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models")
async def models(request: HttpRequest):
    st = server(request)
    st.check_key(request)
    return {"object": "list", "data": [{"id": st.model_name, "object": "model", "created": 0,
                                        "owned_by": "k3jax", "max_model_len": st.context}]}


@router.post("/v1/completions")
async def completions(body: proto.CompletionRequest, request: HttpRequest):
    """Text in, text out; ``echo`` returns the prompt first (with ``logprobs``, its tokens' too)."""
    st = server(request)
    st.check_key(request)
    st.check_model(body.model)
    proto.check_unsupported(body)
    prompts = _prompts(body.prompt, st.tokenizer)
    k = body.logprobs
    if k is not None and not 0 <= k <= proto.MAX_LOGPROBS:
        raise proto.ApiError(400, f"logprobs={k}: must be between 0 and {proto.MAX_LOGPROBS}", param="logprobs")
    echo = None
    if body.echo:
        if body.stream:
            raise proto.ApiError(400, "echo: not supported with stream=true; send the request without stream",
                                 param="echo")
        echo = ([text if text is not None else st.tokenizer.decode(ids) for text, ids in prompts], k)
    n = max(proto.max_tokens(body.max_tokens, len(ids), st.context, default=16, param="max_tokens",
                             allow_zero=bool(body.echo)) for _, ids in prompts)
    out = proto.Body("completion", st.model_name, k, bool(body.return_tokens_as_token_ids))
    return await answer(st, request, body, [ids for _, ids in prompts], n, out, echo=echo)


# -- vLLM's tokenizer routes (lm-eval's tokenizer_backend=remote) --------------------------------
@router.post("/tokenize")
async def tokenize(body: proto.TokenizeRequest, request: HttpRequest):
    st = server(request)
    st.check_key(request)
    st.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise proto.ApiError(400, "tokenize: send either prompt or messages", param="prompt")
    tok = st.tokenizer
    if body.messages is not None:
        ids = chat_prompt(st, body.messages, body.tools, proto.template_kwargs(body), body.add_generation_prompt)
    else:   # special-token strings are the special tokens here, as with Hugging Face tokenizers
        ids = tok.encode_with_special_tokens(body.prompt)
    strs = [tok.decode_bytes([t]).decode("utf-8", errors="replace") for t in ids] \
        if body.return_token_strs else None
    return {"count": len(ids), "max_model_len": st.context, "tokens": ids, "token_strs": strs}


@router.post("/detokenize")
async def detokenize(body: proto.DetokenizeRequest, request: HttpRequest):
    st = server(request)
    st.check_key(request)
    st.check_model(body.model)
    bad = [t for t in body.tokens if not 0 <= t < st.tokenizer.vocab_size]
    if bad:
        raise proto.ApiError(400, f"tokens: ids {bad[:5]} are outside the vocabulary", param="tokens")
    return {"prompt": st.tokenizer.decode(body.tokens)}


@router.get("/tokenizer_info")
async def tokenizer_info(request: HttpRequest):
    st = server(request)
    st.check_key(request)
    tok = st.tokenizer
    name = {i: s for s, i in tok.special_ids.items()}
    return {"tokenizer_class": type(tok).__name__, "vocab_size": tok.vocab_size,
            "model_max_length": st.context, "bos_token": name.get(tok.bos_id),
            "eos_token": name.get(tok.eos_id), "pad_token": name.get(tok.pad_id),
            "bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id,
            "special_tokens": tok.special_ids, "chat_template": getattr(tok, "chat_template", None)}


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
