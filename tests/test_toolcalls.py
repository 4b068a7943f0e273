"""Tool calls and thinking parsed out of generated ids (data/toolcalls.py): parse(render(x)) == x
through each template family's renderer, malformed output as text, tool_choice forcing, and the HTTP
shapes (message.tool_calls, streamed delta.tool_calls, reasoning_content, the 400s) through the real
routes over a scripted engine that replays token ids (no model: nothing compiles)."""
import json
import types

import openai
import pytest

from k3jax.data import chat_template, tiny_tokenizer
from k3jax.data import toolcalls
from k3jax.data.tokenizer import KimiTokenizer
from k3jax.serve.api import create_app
from k3jax.serve.engine import Event
from k3jax.serve.metrics import ServeMetrics

# A K2.5-shaped template (formats.md §3.5: assistant turns start with <think>...</think>, the
# generation prompt ends with <think>, or <think></think> with thinking=false): the tiny K2
# template plus the thinking parts.
K25_TEMPLATE = tiny_tokenizer.KIMI_CHAT_TEMPLATE.replace(
    "{{ message.get('name') or role }}<|im_middle|>",
    "{{ message.get('name') or role }}<|im_middle|>"
    "{%- if role == 'assistant' -%}<think>{{ message.get('reasoning_content') or '' }}</think>{%- endif -%}",
).replace(
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}",
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- if thinking is defined and thinking is false -%}<think></think>{%- else -%}<think>{%- endif -%}"
    "{%- endif -%}")
assert K25_TEMPLATE.count("<think>") == 3

TOOLS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
         for n in ("get_weather", "search", "calc")]
NAMES = [t["function"]["name"] for t in TOOLS]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return tiny_tokenizer.build(tmp_path_factory.mktemp("tiny"), vocab_size=512,
                                num_reserved=tiny_tokenizer.MIN_RESERVED)


def _tok(tiny_dir, template):
    tok = KimiTokenizer.from_dir(tiny_dir)
    tok.chat_template = template
    return tok


@pytest.fixture(scope="module")
def toks(tiny_dir):
    """family -> tokenizer: the built-in K2 markup (no template), the tiny K2 jinja template, K2.5's
    thinking template. (K3's XTML format: tests/test_k3_chat.py, tests/test_k3_toolcalls.py.)"""
    return {"k2-builtin": _tok(tiny_dir, None), "k2": _tok(tiny_dir, tiny_tokenizer.KIMI_CHAT_TEMPLATE),
            "k2.5": _tok(tiny_dir, K25_TEMPLATE)}


