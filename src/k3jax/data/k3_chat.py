"""Kimi K3's chat format ("XTML") rendered natively to token ids and a loss mask.

Written from the format's description (formats.md §3.5a; Moonshot's reference renderer is
`encoding_k3.py`), pinned by hand-written golden renderings in tests/test_k3_chat.py. Shape:

    turn:       <|open|>message role="ROLE"[ name="N"]<|sep|>BODY<|close|>message<|sep|><|end_of_msg|>
    internal:   <|open|>message role="system" type="KIND"<|sep|>BODY<|close|>message<|sep|><|end_of_msg|>
    assistant:  [<|open|>think<|sep|>REASONING<|close|>think<|sep|>]
                <|open|>response<|sep|>CONTENT<|close|>response<|sep|>
                [<|open|>tools<|sep|> per call <|open|>call tool="NAME" index="K"<|sep|>
                  per argument <|open|>argument key="KEY" type="TYPE"<|sep|>VALUE<|close|>argument<|sep|>
                 <|close|>call<|sep|> ... <|close|>tools<|sep|>]
    order:      tool-declare, thinking-effort, messages, tool-choice, response-format, generation
                prompt <|open|>message role="assistant"<|sep|><|open|>think|response<|sep|>

No BOS, no default system prompt, no whitespace between tags or turns. A rendering is a list of
segments, each encoded on its own (as the reference does; it fixes the BPE boundaries): the four
markers are control tokens; tag names, attributes and every string a message carries are ORDINARY
text, so a user typing "<|close|>message<|sep|>" cannot close a turn; image parts become the
processor's prompt (trusted markup). Loss mask: 1 on what the assistant generates, in every
assistant turn (think body and close tag, the response channel -- its open tag too when thinking
is on --, the tools channel, `<|close|>message<|sep|><|end_of_msg|>`); 0 on the generation prompt's
tags and every other turn, so render(msgs + [reply], add_generation_prompt=False) starts with
render(msgs) token for token.
"""
from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from k3jax.data.messages import check_media, content_parts
from k3jax.data.tokenizer import KimiTokenizer, TokenizerError

OPEN, CLOSE, SEP, END_OF_MSG = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"
MARKERS = (END_OF_MSG, OPEN, CLOSE, SEP)
EFFORTS = ("low", "high", "max")
ROLES = ("user", "system", "assistant", "tool")

# (kind, value, mask): "special" (a marker name), "text" (ordinary text), "media" (a processor
# prompt, encoded with its control tokens, mask 0).
Segment = tuple[str, str, int]
Message = Mapping[str, Any]

TOOLS_HEAD = "# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n"
NEW_TOOLS_HEAD = ("## New Tools Available\nThe system dynamically extends the toolset via lazy-loading.\n"
                  "You have access to all existing and extended tools.\n"
                  "Here are the specs for the extended tools.\n\n```json\n")
EFFORT_HEAD = ("`thinking_effort` guides on how much to think in your thinking channel (not including "
               "the response channel), supported values include `low`, `medium`, `high`, and `max`.\n"
               "Now the system is invoked with `thinking_effort=")
TOOL_CHOICE_BODY = {
    "required": "The system is invoked with `tool_choice=required`.\nYou MUST call tools in the next message.",
    "none": "The system is invoked with `tool_choice=none`.\nYou MUST NOT call any tools in the next message.",
}
JSON_RULE = ("Your response must be raw JSON data without markdown code blocks (```json) or any "
             "additional formatting.")
SCHEMA_HEAD = "\nThe JSON data must match the following schema:\n```json\n"


def is_k3(tokenizer: KimiTokenizer) -> bool:
    """Whether the tokenizer has K3's four chat markers as special tokens."""
    special = tokenizer.special_ids
    return all(m in special for m in MARKERS)


def escape(value: Any) -> str:
    """An attribute value: str(value) with `&` -> `&amp;`, then `"` -> `&quot;` (nothing else)."""
    return str(value).replace("&", "&amp;").replace('"', "&quot;")


def unescape(text: str) -> str:
    """The inverse of `escape`: `&quot;` -> `"`, then `&amp;` -> `&`."""
    return text.replace("&quot;", '"').replace("&amp;", "&")


def _text(value: str, mask: int) -> list[Segment]:
    return [("text", value, mask)] if value else []


