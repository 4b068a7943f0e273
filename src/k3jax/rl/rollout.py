"""Rollouts from the inference core: ``num_generations`` samples per prompt, single- or multi-turn.

Each sample takes a slot of the core's programs (``inference.generate.Generator``): its prompt
prefills, the model samples until a stop id (end of turn, EOS) or its token budget, and the
tokens come back with their behaviour log-probabilities (under the distribution actually sampled
from). A turn that ends in tool calls (read by the server's parsers, ``rewards.parse_reply``) runs
the registered tools (``name=module:function``, each call with a timeout; a failure or a timeout
becomes the tool message's content, counted, never a crash), and the tool messages plus the next
assistant header are prefilled into the same live slot (``Generator.extend``: no re-prefill of the
conversation), up to ``max_turns`` model turns. The loss mask is 1 exactly on the tokens the model
sampled: prompt, tool-result and template tokens are 0.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import importlib
import json
from typing import Callable, Mapping, Sequence

from k3jax.data.chat_template import chat_ids
from k3jax.errors import UserError
from k3jax.inference.generate import Generator, Sampling
from k3jax.rl.rewards import Reply, parse_reply


class ToolError(UserError):
    """A tool spec that cannot be loaded (the message names it)."""


@dataclasses.dataclass
class Sample:
    """One rollout: everything after its prompt, model turns and tool turns in order."""
    prompt_index: int
    tokens: list[int] = dataclasses.field(default_factory=list)
    mask: list[int] = dataclasses.field(default_factory=list)           # 1 where the model sampled the token
    logprobs: list[float] = dataclasses.field(default_factory=list)     # behaviour log-probs (0 where mask is 0)
    replies: list[Reply] = dataclasses.field(default_factory=list)      # each model turn, parsed
    tool_results: list[str] = dataclasses.field(default_factory=list)
    tool_errors: int = 0                                                # calls that failed or timed out
    finish: str = ""                                                    # "stop" | "length" | "turns"

    def add(self, tokens, logprobs, sampled: bool) -> None:
        self.tokens += list(tokens)
        self.mask += [int(sampled)] * len(tokens)
        self.logprobs += list(logprobs) if sampled else [0.0] * len(tokens)


def load_tools(specs: Sequence[str]) -> dict[str, Callable]:
    """``["name=module:function", ...]`` (or ``module:function``, named after the function) ->
    {name: callable}; one that cannot be imported is a ToolError naming it."""
    out = {}
    for spec in specs:
        name, _, target = spec.rpartition("=") if "=" in spec else ("", "", spec)
        mod, _, fn = target.partition(":")
        if not mod or not fn:
            raise ToolError(f"tool {spec!r}: write it as name=module:function")
        try:
            f = getattr(importlib.import_module(mod), fn)
        except (ImportError, AttributeError) as e:
            raise ToolError(f"tool {spec!r}: cannot import {target} ({e})") from None
        out[name or fn] = f
    return out


_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="k3jax-rl-tool")


def call_tool(tools: Mapping[str, Callable], call: dict, timeout: float) -> tuple[str, bool]:
    """Run one parsed call -> (the tool message's content, whether it failed). The arguments go in
    as keywords (a dict) or one positional string; the result is sent as a string (JSON for
    anything but a str). A tool left running past ``timeout`` keeps its thread until it returns."""
    fn = tools.get(call["name"])
    if fn is None:
        return f"error: no tool named {call['name']!r}", True
    args = call["arguments"]
    fut = _POOL.submit(fn, **args) if isinstance(args, dict) else _POOL.submit(fn, args)
    try:
        result = fut.result(timeout=timeout)
    except concurrent.futures.TimeoutError:
        return f"error: tool {call['name']!r} timed out after {timeout:g} s", True
    except Exception as e:     # noqa: BLE001 - a tool's failure is the model's to read, not a crash
        return f"error: tool {call['name']!r} failed: {type(e).__name__}: {e}", True
    return (result if isinstance(result, str) else json.dumps(result)), False


def tool_turn_ids(tok, messages: list[dict], tools, reply: Reply, results: Sequence[str], first_id: int = 0
                  ) -> tuple[list[int], list[dict]]:
    """The tokens that follow a model turn ending in tool calls: its tool messages and the next
    assistant header, as the chat format renders them after that turn (the rendering of the
    conversation with them, past the rendering without them) -> (those tokens, the turn and its tool
    messages as chat messages, to extend ``messages`` with)."""
    calls = [{"id": f"functions.{c['name']}:{first_id + i}", "type": "function",
              "function": {"name": c["name"], "arguments": c["arguments"] if isinstance(c["arguments"], str)
                           else json.dumps(c["arguments"])}} for i, c in enumerate(reply.tool_calls)]
    turn = {"role": "assistant", "content": reply.text, "tool_calls": calls}
    answers = [{"role": "tool", "tool_call_id": c["id"], "content": r} for c, r in zip(calls, results)]
    head = chat_ids(tok, messages + [turn], tools=tools, add_generation_prompt=False)
    full = chat_ids(tok, messages + [turn, *answers], tools=tools, add_generation_prompt=True)
    if full[:len(head)] != head:
        raise ValueError("the chat format renders the conversation before the tool messages differently with "
                         "them than without: cannot append the tool turn to a live slot")
    return full[len(head):], [turn, *answers]


def rollout(gen: Generator, tok, prompts: Sequence, *, generations: int, sampling: Sampling, max_new_tokens: int,
            max_turns: int = 1, tools: Mapping[str, Callable] | None = None, tool_timeout: float = 10.0,
            stop_ids: Sequence[int] | None = None) -> list[Sample]:
    """``generations`` samples of each prompt (``rl.prompts.Prompt``: ids, tool names, and a record
    whose ``messages`` / ``tools`` the tool turns are rendered after), in waves of the programs'
    slots. Sample g of prompt p draws with seed ``sampling.seed + p * generations + g``.
    ``max_new_tokens`` bounds the model's tokens of a sample over all its turns."""
    stops = tuple(stop_ids) if stop_ids is not None else (tok.eos_id, tok.im_end_id)
    jobs = [(p, g) for p in range(len(prompts)) for g in range(generations)]
    out: list[Sample] = []
    for w in range(0, len(jobs), gen.p.slots):
        wave = jobs[w:w + gen.p.slots]
        out += _wave(gen, tok, prompts, wave, generations, sampling, max_new_tokens, max_turns, tools or {},
                     tool_timeout, stops)
    return out


def _wave(gen, tok, prompts, wave, generations, sampling, max_new_tokens, max_turns, tools, timeout, stops):
    slots = list(range(len(wave)))
    samples = [Sample(p) for p, _ in wave]
    smp = [dataclasses.replace(sampling, seed=sampling.seed + p * generations + g) for p, g in wave]
    firsts = gen.start(slots, [list(prompts[p].ids) for p, _ in wave], smp)
    convs = {s: list(prompts[p].record.get("messages") or []) for s, (p, _) in zip(slots, wave)}
    turns = {s: 1 for s in slots}
    live = {s: firsts[s] for s in slots}          # slot -> the first token of its current turn (token, lp, blp)
    turn_start = {s: 0 for s in slots}
    while live:
        # the model's tokens left to the sample, and the positions left in its slot
        budgets = {s: min(max_new_tokens - sum(samples[s].mask), gen.p.length - int(gen.pos[s])) - 1 for s in live}
        for s, first in live.items():
            samples[s].add([first[0]], [first[2]], True)
        going = [s for s in live if budgets[s] > 0 and live[s][0] not in stops]
        more = gen.decode(going, [budgets[s] for s in going], stop_ids=stops)
        nxt = {}
        for s in live:
            toks, _, blps = more.get(s, ([], [], []))
            samples[s].add(toks, blps, True)
            p = samples[s].prompt_index
            turn = samples[s].tokens[turn_start[s]:]
            reply = parse_reply(tok, list(prompts[p].ids) + samples[s].tokens[:turn_start[s]], turn,
                                tools=prompts[p].tools, stop_ids=stops)
            samples[s].replies.append(reply)
            ended = bool(turn) and turn[-1] in stops
            if not ended:
                samples[s].finish = "length"
            elif not reply.tool_calls:
                samples[s].finish = "stop"
            elif turns[s] >= max_turns or not tools:
                samples[s].finish = "turns" if tools else "stop"
            else:
                results, failed = zip(*(call_tool(tools, c, timeout) for c in reply.tool_calls))
                samples[s].tool_results += results
                samples[s].tool_errors += sum(failed)
                n_calls = sum(len(r.tool_calls) for r in samples[s].replies[:-1])
                ids, msgs = tool_turn_ids(tok, convs[s], prompts[p].record.get("tools"), reply, results, n_calls)
                convs[s] += msgs
                if len(prompts[p].ids) + len(samples[s].tokens) + len(ids) + 1 > gen.p.length:
                    samples[s].finish = "length"
                    continue
                samples[s].add(ids, [], False)
                turn_start[s] = len(samples[s].tokens)
                turns[s] += 1
                nxt[s] = gen.extend(s, ids)
        live = nxt
    return samples
