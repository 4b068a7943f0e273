"""Generated token ids -> OpenAI fields: content, ``reasoning_content`` and ``tool_calls``.

A streaming parser over the ids a chat request generates (pure Python), for the K2 / K2.5 / Kimi
Linear markup (formats.md §3.5; K3's XTML replies are parsed by ``k3_toolcalls.K3Parser``, which
emits the same events). The markers are special tokens, looked up by name in the tokenizer, so text
a model writes that spells a marker's name is ordinary text::

    <think> reasoning </think> content
    <|tool_calls_section_begin|>
      <|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{json}<|tool_call_end|> ...
    <|tool_calls_section_end|>

A tool-call section is released whole when it closes: every call's id must be
``functions.NAME:IDX`` with NAME among the request's tools and its arguments a JSON object;
otherwise the whole section comes back as content text (the markers as their names) and the
reason is recorded in ``failures``, as it is for a section still open when generation ends.
With ``parallel=False`` the section ends at its first complete call (``done`` turns true: the
caller stops the generation). Reasoning and content text stream as they come, through
``TextState`` (UTF-8 across tokens, ``stop`` strings).
"""
from __future__ import annotations

import codecs
import dataclasses
import json
import re
from collections.abc import Iterable, Sequence

from k3jax.data import k3_chat
from k3jax.data.reply_text import TextState

K2_TOOL_TOKENS = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
                  "<|tool_call_argument_begin|>", "<|tool_call_end|>")
K2_THINK_TOKENS = ("<think>", "</think>")
CALL_ID = re.compile(r"functions\.(?P<name>.+):(?P<index>\d+)", re.DOTALL)

# parser states
CONTENT, REASONING, SECTION, CALL_ID_TEXT, ARGS = "content", "reasoning", "section", "call_id", "arguments"
# lexical symbols
THINK_OPEN, THINK_CLOSE, SECTION_OPEN, SECTION_CLOSE, CALL_OPEN, ARG_OPEN, CALL_CLOSE = (
    "think_open", "think_close", "section_open", "section_close", "call_open", "arg_open", "call_close")

K2_SYMBOL = {"<think>": THINK_OPEN, "</think>": THINK_CLOSE, "<|tool_calls_section_begin|>": SECTION_OPEN,
             "<|tool_calls_section_end|>": SECTION_CLOSE, "<|tool_call_begin|>": CALL_OPEN,
             "<|tool_call_argument_begin|>": ARG_OPEN, "<|tool_call_end|>": CALL_CLOSE}


@dataclasses.dataclass(frozen=True)
class Grammar:
    """The K2-family tool-call and thinking markup of one tokenizer, as token ids."""
    tok: object
    ids: dict                                   # marker name -> id
    think: bool                                 # the tokenizer has thinking markup

    @classmethod
    def of(cls, tok) -> Grammar | None:
        """K2's tool tokens (with ``<think>`` / ``</think>`` where present); None without them (no tool
        calls, no thinking). A K3 tokenizer has none of them: its replies go to ``K3Parser``."""
        sp = tok.special_ids
        if all(t in sp for t in K2_TOOL_TOKENS):
            names = K2_TOOL_TOKENS + tuple(t for t in K2_THINK_TOKENS if t in sp)
            return cls(tok, {t: sp[t] for t in names}, all(t in sp for t in K2_THINK_TOKENS))
        return None

    def think_open(self) -> list[int]:
        return [self.ids["<think>"]] if self.think else []

    def think_close(self) -> list[int]:
        return [self.ids["</think>"]]

    def section_open(self) -> list[int]:
        return [self.ids["<|tool_calls_section_begin|>"]]

    def call_header(self, call_id: str) -> list[int]:
        return [self.ids["<|tool_call_begin|>"], *self.tok.encode(call_id), self.ids["<|tool_call_argument_begin|>"]]


def ban_token(tok) -> int:
    """The token that opens a tool-call section, which ``tool_choice="none"`` bans in sampling: K3's
    ``<|open|>`` (banned once the reply's own channels are open), K2's
    ``<|tool_calls_section_begin|>``; -1 for a tokenizer with neither."""
    if k3_chat.is_k3(tok):
        return tok.special_ids[k3_chat.OPEN]
    return tok.special_ids["<|tool_calls_section_begin|>"] if Grammar.of(tok) is not None else -1