def open_tag(name: str, attrs: Iterable[tuple[str, Any]] | Mapping[str, Any] = (),
             mask: int = 0) -> list[Segment]:
    """`<|open|>NAME KEY="VALUE" ...<|sep|>`; each attribute is the four text segments ` KEY`,
    `="`, the escaped value and `"` (empty ones dropped)."""
    items = attrs.items() if isinstance(attrs, Mapping) else attrs
    segs = [("special", OPEN, mask)] + _text(name, mask)
    for key, value in items:
        segs += _text(f" {key}", mask) + _text('="', mask) + _text(escape(value), mask) + _text('"', mask)
    return segs + [("special", SEP, mask)]


def close_tag(name: str, mask: int = 0) -> list[Segment]:
    """`<|close|>NAME<|sep|>`."""
    return [("special", CLOSE, mask)] + _text(name, mask) + [("special", SEP, mask)]


def _turn(attrs, body: list[Segment], end_mask: int = 0) -> list[Segment]:
    return (open_tag("message", attrs) + body + close_tag("message", end_mask)
            + [("special", END_OF_MSG, end_mask)])


def _system_turn(kind: str, body: str) -> list[Segment]:
    return _turn((("role", "system"), ("type", kind)), _text(body.strip(), 0))


def _compact_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), sort_keys=True)


def _tools_json(tools: Sequence[Any]) -> str:
    """The tool list as given (OpenAI-wrapped), compact, keys sorted recursively; None-valued keys
    of each tool and its "function" are dropped (unset optional fields), not those in parameters."""
    cleaned = []
    for tool in tools:
        if isinstance(tool, Mapping):
            tool = {k: v for k, v in tool.items() if v is not None}
            if isinstance(tool.get("function"), Mapping):
                tool["function"] = {k: v for k, v in tool["function"].items() if v is not None}
        cleaned.append(tool)
    return _compact_json(cleaned)


def _call_name(call: Any) -> Any:
    if not isinstance(call, Mapping):
        return None
    fn = call.get("function")
    return fn.get("name") if isinstance(fn, Mapping) else call.get("name")   # flat calls: {"name", ...}


def _normalize(messages: Sequence[Message]) -> list[dict]:
    """Shallow copies with `developer` -> `system`; tool results re-ordered (`_order_tool_results`)."""
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise TypeError(f"message {i} must be a mapping, got {type(message).__name__}")
        message = dict(message)
        role = message.get("role")
        if role == "developer":           # as vLLM's K3 renderer does
            message["role"] = "system"
        elif role not in ROLES:
            # Deliberately unlike the reference renderer, which silently skips unknown roles (and
            # non-dict messages): dropping a turn the caller meant to send is refused instead.
            raise ValueError(f"message {i} has unknown role {role!r}; expected one of {ROLES} or 'developer'")
        out.append(message)
    return _order_tool_results(out)


def _order_tool_results(messages: list[dict]) -> list[dict]:
    """Each run of consecutive tool messages is put in the order of the latest assistant's
    tool_calls (matched by `tool_call_id`, else `id`, against the calls' ids as strings), with
    `tool` (and `name`, if present) set to the matched call's name -- only if every message of
    the run matches; otherwise the run is left as it is."""
    calls: Sequence[Any] = []
    i = 0
    while i < len(messages):
        if messages[i]["role"] != "tool":
            if messages[i]["role"] == "assistant":
                calls = messages[i].get("tool_calls") or []
            i += 1
            continue
        j = i
        while j < len(messages) and messages[j]["role"] == "tool":
            j += 1
        position: dict[str, tuple[int, Any]] = {}
        for pos, call in enumerate(calls, 1):     # every entry advances the position
            if isinstance(call, Mapping) and call.get("id") is not None:
                position.setdefault(str(call["id"]), (pos, _call_name(call)))   # first one wins
        keys = [m.get("tool_call_id") if m.get("tool_call_id") is not None else m.get("id")
                for m in messages[i:j]]
        hits = [position.get(str(k)) if k is not None else None for k in keys]
        if all(hits):
            order = sorted(range(j - i), key=lambda k: (hits[k][0], k))
            run = []
            for k in order:
                message = messages[i + k]
                message["tool"] = hits[k][1]
                if "name" in message:
                    message["name"] = hits[k][1]
                run.append(message)
            messages[i:j] = run
        i = j
    return messages


def _body(message: Message, images: Iterator[str] | None, mask: int) -> list[Segment]:
    """Content as text segments (raw), image part i as the media segment media[i] (mask 0)."""
    segs: list[Segment] = []
    for part in content_parts(message, images is not None):
        segs += _text(part, mask) if part is not None else [("media", next(images), 0)]
    return segs


