"""Kimi K2-style chat template rendered straight to ids, plus a jinja path for parity checks.

Shape (formats.md §3.5), one turn per message, no separators between turns:

    if tools:    <|im_system|>tool_declare<|im_middle|>{tools json}<|im_end|>
    if messages[0] is not system:
                 <|im_system|>system<|im_middle|>{DEFAULT_SYSTEM}<|im_end|>
    per message: <|im_{user|assistant|system}|>{name or role}<|im_middle|>{content}[calls]<|im_end|>
    role "tool": <|im_system|>tool<|im_middle|>## Return of {tool_call_id}\n{content}<|im_end|>
    generation:  <|im_assistant|>assistant<|im_middle|>
    [calls]:     <|tool_calls_section_begin|>, per call <|tool_call_begin|>{id or
                 functions.NAME:IDX}<|tool_call_argument_begin|>{arguments json}
                 <|tool_call_end|>, then <|tool_calls_section_end|>

Control tokens are inserted as ids; everything a message carries (content, names, ids, tool
arguments) is encoded as ORDINARY text, so a user typing "<|im_end|>" cannot end a turn. The
loss mask is 1 on exactly the tokens the assistant produces: its content, tool calls and the
closing <|im_end|> (the stop token it must learn), 0 on headers, prompts and other roles.

A K3 tokenizer (its `<|open|>` / `<|close|>` / `<|sep|>` / `<|end_of_msg|>` control tokens present)
is rendered by k3jax's native K3 renderer (`k3_chat`, formats.md §3.5a) in `render` and `chat_ids`
alike, whether or not its directory ships a jinja template: the family decides, not the file. For
the others, `chat_ids` renders the checkpoint's own jinja template (K2, K2.5, Kimi Linear) in a
sandbox to ids, with the same rule that message text stays ordinary text; `render` is the built-in
K2 markup for tokenizers that ship no template.
"""
from __future__ import annotations

import json
import os
import re
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

from k3jax.data import k3_chat
from k3jax.data.messages import check_media, content_parts, content_text
from k3jax.data.tokenizer import CHAT_TOKENS, KimiTokenizer, TokenizerError

DEFAULT_SYSTEM = "You are Kimi, an AI assistant created by Moonshot AI."
ROLE_TOKEN = {"user": "<|im_user|>", "assistant": "<|im_assistant|>", "system": "<|im_system|>"}

Message = Mapping[str, Any]
# A rendered piece: ("special", name) a prompt-side control token, ("special_out", name) one the
# assistant emits (mask 1), or ("text", (str, mask)) ordinary text.
_Segment = tuple[str, Any]


def _tool_call_segments(calls: Sequence[Mapping[str, Any]]) -> list[_Segment]:
    """The assistant's tool-call section (all of it is assistant output: mask 1)."""
    segs: list[_Segment] = [("special_out", "<|tool_calls_section_begin|>")]
    for idx, call in enumerate(calls):
        fn = call["function"]
        call_id = call.get("id") or f"functions.{fn['name']}:{idx}"
        args = fn["arguments"]
        # transformers' `tojson` filter is json.dumps(ensure_ascii=False) with default spacing.
        args_text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        segs += [("special_out", "<|tool_call_begin|>"), ("text", (str(call_id), 1)),
                 ("special_out", "<|tool_call_argument_begin|>"), ("text", (args_text, 1)),
                 ("special_out", "<|tool_call_end|>")]
    segs.append(("special_out", "<|tool_calls_section_end|>"))
    return segs


