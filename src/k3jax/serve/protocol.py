"""OpenAI request bodies (pydantic) and the response / chunk bodies built from engine events. Field
meanings follow the OpenAI API reference; ``top_k``, ``chat_template_kwargs`` are extensions (as in
vLLM). An unknown field is ignored unless it would change the output and k3jax does not implement it
(``UNSUPPORTED``): then the request is a 400 naming it.
"""
from __future__ import annotations

import hashlib
import time
import uuid
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict

MAX_LOGPROBS = 20


class ApiError(Exception):
    """An error response in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",  # noqa: A002
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")       # kept for check_unsupported, otherwise unused
    model: Optional[str] = None
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    n: Optional[int] = None
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    stop: Union[str, list[str], None] = None
    seed: Optional[int] = None
    # vLLM's extensions: logprob tokens as "token_id:<id>"; generate max_tokens whatever the model
    # emits (benchmarks: fixed output lengths)
    return_tokens_as_token_ids: Optional[bool] = False
    ignore_eos: Optional[bool] = False


class CompletionRequest(_Common):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    logprobs: Optional[int] = None
    echo: Optional[bool] = False


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt, or messages rendered with the chat template."""
    model_config = ConfigDict(extra="ignore")
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[dict[str, Any]]] = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True
    tools: Optional[list[dict[str, Any]]] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    return_token_strs: Optional[bool] = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: Optional[str] = None
    tokens: list[int]


class ChatRequest(_Common):
    messages: list[dict[str, Any]]
    max_completion_tokens: Optional[int] = None
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: Optional[bool] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None


def _off(value) -> bool:
    return value in (None, False, 0, 0.0, "", [], {})


# Fields that change what is generated and that k3jax does not implement -> 400 unless the value is
# the neutral one. Everything else unknown (user, metadata, store, service_tier, ...) is ignored.
UNSUPPORTED = {
    "logit_bias": _off, "presence_penalty": _off, "frequency_penalty": _off,
    "repetition_penalty": lambda v: v in (None, 1, 1.0), "min_p": _off, "min_tokens": _off,
    "best_of": lambda v: v in (None, 1), "suffix": _off, "use_beam_search": _off,
    "response_format": lambda v: v is None or (isinstance(v, dict) and v.get("type") in (None, "text")),
    "functions": _off, "function_call": _off, "reasoning_effort": _off,
    "guided_json": _off, "guided_regex": _off, "guided_choice": _off, "guided_grammar": _off,
    "structured_outputs": _off, "bad_words": _off, "allowed_token_ids": _off, "stop_token_ids": _off,
    "logits_processors": _off, "prompt_logprobs": _off, "truncate_prompt_tokens": _off,
    "audio": _off, "modalities": lambda v: v in (None, ["text"]), "web_search_options": _off,
}
# Names the chat template renderer itself passes; chat_template_kwargs may not override them.
RESERVED_TEMPLATE_KWARGS = ("messages", "conversations", "tools", "documents", "chat_template",
                            "add_generation_prompt", "continue_final_message", "return_assistant_tokens_mask")


def check_unsupported(req: _Common, allow: tuple[str, ...] = ()) -> None:
    """A 400 naming the first field that would change the output and is not implemented (``allow``:
    fields this model implements, e.g. K3's response_format)."""
    for field, value in (req.model_extra or {}).items():
        ok = UNSUPPORTED.get(field)
        if ok is not None and field not in allow and not ok(value):
            raise ApiError(400, f"{field}: not supported by this server (it would change the output); "
                           "remove it", param=field, code="unsupported_parameter")


def check_tool_messages(messages: list[dict]) -> None:
    """Each ``tool`` message answers a call an earlier assistant message made (its
    ``tool_call_id`` is one of their ``tool_calls`` ids), as OpenAI requires: otherwise a 400
    naming the message and the id."""
    ids: set = set()
    for i, m in enumerate(messages):
        if m.get("role") == "assistant":
            ids |= {c.get("id") for c in m.get("tool_calls") or [] if isinstance(c, dict)}
        elif m.get("role") == "tool":
            got = m.get("tool_call_id")
            if got is None or got not in ids:
                raise ApiError(400, f"messages[{i}]: a 'tool' message must answer a preceding assistant message's "
                                    f"tool_calls; tool_call_id {got!r} is not one of their ids "
                                    f"{sorted(map(str, ids)) or '(none)'}", param="messages")