def _arguments(raw: Any) -> Mapping[str, Any] | str:
    """A call's arguments as a mapping, or the raw string when it is not JSON (written whole)."""
    if raw is None:
        return {}
    if isinstance(raw, Mapping):
        return raw
    if isinstance(raw, str):
        if not raw.strip():
            return {}
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            return raw
        if not isinstance(value, dict):
            raise ValueError(f"tool-call arguments must be a JSON object, got {type(value).__name__}: "
                             f"{raw[:80]!r}")
        return value
    raise TypeError(f"tool-call arguments must be a dict, a JSON string or None, got {type(raw).__name__}")


def _arg_type(value: Any) -> str:
    if isinstance(value, bool):           # before number: bool is an int
        return "boolean"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    return "object" if isinstance(value, dict) else "array"


def _tools_channel(calls: Sequence[Mapping[str, Any]]) -> list[Segment]:
    segs = open_tag("tools", mask=1)
    for k, call in enumerate(calls, 1):
        fn = call.get("function") if isinstance(call.get("function"), Mapping) else call
        name = fn.get("name")
        if not name:
            raise ValueError(f"tool call {k} has no function name: {call!r}")
        segs += open_tag("call", (("tool", name), ("index", k)), 1)
        args = _arguments(fn.get("arguments"))
        if isinstance(args, str):         # not JSON: the raw-JSON block, no argument tags
            segs += open_tag("json", (("type", "object"),), 1) + _text(args, 1) + close_tag("json", 1)
        else:
            for key, value in args.items():   # insertion order, not sorted
                segs += open_tag("argument", (("key", key), ("type", _arg_type(value))), 1)
                segs += _text(value if isinstance(value, str) else json.dumps(value, ensure_ascii=False), 1)
                segs += close_tag("argument", 1)
        segs += close_tag("call", 1)
    return segs + close_tag("tools", 1)


def _assistant(message: Message, images: Iterator[str] | None, thinking: bool) -> list[Segment]:
    attrs = [("role", "assistant")] + ([("name", message["name"])] if message.get("name") else [])
    segs = open_tag("message", attrs)
    if thinking:                          # every assistant turn keeps its think channel
        reasoning = message.get("reasoning_content") or message.get("reasoning")
        segs += open_tag("think")
        if reasoning is not None and str(reasoning).strip():
            segs += _text(str(reasoning), 1)
        segs += close_tag("think", 1)
    segs += open_tag("response", mask=1 if thinking else 0)   # thinking off: the generation prompt's
    segs += _body(message, images, 1) + close_tag("response", 1)
    if message.get("tool_calls"):
        segs += _tools_channel(message["tool_calls"])
    return segs + close_tag("message", 1) + [("special", END_OF_MSG, 1)]


def _response_format_turn(response_format: Any) -> list[Segment]:
    if response_format is None:
        return []
    rf = response_format
    kind = rf.get("type") if isinstance(rf, Mapping) else rf   # a bare "json_object" works too
    if kind == "text":
        return []
    if kind not in ("json_object", "json_schema"):
        raise ValueError(f"response_format type must be 'text', 'json_object' or 'json_schema', got {kind!r}")
    body = f"The system is invoked with `response_format={kind}`.\n{JSON_RULE}"
    if kind == "json_schema":
        spec = rf.get("json_schema") if isinstance(rf, Mapping) else None
        if not isinstance(spec, Mapping):
            raise ValueError("response_format json_schema needs a 'json_schema' object")
        schema = spec["schema"] if "schema" in spec else spec.get("json_schema", spec)
        body += SCHEMA_HEAD + _compact_json(schema) + "\n```"
    return _system_turn("response-format", body)


def generation_prompt(thinking: bool) -> list[Segment]:
    """`<|open|>message role="assistant"<|sep|>` + `<|open|>think<|sep|>` (thinking) or
    `<|open|>response<|sep|>`; mask 0."""
    return open_tag("message", (("role", "assistant"),)) + open_tag("think" if thinking else "response")