def _segments(messages: Sequence[Message], *, add_generation_prompt: bool,
              tools: Sequence[Mapping[str, Any]] | None,
              default_system: str | None, media: Sequence[str] | None = None) -> list[_Segment]:
    """Template structure as ("special", name) / ("text", (str, mask)) / ("media", prompt) pieces,
    in order; image part i becomes ("media", media[i]) (prompt-side, mask 0)."""
    check_media(messages, media)
    images = iter(media or ())
    segs: list[_Segment] = []
    if tools:
        segs += [("special", "<|im_system|>"), ("text", ("tool_declare", 0)),
                 ("special", "<|im_middle|>"),
                 ("text", (json.dumps(list(tools), ensure_ascii=False), 0)),
                 ("special", "<|im_end|>")]
    if messages and messages[0].get("role") != "system" and default_system is not None:
        segs += [("special", "<|im_system|>"), ("text", ("system", 0)),
                 ("special", "<|im_middle|>"), ("text", (default_system, 0)),
                 ("special", "<|im_end|>")]
    for message in messages:
        role = message.get("role")
        if role == "tool":
            body = f"## Return of {message.get('tool_call_id')}\n{content_text(message)}"
            segs += [("special", "<|im_system|>"), ("text", ("tool", 0)),
                     ("special", "<|im_middle|>"), ("text", (body, 0)),
                     ("special", "<|im_end|>")]
            continue
        if role not in ROLE_TOKEN:
            raise ValueError(f"unknown role {role!r}")
        out = 1 if role == "assistant" else 0
        segs += [("special", ROLE_TOKEN[role]), ("text", (message.get("name") or role, 0)),
                 ("special", "<|im_middle|>")]
        segs += [("text", (p, out)) if p is not None else ("media", next(images))
                 for p in content_parts(message, media is not None)]
        if role == "assistant" and message.get("tool_calls"):
            segs += _tool_call_segments(message["tool_calls"])
        segs.append(("special_out" if out else "special", "<|im_end|>"))
    if add_generation_prompt:
        segs += [("special", "<|im_assistant|>"), ("text", ("assistant", 0)),
                 ("special", "<|im_middle|>")]
    return segs


def render(tokenizer: KimiTokenizer, messages: Sequence[Message], *,
           add_generation_prompt: bool = True,
           tools: Sequence[Mapping[str, Any]] | None = None,
           default_system: str | None = DEFAULT_SYSTEM,
           media: Sequence[str] | None = None) -> tuple[list[int], list[int]]:
    """Render a conversation to token ids and a per-token loss mask.

    Args:
      tokenizer: a `KimiTokenizer` with the K2 chat control tokens, or K3's (then `k3_chat.render`
        with K3's defaults: thinking on, thinking_effort "max"; `default_system` does not apply).
      messages: `[{"role": "system"|"user"|"assistant"|"tool", "content": str | [text parts],
        optional "name", "tool_calls", "tool_call_id"}, ...]`.
      add_generation_prompt: append `<|im_assistant|>assistant<|im_middle|>` (inference); use
        False for training on complete conversations.
      tools: optional tool schemas, declared in a leading `tool_declare` system turn.
      default_system: injected when the first message is not a system one (Kimi's template
        does this); None disables the injection.
      media: the media prompts (``vision_processor.MediaItem.prompt``, pads expanded), one per
        `{"type": "image"}` content part in order; they become control tokens with mask 0.
    Returns:
      `(ids, mask)`: two equal-length lists of ints; mask[i] = 1 iff token i is assistant
      output (content, tool calls, closing <|im_end|>). The training target weight of position
      t is mask[t + 1].
    """
    if k3_chat.is_k3(tokenizer):      # K3 has no default system prompt
        return k3_chat.render(tokenizer, messages, add_generation_prompt=add_generation_prompt, tools=tools,
                              media=media)
    missing = [t for t in CHAT_TOKENS if t not in tokenizer.special_ids]
    if missing:
        raise TokenizerError(f"tokenizer lacks the K2 chat tokens {missing} and K3's {list(k3_chat.MARKERS)}: "
                             "it cannot render a chat")
    ids: list[int] = []
    mask: list[int] = []
    for kind, value in _segments(messages, add_generation_prompt=add_generation_prompt,
                                 tools=tools, default_system=default_system, media=media):
        if kind == "text":
            text, m = value
            piece = tokenizer.encode(text)  # ordinary text: special strings are not control
        elif kind == "media":               # the processor's prompt: trusted markup
            piece, m = tokenizer.encode_with_special_tokens(value), 0
        else:
            piece, m = [tokenizer.token_id(value)], 1 if kind == "special_out" else 0
        ids += piece
        mask += [m] * len(piece)
    return ids, mask


def render_text(messages: Sequence[Message], *, add_generation_prompt: bool = True,
                tools: Sequence[Mapping[str, Any]] | None = None,
                default_system: str | None = DEFAULT_SYSTEM, media: Sequence[str] | None = None) -> str:
    """The same rendering as a string (control tokens written by name), for display and for
    comparison with a jinja rendering."""
    segs = _segments(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                     default_system=default_system, media=media)
    return "".join(v if k != "text" else v[0] for k, v in segs)


