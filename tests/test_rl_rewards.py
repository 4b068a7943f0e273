"""RL rewards (k3jax.rl.rewards): the final-answer policy, replies read through the server's parsers in
K3's and K2's formats (tool calls, reasoning, malformed sections, unclosed thinking), the built-in
verifiers, user module:function rewards and their errors, weighted sums. Pure Python, tiny tokenizers."""
import dataclasses
import json
import math
import sys

import pytest

from k3jax.config import RLConfig
from k3jax.data import chat_template, k3_chat, tiny_tokenizer
from k3jax.data.tokenizer import KimiTokenizer
from k3jax.rl import rewards as R

TOOLS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
         for n in ("get_weather", "calc")]
NAMES = ["get_weather", "calc"]
USER = [{"role": "user", "content": "Weather in Paris for 3 days?"}]


@pytest.fixture(scope="module")
def k3(tmp_path_factory):
    return KimiTokenizer.from_dir(tiny_tokenizer.build(tmp_path_factory.mktemp("k3"), vocab_size=512,
                                                       num_reserved=tiny_tokenizer.MIN_RESERVED, family="k3"))


@pytest.fixture(scope="module")
def k2(tmp_path_factory):
    return KimiTokenizer.from_dir(tiny_tokenizer.build(tmp_path_factory.mktemp("k2"), vocab_size=512,
                                                       num_reserved=tiny_tokenizer.MIN_RESERVED))