def segments(messages: Sequence[Message], *, tools: Sequence[Any] | None = None,
             add_generation_prompt: bool = True, thinking: bool = True, thinking_effort: str | None = "max",
             tool_choice: Any = None, response_format: Any = None,
             media: Sequence[str] | None = None) -> list[Segment]:
    """A conversation as segments (see `render` for the arguments)."""
    if thinking and thinking_effort is not None and thinking_effort not in EFFORTS:
        raise ValueError(f"thinking_effort must be one of {EFFORTS} or None, got {thinking_effort!r}")
    msgs = _normalize(messages)
    check_media(msgs, media)
    images = iter(media) if media is not None else None
    segs: list[Segment] = []
    if tools:
        segs += _system_turn("tool-declare", TOOLS_HEAD + _tools_json(tools) + "\n```")
    if thinking and thinking_effort is not None:
        segs += _system_turn("thinking-effort", f"{EFFORT_HEAD}{thinking_effort}`.")
    calls: Sequence[Any] = []
    n_results = 0
    for m in msgs:
        role = m["role"]
        if role == "assistant":
            calls, n_results = m.get("tool_calls") or [], 0
            segs += _assistant(m, images, thinking)
        elif role == "tool":
            n_results += 1
            name = m.get("tool") or m.get("name")
            if not name and n_results <= len(calls):
                name = _call_name(calls[n_results - 1])
            if not name:
                raise ValueError(f"tool result {n_results} after the last assistant turn has no tool name "
                                 "(no matching tool_call_id, 'tool' or 'name', and no call at its position)")
            segs += _turn((("role", "tool"), ("tool", name), ("index", n_results)), _body(m, None, 0))
        elif role == "system" and m.get("tools"):   # more tools mid-conversation; content dropped
            for part in content_parts(m, images is not None):
                if part is None:          # keep later images in step: this one is dropped too
                    next(images)
            segs += _system_turn("tool-declare", NEW_TOOLS_HEAD + _tools_json(m["tools"]) + "\n```")
        else:
            attrs = [("role", role)] + ([("name", m["name"])] if m.get("name") else [])
            segs += _turn(attrs, _body(m, images, 0))
    if isinstance(tool_choice, str) and tool_choice in TOOL_CHOICE_BODY:
        segs += _system_turn("tool-choice", TOOL_CHOICE_BODY[tool_choice])
    segs += _response_format_turn(response_format)
    if add_generation_prompt:
        segs += generation_prompt(thinking)
    return segs


def encode(tokenizer: KimiTokenizer, segs: Iterable[Segment]) -> tuple[list[int], list[int]]:
    """Segments -> (ids, per-token mask): markers as their ids, text as ordinary text, media
    prompts with their control tokens; each segment encoded on its own."""
    ids: list[int] = []
    mask: list[int] = []
    for kind, value, m in segs:
        if kind == "special":
            piece = [tokenizer.token_id(value)]
        elif kind == "text":
            piece = tokenizer.encode(value)
        elif kind == "media":
            piece = tokenizer.encode_with_special_tokens(value)
        else:
            raise ValueError(f"unknown segment kind {kind!r}")
        ids += piece
        mask += [m] * len(piece)
    return ids, mask


def render(tokenizer: KimiTokenizer, messages: Sequence[Message],
           **kwargs: Any) -> tuple[list[int], list[int]]:
    """Render a conversation in K3's format to token ids and a per-token loss mask.

    tokenizer: a K3 tokenizer (`is_k3`), else TokenizerError. messages: `[{"role": "system" |
    "developer" | "user" | "assistant" | "tool", "content": str | [text / image parts] | None,
    optional "name", "reasoning_content" (or "reasoning"), "tool_calls", "tool_call_id", "tool";
    a system message with "tools" declares more}, ...]`. Keywords (`segments`): tools (OpenAI-
    wrapped schemas), add_generation_prompt (False for training), thinking, thinking_effort ("low"
    | "high" | "max" | None), tool_choice ("required" / "none" add a turn; "auto", None or a named
    tool none), response_format ({"type": "json_object" | "json_schema" | "text"}), media (one
    processor prompt per image part). Returns `(ids, mask)`, mask[i] = 1 iff token i is assistant
    output.
    """
    missing = [m for m in MARKERS if m not in tokenizer.special_ids]
    if missing:
        raise TokenizerError(f"tokenizer lacks the K3 chat markers {missing}; it is not a K3 tokenizer")
    return encode(tokenizer, segments(messages, **kwargs))


def render_text(messages: Sequence[Message], **kwargs: Any) -> str:
    """The same rendering as a string: markers written by name, media prompts as given."""
    return "".join(value for _, value, _ in segments(messages, **kwargs))
