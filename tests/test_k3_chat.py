"""K3's native chat renderer (data/k3_chat.py): golden renderings written by hand from the format's
description, the ids path (markers are control tokens, typed marker names are text), the loss
mask, the prefix property and the errors. Pure Python, no JAX compile."""
import json
import re

import pytest

from k3jax.data import k3_chat, tiny_tokenizer
from k3jax.data.tokenizer import KimiTokenizer, TokenizerError

MARKERS = ("<|end_of_msg|>", "<|open|>", "<|close|>", "<|sep|>")
END = "<|close|>message<|sep|><|end_of_msg|>"
GEN_THINK = '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>'
GEN_RESP = '<|open|>message role="assistant"<|sep|><|open|>response<|sep|>'
EFFORT_TEXT = ("`thinking_effort` guides on how much to think in your thinking channel (not including the "
               "response channel), supported values include `low`, `medium`, `high`, and `max`.\n"
               "Now the system is invoked with `thinking_effort=")
IMG = "<|media_begin|>image 28x28<|media_content|><|media_pad|><|media_pad|><|media_end|>"
JSON_RULE = ("Your response must be raw JSON data without markdown code blocks (```json) or any "
             "additional formatting.")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get weather", "strict": None,
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "default": None}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
TIME_DECLARE = ('<|open|>message role="system" type="tool-declare"<|sep|># Tools\nHere are the available tools, '
                'described in JSONSchema.\n\n```json\n[{"function":{"name":"get_time","parameters":'
                '{"properties":{},"type":"object"}},"type":"function"}]\n```' + END)


def call(name, arguments, id=None):
    return {"id": id, "type": "function", "function": {"name": name, "arguments": arguments}}


