"""Kimi K3 replies ("XTML" markup, formats.md §3.5a) -> OpenAI fields, streamed from generated ids.

A reply, after the generation prompt's ``<|open|>think<|sep|>`` (or ``<|open|>response<|sep|>``)::

    REASONING<|close|>think<|sep|><|open|>response<|sep|>CONTENT<|close|>response<|sep|>
    [<|open|>tools<|sep|>
       <|open|>call tool="NAME" index="1"<|sep|>
         <|open|>argument key="K" type="T"<|sep|>VALUE<|close|>argument<|sep|> ...
         (or <|open|>json type="object"<|sep|>RAW<|close|>json<|sep|>)
       <|close|>call<|sep|> ...
     <|close|>tools<|sep|>]<|close|>message<|sep|><|end_of_msg|>

The markers are special ids; tag names and attributes are ordinary text between them, so a tag is
read whole (from ``<|open|>``/``<|close|>`` to ``<|sep|>``) before it counts. Text a model writes that
spells a marker is ordinary text. Reasoning and content stream as they come (``TextState``: UTF-8
across tokens, ``stop`` strings); only the ids of a tag still being read are held back. Each call is
released whole when its ``<|close|>call<|sep|>`` arrives. Malformed output never raises: the ids of
a broken call (or stray ids in the tools channel) come back as content text, markers by name, and the
reason goes to ``failures``. Events are those of ``toolcalls.Parser`` (``toolcalls.message`` and
``toolcalls.deltas`` turn them into OpenAI fields).
"""
from __future__ import annotations

import dataclasses
import json
import secrets
from collections.abc import Iterable, Sequence

import regex

from k3jax.data.k3_chat import CLOSE, END_OF_MSG, OPEN, SEP, close_tag, encode, open_tag, unescape
from k3jax.data.reply_text import TextState

_NAME = r"[A-Za-z_][\w.\-]*"
OPEN_TAG = regex.compile(rf'({_NAME})((?: [\w\-]+="[^"]*")*)')
CLOSE_TAG = regex.compile(_NAME)
ATTR = regex.compile(r' ([\w\-]+)="([^"]*)"')
MAX_TAG_IDS = 512        # an "open tag" longer than this is text (it would hold streaming back)
TOOL_TAGS = frozenset({"tools", "call", "argument", "json"})
# tags that end a think/response channel that was left open (the message-level structure)
LEVEL = frozenset({("open", "think"), ("open", "response"), ("open", "tools"), ("close", "message")})

# parser states (THINK / RESPONSE are also the channel tag names)
MSG, THINK, RESPONSE, TOOLS, TOOLS_OFF, CALL, ARG, JSON, ENDED = (
    "message", "think", "response", "tools", "tools_off", "call", "argument", "json", "ended")
CALL_STATES = (CALL, ARG, JSON)


def _tag_ids(tok, name: str, attrs=(), *, close: bool = False) -> list[int]:
    """A tag's ids exactly as the renderer (k3_chat) encodes it."""
    return encode(tok, close_tag(name) if close else open_tag(name, attrs))[0]


def forced_tokens(tok, prompt: Sequence[int], choice: str, name: str | None = None) -> tuple[list[int], list[int]]:
    """Ids appended to the prompt for ``tool_choice`` and the ids the parser is primed with.

    "required": close the channel the generation prompt opened (think, then an empty response) and
    open the tools channel; "named": also the header of call 1 to NAME, its attribute split in the
    renderer's segments (`` tool``, ``="``, value, ``"``) so the ids are the ones the renderer makes;
    anything else forces nothing. prime = the prompt's trailing channel tag + the forced ids."""
    think, response = _tag_ids(tok, THINK), _tag_ids(tok, RESPONSE)
    tail = next((t for t in (think, response) if list(prompt[-len(t):]) == t), [])
    forced: list[int] = []
    if choice in ("required", "named"):
        if tail == think:
            forced += _tag_ids(tok, THINK, close=True) + response
        elif tail != response:            # no channel open: write an empty response channel
            forced += response
        forced += _tag_ids(tok, RESPONSE, close=True) + _tag_ids(tok, TOOLS)
        if choice == "named":
            if not name:
                raise ValueError("tool_choice named: a function name is needed")
            forced += _tag_ids(tok, "call", (("tool", name), ("index", "1")))
    return forced, list(tail) + forced


@dataclasses.dataclass
class _Call:
    ids: list[int]                                  # every id of the call so far (text if it fails)
    name: str | None
    bad: str | None = None                          # the first reason it will fail
    args: dict = dataclasses.field(default_factory=dict)
    raw: str | None = None                          # the <|open|>json ...> block's text
    key: str = ""                                   # the argument being read
    type: str = "string"
    value: list[int] = dataclasses.field(default_factory=list)