def call(name, args):
    return {"type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


def generated(tok, reply):
    """(prompt ids, the ids a model generates for `reply`, up to and with its end-of-turn token)."""
    prompt = chat_template.chat_ids(tok, USER, tools=TOOLS)
    full = chat_template.chat_ids(tok, USER + [reply], tools=TOOLS, add_generation_prompt=False)
    assert full[:len(prompt)] == prompt
    rest = full[len(prompt):]
    return prompt, rest[:rest.index(tok.im_end_id) + 1]


# -- the answer policy ----------------------------------------------------------------------------------
@pytest.mark.parametrize("text,answer,want", [
    ("8", 8, True), ("8.0", "8", True), (" 8 ", 8, True), ("08", 8, True), ("8.", 8, True),
    ("\\boxed{8}", 8, True), ("So \\boxed{ 8.00 }.", "8", True), ("The answer is 8.", 8, True),
    ("The answer is 8.\nBecause 8 > 5.", 8, True),
    ("Final answer: $8$", 8, True), ("1,000", 1000, True), ("\\frac{1}{2}", "0.5", True), ("16/2", 8, True),
    ("\\boxed{\\dfrac{3}{4}}", 0.75, True), ("first \\boxed{4}, then \\boxed{8}", 8, True),
    ("\\boxed{x^{2}+1}", "x^{2}+1", True), ("Paris", "paris", True), ("\\text{Paris}", "Paris", True),
    ("eight", ["8", "eight"], True), ("-3.5", "-7/2", True), ("1e3", 1000, True),
    ("I think 3, or maybe 8", 8, False), ("8 apples", 8, False), ("\\boxed{9}", 8, False),
    ("the answer is 9, not 8", 8, False), ("\\boxed{8", 8, False), ("", 8, False), ("1,00", 100, False),
])
def test_final_answer_policy(text, answer, want):
    reply = R.Reply(text=text)
    assert R.exact_match({"answer": answer}, reply) == float(want)


def test_answer_helpers():
    assert R.last_boxed("a \\boxed{1} b \\fbox{{2}}") == "{2}" and R.last_boxed("no box") is None
    assert R.extract_answer("reasoning... The answer is: 42") == "42"
    assert R.as_number("3/0") is None and R.as_number("1.2.3") is None and R.as_number("-") is None


# -- replies through the server's parsers -------------------------------------------------------------
REPLY = {"role": "assistant", "reasoning_content": "Need the weather.", "content": "Checking. The answer is 8.",
         "tool_calls": [call("get_weather", {"city": "Paris", "days": 3}), call("calc", {"expr": "2+2"})]}


def test_k3_reply_calls_answer_and_format(k3):
    prompt, ids = generated(k3, REPLY)
    rep = R.parse_reply(k3, prompt, ids, tools=NAMES)
    assert rep.text == "Checking. The answer is 8." and rep.reasoning == "Need the weather."
    assert rep.tool_calls == ({"name": "get_weather", "arguments": {"city": "Paris", "days": 3}},
                              {"name": "calc", "arguments": {"expr": "2+2"}})
    assert rep.think_closed and not rep.failures
    rec = {"answer": "8.0", "tool_call": [{"name": "get_weather", "arguments": {"days": 3, "city": "Paris"}},
                                          {"function": {"name": "calc", "arguments": '{"expr": "2+2"}'}}]}
    assert (R.exact_match(rec, rep), R.tool_call(rec, rep), R.format_reward(rec, rep)) == (1.0, 1.0, 1.0)
    for wrong in ([rec["tool_call"][0]],                                                   # a call missing
                  [rec["tool_call"][1], rec["tool_call"][0]],                              # order
                  [{"name": "get_weather", "arguments": {"city": "Paris", "days": "3"}},   # "3" is not 3
                   rec["tool_call"][1]]):
        assert R.tool_call({"tool_call": wrong}, rep) == 0.0


def test_k3_malformed_and_unclosed(k3):
    prompt, ids = generated(k3, REPLY)
    bad = R.parse_reply(k3, prompt, ids, tools=["calc"])            # get_weather was not declared
    assert "unknown_function" in bad.failures and R.format_reward({}, bad) == 0.0
    assert R.tool_call({"tool_call": {"name": "calc", "arguments": {"expr": "2+2"}}}, bad) == 1.0
    close = k3_chat.encode(k3, k3_chat.close_tag("think"))[0]
    at = next(i for i in range(len(ids)) if ids[i:i + len(close)] == close)
    cut = R.parse_reply(k3, prompt, ids[:at], tools=NAMES)         # generation ran out while thinking
    assert not cut.think_closed and cut.text == "" and R.format_reward({}, cut) == 0.0
    skipped = R.parse_reply(k3, prompt, ids[:at] + ids[at + len(close):], tools=NAMES)   # never closed think
    assert not skipped.think_closed and skipped.text == "Checking. The answer is 8."
    plain = R.parse_reply(k3, prompt, ids, tools=())               # no tools declared: the section is malformed
    assert plain.failures and plain.tool_calls == () and R.format_reward({}, plain) == 0.0


def test_k2_reply_calls_answer_and_format(k2):
    reply = {k: v for k, v in REPLY.items() if k != "reasoning_content"}   # K2-Instruct's markup: no thinking
    prompt, ids = generated(k2, reply)
    rep = R.parse_reply(k2, prompt, ids, tools=NAMES)
    assert rep.text == "Checking. The answer is 8." and rep.think_closed and not rep.failures
    assert [c["name"] for c in rep.tool_calls] == NAMES and rep.tool_calls[0]["arguments"]["days"] == 3
    rec = {"answer": 8, "tool_call": [{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}},
                                      {"name": "calc", "arguments": {"expr": "2+2"}}]}
    assert (R.exact_match(rec, rep), R.tool_call(rec, rep), R.format_reward(rec, rep)) == (1.0, 1.0, 1.0)
    section_end = k2.token_id("<|tool_calls_section_end|>")
    cut = R.parse_reply(k2, prompt, ids[:ids.index(section_end)], tools=NAMES)   # the section never closes
    assert "unclosed" in cut.failures and cut.tool_calls == () and R.format_reward({}, cut) == 0.0
    undeclared = R.parse_reply(k2, prompt, ids, tools=())   # a section although no tool was declared
    assert "unknown_function" in undeclared.failures and R.format_reward({}, undeclared) == 0.0
    # thinking (K2-Thinking / K2.5): the prompt opened <think>; closed or left open
    think, end = k2.token_id("<think>"), k2.token_id("</think>")
    body = k2.encode("Hmm, 4+4.") + [end] + k2.encode("\\boxed{8}")
    closed = R.parse_reply(k2, prompt + [think], body + [k2.im_end_id], tools=NAMES)
    assert closed.think_closed and closed.reasoning == "Hmm, 4+4." and R.exact_match(rec, closed) == 1.0
    open_ = R.parse_reply(k2, prompt + [think], body[:3], tools=NAMES)
    assert not open_.think_closed and open_.text == "" and R.format_reward(rec, open_) == 0.0