def call(name, args, idx):
    return {"id": f"functions.{name}:{idx}", "type": "function",
            "function": {"name": name, "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)}}


CASES = {
    "one call": dict(content="Let me look.", reasoning_content="The user wants weather.",
                     tool_calls=[call("get_weather", {"city": "Paris"}, 0)]),
    "parallel, unicode, nested, specials": dict(
        content=None, reasoning_content="三 calls at once ☕",
        tool_calls=[call("get_weather", {"city": "東京", "note": "café ☕ 🚀"}, 3),
                    call("search", {"q": {"nested": [1, 2.5, {"c": None, "d": [True, False]}]}, "e": []}, 4),
                    call("calc", '{"expr": "a\\"b\\\\c\\n\\t}{", "tokens": "<|tool_call_end|></think><|close|>'
                                 '<|open|><|sep|><|im_end|><|end_of_msg|>"}', 5)]),
    "compact json": dict(content="", reasoning_content=None, tool_calls=[call("calc", '{"x":1,"y":[2,3]}', 0)]),
    "text only": dict(content="No tools needed: <|tool_calls_section_begin|> is just text.",
                      reasoning_content="short", tool_calls=None),
}


def _expected(case, family):
    want = {"role": "assistant", "content": case["content"], "reasoning_content": case["reasoning_content"]}
    if family.startswith("k2") and family != "k2.5":
        want["reasoning_content"] = None              # K2-Instruct's markup has no thinking
    if case["tool_calls"]:
        want["tool_calls"] = case["tool_calls"]
        want["content"] = want["content"] or None
    else:
        want["content"] = want["content"] or ""
    return want


def _generated(tok, case, kwargs=None):
    """render(conversation + assistant x) minus render(conversation, generation prompt) -> (the prompt,
    the ids the model would generate for x, up to its end-of-message token)."""
    user = [{"role": "user", "content": "weather in Paris and Tokyo?"}]
    x = {"role": "assistant", **{k: v for k, v in case.items() if v is not None}}
    prompt = chat_template.chat_ids(tok, user, tools=TOOLS, template_kwargs=kwargs)
    full = chat_template.chat_ids(tok, user + [x], tools=TOOLS, add_generation_prompt=False, template_kwargs=kwargs)
    assert full[:len(prompt)] == prompt
    rest = full[len(prompt):]
    return prompt, rest[:rest.index(tok.im_end_id)]


def _parse(tok, prompt, ids, *, tools=NAMES, choice="auto", name=None, index=0, stop=(), parallel=True):
    g = toolcalls.Grammar.of(tok)
    forced, prime = toolcalls.forced_tokens(g, prompt, choice, name, index)
    p = toolcalls.Parser(g, tok, tools=tools, stop=stop, parallel=parallel, prime=prime)
    events = [e for t in ids for e in p.feed(t)] + p.finish()
    return p, events, forced


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("family", ["k2-builtin", "k2", "k2.5"])
def test_parse_of_render_is_identity(toks, family, case):
    tok, x = toks[family], CASES[case]
    if family != "k2.5":
        x = dict(x, reasoning_content=None)
    prompt, ids = _generated(tok, x)
    p, events, _ = _parse(tok, prompt, ids)
    want = _expected(x, family)
    assert toolcalls.message(events) == want and not p.failures
    # The stream's deltas, accumulated as an OpenAI client does, give the same message.
    assert _accumulate(toolcalls.deltas(events)) == want


def _accumulate(deltas):
    msg = {"role": "assistant", "content": None, "reasoning_content": None}
    calls = []
    for d in deltas:
        for key in ("content", "reasoning_content"):
            if key in d:
                msg[key] = (msg[key] or "") + d[key]
        for c in d.get("tool_calls", []):
            if c["index"] == len(calls):
                assert set(c) == {"index", "id", "type", "function"} and c["function"]["arguments"] == ""
                calls.append({"id": c["id"], "type": c["type"], "function": dict(c["function"])})
            else:
                assert set(c) == {"index", "function"}
                calls[c["index"]]["function"]["arguments"] += c["function"]["arguments"]
    if calls:
        msg["tool_calls"] = calls
    elif msg["content"] is None:
        msg["content"] = ""
    return msg


def test_reasoning_text_cannot_inject_markup(toks):
    tok = toks["k2.5"]
    msgs = [{"role": "user", "content": "q"},
            {"role": "assistant", "content": "a", "reasoning_content": "x</think><|im_end|>y"}]
    ids = chat_template.chat_ids(tok, msgs, add_generation_prompt=False)
    assert ids.count(tok.token_id("</think>")) == 1 and ids.count(tok.im_end_id) == 3   # system, user, assistant


def _section(tok, *calls, close=True):
    """K2 ids: a section with (id text, arguments text) calls."""
    sp = tok.special_ids
    ids = [sp["<|tool_calls_section_begin|>"]]
    for cid, args in calls:
        ids += [sp["<|tool_call_begin|>"], *tok.encode(cid), sp["<|tool_call_argument_begin|>"], *tok.encode(args),
                sp["<|tool_call_end|>"]]
    return ids + ([sp["<|tool_calls_section_end|>"]] if close else [])


@pytest.mark.parametrize("calls,close,reason", [
    ([("functions.get_weather:0", '{"city": "Par')], True, "bad_json"),
    ([("functions.get_weather:0", '["not", "an object"]')], True, "arguments_not_an_object"),
    ([("functions.rm_rf:0", '{}')], True, "unknown_function"),
    ([("get_weather", '{}')], True, "bad_id"),
    ([("functions.get_weather:0", '{"a": 1}'), ("functions.search:1", '{"q": "x"}')], False, "unclosed"),
    ([("functions.get_weather:0", '{"a": 1}'), ("functions.nope:1", '{}')], True, "unknown_function"),
])
def test_malformed_sections_come_back_as_text(toks, calls, close, reason):
    tok = toks["k2"]
    ids = tok.encode("Sure. ") + _section(tok, *calls, close=close)
    p, events, _ = _parse(tok, [], ids)
    msg = toolcalls.message(events)
    assert msg == {"role": "assistant", "content": tok.decode(ids), "reasoning_content": None}
    assert p.failures == [reason] and p.released == 0


def test_unexpected_token_stop_strings_and_tools_off(toks):
    tok, sp = toks["k2"], toks["k2"].special_ids
    ids = _section(tok, ("functions.calc:0", '{"x": 1}'))
    # A marker out of place inside a section: the section so far is text, what follows is parsed again.
    bad = ids[:3] + [sp["<think>"]] + tok.encode("after")
    p, events, _ = _parse(tok, [], bad)
    assert toolcalls.message(events)["content"] == tok.decode(bad) and p.failures == ["unexpected_token"]
    # tool_choice="none" (tools=None): the markers stay text, nothing is counted.
    p, events, _ = _parse(tok, [], ids, tools=None)
    assert toolcalls.message(events)["content"] == tok.decode(ids) and not p.failures
    # A stop string cuts the content; reasoning after </think> is not content.
    p, events, _ = _parse(tok, [sp["<think>"]], tok.encode("plan") + [sp["</think>"]] + tok.encode("hello world"),
                          stop=("world",))
    assert toolcalls.message(events) == {"role": "assistant", "content": "hello ", "reasoning_content": "plan"}


def test_parallel_false_stops_at_the_first_call(toks):
    tok = toks["k2"]
    ids = _section(tok, ("functions.calc:0", '{"x": 1}'), ("functions.search:1", '{"q": "y"}'))
    g = toolcalls.Grammar.of(tok)
    p = toolcalls.Parser(g, tok, tools=NAMES, parallel=False)
    events, used = [], 0
    for t in ids:
        events += p.feed(t)
        used += 1
        if p.done:
            break
    assert used == ids.index(tok.token_id("<|tool_call_end|>")) + 1
    assert toolcalls.message(events)["tool_calls"] == [call("calc", '{"x": 1}', 0)]
    assert events[-1] == ("section_end",)


@pytest.mark.parametrize("family", ["k2", "k2.5"])
def test_forced_tokens_prime_the_parser(toks, family):
    """required opens the section, named also writes the call's header; the parser starts where the
    model continues (after an open thinking block, which the forced tokens close)."""
    tok = toks[family]
    g = toolcalls.Grammar.of(tok)
    prompt = chat_template.chat_ids(tok, [{"role": "user", "content": "hi"}], tools=TOOLS)
    thinking = family != "k2"
    assert (toolcalls.forced_tokens(g, prompt, "auto") == ([], g.think_open())) == thinking
    forced, _ = toolcalls.forced_tokens(g, prompt, "required")
    assert forced == (g.think_close() if thinking else []) + g.section_open()
    forced, _ = toolcalls.forced_tokens(g, prompt, "named", "search", index=2)
    head = g.section_open() + g.call_header("functions.search:2")
    assert forced == (g.think_close() if thinking else []) + head
    close = [g.ids["<|tool_call_end|>"], g.ids["<|tool_calls_section_end|>"]]
    p, events, _ = _parse(tok, prompt, tok.encode('{"q": "jax"}') + close, choice="named", name="search",
                          index=2, parallel=False)
    assert toolcalls.message(events) == {"role": "assistant", "content": None, "reasoning_content": None,
                                         "tool_calls": [call("search", '{"q": "jax"}', 2)]}
    # Forced into the arguments, the model never closes the call: the forced text comes back as content.
    p, events, _ = _parse(tok, prompt, tok.encode("zzz"), choice="named", name="search", index=2)
    assert toolcalls.message(events)["content"] == tok.decode(head) + "zzz" and p.failures == ["unclosed"]


# -- HTTP: the real routes over a scripted engine ---------------------------------------------------
class ScriptedEngine:
    """Engine's submit/cancel interface; replays ``script`` (token ids) as one Event per token, the last
    with ``finish``. Records each request (prompt ids with forced tokens) and cancellations."""

    def __init__(self, tok):
        self.tok, self.error, self.stop_ids = tok, None, frozenset((tok.eos_id, tok.im_end_id))
        self.script, self.finish, self.requests, self.cancelled = [], "stop", [], []

    def submit(self, req):
        self.requests.append(req)
        n = len(self.script)
        for i, t in enumerate(self.script):
            req.sink(Event(tok_text(self.tok, t), [t], [], self.finish if i == n - 1 else None, len(req.prompt), i + 1))

    def cancel(self, req):
        self.cancelled.append(req)

    def stats(self):
        return {"queue": 0, "active": 0, "slots": 1}


def tok_text(tok, t):
    return tok.decode([t])


@pytest.fixture(scope="module")
def scripted(toks):
    yield from _scripted_server(toks["k2.5"])


def _scripted_server(tok):
    """The real routes over a ScriptedEngine for ``tok``, with the openai client (a fixture's body)."""
    from test_serve import start_http

    engine = ScriptedEngine(tok)
    metrics = ServeMetrics(engine.stats)
    server, thread, url = start_http(create_app(engine, tok, model_name="m", context=4096, metrics=metrics))
    yield types.SimpleNamespace(engine=engine, tok=tok, url=url, metrics=metrics,
                                client=openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60))
    server.should_exit = True
    thread.join(30)


def _both(s, script, finish="stop", **kw):
    """The same scripted generation, non-streamed and streamed (accumulated) -> (message, finish) x 2."""
    s.engine.script, s.engine.finish = script, finish
    kw = dict(model="m", messages=[{"role": "user", "content": "weather?"}], tools=TOOLS, **kw)
    full = s.client.chat.completions.create(**kw).choices[0]
    msg = full.message.model_dump(exclude_none=False)
    chunks = list(s.client.chat.completions.create(stream=True, **kw))
    deltas = [c.choices[0].delta.model_dump(exclude_none=True) for c in chunks]
    assert deltas[0]["role"] == "assistant"
    streamed = _accumulate([{k: v for k, v in d.items() if k != "role"} for d in deltas])
    return (msg, full.finish_reason), (streamed, chunks[-1].choices[0].finish_reason)


def test_http_tool_calls_and_reasoning(scripted):
    s, tok = scripted, scripted.tok
    x = CASES["parallel, unicode, nested, specials"]
    _, ids = _generated(tok, x)
    (msg, finish), (streamed, sfinish) = _both(s, ids + [tok.im_end_id])
    assert finish == sfinish == "tool_calls"
    assert msg["tool_calls"] == streamed["tool_calls"] == x["tool_calls"]
    assert msg["reasoning_content"] == streamed["reasoning_content"] == x["reasoning_content"]
    assert msg["content"] is None and streamed["content"] in (None, "")
    assert s.engine.requests[-1].prompt == chat_template.chat_ids(     # auto: nothing forced
        tok, [{"role": "user", "content": "weather?"}], tools=TOOLS)
    # Malformed: text, finish unchanged, counted.
    bad = tok.encode("ok ") + _section(tok, ("functions.get_weather:0", '{"city": '))
    (msg, finish), (streamed, sfinish) = _both(s, [tok.token_id("</think>")] + bad + [tok.im_end_id])
    assert finish == sfinish == "stop" and "tool_calls" not in {k for k, v in msg.items() if v}
    assert msg["content"] == streamed["content"] == tok.decode(bad) and msg["reasoning_content"] is None
    metrics = s.metrics.render().decode()
    assert 'k3jax_tool_call_parse_failures_total{reason="bad_json"} 2.0' in metrics
    assert "k3jax_tool_calls_total 6.0" in metrics


def test_http_tool_choice_forcing_and_parallel_false(scripted):
    s, tok = scripted, scripted.tok
    g = toolcalls.Grammar.of(tok)
    prompt = chat_template.chat_ids(tok, [{"role": "user", "content": "weather?"}], tools=TOOLS)
    two = tok.encode('{"city": "Oslo"}') + [g.ids["<|tool_call_end|>"]] + _section(tok, ("functions.calc:1", "{}"))[1:]
    (msg, finish), (streamed, _) = _both(s, two, finish="length",
                                         tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert s.engine.requests[-1].prompt == prompt + g.think_close() + g.section_open() + \
        g.call_header("functions.get_weather:0")
    assert finish == "tool_calls" and msg["tool_calls"] == streamed["tool_calls"] == [
        call("get_weather", '{"city": "Oslo"}', 0)]
    assert s.engine.cancelled[-1] is s.engine.requests[-1]       # generation ended at the first call
    (msg, _), _ = _both(s, tok.encode("hi"), tool_choice="required", parallel_tool_calls=False)
    assert s.engine.requests[-1].prompt == prompt + g.think_close() + g.section_open()
    assert msg["content"] == tok.decode(g.section_open()) + "hi"  # never closed: text
    # tool_choice="none": no tools in the prompt, markers are text; thinking off via the template kwarg.
    ids = _section(tok, ("functions.calc:0", "{}"))
    (msg, finish), _ = _both(s, ids, tool_choice="none", extra_body={"chat_template_kwargs": {"thinking": False}})
    assert s.engine.requests[-1].prompt == chat_template.chat_ids(
        tok, [{"role": "user", "content": "weather?"}], template_kwargs={"thinking": False})
    assert finish == "stop" and msg["content"] == tok.decode(ids) and not msg["tool_calls"]
    # ... and the engine is told to keep the section's opening token out of the reply (here scripted).
    r = s.engine.requests[-1]
    assert (r.ban_token, r.ban) == (tok.token_id("<|tool_calls_section_begin|>"), 0)
    (msg, _), _ = _both(s, tok.encode("hi"))
    assert s.engine.requests[-1].ban_token == -1                  # auto: nothing banned


@pytest.mark.parametrize("extra,param", [
    ({"tool_choice": {"type": "function", "function": {"name": "launch"}}}, "tool_choice"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"logit_bias": {"5": 10}}, "logit_bias"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"guided_json": {"type": "object"}}, "guided_json"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
])
def test_http_400s(scripted, extra, param):
    s = scripted
    with pytest.raises(openai.BadRequestError) as e:
        s.client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], tools=TOOLS,
                                         extra_body=extra)
    assert e.value.body["param"] == param and param in e.value.body["message"]
    if param == "tool_choice" and "launch" in json.dumps(extra):
        assert "'launch'" in e.value.body["message"]


