"""Rewards for RL on verifiable tasks: built-in verifiers, user ``module:function`` rewards, their
weighted sum (docs/rl.md).

A completion's ids are read through the server's own parsers (``data.k3_toolcalls.K3Parser`` for
K3's format, ``data.toolcalls.Parser`` for K2's), primed as the server primes them, into a
``Reply``: the content text, the reasoning, the tool calls, the parser's failures (malformed tool
sections) and whether the thinking channel was closed. Rewards see the prompt's record (its JSON
fields) and the reply:

    exact_match  1 if the reply's final answer equals the record's ``answer`` (see ``extract_answer``
                 and ``answers_equal`` for the policy), else 0
    tool_call    1 if the reply's tool calls equal the record's ``tool_call`` (one call or a list, in
                 order: same names, JSON-equal arguments), else 0
    format       1 if the thinking channel was closed and no tool section was malformed, else 0

A user reward ``pkg.module:function`` is called as ``function(record, completion, tool_calls)`` with
the record (a copy), the content text and the calls (``[{"name", "arguments"}]``, arguments a dict
when they are JSON) and returns a finite number; a ``fields`` attribute (names of record fields it
reads) makes the prompt set check them up front. A reward that cannot be imported is a
``RewardError`` at load; one that raises or returns no number is a ``RewardError`` naming it and the
prompt's file:line, or (``rl_reward_errors=zero``) scores 0 and is counted.
"""
from __future__ import annotations

import copy
import dataclasses
import importlib
import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from fractions import Fraction
from typing import Any

import numpy as np

from k3jax.config import RLConfig
from k3jax.data import k3_chat
from k3jax.data import k3_toolcalls, toolcalls
from k3jax.data.tokenizer import KimiTokenizer
from k3jax.errors import UserError
from k3jax.validation import rl_reward_specs


class RewardError(UserError):
    """A reward that cannot be loaded, or that failed on a prompt (the message names both)."""


@dataclasses.dataclass(frozen=True)
class Reply:
    """One completion (or a multi-turn trajectory's model side) as the rewards see it."""
    text: str                                   # content: what the model said outside thinking and tool calls
    reasoning: str = ""
    tool_calls: tuple[dict, ...] = ()           # {"name": str, "arguments": dict | str}, in order
    failures: tuple[str, ...] = ()              # parser failures: why tool sections came back as text
    think_closed: bool = True                   # no thinking channel left open


def _call(name: str, arguments: str) -> dict:
    try:
        args = json.loads(arguments)
    except ValueError:
        args = arguments
    return {"name": name, "arguments": args}


def parse_reply(tok: KimiTokenizer, prompt_ids: Sequence[int], completion_ids: Sequence[int], *,
                tools: Sequence[str] = (), stop_ids: Sequence[int] | None = None) -> Reply:
    """A completion's ids -> ``Reply``, through the parser the server uses for ``tok``'s family.

    ``prompt_ids``: the prompt the completion continues (its trailing ``<|open|>think<|sep|>`` or
    ``<think>`` primes the parser, as the server does). ``tools``: the function names the prompt
    declared; a call to any other name, or a tool section when none were declared, is a failure.
    ``stop_ids``: the generation ends at the first of them (default: EOS and the end-of-turn token,
    the server's stop ids)."""
    names = list(tools)
    if k3_chat.is_k3(tok):
        _, prime = k3_toolcalls.forced_tokens(tok, prompt_ids, "auto")
        parser = k3_toolcalls.K3Parser(tok, tools=names, prime=prime)
        thinking = k3_toolcalls.THINK
        close_think = k3_chat.encode(tok, k3_chat.close_tag("think"))[0]
    else:
        grammar = toolcalls.Grammar.of(tok)
        prime = [] if grammar is None else toolcalls.forced_tokens(grammar, prompt_ids, "auto")[1]
        parser = toolcalls.Parser(grammar, tok, tools=names, prime=prime)
        thinking = toolcalls.REASONING
        close_think = [tok.special_ids["</think>"]] if grammar is not None and grammar.think else []
    stops = {tok.eos_id, tok.im_end_id} if stop_ids is None else set(stop_ids)
    events: list[tuple] = []
    seen: list[int] = []
    left_open = False
    for t in completion_ids:
        t = int(t)
        if t in stops:
            break
        before = parser.state
        seen.append(t)
        events += parser.feed(t)
        # K3: a think channel left open and followed by another channel is read on (formats.md), but
        # it was not closed; K2's reasoning state ends only at </think>.
        if before == thinking and parser.state != thinking and seen[-len(close_think):] != close_think:
            left_open = True
    think_closed = parser.state != thinking and not left_open
    events += parser.finish()
    msg = toolcalls.message(events)
    calls = tuple(_call(c["function"]["name"], c["function"]["arguments"]) for c in msg.get("tool_calls", ()))
    return Reply(text=msg["content"] or "", reasoning=msg["reasoning_content"] or "", tool_calls=calls,
                 failures=tuple(parser.failures), think_closed=think_closed)