def tool_choice(req: ChatRequest) -> tuple[str, str | None, list[str]]:
    """-> (mode: "none" | "auto" | "required" | "named", the named function or None, the names of
    the request's tools). OpenAI's default: "auto" with tools, "none" without."""
    names = []
    for i, t in enumerate(req.tools or []):
        fn = t.get("function") if isinstance(t, dict) else None
        if not (isinstance(t, dict) and t.get("type", "function") == "function" and isinstance(fn, dict)
                and isinstance(fn.get("name"), str) and fn["name"]):
            raise ApiError(400, f"tools[{i}]: must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}",
                           param="tools")
        names.append(fn["name"])
    c = req.tool_choice
    if c is None:
        return ("auto" if names else "none"), None, names
    if isinstance(c, dict):
        fn = c.get("function")
        if c.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ApiError(400, 'tool_choice: must be "none", "auto", "required" or '
                           '{"type": "function", "function": {"name": ...}}', param="tool_choice")
        if fn["name"] not in names:
            raise ApiError(400, f"tool_choice: the function {fn['name']!r} is not among the request's tools "
                           f"{names}", param="tool_choice")
        return "named", fn["name"], names
    if c not in ("none", "auto", "required"):
        raise ApiError(400, f'tool_choice={c!r}: must be "none", "auto", "required" or a named function',
                       param="tool_choice")
    if c == "required" and not names:
        raise ApiError(400, 'tool_choice="required" needs tools', param="tool_choice")
    return c, None, names


RESPONSE_FORMATS = ("text", "json_object", "json_schema")


def response_format(req) -> dict | None:
    """K3's ``response_format`` (json_object / json_schema render an instruction turn; text or none,
    None); another type, or json_schema without its schema, is a 400."""
    rf = (req.model_extra or {}).get("response_format")
    if rf is None:
        return None
    kind = rf.get("type") if isinstance(rf, dict) else None
    if kind not in RESPONSE_FORMATS:
        raise ApiError(400, f"response_format: type must be one of {list(RESPONSE_FORMATS)}, got {kind!r}",
                       param="response_format")
    if kind == "json_schema" and not isinstance(rf.get("json_schema"), dict):
        raise ApiError(400, 'response_format: json_schema needs {"json_schema": {"name": ..., "schema": {...}}}',
                       param="response_format")
    return None if kind == "text" else rf


def template_kwargs(req) -> dict:
    kw = dict(req.chat_template_kwargs or {})
    bad = [k for k in kw if k in RESERVED_TEMPLATE_KWARGS]
    if bad:
        raise ApiError(400, f"chat_template_kwargs: {bad[0]!r} is set by the server, not by a kwarg",
                       param="chat_template_kwargs")
    return kw


def sampling(req: _Common, max_n: int = 1) -> dict:
    """Validated sampling settings of a request (ApiError 400 naming the bad parameter); ``max_n``:
    the most choices a request may ask for (the server's slots, serve_max_batch)."""
    n = 1 if req.n is None else req.n
    if not 1 <= n <= max_n:
        raise ApiError(400, f"n={n}: must be between 1 and {max_n} (serve_max_batch, the server's slots)", param="n")
    t = 1.0 if req.temperature is None else req.temperature
    if not 0.0 <= t <= 2.0:
        raise ApiError(400, f"temperature={t}: must be between 0 and 2", param="temperature")
    p = 1.0 if req.top_p is None else req.top_p
    if not 0.0 < p <= 1.0:
        raise ApiError(400, f"top_p={p}: must be in (0, 1]", param="top_p")
    k = req.top_k or 0
    if k < -1:
        raise ApiError(400, f"top_k={k}: must be -1 or 0 (off) or a positive count", param="top_k")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > 4:
        raise ApiError(400, f"stop: at most 4 sequences, got {len(stop)}", param="stop")
    seed = uuid.uuid4().int & 0xFFFFFFFF if req.seed is None else req.seed
    return {"temperature": t, "top_p": p, "top_k": max(k, 0), "stop": tuple(stop), "seed": seed,
            "ignore_eos": bool(req.ignore_eos), "n": n}


def copy_seed(seed: int, i: int) -> int:
    """Choice i's sampling seed: the request's for the first, a hash of (seed, i) for the others, so
    the same request gives the same n choices."""
    if i == 0:
        return seed & 0xFFFFFFFF
    return int.from_bytes(hashlib.blake2b(f"{seed}:{i}".encode(), digest_size=4).digest(), "little")