def test_http_a_tool_message_must_answer_a_call(scripted):
    """A ``tool`` message whose tool_call_id no earlier assistant tool_calls made is a 400 naming
    it (OpenAI's rule); one that answers a call is accepted."""
    s = scripted
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    for msgs, bad in [([{"role": "user", "content": "x"}, {"role": "tool", "tool_call_id": "call_9", "content": "1"}],
                       "call_9"),
                      ([{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [call]},
                        {"role": "tool", "tool_call_id": "call_2", "content": "1"}], "call_2")]:
        with pytest.raises(openai.BadRequestError) as e:
            s.client.chat.completions.create(model="m", messages=msgs, tools=TOOLS)
        assert e.value.body["param"] == "messages" and f"'{bad}'" in e.value.body["message"]
        assert "messages[1]" in e.value.body["message"] or "messages[2]" in e.value.body["message"]
    s.engine.script, s.engine.finish = s.tok.encode("sunny"), "stop"
    ok = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [call]},
          {"role": "tool", "tool_call_id": "call_1", "content": "1"}]
    assert s.client.chat.completions.create(model="m", messages=ok, tools=TOOLS).choices[0].finish_reason == "stop"
    assert s.engine.requests[-1].prompt == chat_template.chat_ids(s.tok, ok, tools=TOOLS)