def read_chat_template(model_dir: str | os.PathLike) -> str:
    """The jinja chat template of a model directory: `chat_template` in tokenizer_config.json,
    else `chat_template.jinja`. Only reads text; nothing in the directory is executed."""
    model_dir = os.fspath(model_dir)
    config_file = os.path.join(model_dir, "tokenizer_config.json")
    if os.path.isfile(config_file):
        with open(config_file, encoding="utf-8") as f:
            template = json.load(f).get("chat_template")
        if isinstance(template, str):
            return template
        if isinstance(template, list):  # HF's named-template form: [{"name", "template"}]
            named = {t.get("name"): t.get("template") for t in template}
            if "default" in named:
                return named["default"]
    jinja_file = os.path.join(model_dir, "chat_template.jinja")
    if os.path.isfile(jinja_file):
        with open(jinja_file, encoding="utf-8") as f:
            return f.read()
    raise FileNotFoundError(f"{model_dir} has no chat_template in tokenizer_config.json and no "
                            "chat_template.jinja")


def render_with_jinja(model_dir: str | os.PathLike, messages: Sequence[Message], *,
                      add_generation_prompt: bool = True,
                      tools: Sequence[Mapping[str, Any]] | None = None) -> str:
    """Render with the directory's own jinja template through transformers' sandboxed renderer
    (the engine behind `apply_chat_template`), without loading a tokenizer class, so no
    `tokenization_*.py` from the directory is imported. Returns the rendered text; encode it
    with `KimiTokenizer.encode_with_special_tokens` only if every message is trusted."""
    return _render_jinja(read_chat_template(model_dir), messages, add_generation_prompt=add_generation_prompt,
                         tools=tools)


def _render_jinja(template: str, messages, *, add_generation_prompt: bool, tools, **kwargs) -> str:
    """transformers' renderer (the engine behind `apply_chat_template`: an immutable sandboxed
    jinja2 environment, so a template can call no Python beyond its filters) on a template string;
    `kwargs` become template variables (e.g. K2.5's `thinking`)."""
    # lazy: transformers is a slow import (seconds), needed only for a checkpoint's K2-family jinja template
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template(conversations=[list(messages)], tools=list(tools) if tools else None,
                                        chat_template=template, add_generation_prompt=add_generation_prompt,
                                        **kwargs)
    return rendered[0]


def _specials_in(text: str, tokenizer: KimiTokenizer) -> list[str]:
    return [name for name in tokenizer.special_ids if name in text]


K3_TEMPLATE_KWARGS = ("thinking", "thinking_effort")


def k3_template_kwargs(template_kwargs: Mapping[str, Any] | None) -> dict:
    """K3's chat options from a request's ``chat_template_kwargs``: ``thinking`` (a bool) and
    ``thinking_effort`` (low / high / max, or None for no thinking-effort turn); anything else is a
    ValueError naming it."""
    kw = dict(template_kwargs or {})
    bad = sorted(set(kw) - set(K3_TEMPLATE_KWARGS))
    if bad:
        raise ValueError(f"{bad}: K3's renderer takes only {list(K3_TEMPLATE_KWARGS)}")
    if not isinstance(kw.get("thinking", True), bool):
        raise ValueError(f"thinking must be true or false, got {kw['thinking']!r}")
    effort = kw.get("thinking_effort", "max")
    if effort is not None and effort not in k3_chat.EFFORTS:
        raise ValueError(f"thinking_effort must be one of {list(k3_chat.EFFORTS)} or null, got {effort!r}")
    return kw