def max_tokens(requested: int | None, prompt_len: int, context: int, *, default: int | None, param: str,
               allow_zero: bool = False) -> int:
    """The completion budget: ``requested`` (or the default; None = the rest of the context), checked
    against the context (prompt + completion <= context) like OpenAI's context_length_exceeded.
    ``allow_zero``: 0 is allowed (completions with echo: the prompt's log-probabilities only)."""
    if requested is not None and requested < (0 if allow_zero else 1):
        raise ApiError(400, f"{param}={requested}: must be at least {0 if allow_zero else 1}", param=param)
    want = requested if requested is not None else default
    total = prompt_len + (1 if want is None else want)
    if total > context:
        raise ApiError(400, f"This model's maximum context length is {context} tokens. However, you requested "
                       f"{total} tokens ({prompt_len} in the messages/prompt, {total - prompt_len} for the completion). "
                       "Please reduce the length of the prompt or the completion.",
                       param="messages" if param == "max_completion_tokens" else "prompt",
                       code="context_length_exceeded")
    return context - prompt_len if want is None else want


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


# -- logprobs in the two OpenAI formats -----------------------------------------------------------
def _name(token_id: int, piece: str, as_ids: bool) -> str:
    return f"token_id:{token_id}" if as_ids else piece


def chat_logprobs(entries: list[dict], k: int, as_ids: bool = False) -> dict:
    return {"content": [{"token": _name(e["id"], e["token"], as_ids), "logprob": e["logprob"], "bytes": e["bytes"],
                         "top_logprobs": [{"token": _name(i, s, as_ids), "logprob": v, "bytes": list(s.encode("utf-8"))}
                                          for i, s, v in e["top"][:k]]} for e in entries]}


def completion_logprobs(entries: list[dict], offset: int, as_ids: bool = False) -> dict:
    """Legacy completions format; text_offset counts characters from the start of the completion."""
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e["token"])
    return {"tokens": [_name(e["id"], e["token"], as_ids) for e in entries],
            "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [None if e["top"] is None else {_name(i, s, as_ids): v for i, s, v in e["top"]}
                             for e in entries],
            "text_offset": offsets}


# -- bodies ---------------------------------------------------------------------------------------
class Body:
    """Builds the response (or stream chunks) of one request."""

    def __init__(self, kind: Literal["chat", "completion"], model: str, logprobs: int | None, as_ids: bool = False):
        self.kind, self.model, self.logprobs, self.as_ids = kind, model, logprobs, as_ids
        self.id = new_id("chatcmpl" if kind == "chat" else "cmpl")
        self.created = int(time.time())
        self.offsets: dict[int, int] = {}     # per choice: characters streamed so far (text_offset)

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _lp(self, entries, offset: int = 0):
        if self.logprobs is None:
            return None
        if self.kind == "chat":
            return chat_logprobs(entries, self.logprobs, self.as_ids)
        return completion_logprobs(entries, offset, self.as_ids)

    def chunk(self, text: str, entries: list[dict], finish: str | None, *, first: bool = False,
              index: int = 0) -> dict:
        lp = self._lp(entries, self.offsets.get(index, 0))
        if self.kind == "chat":
            delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
            choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}
            body = dict(self._head("chat.completion.chunk"), choices=[choice])
        else:
            body = dict(self._head("text_completion"), choices=[{"index": index, "text": text, "logprobs": lp,
                                                                 "finish_reason": finish}])
        self.offsets[index] = self.offsets.get(index, 0) + len(text)
        return body

    def delta_chunk(self, delta: dict, entries: list[dict], finish: str | None, index: int = 0) -> dict:
        """A chat chunk with a given delta (content, reasoning_content or tool_calls)."""
        choice = {"index": index, "delta": delta, "logprobs": self._lp(entries), "finish_reason": finish}
        return dict(self._head("chat.completion.chunk"), choices=[choice])

    def chat_choice(self, index: int, message: dict, entries: list[dict], finish: str) -> dict:
        return {"index": index, "message": message, "logprobs": self._lp(entries), "finish_reason": finish}

    def text_choice(self, index: int, text: str, entries: list[dict], finish: str) -> dict:
        """A completions choice; with echo, ``text`` and ``entries`` start with the prompt's."""
        return {"index": index, "text": text, "logprobs": self._lp(entries), "finish_reason": finish}

    def response(self, choices: list[dict], prompt: int, completion: int) -> dict:
        """The whole (non-streamed) answer; ``completion`` counts every choice's tokens."""
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        return dict(self._head(obj), choices=choices, usage=usage(prompt, completion))

    def usage_chunk(self, prompt: int, completion: int) -> dict:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return dict(self._head(obj), choices=[], usage=usage(prompt, completion))
