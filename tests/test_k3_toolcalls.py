"""Kimi K3 replies parsed out of generated ids (data/k3_toolcalls.py): parse(render(x)) == x through
data/k3_chat.py, in one piece and token by token; malformed output as text with a failure reason;
streaming (calls released at their close tag, text never held except a tag being read);
tool_choice forcing with the renderer's exact ids. Pure Python, a tiny K3 tokenizer."""
import json
import re

import pytest

from k3jax.data import k3_chat, tiny_tokenizer
from k3jax.data import toolcalls
from k3jax.data.k3_toolcalls import K3Parser, forced_tokens
from k3jax.data.messages import content_parts
from k3jax.data.tokenizer import KimiTokenizer

MARKERS = ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>")
MARK = re.compile("(" + "|".join(re.escape(m) for m in MARKERS) + ")")
THINK, RESP = "<|open|>think<|sep|>", "<|open|>response<|sep|>"
TOOLS = ("get_weather", "lookup", "f")
CONV = [{"role": "user", "content": "What's the weather in Paris?"}]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = tiny_tokenizer.build(tmp_path_factory.mktemp("k3tok"), vocab_size=512,
                             num_reserved=tiny_tokenizer.MIN_RESERVED, family="k3")
    return KimiTokenizer.from_dir(d)


def X(tok, s: str) -> list[int]:
    """Markers written by name -> their control ids; the rest ordinary text."""
    ids = []
    for piece in MARK.split(s):
        if piece in MARKERS:
            ids.append(tok.token_id(piece))
        elif piece:
            ids += tok.encode(piece)
    return ids


def run(tok, ids, *, prime=THINK, tools=TOOLS, **kw):
    """-> (parser, events), fed one id at a time, then finish()."""
    p = K3Parser(tok, tools=tools, prime=X(tok, prime) if isinstance(prime, str) else prime, **kw)
    events = []
    for t in ids:
        events += p.feed(t)
    return p, events + p.finish()


def msg(events):
    return toolcalls.message(events)


def call(name, args):
    return {"id": "x", "type": "function", "function": {"name": name, "arguments": args}}


def comparable(m: dict) -> dict:
    """A message without call ids, content None when empty, arguments parsed where they are JSON."""
    def args(a):
        if isinstance(a, str):
            try:
                return json.loads(a)
            except ValueError:
                return a
        return a
    return {"content": m.get("content") or None, "reasoning_content": m.get("reasoning_content") or None,
            "tool_calls": [(c["function"]["name"], args(c["function"]["arguments"]))
                           for c in m.get("tool_calls") or []]}


REPLIES = {
    "full": ({"role": "assistant", "reasoning_content": "Need the weather.\nCall tools.", "content": "Let me check.",
              "tool_calls": [call("get_weather", json.dumps({"city": "Paris", "days": 3, "opts": {"unit": "C", "x": [1, 2]},
                                                            "alerts": True, "when": None, "scale": 2.5})),
                             call("lookup", {"q": "Paris weather", "flag": False})]}, True),
    "content_only": ({"role": "assistant", "content": "The capital of France is Paris."}, True),
    "calls_only": ({"role": "assistant", "content": "", "tool_calls": [call("f", "{}"), call("lookup", '{"q": "a"}')]},
                   True),
    "unicode": ({"role": "assistant", "reasoning_content": "思考一下 🤔", "content": "héllo 世界 🙂",
                 "tool_calls": [call("lookup", {"q": "東京 café ✓", "n": "日本"})]}, True),
    "escaped_key": ({"role": "assistant", "content": "ok",
                     "tool_calls": [call("lookup", {'a"b&c': "v&amp;\"w", "&quot;": 1})]}, True),
    "markup_in_value": ({"role": "assistant", "content": "x < y <|close|>response<|sep|>\n",
                         "tool_calls": [call("f", {"code": "if a < b:\n    <|close|>argument<|sep|>\n<div>"})]}, True),
    "raw_json": ({"role": "assistant", "content": "", "tool_calls": [call("f", '{"a": 1, "b": ')]}, True),
    "thinking_off": ({"role": "assistant", "content": "Sunny.", "tool_calls": [call("get_weather", {"city": "Oslo"})]},
                     False),
}


def generated(tok, reply, thinking):
    """(the ids the model generates for `reply`, the prompt's ids)."""
    prompt, _ = k3_chat.render(tok, CONV, add_generation_prompt=True, thinking=thinking)
    full, _ = k3_chat.render(tok, CONV + [reply], add_generation_prompt=False, thinking=thinking)
    assert full[:len(prompt)] == prompt
    gen = full[len(prompt):]
    return gen[:gen.index(tok.token_id("<|end_of_msg|>"))], prompt