def forced_tokens(grammar: Grammar, prompt: Sequence[int], choice: str, name: str | None = None,
                  index: int = 0) -> tuple[list[int], list[int]]:
    """Tokens appended to the prompt for ``tool_choice`` ("required": open the tool-call section;
    "named": also the header of call ``functions.NAME:INDEX``), and the ids the parser is primed
    with (the prompt's trailing thinking opener, then the forced tokens), so that it starts in the
    state the model continues from. A thinking block the prompt left open is closed first: a forced
    call is not preceded by reasoning."""
    opener = grammar.think_open()
    prime = list(opener) if opener and list(prompt[-len(opener):]) == opener else []
    forced: list[int] = []
    if choice in ("required", "named"):
        if prime:
            forced += grammar.think_close()
        forced += grammar.section_open()
        if choice == "named":
            forced += grammar.call_header(f"functions.{name}:{index}")
    return forced, prime + forced


@dataclasses.dataclass
class _Call:
    tokens: list[int] = dataclasses.field(default_factory=list)      # the id's tokens
    fragments: list[str] = dataclasses.field(default_factory=list)   # argument text, per token
    utf8: object = dataclasses.field(default_factory=lambda: codecs.getincrementaldecoder("utf-8")("replace"))
    bad: str | None = None
    call_id: str = ""
    name: str = ""


class Parser:
    """Feeds on generated ids (``feed``), then ``finish``; both return events:

    ``("content", text)``, ``("reasoning", text)``, ``("call", index, id, name)``,
    ``("arguments", index, fragment)``, ``("call_end", index)``, ``("section_end",)``.

    ``tools``: the function names calls may use; None turns tool-call parsing off (the markers stay
    text). ``prime``: ids the model continues from (``forced_tokens``), consumed silently.
    """

    def __init__(self, grammar: Grammar | None, tok, *, tools: Iterable[str] | None = None,
                 stop: tuple[str, ...] = (), parallel: bool = True, prime: Sequence[int] = ()):
        self.g, self.tok = grammar, tok
        self._k2 = {} if grammar is None else {i: K2_SYMBOL[n] for n, i in grammar.ids.items() if n in K2_SYMBOL}
        self.tools = None if tools is None or grammar is None else frozenset(tools)
        self.parallel = parallel
        self.content, self.reasoning = TextState(tok, stop), TextState(tok, stop)
        self.state = CONTENT
        self.section: list[int] = []             # ids of the open section (returned as text if it fails)
        self.calls: list[_Call] = []
        self.bad: str | None = None
        self.released = 0                        # calls returned so far (the next call's index)
        self.failures: list[str] = []            # why sections came back as text
        self.done = False                        # parallel=False and a call was returned
        for t in prime:
            self.feed(t)

    # -- lexing ---------------------------------------------------------------------------------
    def _symbols(self, t: int) -> list[tuple[str | None, list[int]]]:
        """-> [(symbol or None for text, the ids it covers)]."""
        return [(self._k2.get(t) if self.g is not None else None, [t])]

    # -- feeding --------------------------------------------------------------------------------
    def feed(self, t: int) -> list[tuple]:
        out: list[tuple] = []
        if self.done:
            return out
        for sym, ids in self._symbols(int(t)):
            self._step(sym, ids, out)
        return out

    def _text(self, ids: list[int], out: list, channel: str | None = None) -> None:
        channel = channel or (REASONING if self.state == REASONING else CONTENT)
        st = self.reasoning if channel == REASONING else self.content
        for i in ids:
            s, _ = st.add(i)
            if s:
                out.append((channel, s))

    def _step(self, sym: str | None, ids: list[int], out: list) -> None:
        s = self.state
        if s in (CONTENT, REASONING):
            if sym == THINK_OPEN and s == CONTENT and self.g.think:
                self.state = REASONING
            elif sym == THINK_CLOSE and s == REASONING:
                self.state = CONTENT
            elif sym == SECTION_OPEN and self.tools is not None:
                self.state, self.section, self.calls, self.bad = SECTION, list(ids), [], None
            else:
                self._text(ids, out)
            return
        self.section += ids
        if s == SECTION:
            if sym == CALL_OPEN:
                self.calls.append(_Call())
                self.state = CALL_ID_TEXT
            elif sym == SECTION_CLOSE:
                self._close(out)
            elif sym is None and not self.tok.is_special(ids[0]):
                if self.tok.decode(ids).strip():
                    self.bad = self.bad or "stray_text"
            else:
                self._fail("unexpected_token", out)
        elif s == CALL_ID_TEXT:
            call = self.calls[-1]
            if sym == ARG_OPEN:
                call.call_id = self.tok.decode(call.tokens)
                m = CALL_ID.fullmatch(call.call_id)
                call.name = m["name"] if m else ""
                if m is None:
                    call.bad = "bad_id"
                elif call.name not in self.tools:
                    call.bad = "unknown_function"
                self.state = ARGS
            elif sym is None and not self.tok.is_special(ids[0]):
                call.tokens += ids
            else:
                self._fail("unexpected_token", out)
        elif s == ARGS:
            call = self.calls[-1]
            if sym == CALL_CLOSE:
                tail = call.utf8.decode(b"", final=True)
                if tail:
                    call.fragments.append(tail)
                if call.bad is None:
                    try:
                        if not isinstance(json.loads("".join(call.fragments)), dict):
                            call.bad = "arguments_not_an_object"
                    except ValueError:
                        call.bad = "bad_json"
                self.bad = self.bad or call.bad
                self.state = SECTION
                if not self.parallel:
                    self._close(out)
                    self.done = self.done or bool(self.released)
            elif sym is None and not self.tok.is_special(ids[0]):
                piece = call.utf8.decode(self.tok.decode_bytes(ids))
                if piece:
                    call.fragments.append(piece)
            else:
                self._fail("unexpected_token", out)

    def _close(self, out: list) -> None:
        """The section ends: its calls, or all of it as text."""
        if self.bad is not None or not self.calls:
            self._fail(self.bad or "no_calls", out)
            return
        for call in self.calls:
            i = self.released
            self.released += 1
            out.append(("call", i, call.call_id, call.name))
            out += [("arguments", i, f) for f in call.fragments]
            out.append(("call_end", i))
        out.append(("section_end",))
        self.state, self.section, self.calls = CONTENT, [], []

    def _fail(self, reason: str, out: list) -> None:
        self.failures.append(reason)
        ids, self.section, self.calls, self.bad = self.section, [], [], None
        self.state = CONTENT
        self._text(ids, out, CONTENT)

    def finish(self) -> list[tuple]:
        """Generation ended: an open section is text ("unclosed"), and held-back text is released."""
        out: list[tuple] = []
        if self.state in (SECTION, CALL_ID_TEXT, ARGS) and not self.done:
            self._fail("unclosed", out)
        for channel, st in ((REASONING, self.reasoning), (CONTENT, self.content)):
            s = st.finish()
            if s:
                out.append((channel, s))
        return out


