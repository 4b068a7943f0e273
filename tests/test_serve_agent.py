"""A two-turn agent loop through the openai client against the server, with tool calls the model
makes itself (issue 37 item 6a). tests/assets/agent_tiny is the tiny model fine-tuned on synthetic
get_weather / get_time conversations by scripts/make_agent_checkpoint.py (committed; never trained
here). The questions are not in its fine-tuning set (make_agent_checkpoint.HELD_OUT, asserted
there). The untuned shared checkpoint (tiny_run), served with the same settings (so the same
compiled programs), must call none of the expected tools: the calls come from the fine-tuning.

With tool_choice=auto at least 3 of the 4 questions must give the expected call, name and
arguments (`{"city": <the question's city>}`), streamed and non-streamed alike, and each call must be
followed, after the test's `tool` message, by a plain answer. Run with -s for the transcript."""
import json
import sys
import types

import jax
import openai
import pytest

from k3jax import config as C
from k3jax.serve.main import build
from k3jax.sharding import make_mesh

from helpers import REPO
from test_serve import start_http

sys.path.insert(0, str(REPO / "scripts"))
from make_agent_checkpoint import CITIES, HELD_OUT, SYSTEM, TOOLS  # noqa: E402

ASSET = REPO / "tests" / "assets" / "agent_tiny"
# One decode bucket, one prefill chunk size, no prefix cache: as few compiles as serving allows.
SERVE = ["max_target_length=256", "serve_max_batch=2", "serve_max_queue=4", "serve_prefill_chunk=32",
         "serve_decode_buckets=[2]", "serve_prefix_cache_bytes=0"]


def serve(args, checkpoint):
    cfg = C.load(C.REPO_CONFIGS / "base.yml", [*args, f"load_parameters_path={checkpoint}", *SERVE])
    engine, app, _ = build(cfg, make_mesh(cfg, jax.devices()[:1]))
    engine.start()
    server, thread, url = start_http(app)
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)

    def stop():
        server.should_exit = True
        thread.join(30)
        engine.stop(30)
    return types.SimpleNamespace(client=client, name=cfg.model_name, stop=stop)


@pytest.fixture(scope="module")
def servers(tiny_run):
    """(the agent checkpoint's server, the untuned tiny_run checkpoint's), same settings."""
    agent = serve(tiny_run.args, ASSET)
    control = serve(tiny_run.args, tiny_run.checkpoint)
    yield agent, control
    agent.stop()
    control.stop()


def messages(question):
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def ask(s, msgs, stream=False, max_tokens=48):
    """A greedy chat request with tool_choice=auto -> (finish_reason, content, [(id, name, arguments)]);
    streamed, the deltas are joined as an OpenAI client would."""
    kw = dict(model=s.name, messages=msgs, tools=TOOLS, tool_choice="auto", temperature=0, max_tokens=max_tokens)
    if not stream:
        c = s.client.chat.completions.create(**kw).choices[0]
        calls = [(t.id, t.function.name, t.function.arguments) for t in c.message.tool_calls or []]
        return c.finish_reason, c.message.content, calls
    finish, content, calls = None, "", {}
    for chunk in s.client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            finish = ch.finish_reason or finish
            content += ch.delta.content or ""
            for t in ch.delta.tool_calls or []:
                c = calls.setdefault(t.index, ["", "", ""])
                c[0] += t.id or ""
                c[1] += (t.function.name or "") if t.function else ""
                c[2] += (t.function.arguments or "") if t.function else ""
    return finish, content or None, [tuple(calls[i]) for i in sorted(calls)]


def ask_both(s, msgs, **kw):
    """The non-streamed answer, checked equal to the streamed one."""
    got = ask(s, msgs, **kw)
    assert ask(s, msgs, stream=True, **kw) == got, f"streaming and non-streaming differ for {msgs[-1]}"
    return got


def hit(calls, name, args=None):
    """Exactly one call, to `name`, with arguments that parse to `args` (any when None)."""
    if len(calls) != 1 or calls[0][1] != name:
        return False
    try:
        return args is None or json.loads(calls[0][2]) == args
    except ValueError:
        return False


def test_agent_loop_with_the_models_own_tool_calls(servers):
    agent, control = servers
    right_tool = right_args = 0
    for question, name, args in HELD_OUT:
        msgs = messages(question)
        finish, content, calls = ask_both(agent, msgs)
        print(f"\n>>> user: {question!r} (tools {[t['function']['name'] for t in TOOLS]}, tool_choice=auto)")
        print(f"<<< finish_reason={finish} content={content!r} tool_calls={calls}")
        if not hit(calls, name):
            print(f"    expected {name}: not called")
            continue
        right_tool += 1
        right_args += hit(calls, name, args)
        print(f"    expected {name}({json.dumps(args)}): tool right, arguments {'right' if hit(calls, name, args) else 'wrong'}")
        assert finish == "tool_calls"
        call_id, fn, arguments = calls[0]
        assert call_id == f"functions.{fn}:0"
        assert set(json.loads(arguments)) == {"city"} and json.loads(arguments)["city"] in CITIES, arguments
        result = json.dumps({"temp": 17, "sky": "cloudy"} if fn == "get_weather" else {"time": "09:30"})
        history = msgs + [{"role": "assistant", "content": content, "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": fn, "arguments": arguments}}]},
                          {"role": "tool", "tool_call_id": call_id, "content": result}]
        finish2, content2, calls2 = ask_both(agent, history)
        print(f">>> tool {call_id}: {result}")
        print(f"<<< finish_reason={finish2} content={content2!r} tool_calls={calls2}")
        assert finish2 == "stop" and content2 and not calls2, "the model did not answer after the tool's result"
    print(f"fine-tuned: the expected tool {right_tool} of {len(HELD_OUT)}, with the expected arguments {right_args}")
    assert right_args >= 3, f"the expected call (name and arguments) for {right_args} of {len(HELD_OUT)} questions"

    untuned = 0
    for question, name, args in HELD_OUT:
        finish, content, calls = ask_both(control, messages(question))
        untuned += hit(calls, name)
        print(f"untuned: {question!r} -> finish_reason={finish} tool_calls={calls} content={content!r}")
    assert untuned == 0


def test_sft_record_tools_are_declared_as_the_server_declares_them(tmp_path):
    """An SFT record's `tools` field (how make_agent_checkpoint declares its tools): its training
    rendering starts with the prompt the server renders for the same messages and tools (chat_ids
    through the tokenizer's jinja template; not trained on), and a malformed field is one line."""
    from k3jax.data import sft, tiny_tokenizer
    from k3jax.data.chat_template import chat_ids
    from k3jax.data.tokenizer import KimiTokenizer
    tok = KimiTokenizer.from_dir(tiny_tokenizer.build(tmp_path, vocab_size=512, num_reserved=tiny_tokenizer.MIN_RESERVED))
    msgs = messages(HELD_OUT[0][0]) + [{"role": "assistant", "content": "It is sunny."}]
    record = {"tools": TOOLS, "messages": msgs}
    served = chat_ids(tok, msgs[:2], tools=TOOLS)
    ids, weights = sft.conversation_to_example(tok, sft.record_to_messages(record, "messages"))
    assert list(ids[:len(served)]) == served and not weights[:len(served)].any() and weights.any()
    plain, _ = sft.conversation_to_example(tok, sft.record_to_messages({"messages": msgs}, "messages"))
    assert len(plain) < len(ids) and "tool_declare" not in tok.decode(plain)
    with pytest.raises(ValueError, match="'tools' must be a list"):
        sft.record_to_messages({"tools": "get_weather", "messages": msgs}, "messages")