def test_http_harmless_fields_are_ignored(scripted):
    s = scripted
    s.engine.script, s.engine.finish = s.tok.encode("fine"), "length"
    r = s.client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], user="u",
                                         metadata={"k": "v"}, store=False, presence_penalty=0, logit_bias={},
                                         response_format={"type": "text"},
                                         extra_body={"frobnicate": 1, "chat_template_kwargs": {"thinking": False}})
    assert r.choices[0].message.content == "fine" and r.choices[0].finish_reason == "length"
    assert r.choices[0].message.reasoning_content is None     # thinking off: the prompt closed the block
    r = s.client.completions.create(model="m", prompt="x", best_of=1, suffix=None)
    assert r.choices[0].text == "fine"
    with pytest.raises(openai.BadRequestError) as e:
        s.client.completions.create(model="m", prompt="x", best_of=3)
    assert e.value.body["param"] == "best_of"


# -- HTTP with a K3 tokenizer: K3's XTML format (data/k3_chat.py, data/k3_toolcalls.py) -----------------
USER = [{"role": "user", "content": "weather?"}]


@pytest.fixture(scope="module")
def k3_scripted(tmp_path_factory):
    yield from _scripted_server(KimiTokenizer.from_dir(tiny_tokenizer.build(
        tmp_path_factory.mktemp("k3tok"), vocab_size=512, num_reserved=tiny_tokenizer.MIN_RESERVED, family="k3")))


