"""``POST /v1/chat/completions``: the messages (and tools, images) rendered with the model's chat
template, the tool choice turned into forced or banned tokens, and the reply parsed into content,
reasoning and tool calls (``reply.ChatTurn``). ``chat_prompt`` also serves ``POST /tokenize``.
"""
from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request as HttpRequest

from k3jax.data import k3_toolcalls
from k3jax.data import toolcalls
from k3jax.data.chat_template import chat_ids, k3_template_kwargs
from k3jax.serve import media as mediaio
from k3jax.serve import protocol as proto
from k3jax.serve.reply import answer
from k3jax.serve.state import ServerState, server

router = APIRouter()


@router.post("/v1/chat/completions")
async def chat(body: proto.ChatRequest, request: HttpRequest):
    st = server(request)
    st.check_key(request)
    st.check_model(body.model)
    # K3's format has a response-format turn (an instruction, not constrained decoding); K2's has none.
    proto.check_unsupported(body, allow=("response_format",) if st.k3 else ())
    if not body.messages:
        raise proto.ApiError(400, "messages: must contain at least one message", param="messages")
    proto.check_tool_messages(body.messages)
    choice, name, names = proto.tool_choice(body)
    if choice in ("required", "named") and st.grammar is None and not st.k3:
        raise proto.ApiError(400, f"tool_choice={body.tool_choice!r}: this model's tokenizer has no tool-call "
                             "markup", param="tool_choice")
    items = await _images(st, body.messages)
    ids, bounds, forced, prime = _prompt(st, body, choice, name, items)
    ids = ids + forced
    # tool_choice="none" (or no tools): the tool-call section cannot be opened. K2: its opening token
    # is banned; K3: <|open|> is banned once the reply has opened the channels it must (its response
    # channel after the think channel the prompt opened), so a tools channel never starts.
    ban = (-1, -1)                 # (token, times allowed): Request.ban_token / ban
    if choice == "none" and st.ban_token >= 0:
        ban = (st.ban_token, int(bool(st.think_tag) and ids[-len(st.think_tag):] == st.think_tag))
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
    n = proto.max_tokens(want, len(ids), st.context, default=None, param=param)
    out = proto.Body("chat", st.model_name, k, bool(body.return_tokens_as_token_ids))
    media = (tuple(items), mediaio.media_keys(ids, items, st.images["pad_id"])) if items else None
    return await answer(st, request, body, [ids], n, out, parse, media=media, ban=ban, boundaries=bounds)


def _prompt(st: ServerState, body: proto.ChatRequest, choice: str, name: str | None,
            items: list) -> tuple[list[int], tuple, list[int], list[int]]:
    """-> (the prompt's ids, its turn boundaries, the tokens tool_choice forces after it, the parser's
    view of those forced tokens). K3 keeps its tools declared and says "none" / "required" in a
    tool-choice turn; K2's format drops the tools for "none" and forces its call markup otherwise."""
    media = [it.prompt for it in items] if items else None
    if st.k3:
        try:
            k3_template_kwargs(body.chat_template_kwargs)
        except ValueError as e:
            raise proto.ApiError(400, f"chat_template_kwargs: {e}", param="chat_template_kwargs") from None
        k3_options = {"tool_choice": body.tool_choice if body.tool_choice in ("none", "required") else None,
                      "response_format": proto.response_format(body)}
        kwargs = proto.template_kwargs(body)
        ids = chat_prompt(st, body.messages, body.tools, kwargs, media=media, **k3_options)
        bounds = _boundaries(st, body.messages, body.tools, kwargs, ids, items, k3_options)
        forced, prime = k3_toolcalls.forced_tokens(st.tokenizer, ids, choice, name)
        return ids, bounds, forced, prime
    tools, kwargs = body.tools if choice != "none" else None, proto.template_kwargs(body)
    ids = chat_prompt(st, body.messages, tools, kwargs, media=media)
    bounds = _boundaries(st, body.messages, tools, kwargs, ids, items, {})
    forced, prime = ([], []) if st.grammar is None else toolcalls.forced_tokens(
        st.grammar, ids, choice, name, index=sum(len(m.get("tool_calls") or []) for m in body.messages
                                                 if isinstance(m, dict) and m.get("role") == "assistant"))
    return ids, bounds, forced, prime


def chat_prompt(st: ServerState, messages, tools, kwargs, add_generation_prompt: bool = True, media=None,
                **k3_options) -> list[int]:
    """The chat template's token ids; a conversation it cannot render is a 400."""
    try:
        return chat_ids(st.tokenizer, messages, tools=tools, template_kwargs=kwargs,
                        add_generation_prompt=add_generation_prompt, media=media, **k3_options)
    except (ValueError, KeyError, TypeError) as e:
        raise proto.ApiError(400, f"messages: {e}", param="messages") from None


def _boundaries(st: ServerState, messages, tools, kwargs, ids, items, k3_options) -> tuple:
    """Where the prompt's turns end (the tool declaration, each earlier message): the prefix
    cache keeps snapshots there, so requests sharing a system prompt, tools or earlier turns
    reuse them. A prefix counts only if its own rendering is a token prefix of ``ids``; with
    images none is computed (a prefix would need its own images' prompts). At most the first
    three and the last four boundaries of a long conversation (each is one more rendering)."""
    if getattr(st.engine, "prefix", None) is None or items:
        return ()
    n = len(messages)
    out = []
    for i in sorted(set(range(min(n, 3))) | set(range(max(0, n - 4), n))):
        try:
            pre = chat_ids(st.tokenizer, messages[:i], tools=tools, template_kwargs=kwargs,
                           add_generation_prompt=False, **k3_options)
        except Exception:     # noqa: BLE001 - a prefix the template cannot render alone has no boundary
            continue
        if 0 < len(pre) < len(ids) and ids[:len(pre)] == pre:
            out.append(len(pre))
    return tuple(out)


async def _images(st: ServerState, messages) -> list:
    """The request's images, fetched and processed off the event loop ([] without image parts)."""
    urls = mediaio.image_urls(messages)
    if not urls:
        return []
    if st.images is None:
        raise proto.ApiError(400, f"messages: {len(urls)} image part(s), but this model has no vision tower "
                             "(vision_enabled=false); send text only", param="messages", code="images_not_supported")
    images, p = st.images, st.engine.p
    items = await asyncio.to_thread(mediaio.load_images, urls, images["pcfg"], domains=images["domains"],
                                    max_bytes=images["max_bytes"], timeout=images["timeout"])
    if len(items) > p.media_items:    # only without vision_max_images (media.load_images checks it)
        raise proto.ApiError(400, f"messages: {len(items)} images, over the {p.media_items} one tower call "
                             "takes; send fewer", param="messages", code="too_many_images")
    if not p.fits(items):
        raise proto.ApiError(400, f"messages: the images make {sum(len(it.patches) for it in items)} patches, "
                             f"over the {p.patch_buckets[-1]} the server compiled for (vision_patch_buckets); "
                             "send fewer or smaller images", param="messages", code="images_too_large")
    return items