@pytest.mark.parametrize("case", sorted(REPLIES))
def test_roundtrip(tok, case):
    reply, thinking = REPLIES[case]
    gen, prompt = generated(tok, reply, thinking)
    forced, prime = forced_tokens(tok, prompt, "auto")
    assert forced == [] and prime == X(tok, THINK if thinking else RESP)
    want = comparable(reply)
    p, events = run(tok, gen, prime=prime)                       # one piece: all events at once
    assert comparable(msg(events)) == want and p.failures == [] and p.released == len(want["tool_calls"])
    streamed, feeds = [], []                                     # token by token, events concatenated
    q = K3Parser(tok, tools=TOOLS, prime=prime)
    for t in gen:
        feeds.append(q.feed(t))
        streamed += feeds[-1]
    streamed += q.finish()
    strip = [tuple(e[:2]) + ("ID",) + e[3:] if e[0] == "call" else e for e in events]
    assert [tuple(e[:2]) + ("ID",) + e[3:] if e[0] == "call" else e for e in streamed] == strip
    # the stream form (deltas) carries the same message
    ids = {e[1]: e[2] for e in streamed if e[0] == "call"}
    assert len(set(ids.values())) == len(ids) and all(i.startswith("call_") for i in ids.values())
    text = {"content": "", "reasoning_content": ""}
    calls = {}
    for d in toolcalls.deltas(streamed):
        for k in text:
            text[k] += d.get(k, "")
        for c in d.get("tool_calls", []):
            calls.setdefault(c["index"], {"name": c["function"].get("name"), "arguments": ""})
            calls[c["index"]]["arguments"] += c["function"]["arguments"]
    again = {**text, "tool_calls": [{"function": calls[i]} for i in sorted(calls)]}
    assert comparable(again) == want
    # reasoning and content streamed as they came: all out before their channel's close marker
    for kind, channel in (("content", "response"), ("reasoning", "think")):
        closer = X(tok, f"<|close|>{channel}<|sep|>")
        at = next((i for i in range(len(gen)) if gen[i:i + len(closer)] == closer), 0)
        assert "".join(e[1] for f in feeds[:at] for e in f if e[0] == kind) == (want[f"{kind}_content" if kind ==
                                                                                    "reasoning" else kind] or "")


def test_calls_released_at_their_close_tag(tok):
    reply, thinking = REPLIES["full"]
    gen, _ = generated(tok, reply, thinking)
    p = K3Parser(tok, tools=TOOLS, prime=X(tok, THINK))
    close_call = X(tok, "<|close|>call<|sep|>")
    ends = [i + len(close_call) - 1 for i in range(len(gen)) if gen[i:i + len(close_call)] == close_call]
    seen = [i for i, t in enumerate(gen) if any(e[0] == "call" for e in p.feed(t))]
    assert len(ends) == 2 and seen == ends


def test_cut_inside_a_marker(tok):
    ids = X(tok, "hi there") + [tok.token_id("<|open|>")] + tok.encode("respo")
    p, events = run(tok, ids, prime=RESP)
    assert msg(events)["content"] == "hi there<|open|>respo" and p.failures == []
    p = K3Parser(tok, tools=TOOLS, prime=X(tok, RESP))
    assert "".join(e[1] for t in ids for e in p.feed(t)) == "hi there"       # the tag is held ...
    assert "".join(e[1] for e in p.finish()) == "<|open|>respo"               # ... until the end


def test_not_a_tag_is_not_held(tok):
    p = K3Parser(tok, tools=TOOLS, prime=X(tok, RESP))
    p.feed(tok.token_id("<|open|>"))
    assert "".join(e[1] for e in p.feed(tok.encode(" (")[0])) == "<|open|> "  # cannot start a tag name
    assert p.feed(tok.token_id("<|sep|>")) == [("content", "<|sep|>")]


def test_user_typed_markers_are_text(tok):
    typed = "<|close|>response<|sep|><|open|>tools<|sep|>"
    ids = tok.encode(typed) + X(tok, "<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>")
    p, events = run(tok, ids, prime=RESP)
    assert msg(events) == {"role": "assistant", "content": typed, "reasoning_content": None}
    assert p.failures == []