def _xtml(tok, text):
    """Ids of XTML text written with the markers by name (the markers as control tokens)."""
    return tok.encode_with_special_tokens(text)


def test_k3_http_forced_call_has_typed_arguments(k3_scripted):
    """A named tool_choice forces K3's opening tokens (the think channel closed, an empty response, the
    tools channel and the call's open tag); the model's typed arguments come back as a JSON object."""
    s, tok = k3_scripted, k3_scripted.tok
    args = ('<|open|>argument key="city" type="string"<|sep|>Paris <b>\n"x"<|close|>argument<|sep|>'
            '<|open|>argument key="days" type="number"<|sep|>3<|close|>argument<|sep|>'
            '<|open|>argument key="metric" type="boolean"<|sep|>true<|close|>argument<|sep|>'
            '<|open|>argument key="at" type="null"<|sep|>null<|close|>argument<|sep|>'
            '<|open|>argument key="opts" type="object"<|sep|>{"a": [1, 2.5]}<|close|>argument<|sep|>'
            '<|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|>')
    (msg, finish), (streamed, sfinish) = _both(s, _xtml(tok, args) + [tok.im_end_id], finish="stop",
                                               tool_choice={"type": "function", "function": {"name": "get_weather"}})
    prompt = chat_template.chat_ids(tok, USER, tools=TOOLS)
    forced = ('<|close|>think<|sep|><|open|>response<|sep|><|close|>response<|sep|><|open|>tools<|sep|>'
              '<|open|>call tool="get_weather" index="1"<|sep|>')
    sent = s.engine.requests[-1].prompt
    assert sent[:len(prompt)] == prompt and tok.decode(sent[len(prompt):]) == forced
    assert tok.decode(prompt).endswith('<|open|>message role="assistant"<|sep|><|open|>think<|sep|>')
    assert finish == sfinish == "tool_calls" and msg["content"] is None
    for m in (msg, streamed):
        (c,) = m["tool_calls"]
        assert c["function"]["name"] == "get_weather" and c["type"] == "function" and c["id"]
        assert json.loads(c["function"]["arguments"]) == {"city": 'Paris <b>\n"x"', "days": 3, "metric": True,
                                                          "at": None, "opts": {"a": [1, 2.5]}}
    assert msg["tool_calls"][0]["id"] != streamed["tool_calls"][0]["id"]   # opaque, unique per response