class K3Parser:
    """Feeds on generated ids (``feed``), then ``finish``; both return events:

    ``("content", text)``, ``("reasoning", text)``, ``("call", index, id, name)``,
    ``("arguments", index, json_string)``, ``("call_end", index)``, ``("section_end",)``.

    ``tools``: the function names calls may use; None turns tool-call parsing off (a tools channel is
    content text, failure "tools_off"). ``parallel=False``: ``done`` turns true at the first released
    call (the caller stops generating). ``prime``: ids the model continues from (the prompt's
    trailing channel tag, ``forced_tokens``), consumed without events.
    """

    def __init__(self, tok, *, tools: Iterable[str] | None = None, stop: tuple[str, ...] = (),
                 parallel: bool = True, prime: Sequence[int] = ()):
        self.tok = tok
        self.open, self.close, self.sep = tok.token_id(OPEN), tok.token_id(CLOSE), tok.token_id(SEP)
        self.eom = tok.special_ids.get(END_OF_MSG)
        self.tools = None if tools is None else frozenset(tools)
        self.parallel = parallel
        self.content, self.reasoning = TextState(tok, stop), TextState(tok, stop)
        self.state = MSG
        self.tag: list[int] | None = None          # ids since <|open|>/<|close|>, the tag not read yet
        self.call: _Call | None = None
        self.pending: list[int] = []               # tools-channel ids not returned yet (text if no call is)
        self.sec_released = self.sec_failed = False
        self.junk = False                          # the last tools-channel ids were stray (text or markers)
        self.released = 0                          # calls returned so far (the next call's index)
        self.failures: list[str] = []
        self.done = False
        for t in prime:
            self.feed(t)

    # -- lexing: ids -> (kind, name, attrs, ids), kind "text" | "open" | "close" | "bad" ---------------
    def _lex(self, t: int) -> list[tuple]:
        if self.tag is not None:
            if t == self.sep:
                ids, self.tag = self.tag + [t], None
                return [self._read_tag(ids)]
            if self.tok.is_special(t):          # not a tag: its ids are text; t starts afresh
                ids, self.tag = self.tag, None
                return [("bad", None, None, ids), *self._lex(t)]
            self.tag.append(t)
            text = self.tok.decode_bytes(self.tag[1:]).decode("utf-8", "ignore")
            grammar = OPEN_TAG if self.tag[0] == self.open else CLOSE_TAG
            if len(self.tag) > MAX_TAG_IDS or not grammar.fullmatch(text, partial=True):
                ids, self.tag = self.tag, None
                return [("bad", None, None, ids)]
            return []
        if t in (self.open, self.close):
            self.tag = [t]
            return []
        return [("bad" if self.tok.is_special(t) else "text", None, None, [t])]

    def _read_tag(self, ids: list[int]) -> tuple:
        text = self.tok.decode(ids[1:-1])
        if ids[0] == self.open:
            m = OPEN_TAG.fullmatch(text)
            if m:
                return "open", m[1], {k: unescape(v) for k, v in ATTR.findall(m[2])}, ids
        elif CLOSE_TAG.fullmatch(text):
            return "close", text, {}, ids
        return "bad", None, None, ids

    # -- feeding --------------------------------------------------------------------------------------
    def feed(self, t: int) -> list[tuple]:
        out: list[tuple] = []
        t = int(t)
        if self.done or self.state == ENDED or t == self.eom:
            return out
        for sym in self._lex(t):
            if self.done or self.state == ENDED:
                break
            self._step(sym, out)
        return out

    def _text(self, ids: list[int], out: list, channel: str = "content") -> None:
        st = self.reasoning if channel == "reasoning" else self.content
        for i in ids:
            s, _ = st.add(i)
            if s:
                out.append((channel, s))

    def _step(self, sym: tuple, out: list) -> None:
        kind, name, attrs, ids = sym
        key, s = (kind, name), self.state
        if s in (THINK, RESPONSE):
            if key == ("close", s):
                self.state = MSG
            elif key in LEVEL:                  # the channel was left open: the tag is the next one
                self.state = MSG
                self._step(sym, out)
            else:
                self._text(ids, out, "reasoning" if s == THINK else "content")
        elif s == MSG:
            if key in (("open", THINK), ("open", RESPONSE)):
                self.state = name
            elif key == ("open", TOOLS) and self.tools is None:
                self.failures.append("tools_off")
                self.state = TOOLS_OFF
                self._text(ids, out)
            elif key == ("open", TOOLS):
                self.state, self.pending, self.sec_released, self.sec_failed = TOOLS, list(ids), False, False
            elif key == ("close", "message"):
                self.state = ENDED
            else:
                if kind in ("open", "close") and name in TOOL_TAGS:
                    self.failures.append("unexpected_token")
                self._text(ids, out)
        elif s == TOOLS_OFF:
            if key == ("close", "message"):
                self.state = ENDED
                return
            self._text(ids, out)
            if key == ("close", TOOLS):
                self.state = MSG
        elif s == TOOLS:
            self._tools_step(key, attrs, ids, out)
        else:
            self._call_step(sym, out)

    def _tools_step(self, key: tuple, attrs: dict | None, ids: list[int], out: list) -> None:
        if key == ("open", CALL):
            name = attrs.get("tool")
            self.call = _Call(list(ids), name, None if name and name in self.tools else "unknown_function")
            self.state = CALL
        elif key == ("close", TOOLS):
            self._end_section(ids, None, out)
        elif key == ("close", "message"):
            self._end_section([], "unclosed", out)
            self.state = ENDED
        elif self.junk and key[0] in ("text", "bad"):
            self._text(ids, out)                # more of the same stray run: one failure for it
            return
        elif key[0] == "text" and not self.tok.decode(ids).strip():
            if not self.sec_released:
                self.pending += ids             # whitespace between calls
        else:
            self._fail(ids, "stray_text" if key[0] == "text" else "unexpected_token", out)
            self.junk = True
            return
        self.junk = False

    def _call_step(self, sym: tuple, out: list) -> None:
        kind, name, attrs, ids = sym
        key, call = (kind, name), self.call
        if key == ("close", CALL):
            call.ids += ids
            if self.state != CALL:
                call.bad = call.bad or "unclosed"
            self._end_call(out)
        elif key in (("open", CALL), ("close", TOOLS)):   # the call was left open
            self._fail(call.ids, call.bad or "unclosed", out)
            self._step(sym, out)
        elif key == ("close", "message"):
            self.pending += call.ids
            self.call = None
            self._end_section([], call.bad or "unclosed", out)
            self.state = ENDED
        elif call.bad:
            call.ids += ids
        elif self.state == CALL:
            call.ids += ids
            if kind == "text":
                if self.tok.decode(ids).strip():
                    call.bad = "stray_text"
            elif key == ("open", ARG) and call.raw is None and "key" in attrs:
                call.key, call.type, call.value = attrs["key"], attrs.get("type", "string"), []
                self.state = ARG
            elif key == ("open", JSON) and call.raw is None and not call.args:
                call.value = []
                self.state = JSON
            else:
                call.bad = "bad_argument" if key in (("open", ARG), ("open", JSON)) else "unexpected_token"
        else:                                   # reading an argument's value or the json block
            call.ids += ids
            if kind == "text":
                call.value += ids
                return
            closer, self.state = ("close", self.state), CALL
            if key != closer:
                call.bad = "unexpected_token"
                return
            text = self.tok.decode_bytes(call.value).decode("utf-8", "replace")
            if closer[1] == ARG:
                call.args[call.key] = _typed(text, call.type)
            else:
                call.raw = text

    def _end_call(self, out: list) -> None:
        """``<|close|>call<|sep|>``: the call is released, or comes back as text."""
        call, self.call, self.state = self.call, None, TOOLS
        if call.bad:
            self._fail(call.ids, call.bad, out)
            return
        i = self.released
        self.released += 1
        self.sec_released, self.pending = True, []
        args = call.raw if call.raw is not None else json.dumps(call.args, ensure_ascii=False)
        out += [("call", i, f"call_{secrets.token_hex(12)}", call.name), ("arguments", i, args), ("call_end", i)]
        if not self.parallel:
            self._end_section([], None, out)
            self.done = True

    def _fail(self, ids: list[int], reason: str, out: list) -> None:
        """Ids of the tools channel that are not a call: content text (after the channel's own ids
        held so far, when no call of it was released)."""
        self.failures.append(reason)
        self.sec_failed, self.call, self.state = True, None, TOOLS
        ids, self.pending = self.pending + ids, []
        self._text(ids, out)

    def _end_section(self, close_ids: list[int], reason: str | None, out: list) -> None:
        """The tools channel ends (its close tag, the message's, or the generation's end)."""
        if reason:
            self.failures.append(reason)
        if self.sec_released:
            self._text(self.pending, out)       # a call cut off after released ones
            out.append(("section_end",))
        else:                                   # no call: the whole channel is text
            if not reason and not self.sec_failed:
                self.failures.append("no_calls")
            self._text(self.pending + close_ids, out)
        self.pending, self.state = [], MSG

    def finish(self) -> list[tuple]:
        """Generation ended: a tag being read is text, an unclosed call or tools channel is text
        ("unclosed"; calls released before stay), an unclosed think/response channel is fine, and
        held-back text is released."""
        out: list[tuple] = []
        tag, self.tag = self.tag or [], None
        if not self.done and self.state != ENDED:
            if self.state in CALL_STATES:
                self.pending += self.call.ids + tag
                reason, self.call = self.call.bad or "unclosed", None
                self._end_section([], reason, out)
            elif self.state == TOOLS:
                self.pending += tag
                self._end_section([], "unclosed", out)
            elif tag:
                self._step(("bad", None, None, tag), out)
        for channel, st in (("reasoning", self.reasoning), ("content", self.content)):
            s = st.finish()
            if s:
                out.append((channel, s))
        self.state = ENDED
        return out


def _typed(text: str, type_: str):
    """An argument's value by its ``type=``: strings raw, anything else JSON (raw text if not JSON)."""
    if type_ == "string":
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text