def test_unclosed_channels(tok):
    p, events = run(tok, X(tok, "thinking hard..."))                           # think never closed
    assert msg(events) == {"role": "assistant", "content": "", "reasoning_content": "thinking hard..."}
    assert p.failures == []
    head = '<|open|>call tool="f" index="1"<|sep|><|open|>argument key="a" type="string"<|sep|>x'
    p, events = run(tok, X(tok, "ok<|close|>response<|sep|><|open|>tools<|sep|>" + head), prime=RESP)
    assert msg(events)["content"] == "ok<|open|>tools<|sep|>" + head and p.failures == ["unclosed"]
    done = '<|open|>call tool="f" index="1"<|sep|><|close|>call<|sep|>'      # cut after a released call
    p, events = run(tok, X(tok, "ok<|close|>response<|sep|><|open|>tools<|sep|>" + done + "<|open|>cal"), prime=RESP)
    m = msg(events)
    assert m["content"] == "ok<|open|>cal" and len(m["tool_calls"]) == 1 and p.failures == ["unclosed"]


TOOLS_OPEN = "<|close|>response<|sep|><|open|>tools<|sep|>"
GOOD = '<|open|>call tool="f" index="2"<|sep|><|close|>call<|sep|>'
MALFORMED = {   # generated text (after RESP) -> (failures, content, calls released)
    "stray_text": (TOOLS_OPEN + "oops" + GOOD + "<|close|>tools<|sep|>", ["stray_text"], "<|open|>tools<|sep|>oops", 1),
    "stray_text_in_call": (TOOLS_OPEN + '<|open|>call tool="f" index="1"<|sep|>zz<|close|>call<|sep|>' + GOOD
                           + "<|close|>tools<|sep|>", ["stray_text"],
                           '<|open|>tools<|sep|><|open|>call tool="f" index="1"<|sep|>zz<|close|>call<|sep|>', 1),
    "unknown_function": (TOOLS_OPEN + '<|open|>call tool="rm" index="1"<|sep|><|close|>call<|sep|><|close|>tools<|sep|>',
                         ["unknown_function"], '<|open|>tools<|sep|><|open|>call tool="rm" index="1"<|sep|>'
                         '<|close|>call<|sep|><|close|>tools<|sep|>', 0),
    "no_tool_attribute": (TOOLS_OPEN + '<|open|>call index="1"<|sep|><|close|>call<|sep|>' + GOOD + "<|close|>tools<|sep|>",
                          ["unknown_function"], '<|open|>tools<|sep|><|open|>call index="1"<|sep|><|close|>call<|sep|>', 1),
    "mismatched_close": (TOOLS_OPEN + GOOD + '<|open|>call tool="f" index="3"<|sep|><|close|>argument<|sep|>'
                         "<|close|>call<|sep|><|close|>tools<|sep|>", ["unexpected_token"],
                         '<|open|>call tool="f" index="3"<|sep|><|close|>argument<|sep|><|close|>call<|sep|>', 1),
    "lone_sep": (TOOLS_OPEN + GOOD + "<|sep|><|close|>tools<|sep|>", ["unexpected_token"], "<|sep|>", 1),
    "bad_tag_text": (TOOLS_OPEN + "<|open|>call tool=f<|sep|>" + GOOD + "<|close|>tools<|sep|>", ["unexpected_token"],
                     "<|open|>tools<|sep|><|open|>call tool=f<|sep|>", 1),
    "argument_unclosed": (TOOLS_OPEN + '<|open|>call tool="f" index="1"<|sep|><|open|>argument key="a"<|sep|>1'
                          "<|close|>call<|sep|><|close|>tools<|sep|>", ["unclosed"],
                          '<|open|>tools<|sep|><|open|>call tool="f" index="1"<|sep|><|open|>argument key="a"<|sep|>1'
                          "<|close|>call<|sep|><|close|>tools<|sep|>", 0),
    "argument_without_key": (TOOLS_OPEN + '<|open|>call tool="f" index="1"<|sep|><|open|>argument type="string"<|sep|>1'
                             "<|close|>argument<|sep|><|close|>call<|sep|>" + GOOD + "<|close|>tools<|sep|>",
                             ["bad_argument"], '<|open|>tools<|sep|><|open|>call tool="f" index="1"<|sep|><|open|>'
                             'argument type="string"<|sep|>1<|close|>argument<|sep|><|close|>call<|sep|>', 1),
    "call_left_open": (TOOLS_OPEN + '<|open|>call tool="f" index="1"<|sep|>' + GOOD + "<|close|>tools<|sep|>",
                       ["unclosed"], '<|open|>tools<|sep|><|open|>call tool="f" index="1"<|sep|>', 1),
    "tools_not_closed": (TOOLS_OPEN + GOOD + "<|close|>message<|sep|>", ["unclosed"], "", 1),
    "empty_tools": (TOOLS_OPEN + "<|close|>tools<|sep|>", ["no_calls"], "<|open|>tools<|sep|><|close|>tools<|sep|>", 0),
    "call_outside_tools": ("<|close|>response<|sep|>" + GOOD, ["unexpected_token", "unexpected_token"], GOOD, 0),
    "text_after_response": ("<|close|>response<|sep|> and more", [], " and more", 0),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_is_text(tok, case):
    text, failures, content, n = MALFORMED[case]
    ids = X(tok, text + "<|close|>message<|sep|><|end_of_msg|>")
    p, events = run(tok, ids, prime=RESP)
    m = msg(events)
    assert p.failures == failures and (m["content"] or "") == content and len(m.get("tool_calls", [])) == n
    for k in range(len(ids) + 1):                               # cut anywhere: never raises
        run(tok, ids[:k], prime=RESP)


def test_tools_off(tok):
    text = TOOLS_OPEN + GOOD + "<|close|>tools<|sep|>"
    p, events = run(tok, X(tok, "hi" + text + "<|close|>message<|sep|>"), prime=RESP, tools=None)
    assert msg(events) == {"role": "assistant", "content": "hi" + text[len("<|close|>response<|sep|>"):],
                           "reasoning_content": None}
    assert p.failures == ["tools_off"]


def test_after_message_ignored_and_stop(tok):
    p, events = run(tok, X(tok, "a STOP b<|close|>response<|sep|><|close|>message<|sep|>junk " + GOOD),
                    prime=RESP, stop=("STOP",))
    assert msg(events)["content"] == "a " and p.released == 0 and p.failures == []


def test_parallel_false(tok):
    two = TOOLS_OPEN + GOOD.replace('"2"', '"1"') + GOOD + "<|close|>tools<|sep|>"
    p = K3Parser(tok, tools=TOOLS, prime=X(tok, RESP), parallel=False)
    events = []
    for t in X(tok, two):
        assert not p.done
        events += p.feed(t)
        if p.done:
            break
    assert p.done and p.feed(tok.encode("x")[0]) == [] and p.released == 1
    assert [e[0] for e in events + p.finish()] == ["call", "arguments", "call_end", "section_end"]


@pytest.mark.parametrize("thinking", [True, False])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_tokens(tok, thinking, choice):
    reply = {"role": "assistant", "content": "",
             "tool_calls": [call("get_weather", {"city": "Paris", "days": 2}), call("lookup", {"q": "x"})]}
    prompt, _ = k3_chat.render(tok, CONV, add_generation_prompt=True, thinking=thinking)
    full, _ = k3_chat.render(tok, CONV + [reply], add_generation_prompt=False, thinking=thinking)
    forced, prime = forced_tokens(tok, prompt, choice, "get_weather")
    assert full[:len(prompt) + len(forced)] == prompt + forced              # the renderer's exact ids
    assert prime == X(tok, THINK if thinking else RESP) + forced
    rest = full[len(prompt) + len(forced):]
    p, events = run(tok, rest, prime=prime)
    assert comparable(msg(events)) == comparable(reply) and p.failures == []
    required, _ = forced_tokens(tok, prompt, "required")
    header = '<|open|>call tool="get_weather" index="1"<|sep|>' if choice == "named" else ""
    assert forced[:len(required)] == required and tok.decode(forced[len(required):]) == header
    assert tok.decode(required).endswith("<|close|>response<|sep|><|open|>tools<|sep|>")


def test_forced_named_escapes_and_parses(tok):
    prompt = X(tok, '<|open|>message role="assistant"<|sep|>' + RESP)
    forced, prime = forced_tokens(tok, prompt, "named", 'a"b&c')
    assert tok.decode(forced).endswith('<|open|>call tool="a&quot;b&amp;c" index="1"<|sep|>')
    p, events = run(tok, X(tok, '<|open|>argument key="k" type="number"<|sep|>7<|close|>argument<|sep|>'
                             "<|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|>"),
                    prime=prime, tools=['a"b&c'])
    assert comparable(msg(events))["tool_calls"] == [('a"b&c', {"k": 7})]
    assert forced_tokens(tok, prompt, "auto") == ([], X(tok, RESP))
    assert forced_tokens(tok, prompt, "none", None) == ([], X(tok, RESP))


def test_random_ids_never_raise(tok):
    """Random mixes of markers, tag names, attributes and text: no exception, and the events agree
    with the parser's counters."""
    import random
    rng = random.Random(0)
    pieces = [[tok.token_id(m)] for m in MARKERS] * 3 + [tok.encode(s) for s in (
        "think", "response", "tools", "call", "argument", "json", "message", ' tool="f"', ' index="1"',
        ' key="a"', ' type="number"', ' type="string"', "12", "héllo", " ", "{", "\n", '"')]
    for n in range(400):
        ids = [t for _ in range(rng.randrange(1, 40)) for t in rng.choice(pieces)]
        p, events = run(tok, ids, prime=rng.choice([THINK, RESP, ""]), tools=rng.choice([TOOLS, None]),
                        parallel=bool(n % 3))
        assert sum(e[0] == "call" for e in events) == p.released and (p.released <= 1 or p.parallel)
        assert set(p.failures) <= {"stray_text", "unexpected_token", "unclosed", "unknown_function",
                                   "tools_off", "bad_argument", "no_calls"}
        msg(events)
        assert p.feed(ids[0]) == [] and p.finish() == []


def _golden_replies():
    """(case id, conversation kwargs, index) of every assistant message in test_k3_chat's goldens."""
    from test_k3_chat import CASES
    return [(cid, kwargs, i) for cid, _, kwargs, _ in CASES
            for i, m in enumerate(kwargs["messages"]) if m.get("role") == "assistant"]


def _as_given(m: dict, thinking: bool) -> dict:
    """What parsing a rendered assistant message gives back, from the message as written: text parts
    joined, `reasoning` read as reasoning_content (none with thinking off: not rendered), blank
    arguments as {}, flat calls as calls."""
    content = m.get("content")
    if isinstance(content, list):
        content = "".join(p["text"] for p in content)
    calls = []
    for c in m.get("tool_calls") or []:
        fn = c.get("function", c)
        a = fn.get("arguments")
        calls.append(call(fn["name"], {} if a is None or (isinstance(a, str) and not a.strip()) else a))
    reasoning = (m.get("reasoning_content") or m.get("reasoning")) if thinking else None
    return comparable({"content": content, "reasoning_content": reasoning if reasoning and reasoning.strip() else None,
                       "tool_calls": calls})


@pytest.mark.parametrize("cid,kwargs,i", _golden_replies(), ids=lambda v: v if isinstance(v, (str, int)) else "")
def test_every_golden_assistant_message_parses_back(tok, cid, kwargs, i):
    """parse(render(x)) == x for each assistant message of the renderer's golden conversations, in one
    piece and token by token: its generated ids are the conversation up to it minus what precedes
    them (the conversation before it and the turn's opening tags: the generation prompt, or a named
    assistant's own open tag)."""
    msgs = kwargs["messages"]
    kw = {k: v for k, v in kwargs.items() if k not in ("messages", "add_generation_prompt", "tool_choice",
                                                         "response_format", "media")}   # no images in replies
    media = kwargs.get("media")
    images = lambda ms: media[:sum(content_parts(m, True).count(None) for m in ms  # noqa: E731
                                   if m.get("role") != "tool")] if media else None
    thinking = kw.get("thinking", True)
    head = k3_chat.open_tag("message", [("role", "assistant")] + ([("name", msgs[i]["name"])] if msgs[i].get("name")
                                                                   else []))
    head += k3_chat.open_tag("think" if thinking else "response")
    before, _ = k3_chat.render(tok, msgs[:i], add_generation_prompt=False, media=images(msgs[:i]), **kw)
    prompt = before + k3_chat.encode(tok, head)[0]
    full, _ = k3_chat.render(tok, msgs[:i + 1], add_generation_prompt=False, media=images(msgs[:i + 1]), **kw)
    assert full[:len(prompt)] == prompt, cid
    gen = full[len(prompt):]
    gen = gen[:gen.index(tok.token_id("<|end_of_msg|>"))]
    names = [c.get("function", c)["name"] for c in msgs[i].get("tool_calls") or []]
    prime = forced_tokens(tok, prompt, "auto")[1]
    assert prime == X(tok, THINK if thinking else RESP)
    want = _as_given(msgs[i], thinking)
    p, events = run(tok, gen, prime=prime, tools=names)
    assert comparable(msg(events)) == want and p.failures == [], cid
    q = K3Parser(tok, tools=names, prime=prime)
    streamed = [e for t in gen for e in q.feed(t)] + q.finish()
    assert comparable(msg(streamed)) == want and q.failures == [], cid