def test_k3_http_reasoning_and_calls_with_thinking_on(k3_scripted):
    """auto: the think channel becomes reasoning_content, the response channel content, each call of the
    tools channel a tool call; finish_reason tool_calls."""
    s, tok = k3_scripted, k3_scripted.tok
    reply = ('need the weather<|close|>think<|sep|><|open|>response<|sep|>Checking.<|close|>response<|sep|>'
             '<|open|>tools<|sep|><|open|>call tool="search" index="1"<|sep|>'
             '<|open|>argument key="q" type="string"<|sep|>Oslo & Paris<|close|>argument<|sep|><|close|>call<|sep|>'
             '<|open|>call tool="calc" index="2"<|sep|><|open|>json type="object"<|sep|>{not json<|close|>json<|sep|>'
             '<|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|>')
    (msg, finish), (streamed, sfinish) = _both(s, _xtml(tok, reply) + [tok.im_end_id])
    assert finish == sfinish == "tool_calls"
    for m in (msg, streamed):
        assert m["reasoning_content"] == "need the weather" and m["content"] == "Checking."
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"]] == [
            ("search", '{"q": "Oslo & Paris"}'), ("calc", "{not json")]
    assert s.engine.requests[-1].ban_token == -1


def test_k3_http_tool_choice_none_renders_its_turn_and_bans_the_tools_channel(k3_scripted):
    """none: the tools stay declared, a tool-choice turn says so, and the engine request bans <|open|>
    after the one the reply needs (its response channel after thinking; none with thinking off), so a
    tools channel cannot start; the content has no markup."""
    s, tok = k3_scripted, k3_scripted.tok
    reply = _xtml(tok, "hm<|close|>think<|sep|><|open|>response<|sep|>Sunny.<|close|>response<|sep|>"
                       "<|close|>message<|sep|>") + [tok.im_end_id]
    (msg, finish), _ = _both(s, reply, tool_choice="none")
    r = s.engine.requests[-1]
    text = tok.decode(r.prompt)
    assert (r.ban_token, r.ban) == (tok.token_id("<|open|>"), 1)
    assert text.startswith('<|open|>message role="system" type="tool-declare"<|sep|># Tools')
    assert text.endswith('<|open|>message role="system" type="tool-choice"<|sep|>The system is invoked with '
                         '`tool_choice=none`.\nYou MUST NOT call any tools in the next message.'
                         '<|close|>message<|sep|><|end_of_msg|>'
                         '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>')
    assert finish == "stop" and msg["content"] == "Sunny." and "<|" not in msg["content"]
    (msg, _), _ = _both(s, _xtml(tok, "Sunny.<|close|>response<|sep|><|close|>message<|sep|>"), tool_choice="none",
                        extra_body={"chat_template_kwargs": {"thinking": False}})
    r = s.engine.requests[-1]
    assert r.ban == 0
    assert tok.decode(r.prompt).endswith('<|open|>message role="assistant"<|sep|><|open|>response<|sep|>')
    assert msg["content"] == "Sunny." and msg["reasoning_content"] is None