# -- events -> OpenAI fields ------------------------------------------------------------------------
def message(events: Iterable[tuple]) -> dict:
    """Events -> the fields of a chat ``message``: content (None when only calls were made),
    reasoning_content (None without reasoning) and, when calls were made, tool_calls."""
    content, reasoning, calls = [], [], []
    for ev in events:
        if ev[0] == "content":
            content.append(ev[1])
        elif ev[0] == "reasoning":
            reasoning.append(ev[1])
        elif ev[0] == "call":
            calls.append({"id": ev[2], "type": "function", "function": {"name": ev[3], "arguments": ""}})
        elif ev[0] == "arguments":
            calls[ev[1]]["function"]["arguments"] += ev[2]
    text = "".join(content)
    msg = {"role": "assistant", "content": text if text or not calls else None,
           "reasoning_content": "".join(reasoning) or None}
    if calls:
        msg["tool_calls"] = calls
    return msg


def deltas(events: Iterable[tuple]) -> list[dict]:
    """Events -> stream ``delta`` objects, in order: text of one kind merged, each call's header
    (index, id, type, name, empty arguments) then one delta per argument fragment."""
    out: list[dict] = []
    for ev in events:
        kind = ev[0]
        if kind in ("content", "reasoning"):
            key = "content" if kind == "content" else "reasoning_content"
            if out and set(out[-1]) == {key}:
                out[-1][key] += ev[1]
            else:
                out.append({key: ev[1]})
        elif kind == "call":
            out.append({"tool_calls": [{"index": ev[1], "id": ev[2], "type": "function",
                                        "function": {"name": ev[3], "arguments": ""}}]})
        elif kind == "arguments":
            out.append({"tool_calls": [{"index": ev[1], "function": {"arguments": ev[2]}}]})
    return out