# -- user rewards, errors, weights ----------------------------------------------------------------------
USER_MODULE = '''
def length_bonus(record, completion, tool_calls):
    return len(completion) / record["scale"] + len(tool_calls)
length_bonus.fields = ["scale"]

def boom(record, completion, tool_calls):
    raise KeyError("no such thing")

def nothing(record, completion, tool_calls):
    return None

def nan(record, completion, tool_calls):
    return float("nan")

def mutate(record, completion, tool_calls):
    record["answer"] = "9"
    tool_calls.clear()
    return 0.5
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(USER_MODULE)
    (tmp_path / "broken_rewards.py").write_text("import not_a_module_anywhere\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_rewards"
    for m in ("my_rewards", "broken_rewards"):
        sys.modules.pop(m, None)


def test_weighted_sum_with_a_user_reward(user_module):
    cfg = dataclasses.replace(RLConfig(), rl_rewards=["exact_match=2", "format=0.5", "my_rewards:length_bonus=0.1",
                                                      "my_rewards:mutate"])
    rs = R.RewardSet.from_config(cfg)
    assert rs.fields == {"answer": "exact_match", "scale": "my_rewards:length_bonus"}
    rep = R.Reply(text="\\boxed{8}", tool_calls=({"name": "calc", "arguments": {}},))
    rec = {"answer": "8", "scale": 9}
    s = rs.score(rec, "p.jsonl:3", rep)
    assert s.components == {"exact_match": 1.0, "format": 1.0, "my_rewards:length_bonus": 2.0,
                            "my_rewards:mutate": 0.5}
    assert s.total == pytest.approx(2 * 1 + 0.5 * 1 + 0.1 * 2 + 0.5) and s.errors == ()
    assert rec["answer"] == "8" and len(rep.tool_calls) == 1           # the user's function got copies
    totals, comps, errors = rs.score_batch([(rec, "p.jsonl:3"), ({"answer": 7, "scale": 1}, "p.jsonl:4")],
                                           [rep, R.Reply(text="8", think_closed=False)])
    assert totals.tolist() == pytest.approx([s.total, 0 + 0 + 0.1 * 1 + 0.5])
    assert comps["exact_match"].tolist() == [1.0, 0.0] and comps["format"].tolist() == [1.0, 0.0]
    assert errors == dict.fromkeys(comps, 0)


@pytest.mark.parametrize("name,fragment", [
    ("my_rewards:boom", "raised KeyError: 'no such thing'"),
    ("my_rewards:nothing", "returned None, not a finite number"),
    ("my_rewards:nan", "returned nan, not a finite number"),
])
def test_a_failing_reward_names_itself_and_the_prompt(user_module, name, fragment):
    rec, rep = {"answer": "8"}, R.Reply(text="8")
    rs = R.RewardSet([R.load_reward("exact_match"), R.load_reward(name)])
    with pytest.raises(R.RewardError) as e:
        rs.score(rec, "data/prompts.jsonl:17", rep)
    assert name in str(e.value) and "data/prompts.jsonl:17" in str(e.value) and fragment in str(e.value)
    assert "\n" not in str(e.value)
    zero = R.RewardSet([R.load_reward("exact_match", 1.0), R.load_reward(name, 3.0)], errors="zero")
    s = zero.score(rec, "data/prompts.jsonl:17", rep)
    assert s.components[name] == 0.0 and s.total == 1.0 and s.errors == (name,)
    assert zero.score_batch([(rec, "x:1")] * 3, [rep] * 3)[2][name] == 3


@pytest.mark.parametrize("spec,fragment", [
    ("no_such_module_xyz:f", "cannot import module 'no_such_module_xyz' of the reward 'no_such_module_xyz:f' "
                             "(ModuleNotFoundError"),
    ("broken_rewards:f", "cannot import module 'broken_rewards'"),
    ("my_rewards:missing", "module 'my_rewards' has no function 'missing'"),
    ("exact_matsh", "unknown reward 'exact_matsh'; built in: exact_match, tool_call, format"),
])
def test_a_reward_that_cannot_be_loaded_is_named(user_module, spec, fragment):
    with pytest.raises(R.RewardError, match=None) as e:
        R.load_reward(spec)
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_builtin_reward_on_a_bad_record_is_reported_with_its_place():
    rs = R.RewardSet([R.load_reward("tool_call")])
    with pytest.raises(R.RewardError, match="reward 'tool_call' raised ValueError: tool_call must be .* at x.jsonl:2"):
        rs.score({"tool_call": "get_weather"}, "x.jsonl:2", R.Reply(text=""))
    assert math.isclose(R.RewardSet([R.load_reward("format", 0.25)]).score({}, "x:1", R.Reply(text="")).total, 0.25)


def test_a_trajectory_is_judged_whole(k3):
    """Multi-turn: each model turn parsed with the prompt it continued; the calls of every turn and the
    last turn's answer are what the rewards see."""
    prompt, ids = generated(k3, REPLY)
    first = R.parse_reply(k3, prompt, ids, tools=NAMES)
    history = USER + [REPLY, {"role": "tool", "tool_call_id": "a", "content": "sunny"},
                      {"role": "tool", "tool_call_id": "b", "content": "4"}]
    prompt2 = chat_template.chat_ids(k3, history, tools=TOOLS)
    full = chat_template.chat_ids(k3, history + [{"role": "assistant", "reasoning_content": "Done.",
                                                   "content": "\\boxed{4}"}], tools=TOOLS, add_generation_prompt=False)
    assert full[:len(prompt2)] == prompt2
    second = R.parse_reply(k3, prompt2, full[len(prompt2):], tools=NAMES)
    whole = R.join_turns([first, second])
    assert whole.text == "\\boxed{4}" and whole.reasoning == "Need the weather.\n\nDone."
    assert [c["name"] for c in whole.tool_calls] == NAMES and whole.think_closed and not whole.failures
    rec = {"answer": 4, "tool_call": [{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}},
                                      {"name": "calc", "arguments": {"expr": "2+2"}}]}
    assert (R.exact_match(rec, whole), R.tool_call(rec, whole), R.format_reward(rec, whole)) == (1.0, 1.0, 1.0)
    cut = R.join_turns([first, dataclasses.replace(second, think_closed=False)])
    assert R.format_reward(rec, cut) == 0.0