CASES = [
    ("tools_two_calls", "tools + system + user + assistant reasoning, two calls, all argument types, effort max",
     dict(tools=[WEATHER], add_generation_prompt=False, messages=[
         {"role": "system", "content": "You are helpful."},
         {"role": "user", "content": "Weather in Paris and Rome?"},
         {"role": "assistant", "reasoning_content": "Two cities.", "content": "", "tool_calls": [
             call("get_weather", '{"city": "Paris", "days": 3, "hours": [9, 18], '
                                 '"opts": {"unit": "C", "deep": {"b": 1, "a": 2}}}', "c1"),
             call("get_weather", {"city": "Rome", "alerts": True, "date": None, "ratio": 2.5}, "c2")]}]),
     '<|open|>message role="system" type="tool-declare"<|sep|># Tools\nHere are the available tools, described in '
     'JSONSchema.\n\n```json\n[{"function":{"description":"Get weather","name":"get_weather","parameters":'
     '{"properties":{"city":{"default":null,"type":"string"}},"required":["city"],"type":"object"}},'
     '"type":"function"}]\n```<|close|>message<|sep|><|end_of_msg|>'
     '<|open|>message role="system" type="thinking-effort"<|sep|>' + EFFORT_TEXT + 'max`.' + END
     + '<|open|>message role="system"<|sep|>You are helpful.<|close|>message<|sep|><|end_of_msg|>'
     '<|open|>message role="user"<|sep|>Weather in Paris and Rome?<|close|>message<|sep|><|end_of_msg|>'
     '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>Two cities.<|close|>think<|sep|>'
     '<|open|>response<|sep|><|close|>response<|sep|><|open|>tools<|sep|>'
     '<|open|>call tool="get_weather" index="1"<|sep|>'
     '<|open|>argument key="city" type="string"<|sep|>Paris<|close|>argument<|sep|>'
     '<|open|>argument key="days" type="number"<|sep|>3<|close|>argument<|sep|>'
     '<|open|>argument key="hours" type="array"<|sep|>[9, 18]<|close|>argument<|sep|>'
     '<|open|>argument key="opts" type="object"<|sep|>{"unit": "C", "deep": {"b": 1, "a": 2}}'
     '<|close|>argument<|sep|>'
     '<|close|>call<|sep|><|open|>call tool="get_weather" index="2"<|sep|>'
     '<|open|>argument key="city" type="string"<|sep|>Rome<|close|>argument<|sep|>'
     '<|open|>argument key="alerts" type="boolean"<|sep|>true<|close|>argument<|sep|>'
     '<|open|>argument key="date" type="null"<|sep|>null<|close|>argument<|sep|>'
     '<|open|>argument key="ratio" type="number"<|sep|>2.5<|close|>argument<|sep|>'
     '<|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>'),
    ("tool_results_reordered", "tool results given out of order, matched by tool_call_id; thinking off",
     dict(thinking=False, messages=[
         {"role": "user", "content": "Both?"},
         {"role": "assistant", "content": "Checking.", "tool_calls": [
             call("get_weather", '{"city":"Paris"}', "c1"), call("get_time", {"tz": "CET"}, "c2")]},
         {"role": "tool", "tool_call_id": "c2", "content": "12:00"},
         {"role": "tool", "tool_call_id": "c1", "name": "wrong", "content": "Sunny"}]),
     '<|open|>message role="user"<|sep|>Both?<|close|>message<|sep|><|end_of_msg|>'
     '<|open|>message role="assistant"<|sep|><|open|>response<|sep|>Checking.<|close|>response<|sep|>'
     '<|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|>'
     '<|open|>argument key="city" type="string"<|sep|>Paris<|close|>argument<|sep|><|close|>call<|sep|>'
     '<|open|>call tool="get_time" index="2"<|sep|>'
     '<|open|>argument key="tz" type="string"<|sep|>CET<|close|>argument<|sep|><|close|>call<|sep|>'
     '<|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>'
     '<|open|>message role="tool" tool="get_weather" index="1"<|sep|>Sunny<|close|>message<|sep|><|end_of_msg|>'
     '<|open|>message role="tool" tool="get_time" index="2"<|sep|>12:00<|close|>message<|sep|><|end_of_msg|>'
     '<|open|>message role="assistant"<|sep|><|open|>response<|sep|>'),
    ("tool_results_unmatched", "a run with an unknown id stays in order; names from the call at each position",
     dict(thinking=False, messages=[
         {"role": "assistant", "content": None, "tool_calls": [call("get_weather", None, "c1"),
                                                                call("get_time", None, "c2")]},
         {"role": "tool", "tool_call_id": "zz", "content": "A"},
         {"role": "tool", "tool_call_id": "c1", "content": "B"}]),
     '<|open|>message role="assistant"<|sep|><|open|>response<|sep|><|close|>response<|sep|><|open|>tools<|sep|>'
     '<|open|>call tool="get_weather" index="1"<|sep|><|close|>call<|sep|>'
     '<|open|>call tool="get_time" index="2"<|sep|><|close|>call<|sep|><|close|>tools<|sep|>' + END
     + '<|open|>message role="tool" tool="get_weather" index="1"<|sep|>A' + END
     + '<|open|>message role="tool" tool="get_time" index="2"<|sep|>B' + END + GEN_RESP),
    ("second_round_tools", "mid-conversation system message with tools (content dropped), empty think, blank args",
     dict(thinking_effort=None, messages=[
         {"role": "user", "content": "hi"},
         {"role": "assistant", "content": "Hello."},
         {"role": "system", "content": "ignored", "tools": [TIME]},
         {"role": "user", "content": "time?"},
         {"role": "assistant", "reasoning_content": "  ", "tool_calls": [call("get_time", " ", "t1")]},
         {"role": "tool", "tool_call_id": "t1", "content": "noon"}]),
     '<|open|>message role="user"<|sep|>hi<|close|>message<|sep|><|end_of_msg|>'
     '<|open|>message role="assistant"<|sep|><|open|>think<|sep|><|close|>think<|sep|>'
     '<|open|>response<|sep|>Hello.<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>'
     '<|open|>message role="system" type="tool-declare"<|sep|>## New Tools Available\nThe system dynamically '
     'extends the toolset via lazy-loading.\nYou have access to all existing and extended tools.\nHere are the '
     'specs for the extended tools.\n\n```json\n[{"function":{"name":"get_time","parameters":{"properties":{},'
     '"type":"object"}},"type":"function"}]\n```<|close|>message<|sep|><|end_of_msg|>'
     '<|open|>message role="user"<|sep|>time?<|close|>message<|sep|><|end_of_msg|>'
     '<|open|>message role="assistant"<|sep|><|open|>think<|sep|><|close|>think<|sep|><|open|>response<|sep|>'
     '<|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool="get_time" index="1"<|sep|>'
     '<|close|>call<|sep|>'
     '<|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>'
     '<|open|>message role="tool" tool="get_time" index="1"<|sep|>noon<|close|>message<|sep|><|end_of_msg|>'
     '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>'),
    ("thinking_off", "no effort turn, stored reasoning dropped, response generation prompt",
     dict(thinking=False, messages=[
         {"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
         {"role": "assistant", "reasoning_content": "easy", "content": "4"}, {"role": "user", "content": "3+3?"}]),
     '<|open|>message role="system"<|sep|>Be brief.<|close|>message<|sep|><|end_of_msg|>'
     '<|open|>message role="user"<|sep|>2+2?<|close|>message<|sep|><|end_of_msg|>'
     '<|open|>message role="assistant"<|sep|><|open|>response<|sep|>4<|close|>response<|sep|>'
     '<|close|>message<|sep|><|end_of_msg|>'
     '<|open|>message role="user"<|sep|>3+3?<|close|>message<|sep|><|end_of_msg|>'
     '<|open|>message role="assistant"<|sep|><|open|>response<|sep|>'),
    ("effort_low", "thinking_effort=low",
     dict(thinking_effort="low", messages=[{"role": "user", "content": "hi"}]),
     '<|open|>message role="system" type="thinking-effort"<|sep|>' + EFFORT_TEXT + 'low`.' + END
     + '<|open|>message role="user"<|sep|>hi' + END + GEN_THINK),
    ("effort_high", "thinking_effort=high",
     dict(thinking_effort="high", messages=[{"role": "user", "content": "hi"}]),
     '<|open|>message role="system" type="thinking-effort"<|sep|>' + EFFORT_TEXT + 'high`.' + END
     + '<|open|>message role="user"<|sep|>hi' + END + GEN_THINK),
    ("effort_max_default", "thinking on with effort max by default",
     dict(messages=[{"role": "user", "content": "hi"}]),
     '<|open|>message role="system" type="thinking-effort"<|sep|>' + EFFORT_TEXT + 'max`.' + END
     + '<|open|>message role="user"<|sep|>hi' + END + GEN_THINK),
    ("effort_none", "thinking_effort=None: no effort turn",
     dict(thinking_effort=None, messages=[{"role": "user", "content": "hi"}]),
     '<|open|>message role="user"<|sep|>hi<|close|>message<|sep|><|end_of_msg|>'
     '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>'),
    ("tool_choice_required", "tool_choice=required turn after the messages (the official frozen shape)",
     dict(thinking=False, tools=[TIME], tool_choice="required", messages=[{"role": "user", "content": "time?"}]),
     TIME_DECLARE + '<|open|>message role="user"<|sep|>time?' + END
     + '<|open|>message role="system" type="tool-choice"<|sep|>The system is invoked with `tool_choice=required`.'
     '\nYou MUST call tools in the next message.' + END + GEN_RESP),
    ("tool_choice_none_json_object", "tool_choice=none, then response_format json_object",
     dict(thinking_effort=None, tool_choice="none", response_format={"type": "json_object"},
          messages=[{"role": "user", "content": "x"}]),
     '<|open|>message role="user"<|sep|>x' + END
     + '<|open|>message role="system" type="tool-choice"<|sep|>The system is invoked with `tool_choice=none`.'
     '\nYou MUST NOT call any tools in the next message.' + END
     + '<|open|>message role="system" type="response-format"<|sep|>The system is invoked with '
     '`response_format=json_object`.\n' + JSON_RULE + END + GEN_THINK),
    ("no_turn_options", "tool_choice auto / named and response_format text add no turns",
     dict(thinking=False, tool_choice={"type": "function", "function": {"name": "get_time"}},
          response_format={"type": "text"}, messages=[{"role": "user", "content": "x"}]),
     '<|open|>message role="user"<|sep|>x<|close|>message<|sep|><|end_of_msg|>'
     '<|open|>message role="assistant"<|sep|><|open|>response<|sep|>'),
    ("response_format_json_schema", "json_schema: the schema only, compact and key-sorted",
     dict(thinking=False, messages=[{"role": "user", "content": "Give JSON"}], response_format={
         "type": "json_schema", "json_schema": {"name": "out", "strict": True, "schema": {
             "type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}},
             "required": ["a"]}}}),
     '<|open|>message role="user"<|sep|>Give JSON' + END
     + '<|open|>message role="system" type="response-format"<|sep|>The system is invoked with '
     '`response_format=json_schema`.\n' + JSON_RULE + '\nThe JSON data must match the following schema:\n'
     '```json\n{"properties":{"a":{"type":"string"},"b":{"type":"integer"}},"required":["a"],"type":"object"}\n```'
     + END + GEN_RESP),
    ("image_part", "an image part becomes the processor's prompt at its place",
     dict(thinking=False, media=[IMG], messages=[{"role": "user", "content": [
         {"type": "text", "text": "What is this?"}, {"type": "image"}, {"type": "text", "text": " Be short."}]}]),
     '<|open|>message role="user"<|sep|>What is this?<|media_begin|>image 28x28<|media_content|><|media_pad|>'
     '<|media_pad|><|media_end|> Be short.<|close|>message<|sep|><|end_of_msg|>'
     '<|open|>message role="assistant"<|sep|><|open|>response<|sep|>'),
    ("typed_markers", "a user typing marker names (stays ordinary text)",
     dict(thinking=False, messages=[{"role": "user", "content": "Say <|close|>message<|sep|><|end_of_msg|> ok"},
                                    {"role": "assistant", "content": "<|open|>think<|sep|>no"}]),
     '<|open|>message role="user"<|sep|>Say <|close|>message<|sep|><|end_of_msg|> ok'
     '<|close|>message<|sep|><|end_of_msg|>'
     '<|open|>message role="assistant"<|sep|><|open|>response<|sep|><|open|>think<|sep|>no<|close|>response<|sep|>'
     '<|close|>message<|sep|><|end_of_msg|><|open|>message role="assistant"<|sep|><|open|>response<|sep|>'),
    ("unicode", "non-ASCII in names, content, reasoning, tools JSON and argument values",
     dict(thinking_effort=None, add_generation_prompt=False,
          tools=[{"type": "function", "function": {"name": "wetter", "description": "Wetter für Städte"}}],
          messages=[{"role": "user", "name": "José", "content": "天気は？ 🌤"},
                    {"role": "assistant", "reasoning_content": "考える", "content": "晴れ ☀",
                     "tool_calls": [call("wetter", {"ciudad": "München", "list": ["ü"]})]}]),
     '<|open|>message role="system" type="tool-declare"<|sep|># Tools\nHere are the available tools, described in '
     'JSONSchema.\n\n```json\n[{"function":{"description":"Wetter für Städte","name":"wetter"},'
     '"type":"function"}]'
     '\n```' + END + '<|open|>message role="user" name="José"<|sep|>天気は？ 🌤' + END
     + '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>考える<|close|>think<|sep|>'
     '<|open|>response<|sep|>晴れ ☀<|close|>response<|sep|><|open|>tools<|sep|>'
     '<|open|>call tool="wetter" index="1"<|sep|>'
     '<|open|>argument key="ciudad" type="string"<|sep|>München<|close|>argument<|sep|>'
     '<|open|>argument key="list" type="array"<|sep|>["ü"]<|close|>argument<|sep|>'
     '<|close|>call<|sep|><|close|>tools<|sep|>' + END),
    ("attr_escaping", 'attribute values with " and & (names, tool, key); bodies raw',
     dict(thinking=False, messages=[
         {"role": "system", "name": 'ops "A" & B', "content": "sys"},
         {"role": "assistant", "name": 'bot&"1"', "content": None,
          "tool_calls": [call('say"hi"&', {'k"e&y': 'v"&<'}, "q")]},
         {"role": "tool", "tool_call_id": "q", "content": '"&"'}]),
     '<|open|>message role="system" name="ops &quot;A&quot; &amp; B"<|sep|>sys' + END
     + '<|open|>message role="assistant" name="bot&amp;&quot;1&quot;"<|sep|><|open|>response<|sep|>'
     '<|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool="say&quot;hi&quot;&amp;" index="1"<|sep|>'
     '<|open|>argument key="k&quot;e&amp;y" type="string"<|sep|>v"&<<|close|>argument<|sep|>'
     '<|close|>call<|sep|><|close|>tools<|sep|>' + END
     + '<|open|>message role="tool" tool="say&quot;hi&quot;&amp;" index="1"<|sep|>"&"' + END + GEN_RESP),
    ("raw_json_fallback", "an unparseable arguments string is written whole in a json block",
     dict(thinking=False, messages=[
         {"role": "user", "content": "go"},
         {"role": "assistant", "tool_calls": [call("run", '{"cmd": "ls",', "a")]},
         {"role": "tool", "content": "ok"}]),
     '<|open|>message role="user"<|sep|>go' + END
     + '<|open|>message role="assistant"<|sep|><|open|>response<|sep|><|close|>response<|sep|><|open|>tools<|sep|>'
     '<|open|>call tool="run" index="1"<|sep|><|open|>json type="object"<|sep|>{"cmd": "ls",<|close|>json<|sep|>'
     '<|close|>call<|sep|><|close|>tools<|sep|>' + END
     + '<|open|>message role="tool" tool="run" index="1"<|sep|>ok' + END + GEN_RESP),
    ("developer_parts_flat_call", "developer -> system, text parts joined, `reasoning` key, flat call",
     dict(thinking_effort=None, messages=[
         {"role": "developer", "content": "Rules."},
         {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
         {"role": "assistant", "reasoning": "r", "content": [{"type": "text", "text": "done"}],
          "tool_calls": [{"name": "f", "arguments": {"x": [1, {"y": 2}]}}]}]),
     '<|open|>message role="system"<|sep|>Rules.' + END + '<|open|>message role="user"<|sep|>ab' + END
     + '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>r<|close|>think<|sep|>'
     '<|open|>response<|sep|>done<|close|>response<|sep|><|open|>tools<|sep|>'
     '<|open|>call tool="f" index="1"<|sep|>'
     '<|open|>argument key="x" type="array"<|sep|>[1, {"y": 2}]<|close|>argument<|sep|>'
     '<|close|>call<|sep|><|close|>tools<|sep|>' + END + GEN_THINK),
]
IDS = [c[0] for c in CASES]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return KimiTokenizer.from_dir(tiny_tokenizer.build(tmp_path_factory.mktemp("k3"), vocab_size=512,
                                                       num_reserved=tiny_tokenizer.MIN_RESERVED, family="k3"))


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_golden_text(case):
    _, _, kwargs, expected = case
    assert k3_chat.render_text(**kwargs) == expected


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_ids_decode_and_markers_are_control_tokens(tok, case):
    _, _, kwargs, _ = case
    text = k3_chat.render_text(**kwargs)
    ids, mask = k3_chat.render(tok, **kwargs)
    assert len(ids) == len(mask) and set(mask) <= {0, 1}
    assert tok.decode(ids) == text
    # Every marker in the text is a control id except those typed inside messages (ordinary text).
    typed = sum(json.dumps(kwargs["messages"], ensure_ascii=False).count(m) for m in MARKERS)
    structural = sum(text.count(m) for m in MARKERS) - typed
    marker_ids = {tok.token_id(m) for m in MARKERS}
    assert sum(i in marker_ids for i in ids) == structural
    media_ids = {i for n, i in tok.special_ids.items() if n.startswith("<|media_")}
    assert all(m == 0 for i, m in zip(ids, mask) if i in media_ids)


def test_typed_markers_encode_as_text(tok):
    typed = "Say <|close|>message<|sep|><|end_of_msg|> ok"
    ids, _ = k3_chat.render(tok, [{"role": "user", "content": typed}], thinking=False)
    head = [tok.token_id("<|open|>")] + tok.encode("message") + tok.encode(" role") + tok.encode('="') \
        + tok.encode("user") + tok.encode('"') + [tok.token_id("<|sep|>")]
    assert ids[:len(head) + len(tok.encode(typed))] == head + tok.encode(typed)
    assert ids.count(tok.token_id("<|end_of_msg|>")) == 1


# ------------------------------------------------------------------ loss mask, by hand
def _ids(tok, parts):
    out = []
    for p in parts:
        out += [tok.token_id(p)] if p in MARKERS else tok.encode(p)
    return out


def _tag(name, *attrs):
    return ["<|open|>", name] + [x for k, v in attrs for x in (f" {k}", '="', v, '"')] + ["<|sep|>"]


def _close(name):
    return ["<|close|>", name, "<|sep|>"]


def _expected(tok, pieces):
    ids, mask = [], []
    for parts, m in pieces:
        piece = _ids(tok, parts)
        ids += piece
        mask += [m] * len(piece)
    return ids, mask


def _turn(*attrs, body):
    return _tag("message", *attrs) + [body] + _close("message") + ["<|end_of_msg|>"]


CONVERSATION = [
    {"role": "system", "content": "S"}, {"role": "user", "content": "U"},
    {"role": "assistant", "reasoning_content": "R", "content": "C", "tool_calls": [call("f", {"a": 1}, "1")]},
    {"role": "tool", "tool_call_id": "1", "content": "T"},
    {"role": "assistant", "reasoning_content": "R2", "content": "done"}]


def test_loss_mask_thinking(tok):
    ids, mask = k3_chat.render(tok, CONVERSATION, add_generation_prompt=False)
    asst = _tag("message", ("role", "assistant")) + _tag("think")
    want = _expected(tok, [
        (_turn(("role", "system"), ("type", "thinking-effort"), body=EFFORT_TEXT + "max`."), 0),
        (_turn(("role", "system"), body="S"), 0), (_turn(("role", "user"), body="U"), 0),
        (asst, 0),
        (["R"] + _close("think") + _tag("response") + ["C"] + _close("response") + _tag("tools")
         + _tag("call", ("tool", "f"), ("index", "1")) + _tag("argument", ("key", "a"), ("type", "number"))
         + ["1"] + _close("argument") + _close("call") + _close("tools") + _close("message")
         + ["<|end_of_msg|>"], 1),
        (_turn(("role", "tool"), ("tool", "f"), ("index", "1"), body="T"), 0),
        (asst, 0),
        (["R2"] + _close("think") + _tag("response") + ["done"] + _close("response") + _close("message")
         + ["<|end_of_msg|>"], 1)])
    assert (ids, mask) == want


def test_loss_mask_thinking_off(tok):
    msgs = [{"role": "user", "content": "U"},
            {"role": "assistant", "reasoning_content": "dropped", "content": "C",
             "tool_calls": [call("f", {"s": "x"})]}]
    ids, mask = k3_chat.render(tok, msgs, add_generation_prompt=False, thinking=False)
    want = _expected(tok, [
        (_turn(("role", "user"), body="U"), 0),
        (_tag("message", ("role", "assistant")) + _tag("response"), 0),
        (["C"] + _close("response") + _tag("tools") + _tag("call", ("tool", "f"), ("index", "1"))
         + _tag("argument", ("key", "s"), ("type", "string")) + ["x"] + _close("argument") + _close("call")
         + _close("tools") + _close("message") + ["<|end_of_msg|>"], 1)])
    assert (ids, mask) == want


@pytest.mark.parametrize("thinking", [True, False])
def test_generation_prompt_is_prefix_of_every_assistant_turn(tok, thinking):
    for k, message in enumerate(CONVERSATION):
        if message["role"] != "assistant":
            continue
        prompt, prompt_mask = k3_chat.render(tok, CONVERSATION[:k], tools=[TIME], thinking=thinking)
        full, full_mask = k3_chat.render(tok, CONVERSATION[:k + 1], tools=[TIME], thinking=thinking,
                                         add_generation_prompt=False)
        n = len(prompt)
        assert full[:n] == prompt and full_mask[:n] == prompt_mask   # earlier replies keep their 1s
        assert full_mask[n:] == [1] * (len(full) - n)   # the assistant's whole reply is trained on
    gen = k3_chat.render_text([], thinking=thinking, thinking_effort=None)
    assert gen == (GEN_THINK if thinking else GEN_RESP)


# ------------------------------------------------------------------ pieces and errors
def test_tags_escape_and_is_k3(tok, tmp_path):
    assert k3_chat.escape('a"&b') == "a&quot;&amp;b" and k3_chat.escape(3) == "3"
    for s in ['a"&b', "&quot;", "&amp;quot;", "<x> 'y'\n"]:
        assert k3_chat.unescape(k3_chat.escape(s)) == s
    assert k3_chat.open_tag("call", [("tool", "f"), ("index", 1)], 1) == [
        ("special", "<|open|>", 1), ("text", "call", 1), ("text", " tool", 1), ("text", '="', 1),
        ("text", "f", 1), ("text", '"', 1), ("text", " index", 1), ("text", '="', 1), ("text", "1", 1),
        ("text", '"', 1), ("special", "<|sep|>", 1)]
    assert ("text", "", 0) not in k3_chat.open_tag("x", {"k": ""})
    assert k3_chat.close_tag("think") == [("special", "<|close|>", 0), ("text", "think", 0),
                                          ("special", "<|sep|>", 0)]
    k2 = KimiTokenizer.from_dir(tiny_tokenizer.build(tmp_path, vocab_size=512,
                                                     num_reserved=tiny_tokenizer.MIN_RESERVED))
    assert k3_chat.is_k3(tok) and not k3_chat.is_k3(k2)
    with pytest.raises(TokenizerError, match=re.escape("<|open|>")):
        k3_chat.render(k2, [{"role": "user", "content": "hi"}])


USER = {"role": "user", "content": "hi"}


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(messages=[{"role": "narrator", "content": "x"}]), ValueError, "narrator"),
    (dict(messages=[USER], thinking_effort="medium"), ValueError, "low"),
    (dict(messages=[{"role": "assistant", "tool_calls": [call("f", "[1, 2]")]}]), ValueError, "JSON object"),
    (dict(messages=[{"role": "assistant", "tool_calls": [call("f", 42)]}]), TypeError, "int"),
    (dict(messages=[USER, {"role": "tool", "content": "x"}]), ValueError, "tool name"),
    (dict(messages=[{"role": "user", "content": [{"type": "image"}]}]), ValueError, "text"),
    (dict(messages=[USER], media=[IMG]), ValueError, "0 image parts but 1"),
    (dict(messages=[USER], response_format={"type": "xml"}), ValueError, "xml"),
    (dict(messages=[USER], response_format={"type": "json_schema"}), ValueError, "json_schema"),
], ids=["unknown_role", "bad_effort", "args_json_array", "args_int", "tool_no_name", "image_without_media",
        "media_count", "response_format_type", "json_schema_without_schema"])
def test_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        k3_chat.render_text(**kwargs)