def test_k3_http_response_format_and_thinking_effort_render_their_turns(k3_scripted):
    s, tok = k3_scripted, k3_scripted.tok
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}}
    _both(s, _xtml(tok, "{}"), response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": schema}},
          extra_body={"chat_template_kwargs": {"thinking_effort": "low"}})
    text = tok.decode(s.engine.requests[-1].prompt)
    assert '<|open|>message role="system" type="thinking-effort"<|sep|>' in text and "`thinking_effort=low`" in text
    assert text.endswith('<|open|>message role="system" type="response-format"<|sep|>The system is invoked with '
                         '`response_format=json_schema`.\nYour response must be raw JSON data without markdown code '
                         'blocks (```json) or any additional formatting.\nThe JSON data must match the following '
                         'schema:\n```json\n{"properties":{"ok":{"type":"boolean"}},"type":"object"}\n```'
                         '<|close|>message<|sep|><|end_of_msg|><|open|>message role="assistant"<|sep|>'
                         '<|open|>think<|sep|>')
    for extra, param, words in [({"response_format": {"type": "grammar"}}, "response_format", "'grammar'"),
                                ({"chat_template_kwargs": {"thinking_effort": "medium"}}, "chat_template_kwargs",
                                 "'medium'"),
                                ({"chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs",
                                 "['enable_thinking']")]:
        with pytest.raises(openai.BadRequestError) as e:
            s.client.chat.completions.create(model="m", messages=USER, tools=TOOLS, extra_body=extra)
        assert e.value.body["param"] == param and words in e.value.body["message"], e.value.body
