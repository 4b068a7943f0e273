"""RL rollouts from the inference core (k3jax.rl.rollout) with the agent checkpoint
(tests/assets/agent_tiny, fine-tuned to call get_weather / get_time): a multi-turn rollout calls
the tool the model asked for, appends its result to the live slot and lets the model answer; the
loss mask is 0 exactly on the tool turn's tokens; continuing the slot gives the tokens of the
whole conversation prefilled from scratch; a tool that times out becomes an error message, counted."""
import sys
import time

import jax
import numpy as np
import pytest

from helpers import REPO
from k3jax import config as C
from k3jax import sharding as S
from k3jax.data.chat_template import chat_ids
from k3jax.inference.generate import Generator, Sampling
from k3jax.inference.programs import Programs
from k3jax.rl.prompts import Prompt
from k3jax.rl.rollout import ToolError, load_tools, rollout, tool_turn_ids
from k3jax.runtime import load_tokenizer
from k3jax.state import load_model

sys.path.insert(0, str(REPO / "scripts"))
from make_agent_checkpoint import HELD_OUT, SYSTEM, TOOLS  # noqa: E402

ASSET = REPO / "tests" / "assets" / "agent_tiny"
CALLS = []


def get_weather(city):
    CALLS.append(("get_weather", city))
    return {"temp": 17, "sky": "cloudy"}


def get_time(city):
    CALLS.append(("get_time", city))
    return {"time": "09:30"}


def slow(city):
    time.sleep(3)
    return "late"


@pytest.fixture(scope="module")
def agent(tiny_run):
    cfg = C.load(C.REPO_CONFIGS / "base.yml", [*tiny_run.args, f"load_parameters_path={ASSET}", "max_target_length=256"])
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape((1,) * len(S.MESH_AXES)), S.MESH_AXES)
    model = load_model(cfg, mesh)
    tok = load_tokenizer(cfg)
    progs = Programs(model, mesh, slots=4, length=256, chunk=32, prefill_rows=4, decode_steps=8, top_logprobs=0)
    prompts = []
    for i, (question, _, _) in enumerate(HELD_OUT):
        msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        prompts.append(Prompt({"messages": msgs, "tools": TOOLS}, f"held_out:{i}",
                              tuple(chat_ids(tok, msgs, tools=TOOLS)), tuple(t["function"]["name"] for t in TOOLS)))
    return tok, Generator(progs), prompts


def test_multi_turn_rollout_masks_the_tool_turn_and_continues_the_slot(agent):
    tok, gen, prompts = agent
    tools = load_tools(["get_weather=test_rl_rollout:get_weather", "get_time=test_rl_rollout:get_time"])
    samples = rollout(gen, tok, prompts, generations=1, sampling=Sampling(), max_new_tokens=96, max_turns=2,
                      tools=tools)
    called = [s for s in samples if s.tool_results]
    assert called, [s.replies for s in samples]           # the agent calls its tools (3-4 of 4 in test_serve_agent)
    for s in called:
        p = prompts[s.prompt_index]
        first = s.replies[0]
        want = HELD_OUT[s.prompt_index]
        assert len(s.replies) == 2 and s.finish in ("stop", "length"), (s.finish, s.replies)
        assert [c["name"] for c in first.tool_calls] == [want[1]]
        # the tool ran on the model's arguments and its result is what the model reads next
        assert s.tool_results == ['{"temp": 17, "sky": "cloudy"}' if want[1] == "get_weather" else '{"time": "09:30"}']
        ids, _ = tool_turn_ids(tok, list(p.record["messages"]), TOOLS, first, s.tool_results)
        mask = np.asarray(s.mask)
        start = int(np.flatnonzero(mask == 0)[0])
        assert (mask[start:start + len(ids)] == 0).all() and mask[:start].all() and mask[start + len(ids):].all()
        assert s.tokens[start:start + len(ids)] == ids and s.tokens[start - 1] == tok.im_end_id
        assert all(lp == 0 for lp, m in zip(s.logprobs, s.mask) if not m)
        assert s.replies[1].text and not s.replies[1].tool_calls
        # the continued slot equals the conversation prefilled whole (greedy: same tokens)
        k = start + len(ids)
        fresh = gen.start([0], [list(p.ids) + s.tokens[:k]], [Sampling()])[0]
        again = [fresh[0]] + gen.decode([0], [len(s.tokens) - k - 1], stop_ids=(tok.eos_id, tok.im_end_id))[0][0]
        assert again == s.tokens[k:]
    assert {c[0] for c in CALLS} <= {"get_weather", "get_time"}


def test_a_tool_that_times_out_is_an_error_message_and_one_turn_ends_there(agent):
    tok, gen, prompts = agent
    tools = {"get_weather": slow, "get_time": slow}
    samples = rollout(gen, tok, prompts[:2], generations=2, sampling=Sampling(0.7, 0, 1.0, seed=5),
                      max_new_tokens=64, max_turns=2, tools=tools, tool_timeout=0.2)
    assert len(samples) == 4 and [s.prompt_index for s in samples] == [0, 0, 1, 1]
    for s in samples:
        assert len(s.tokens) == len(s.mask) == len(s.logprobs) and sum(s.mask) <= 64
        assert s.tool_errors == len(s.tool_results)
        assert all(r.startswith("error: tool") and "timed out after 0.2 s" in r for r in s.tool_results)
        assert all(lp <= 0 for lp in s.logprobs) and any(lp < 0 for lp in s.logprobs)   # sampled at T=0.7
    one = rollout(gen, tok, prompts[:1], generations=1, sampling=Sampling(), max_new_tokens=64, max_turns=1,
                  tools=tools)[0]
    assert len(one.replies) == 1 and (one.finish == "turns") == bool(one.replies[0].tool_calls)
    with pytest.raises(ToolError, match="cannot import"):
        load_tools(["w=no_such_module_k3:f"])
    with pytest.raises(ToolError, match="name=module:function"):
        load_tools(["justaname"])