def join_turns(turns: Sequence[Reply]) -> Reply:
    """A multi-turn trajectory's model turns (each parsed on its own, with the prompt it continued) as
    one ``Reply``: the last turn's text (the final answer), every turn's reasoning (blank-line
    separated), calls and failures in order, thinking closed in every turn."""
    if not turns:
        raise ValueError("join_turns: no turns")
    return Reply(text=turns[-1].text, reasoning="\n\n".join(t.reasoning for t in turns if t.reasoning),
                 tool_calls=tuple(c for t in turns for c in t.tool_calls),
                 failures=tuple(f for t in turns for f in t.failures),
                 think_closed=all(t.think_closed for t in turns))

# -- final-answer matching ------------------------------------------------------------------------------
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_ANSWER_IS = re.compile(r"\banswer\s*(?:is\s*:?|:)\s*", re.IGNORECASE)
_FRAC = re.compile(r"^\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}$")
_TEXT = re.compile(r"\\(?:text|mathrm|textbf)\{([^{}]*)\}")
_NUMBER = re.compile(r"^[+-]?(?:\d{1,3}(?:,\d{3})+|\d+)?(?:\.\d+)?(?:[eE][+-]?\d+)?$")


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), nested braces kept; None if there
    is none or it is not closed."""
    found = None
    for m in _BOXED.finditer(text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        found = text[m.end():i - 1] if depth == 0 else None
    return found


def extract_answer(text: str) -> str:
    """The final answer a reply states: the last ``\\boxed{}`` if any; else the rest of the line after
    the last "answer is" / "answer:"; else the whole text. (So "\\boxed{8}", "The answer is 8." and
    "8" all state 8; "3, or maybe 8" states "3, or maybe 8", which matches nothing.)"""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    found = list(_ANSWER_IS.finditer(text))
    return text[found[-1].end():].split("\n", 1)[0] if found else text


def normalize_answer(s: str) -> str:
    """Whitespace collapsed, surrounding ``$``s, a final period and ``\\text{}`` wrappers dropped,
    case folded."""
    s = " ".join(str(s).split())
    s = _TEXT.sub(r"\1", s)
    while len(s) >= 2 and s[0] == s[-1] == "$":
        s = s[1:-1].strip()
    return s.rstrip(".").strip().casefold()


def as_number(s: str) -> Fraction | None:
    """An exact rational for a number written as an integer, a decimal (thousands commas allowed), a
    scientific literal, a fraction a/b or \\frac{a}{b}; None otherwise."""
    s = normalize_answer(s).replace(" ", "")
    m = _FRAC.match(s)
    if m:
        num, den = as_number(m[1]), as_number(m[2])
        return num / den if num is not None and den else None
    if s.count("/") == 1:
        num, den = (as_number(p) for p in s.split("/"))
        return num / den if num is not None and den else None
    if not s or not _NUMBER.match(s) or not any(c.isdigit() for c in s):
        return None
    return Fraction(s.replace(",", ""))


def answers_equal(got: str, want: Any) -> bool:
    """Numerically equal when both are numbers ("8" == "8.0" == "08" == "16/2"), else equal as
    normalised strings. ``want`` may be a list of accepted answers."""
    if isinstance(want, (list, tuple)):
        return any(answers_equal(got, w) for w in want)
    want = str(want)
    a, b = as_number(got), as_number(want)
    if a is not None and b is not None:
        return a == b
    return normalize_answer(got) == normalize_answer(want)


# -- built-in rewards (record, reply) -> float ----------------------------------------------------------
def exact_match(record: Mapping, reply: Reply) -> float:
    return float(answers_equal(extract_answer(reply.text), record["answer"]))


def _expected_calls(value: Any) -> list[dict]:
    calls = value if isinstance(value, list) else [value]
    out = []
    for c in calls:
        fn = c.get("function", c) if isinstance(c, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise ValueError(f"tool_call must be {{\"name\": ..., \"arguments\": {{...}}}} or a list of them, "
                             f"got {c!r}")
        args = fn.get("arguments", {})
        out.append({"name": fn["name"], "arguments": json.loads(args) if isinstance(args, str) else args})
    return out


def tool_call(record: Mapping, reply: Reply) -> float:
    want = _expected_calls(record["tool_call"])
    got = list(reply.tool_calls)
    return float(len(got) == len(want) and all(g["name"] == w["name"] and g["arguments"] == w["arguments"]
                                               for g, w in zip(got, want)))


def format_reward(record: Mapping, reply: Reply) -> float:
    return float(reply.think_closed and not reply.failures)


# name -> (function, record fields it reads)
BUILTIN: dict[str, tuple[Callable[[Mapping, Reply], float], tuple[str, ...]]] = {
    "exact_match": (exact_match, ("answer",)),
    "tool_call": (tool_call, ("tool_call",)),
    "format": (format_reward, ()),
}


@dataclasses.dataclass(frozen=True)
class Reward:
    name: str                                   # as written in rl_rewards: a built-in name or module:function
    fn: Callable[[Mapping, Reply], float]       # (record, reply) -> value
    weight: float
    fields: tuple[str, ...]                     # record fields it reads


def load_reward(spec: str, weight: float = 1.0) -> Reward:
    """A built-in name or ``module:function`` -> ``Reward``; RewardError naming what cannot be loaded."""
    if ":" not in spec:
        if spec not in BUILTIN:
            raise RewardError(f"rl_rewards: unknown reward {spec!r}; built in: {', '.join(BUILTIN)}, or give "
                              "module:function")
        fn, fields = BUILTIN[spec]
        return Reward(spec, fn, weight, fields)
    module, name = spec.split(":")
    try:
        mod = importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - any failure while importing the user's module is reported the same way
        raise RewardError(f"rl_rewards: cannot import module {module!r} of the reward {spec!r} "
                          f"({type(e).__name__}: {_one_line(e)})") from None
    user = getattr(mod, name, None)
    if not callable(user):
        raise RewardError(f"rl_rewards: module {module!r} has no function {name!r} (reward {spec!r})")
    fields = getattr(user, "fields", ())
    if isinstance(fields, str) or not all(isinstance(f, str) for f in fields):
        raise RewardError(f"rl_rewards: {spec}.fields must be a list of record field names, got {fields!r}")

    def call(record: Mapping, reply: Reply) -> float:
        return user(copy.deepcopy(dict(record)), reply.text, [dict(c) for c in reply.tool_calls])
    return Reward(spec, call, weight, tuple(fields))


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


@dataclasses.dataclass(frozen=True)
class Scores:
    total: float                                # sum of weight x value
    components: dict[str, float]                # reward name -> value (before its weight)
    errors: tuple[str, ...] = ()                # rewards that failed and scored 0 (rl_reward_errors=zero)


class RewardSet:
    """Several rewards summed with weights. ``errors``: "raise" (a failure is a RewardError naming the
    reward and the prompt's file:line) or "zero" (the failed component scores 0 and is counted)."""

    def __init__(self, rewards: Sequence[Reward], errors: str = "raise"):
        if errors not in ("raise", "zero"):
            raise ValueError(f"errors={errors!r}: must be raise or zero")
        names = [r.name for r in rewards]
        if not rewards or len(set(names)) != len(names):
            raise RewardError(f"rl_rewards={names}: give each reward once, at least one")
        self.rewards, self.errors = tuple(rewards), errors

    @classmethod
    def from_config(cls, cfg: RLConfig) -> RewardSet:
        """The rewards of ``rl_rewards`` with ``rl_reward_errors``."""
        return cls([load_reward(spec, w) for spec, w in rl_reward_specs(cfg.rl_rewards)], cfg.rl_reward_errors)

    @property
    def fields(self) -> dict[str, str]:
        """Record field -> the first reward that reads it (for the prompt set's up-front check)."""
        out: dict[str, str] = {}
        for r in self.rewards:
            for f in r.fields:
                out.setdefault(f, r.name)
        return out

    def score(self, record: Mapping, where: str, reply: Reply) -> Scores:
        """One completion's rewards. ``where``: the prompt's file:line, for error messages."""
        comps: dict[str, float] = {}
        failed: list[str] = []
        for r in self.rewards:
            try:
                value = r.fn(record, reply)
                bad = None if _is_number(value) else f"returned {value!r}, not a finite number"
            except Exception as e:  # noqa: BLE001 - a reward's own bug, reported with its place
                bad = f"raised {type(e).__name__}: {_one_line(e)}"
            if bad is not None:
                if self.errors == "raise":
                    raise RewardError(f"reward {r.name!r} {bad} on the prompt at {where} (rl_reward_errors=zero "
                                      "scores such a completion 0 instead)")
                failed.append(r.name)
                value = 0.0
            comps[r.name] = float(value)
        return Scores(sum(r.weight * comps[r.name] for r in self.rewards), comps, tuple(failed))

    def score_batch(self, records: Sequence[tuple[Mapping, str]], replies: Sequence[Reply]
                    ) -> tuple[np.ndarray, dict[str, np.ndarray], dict[str, int]]:
        """Rewards of B completions, ``records[i]`` = (record, where) of completion i's prompt ->
        (totals f32 [B], per reward its values f32 [B] for logging, per reward its failures counted)."""
        scores = [self.score(rec, where, rep) for (rec, where), rep in zip(records, replies, strict=True)]
        comps = {r.name: np.asarray([s.components[r.name] for s in scores], np.float32) for r in self.rewards}
        errors = {r.name: sum(r.name in s.errors for s in scores) for r in self.rewards}
        return np.asarray([s.total for s in scores], np.float32), comps, errors


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and math.isfinite(float(v))