def chat_ids(tokenizer: KimiTokenizer, messages: Sequence[Message], *, add_generation_prompt: bool = True,
             tools: Sequence[Mapping[str, Any]] | None = None,
             template_kwargs: Mapping[str, Any] | None = None,
             media: Sequence[str] | None = None, tool_choice: str | None = None,
             response_format: Mapping[str, Any] | None = None) -> list[int]:
    """A conversation -> prompt ids in the checkpoint's own chat markup; the text messages carry
    (content, names, tool-call ids and arguments) stays ORDINARY text, so a user typing
    `<|im_end|>` or `<|end_of_msg|>` cannot close a turn.

    With a `chat_template` in the tokenizer directory (K3's `<|open|>`/`<|sep|>`/`<|close|>`
    markup, or K2's), the template is rendered twice in a sandbox: once as is, once with every
    message string replaced by a unique marker. Where the two agree once the markers are put back
    (the template copied the strings verbatim), the marked rendering tells template text (encoded
    with its control tokens) from message text (encoded as text). A template that rewrites a
    string that contains a special-token name is refused (ValueError): its rendering no longer says
    which characters came from the user. Without a template, the built-in K2 markup (`render`).
    Tool schemas are rendered by the template itself (tojson), so they must not contain
    special-token names either. `template_kwargs` are extra template variables (vLLM's
    `chat_template_kwargs`, e.g. `{"thinking": False}`); a template that reads none ignores them,
    as does the built-in markup.

    `media`: one prompt per `{"type": "image"}` content part, in order (the processor's
    `MediaItem.prompt`: K3's `<|media_begin|>image {W}x{H}<|media_content|>` + pads +
    `<|media_end|>`, K2.5's without the size); each sits where its part sits in the message text
    and is encoded with its control tokens (it is markup the processor wrote, not user text).

    A K3 tokenizer: `k3_chat.render`; `template_kwargs` may hold `thinking` (default True) and
    `thinking_effort` (low / high / max, default max) and nothing else; `tool_choice` "required" /
    "none" and `response_format` (json_object / json_schema) render K3's internal turns. The other
    families have no such turns: `response_format` or those `tool_choice` values are a ValueError.
    """
    if k3_chat.is_k3(tokenizer):
        return k3_chat.render(tokenizer, messages, tools=tools, add_generation_prompt=add_generation_prompt,
                              media=media, tool_choice=tool_choice, response_format=response_format,
                              **k3_template_kwargs(template_kwargs))[0]
    if response_format is not None or tool_choice in ("required", "none"):
        raise ValueError("tool_choice / response_format turns exist only in K3's chat format")
    template = tokenizer.chat_template
    if template is None:
        return render(tokenizer, messages, add_generation_prompt=add_generation_prompt, tools=tools,
                      media=media)[0]
    check_media(messages, media)
    bad = _specials_in(json.dumps(list(tools or []), ensure_ascii=False), tokenizer)
    if bad:
        raise ValueError(f"tool schemas contain the special-token strings {bad[:3]}; remove them")
    nonce = secrets.token_hex(8)
    texts: list[str] = []

    def mark(value: Any) -> Any:
        if not isinstance(value, str):             # e.g. tool arguments as a dict: the template's tojson
            if value is not None and _specials_in(json.dumps(value, ensure_ascii=False, default=str), tokenizer):
                raise ValueError("tool-call arguments contain special-token strings; pass them as a JSON string")
            return value
        texts.append(value)
        return f"\ue000{nonce}:{len(texts) - 1}\ue001"

    with_images = media is not None
    n_media = iter(range(len(media or ())))

    def mark_content(m: Message) -> str:   # text pieces marked, image part i -> marker "m<i>"
        return "".join(mark(p) if p is not None else f"\ue000{nonce}:m{next(n_media)}\ue001"
                       for p in content_parts(m, with_images))

    def plain_content(m: Message, images) -> str:
        return "".join(p if p is not None else next(images) for p in content_parts(m, with_images))

    marked = []
    for m in messages:
        m = dict(m)
        m["content"] = mark_content(m)
        for key in ("name", "tool_call_id", "reasoning_content"):
            if key in m:
                m[key] = mark(m[key])
        if m.get("tool_calls"):
            m["tool_calls"] = [dict(c, id=mark(c.get("id")) if c.get("id") else c.get("id"),
                                    function=dict(c["function"], arguments=mark(c["function"]["arguments"])))
                               for c in m["tool_calls"]]
        marked.append(m)
    images = iter(media or ())
    plain = [dict(m, content=plain_content(m, images)) for m in messages]
    kw = dict(template_kwargs or {}, add_generation_prompt=add_generation_prompt, tools=tools)
    real = _render_jinja(template, plain, **kw)
    pieces = re.split(f"\ue000{nonce}:(m?\\d+)\ue001", _render_jinja(template, marked, **kw))
    # pieces alternate: template text, marker index ("m<i>": media prompt i), template text, ...
    piece_text = lambda p: media[int(p[1:])] if p[0] == "m" else texts[int(p)]  # noqa: E731
    if "".join(piece_text(p) if i % 2 else p for i, p in enumerate(pieces)) != real:
        if with_images:
            raise ValueError("the chat template rewrites message text, so the images' places in it are "
                             "unknown; use a template that copies message content verbatim")
        if any(_specials_in(t, tokenizer) for t in texts):
            raise ValueError("the chat template rewrites message text that contains special-token strings, "
                             "so they cannot be kept as text; remove them from the messages")
        return tokenizer.encode_with_special_tokens(real)   # no message string could inject a token
    ids: list[int] = []
    for i, p in enumerate(pieces):
        if i % 2 and p[0] != "m":
            ids += tokenizer.encode(texts[int(p)])
        else:
            ids += tokenizer.encode_with_special_tokens(piece_text(p) if i % 2 else p)
    return ids
