"""The server end to end: a real uvicorn server (in this process, on one device) over the shared
tiny checkpoint, driven by real HTTP clients (the openai client with max_retries=0; http.client for
bodies the openai client would not send)."""
import concurrent.futures as futures
import http.client
import json
import threading
import time
import types
from urllib.parse import urlparse

import jax
import numpy as np
import openai
import pytest
import uvicorn
from flax import nnx

from k3jax import config as C
from k3jax.data.chat_template import chat_ids, render
from k3jax.inference.generate import generate
from k3jax.serve.main import build
from k3jax.serve.api import create_app
from k3jax.sharding import make_mesh

from helpers import check_greedy
from lm_eval_client import check_lm_eval

CONTEXT, SLOTS, QUEUE, CHUNK = 96, 8, 8, 16
# Two decode buckets (the default would compile 1, 2, 4 and 8), batched prefills of 2 and 4 prompts
# (the default adds 8), and the prefix cache on, in blocks of one chunk (its default size, 1 GiB,
# holds everything these tests send).
SERVE = [f"max_target_length={CONTEXT}", f"serve_max_batch={SLOTS}", f"serve_max_queue={QUEUE}",
         f"serve_prefill_chunk={CHUNK}", f"serve_decode_buckets=[2,{SLOTS}]", f"serve_prefix_block={CHUNK}",
         "serve_prefill_batch=4"]
GREEDY = dict(temperature=0, logprobs=2, extra_body={"return_tokens_as_token_ids": True})


def start_http(app):
    """uvicorn on a free port in a thread -> (server, thread, base url)."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 60
    while not server.started:
        assert time.time() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    return server, thread, f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def served(tiny_run):
    cfg = C.load(C.REPO_CONFIGS / "base.yml", tiny_run.args + [f"load_parameters_path={tiny_run.checkpoint}"] + SERVE)
    mesh = make_mesh(cfg, jax.devices()[:1])
    engine, app, _ = build(cfg, mesh)
    engine.start()
    server, thread, url = start_http(app)
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
    yield types.SimpleNamespace(cfg=cfg, mesh=mesh, engine=engine, url=url, client=client, tok=engine.tok,
                                model=nnx.merge(engine.p.gdef, *engine.p.state), name=cfg.model_name)
    server.should_exit = True
    thread.join(30)
    engine.stop(30)


def post(url, path, body, headers=None):
    """Raw POST -> (status, headers, parsed JSON body or text)."""
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=300)
    conn.request("POST", path, body=body if isinstance(body, (str, bytes)) else json.dumps(body),
                 headers={"Content-Type": "application/json", **(headers or {})})
    r = conn.getresponse()
    data = r.read()
    conn.close()
    try:
        data = json.loads(data)
    except ValueError:
        pass
    return r.status, {k.lower(): v for k, v in r.getheaders()}, data


def stream_completion(client, name, prompt, max_tokens, **kw):
    """A streamed greedy completion -> namespace(id, ids, logprobs, tops, text, finish, usage)."""
    out = types.SimpleNamespace(id=None, ids=[], logprobs=[], tops=[], text="", finish=None, usage=None)
    for chunk in client.completions.create(model=name, prompt=prompt, max_tokens=max_tokens, stream=True,
                                           stream_options={"include_usage": True}, **GREEDY, **kw):
        out.id = chunk.id
        if chunk.usage is not None:
            out.usage = chunk.usage
        for c in chunk.choices:
            out.text += c.text
            out.finish = c.finish_reason or out.finish
            if c.logprobs is not None:
                out.ids += [int(t.split(":")[1]) for t in c.logprobs.tokens]
                out.logprobs += c.logprobs.token_logprobs
                out.tops += c.logprobs.top_logprobs
    return out


def prompts(tok):
    rng = np.random.default_rng(0)
    lengths = [3, 50, 8, 12, 15, 16, 17, 20, 24, 31, 33, 40, 47, 2, 9, 5]
    max_tokens = [24, 7, 17, 9, 30, 12, 8, 20, 6, 16, 11, 25, 7, 14, 19, 10]
    text = "The quick brown fox jumps over the lazy dog while the cat sleeps in the warm sun. "
    out = []
    for i, (n, m) in enumerate(zip(lengths, max_tokens)):
        if i < 4:     # text prompts (the server tokenizes), the rest token ids
            p = (text * 8)[:n * 3]
            out.append((p, tok.encode(p), m))
        else:
            ids = [int(x) for x in rng.integers(0, tok.n_base, n)]
            out.append((ids, ids, m))
    return out


def test_concurrent_streams_equal_alone_and_generate(served):
    reqs = prompts(served.tok)
    with futures.ThreadPoolExecutor(len(reqs)) as pool:
        together = list(pool.map(lambda r: stream_completion(served.client, served.name, r[0], r[2]), reqs))
    # Some prompts take several chunks, and requests shared decode steps (how many at once depends
    # on how prefill chunks and finishing requests interleave).
    assert max(len(r[1]) for r in reqs) > 2 * CHUNK
    assert max(len(ids) for _, ids in served.engine.decode_log) >= SLOTS // 2
    assert max(len(ids) for _, ids in served.engine.prefill_log) >= 2     # prompts prefilled together
    stop = (served.tok.eos_id, served.tok.im_end_id)
    with jax.set_mesh(served.mesh):
        want, _ = generate(served.model, [r[1] for r in reqs], max_new_tokens=max(r[2] for r in reqs), stop_ids=stop)
    forward = nnx.jit(lambda m, t: jax.nn.log_softmax(m(t)[0][0, -1]))
    ties = 0
    for k, ((prompt, ids, m), got) in enumerate(zip(reqs, together)):
        ref = [int(t) for t in want[k][:m] if t >= 0]
        assert got.usage.prompt_tokens == len(ids) and got.usage.completion_tokens == len(got.ids)
        assert got.finish == ("stop" if got.ids[-1] in stop else "length")
        ties += check_greedy(f"request {k} vs generate()", got.ids, got.logprobs, ref,
                     lambda i: np.asarray(forward(served.model, jax.numpy.asarray([ids + ref[:i]]))))
        alone = served.client.completions.create(model=served.name, prompt=prompt, max_tokens=m, **GREEDY)
        lp = alone.choices[0].logprobs
        alone_ids = [int(t.split(":")[1]) for t in lp.tokens]

        def tops(i):    # the concurrent run's top-2, as a (sparse) reference distribution
            ref = np.full(served.tok.vocab_size, -np.inf)
            for t, v in got.tops[i].items():
                ref[int(t.split(":")[1])] = v
            return ref
        ties += check_greedy(f"request {k} alone vs together", alone_ids, lp.token_logprobs, got.ids, tops)
    assert ties <= 2, f"{ties} of 32 comparisons parted at near ties: the comparison would say little"
    # alone, a request decodes serve_decode_steps (default 4) tokens per program: the comparisons
    # above cover those programs against single steps and generate()
    assert served.engine.multi_steps > 0 and served.engine.p.steps == 4


def test_a_request_joins_without_waiting(served):
    """B arrives while A decodes; B's first token comes at an engine iteration whose decode step
    still includes A, and A keeps decoding after it."""
    a_id, b_resp = {}, {}
    stream = served.client.completions.create(model=served.name, prompt="Once upon a time", max_tokens=60,
                                              stream=True, temperature=0, extra_body={"ignore_eos": True})
    b_thread = None
    n = 0
    for chunk in stream:
        a_id["id"] = chunk.id
        n += 1
        if n == 3:
            b_thread = threading.Thread(target=lambda: b_resp.update(r=served.client.completions.create(
                model=served.name, prompt="Hello", max_tokens=3, temperature=0)))
            b_thread.start()
    b_thread.join()
    a, b = a_id["id"], b_resp["r"].id
    b_first = [it for it, rid in served.engine.first_token_log if rid == b]
    a_steps = [it for it, ids in served.engine.decode_log if a in ids]
    assert len(b_first) == 1 and b_first[0] in a_steps and max(a_steps) > b_first[0], (b_first, a_steps)


def _burst(engine, tag: str, seed: int) -> tuple[int, int, dict]:
    """SLOTS prompts of 40 random tokens (3 chunks; ``seed``: none shared with another burst, which
    the prefix cache would restore) submitted at once (under the engine's lock, so one iteration
    admits them all), 6 greedy tokens each -> (decode steps that ran while the burst was still
    prefilling, prefill steps of the burst, tokens per request)."""
    from k3jax.serve.engine import Request
    done, tokens = threading.Semaphore(0), {}
    rng = np.random.default_rng(seed)

    def sink(rid):
        def take(e):
            tokens.setdefault(rid, []).extend(e.tokens)
            if e.finish_reason:
                done.release()
        return take
    with engine._cv:
        start = engine.iteration
        for i in range(SLOTS):
            rid = f"{tag}-{i}"
            engine.submit(Request(prompt=[int(x) for x in rng.integers(10, 400, 40)], max_tokens=6, sink=sink(rid),
                                  temperature=0.0, ignore_eos=True, id=rid))
    for _ in range(SLOTS):
        assert done.acquire(timeout=300)
    mine = lambda ids: any(str(x).startswith(tag) for x in ids)   # noqa: E731
    prefills = [it for it, ids in engine.prefill_log if it > start and mine(ids)]
    decodes = [it for it, ids in engine.decode_log if prefills[0] <= it < prefills[-1] and mine(ids)]
    return len(decodes), len(prefills), tokens


def test_a_burst_prefills_before_its_rows_decode(served):
    """A burst of SLOTS prompts (3 chunks each, 4 prompts per prefill step): with the default
    serve_max_decode_wait=4 the rows that finished prefilling wait for the others, at most 4
    iterations in a row, so fewer decode steps run while the burst prefills than with 0 (a decode
    step after every prefill step); every request gets its 6 tokens either way."""
    eng = served.engine
    assert eng.max_decode_wait == 4
    waits = eng.decode_waits
    waited, steps, tokens = _burst(eng, "wait4", 7)
    assert eng.decode_waits > waits and all(len(t) == 6 for t in tokens.values()) and len(tokens) == SLOTS
    eng.max_decode_wait = 0
    try:
        eager, steps0, tokens0 = _burst(eng, "wait0", 8)
    finally:
        eng.max_decode_wait = 4
    assert all(len(t) == 6 for t in tokens0.values()) and len(tokens0) == SLOTS
    assert steps == steps0 and waited < eager and waited <= steps // 5 + 1, (waited, eager, steps)


def _generate(engine, prompt, n, **kw):
    """One greedy request straight to the engine -> its generated token ids."""
    from k3jax.serve.engine import Request
    done, out = threading.Event(), []

    def sink(e):
        out.extend(e.tokens)
        if e.finish_reason:
            done.set()
    engine.submit(Request(prompt=list(prompt), max_tokens=n, sink=sink, temperature=0.0, ignore_eos=True, **kw))
    assert done.wait(300)
    return out


def test_a_banned_token_is_not_sampled_after_its_allowance(served):
    """tool_choice="none"'s ban through the engine, the wire and the device programs (the first token
    from the prefill, the rest from single and several-step decode calls): a banned token never
    appears once its allowance is used, and the tokens before that point are unchanged."""
    prompt = [int(x) for x in np.random.default_rng(11).integers(10, 400, 20)]
    free = _generate(served.engine, prompt, 10)
    first, later = free[0], free[4]
    got = _generate(served.engine, prompt, 10, ban_token=first, ban=0)       # banned at the prefill
    assert first not in got and got[0] != first
    got = _generate(served.engine, prompt, 10, ban_token=later, ban=0)       # banned in decode
    cut = free.index(later)
    assert later not in got and got[:cut] == free[:cut]
    once = _generate(served.engine, prompt, 10, ban_token=later, ban=1)      # allowed once
    assert once.count(later) == 1 and once[:cut + 1] == free[:cut + 1]
    assert _generate(served.engine, prompt, 10, ban_token=later, ban=-1) == free


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(served):
    url, c, name = served.url, served.client, served.name
    status, _, body = post(url, "/v1/completions", "{not json")
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=name, prompt="hi", max_tokens=-1)
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=name, prompt=list(range(CONTEXT + 5)), max_tokens=4)
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=name, prompt="hi", max_tokens=CONTEXT)     # prompt + completion > context
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=name, prompt="hi", n=SLOTS + 1)
    assert e.value.body["param"] == "n" and str(SLOTS) in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=name, prompt="hi", echo=True, stream=True)
    assert e.value.body["param"] == "echo"
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="gpt-4o", prompt="hi")
    status, _, body = post(url, "/v1/chat/completions", {"model": name, "messages": "nope"})
    assert status == 400 and "messages" in body["error"]["message"]
    # Unknown fields are ignored; the server still answers.
    r = c.completions.create(model=name, prompt="hi", max_tokens=3, extra_body={"frobnicate": 1})
    assert r.usage.completion_tokens >= 1
    assert served.engine.error is None


def test_api_key(served):
    server, thread, url = start_http(create_app(served.engine, served.tok, model_name=served.name, context=CONTEXT,
                                                api_key="sekret"))
    try:
        for key in ("wrong", None):
            status, _, body = post(url, "/v1/completions", {"prompt": "hi", "max_tokens": 2},
                                   {"Authorization": f"Bearer {key}"} if key else {})
            assert status == 401 and body["error"]["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
        ok = openai.OpenAI(base_url=url + "/v1", api_key="sekret", max_retries=0)
        assert ok.completions.create(model=served.name, prompt="hi", max_tokens=2).usage.completion_tokens >= 1
    finally:
        server.should_exit = True
        thread.join(30)


def test_full_queue_gets_429_with_retry_after(served):
    body = {"model": served.name, "prompt": "a b c", "max_tokens": 16, "ignore_eos": True}
    with futures.ThreadPoolExecutor(100) as pool:
        results = list(pool.map(lambda _: post(served.url, "/v1/completions", body), range(100)))
    codes = [s for s, _, _ in results]
    assert set(codes) <= {200, 429} and codes.count(429) > 0 and codes.count(200) >= SLOTS + QUEUE, codes
    for s, h, b in results:
        if s == 429:
            assert h.get("retry-after") == "1" and b["error"]["code"] == "rate_limit_exceeded"
        else:
            assert b["usage"]["completion_tokens"] == 16
    assert post(served.url, "/v1/completions", body)[0] == 200


def test_disconnect_mid_stream_frees_and_resets_the_slot(served):
    stream = served.client.completions.create(model=served.name, prompt="Tell me", max_tokens=80, stream=True,
                                              temperature=0, extra_body={"ignore_eos": True})
    for i, chunk in enumerate(stream):
        if i == 2:
            break
    stream.close()
    rid = chunk.id
    deadline = time.time() + 60
    while not (served.engine.stats()["active"] == 0 and all(
            not np.any(x) for s in range(SLOTS) for x in served.engine.p.row(s))):
        assert time.time() < deadline, served.engine.stats()
        time.sleep(0.1)
    # The request was cancelled before its 80 tokens, and the server still serves.
    assert [(r, n < 80) for i, r, n in served.engine.finished_log if i == rid] == [("cancelled", True)]
    assert served.client.completions.create(model=served.name, prompt="hi", max_tokens=2).usage.completion_tokens


def test_chat_stop_seed_metrics(served):
    c, name, tok = served.client, served.name, served.tok
    msgs = [{"role": "user", "content": "say <|im_end|> twice <|im_assistant|>"}]
    ids = chat_ids(tok, msgs)
    assert ids == render(tok, msgs)[0]            # the special strings stayed text
    chunks = list(c.chat.completions.create(model=name, messages=msgs, max_tokens=5, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].usage.prompt_tokens == len(ids)
    full = c.chat.completions.create(model=name, messages=msgs, max_tokens=5, temperature=0)
    assert full.choices[0].message.content == "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    # A stop string cuts the text right before it.
    base = c.completions.create(model=name, prompt="abc", max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
    text = base.choices[0].text
    cut = next(i for i in range(3, len(text) - 2) if text[i:i + 2].strip() and text.find(text[i:i + 2]) == i)
    stopped = c.completions.create(model=name, prompt="abc", max_tokens=20, temperature=0, stop=[text[cut:cut + 2]],
                                   extra_body={"ignore_eos": True})
    assert stopped.choices[0].text == text[:cut] and stopped.choices[0].finish_reason == "stop"
    # Sampling with a seed is reproducible.
    kw = dict(model=name, prompt="abc", max_tokens=12, temperature=1.0, top_p=0.9, seed=7)
    assert c.completions.create(**kw).choices[0].text == c.completions.create(**kw).choices[0].text
    assert urlget(served.url, "/health") == "ok"
    metrics = urlget(served.url, "/metrics")
    for name in ("k3jax_queue_length", "k3jax_active_slots", "k3jax_output_tokens_per_second",
                 "k3jax_time_to_first_token_seconds_bucket"):
        assert name in metrics
    count = next(l for l in metrics.splitlines() if l.startswith("k3jax_time_to_first_token_seconds_count"))
    assert float(count.split()[-1]) >= 1


def test_tool_choice_named_on_the_model(served):
    """tool_choice names a function: the prompt gets the section and call header as forced tokens
    (usage counts them), and streaming and non-streaming return the same parsed message. The
    untrained model's arguments decide the outcome: a call, or (never closed) the forced text back
    as content with finish_reason unchanged and the failure counted."""
    from k3jax.data import toolcalls

    c, name, tok = served.client, served.name, served.tok
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "w"}]    # short: 96-token context
    tools = [{"type": "function", "function": {"name": "f"}}]
    kw = dict(model=name, messages=msgs, tools=tools, max_tokens=6, temperature=0,
              tool_choice={"type": "function", "function": {"name": "f"}})
    g = toolcalls.Grammar.of(tok)
    head = g.section_open() + g.call_header("functions.f:0")

    def failures():
        return sum(float(line.split()[-1]) for line in urlget(served.url, "/metrics").splitlines()
                   if line.startswith("k3jax_tool_call_parse_failures_total{"))
    before = failures()
    full = c.chat.completions.create(**kw)
    assert full.usage.prompt_tokens == len(chat_ids(tok, msgs, tools=tools)) + len(head)
    chunks = list(c.chat.completions.create(stream=True, **kw))
    choice = full.choices[0]
    calls = [tc for ch in chunks for tc in (ch.choices[0].delta.tool_calls or [])]
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks)
    if choice.finish_reason == "tool_calls":
        assert [t.function.name for t in choice.message.tool_calls] == ["f"]
        assert calls[0].id == choice.message.tool_calls[0].id == "functions.f:0"
    else:
        assert choice.finish_reason in ("length", "stop") and not calls and not choice.message.tool_calls
        assert choice.message.content == text and text.startswith(tok.decode(head))
        assert failures() == before + 2
    assert chunks[-1].choices[0].finish_reason == choice.finish_reason
    for bad, param in (({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
                       ({"logit_bias": {"3": 5}}, "logit_bias")):
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(**dict(kw, **bad))
        assert e.value.body["param"] == param


def urlget(url, path):
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    conn.request("GET", path)
    return conn.getresponse().read().decode()


class _ByteTok:
    """Token i is the i-th entry of a byte table (stands in for the tokenizer's decode_bytes)."""

    def __init__(self, pieces):
        self.pieces = pieces

    def decode_bytes(self, ids):
        return b"".join(self.pieces[i] for i in ids)


@pytest.mark.parametrize("stops,tokens,want,hit", [
    ((), [0, 1, 2], "ab\u00e9", False),                      # é split over two tokens
    (("b\u00e9",), [0, 1, 2, 3], "a", True),                  # stop spans three tokens
    (("xyz",), [0, 3, 4], "a" + "cx", False),                # a held-back prefix released at the end
    (("cx",), [3, 4, 0], "", True),
])
def test_text_state_stops_and_utf8(stops, tokens, want, hit):
    from k3jax.data.reply_text import TextState
    tok = _ByteTok([b"a", b"b\xc3", b"\xa9", b"c", b"x"])
    ts = TextState(tok, stops)
    out, ended = "", False
    for t in tokens:
        piece, ended = ts.add(t)
        out += piece
        if ended:
            break
    if not ended:
        out += ts.finish()
    assert (out, ended) == (want, hit)


def test_wire_round_trip():
    from k3jax.serve.pod import Step, Wire
    rng = np.random.default_rng(0)
    w = Wire(slots=4, max_chunk=16, rows=3)
    dec = Step.decode(rng.integers(0, 500, 4), rng.integers(0, 90, 4), [True, False, True, True],
                      rng.random(4), [0, 3, 0, 40], [1.0, 0.9, 0.5, 1.0], [0, 2**32 - 1, 7, 123456789], [0, 5, 1, 2],
                      [-1, 0, 5 << 20 | 163587, 1 << 20 | 3])
    pre = Step.prefill(3, rng.integers(0, 500, 11), 32, 0.7, 5, 0.95, 2**31 + 5, 9, 1 << 20 | 489)
    cache_steps = [Step.ints("save_block", 1, 48, 7), Step.ints("save_state", 2, 2**31 - 1), Step.ints("drop", 5),
                   Step.ints("load_block", 3, 0, 9), Step.ints("load_state", 0, 8)]
    lp = Step.prefill_lp(1, rng.integers(0, 500, 16), 16, 0.0, 0, 1.0, 3, 0, rng.integers(0, 500, 15), ban=488)
    rows = Step.prefill_rows([2, 0], [rng.integers(0, 500, 16), rng.integers(0, 500, 5)], [0, 48], [0.0, 0.8],
                             [0, 7], [1.0, 0.9], [2**32 - 1, 4], [0, 3], [-1, 2 << 20 | 17])
    multi = Step.decode(*dec.args, kind="decode_steps")
    for step in (dec, multi, pre, lp, rows, Step.reset(2), Step.ints("copy", 1, 3), Step("noop"), Step("stop"), *cache_steps):
        back = w.unpack(w.pack(step))
        assert back.kind == step.kind and len(back.args) == len(step.args)
        for a, b in zip(back.args, step.args):
            for x, y in (zip(a, b) if isinstance(b, list) else [(a, b)]):   # prefill_rows: a list of chunks
                np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def metric(url, name) -> float:
    line = next(l for l in urlget(url, "/metrics").splitlines() if l.startswith(name + " "))
    return float(line.split()[-1])


def greedy_run(served, ids, max_tokens=8):
    """A greedy completion of token ids -> (token ids, their logprobs [n], top-5 logprobs [n, 5])."""
    r = served.client.completions.create(model=served.name, prompt=ids, max_tokens=max_tokens, temperature=0,
                                         logprobs=5, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    lp = r.choices[0].logprobs
    tops = [sorted(t.values(), reverse=True) for t in lp.top_logprobs]
    return [int(t.split(":")[1]) for t in lp.tokens], np.asarray(lp.token_logprobs), np.asarray(tops)


def assert_same(label, got, want):
    assert got[0] == want[0], f"{label}: tokens {got[0]} vs {want[0]}"
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-7, err_msg=label)
    np.testing.assert_allclose(got[2], want[2], rtol=1e-5, atol=1e-7, err_msg=label)


def test_decode_buckets_give_the_same_logprobs(served):
    """A request decoded alone (bucket 2, one padding row) and among 7 others (bucket 8)."""
    rng = np.random.default_rng(11)
    ids = [int(x) for x in rng.integers(0, served.tok.n_base, 5)]
    alone = greedy_run(served, ids, 12)
    others = [[int(x) for x in rng.integers(0, served.tok.n_base, 4)] for _ in range(SLOTS - 1)]
    with futures.ThreadPoolExecutor(SLOTS) as pool:
        busy = [pool.submit(greedy_run, served, o, 40) for o in others]
        time.sleep(0.5)
        together = pool.submit(greedy_run, served, ids, 12).result()
        [f.result() for f in busy]
    assert max(len(rows) for _, rows in served.engine.decode_log) > 2     # the bucket of 8 ran
    assert_same("alone vs together", together, alone)


def test_prefix_cache_hit_restores_and_prefills_the_rest(served):
    eng, url, n = served.engine, served.url, served.tok.n_base
    rng = np.random.default_rng(7)
    ints = lambda k: [int(x) for x in rng.integers(0, n, k)]  # noqa: E731
    shared = ints(3 * CHUNK)
    a, b = shared + ints(5), shared + ints(9)    # 3 usable blocks each: the entry sits at 48 tokens
    c = shared[:2 * CHUNK] + ints(CHUNK + 5)     # shares 2 blocks, but no KDA snapshot there
    cache, eng.prefix = eng.prefix, None         # fresh prefills: the same programs, no cache
    try:
        fresh = {k: greedy_run(served, p) for k, p in (("a", a), ("b", b))}
    finally:
        eng.prefix = cache
    names = ("hits", "misses", "reused_tokens")
    before = {k: metric(url, f"k3jax_prefix_cache_{k}_total") for k in names}
    first = greedy_run(served, a)                # miss; saves blocks 0-2 and the snapshot at 48
    assert_same("a, miss", first, fresh["a"])
    assert_same("b, restored 48 tokens", greedy_run(served, b), fresh["b"])
    assert_same("a again, restored 48 tokens", greedy_run(served, a), fresh["a"])
    greedy_run(served, c)
    after = {k: metric(url, f"k3jax_prefix_cache_{k}_total") for k in names}
    assert {k: after[k] - before[k] for k in names} == {"hits": 2, "misses": 2, "reused_tokens": 6 * CHUNK}
    assert metric(url, "k3jax_prefix_cache_bytes") == cache.bytes > 0


def test_prefix_cache_snapshot_at_a_turn_boundary(served):
    """Two chats sharing a long system prompt and asking different questions: the second diverges
    inside the first's last cached block, and still restores the shared system turn from the
    snapshot kept at its end (rounded down to a block), with the same reply as the cache off."""
    eng, url = served.engine, served.url
    system = {"role": "system", "content": " ".join(f"rule {i}: be brief." for i in range(3))}
    asks = [[system, {"role": "user", "content": q}] for q in ("What is two plus two?", "Name a colour.")]
    cache = eng.prefix
    sys_len = len(chat_ids(served.tok, [system], add_generation_prompt=False))
    assert sys_len >= 2 * CHUNK and all(len(chat_ids(served.tok, a)) < CONTEXT for a in asks)

    def reply(msgs):
        r = served.client.chat.completions.create(model=served.name, messages=msgs, max_tokens=6, temperature=0)
        return r.choices[0].message.content

    eng.prefix = None
    try:
        fresh = [reply(a) for a in asks]
    finally:
        eng.prefix = cache
    before = metric(url, "k3jax_prefix_cache_reused_tokens_total")
    assert reply(asks[0]) == fresh[0]
    assert metric(url, "k3jax_prefix_cache_reused_tokens_total") == before         # the first: a miss
    assert reply(asks[1]) == fresh[1]
    reused = metric(url, "k3jax_prefix_cache_reused_tokens_total") - before
    assert reused == sys_len // CHUNK * CHUNK > 0, (reused, sys_len)


def test_prefix_cache_evicts_the_least_recently_used(served):
    eng, url, n = served.engine, served.url, served.tok.n_base
    rng = np.random.default_rng(8)
    a, b = ([int(x) for x in rng.integers(0, n, 2 * CHUNK + 3)] for _ in range(2))
    cache, capacity = eng.prefix, eng.prefix.capacity
    cache.capacity = 2 * cache.block_bytes + cache.state_bytes      # one two-block entry
    try:
        ev0 = metric(url, "k3jax_prefix_cache_evictions_total")
        first = greedy_run(served, a)
        assert len(cache.entries) == 1 and len(eng.p.store) == 3    # what was cached before is evicted
        greedy_run(served, b)                                         # evicts a's entry
        reused = metric(url, "k3jax_prefix_cache_reused_tokens_total")
        assert_same("a after its eviction", greedy_run(served, a), first)
        assert metric(url, "k3jax_prefix_cache_reused_tokens_total") == reused   # a missed
        assert metric(url, "k3jax_prefix_cache_evictions_total") - ev0 >= 2
        assert len(eng.p.store) == 3 and cache.bytes <= cache.capacity
    finally:
        cache.capacity = capacity


def test_prefix_cache_index():
    from k3jax.serve.prefix_cache import PrefixCache, chain_keys
    toks = list(range(40))
    assert chain_keys(toks, 8, 3) == chain_keys(toks + [1, 2], 8, 3)
    assert chain_keys(toks, 8, 3)[:1] == chain_keys(toks, 8, 3, media=[(9, b"img")])[:1]
    assert chain_keys(toks, 8, 3)[1:] != chain_keys(toks, 8, 3, media=[(9, b"img")])[1:]   # the chain carries it
    pc = PrefixCache(capacity=250, block=8, block_bytes=10, state_bytes=100)
    s1 = pc.plan_save(toks[:17])            # blocks 0-1 + snapshot at 16
    s2 = pc.plan_save(toks[:25])            # shares blocks 0-1, adds block 2 + snapshot at 24
    assert (s1.tokens, len(s1.blocks), s2.tokens, len(s2.blocks)) == (16, 2, 24, 1) and pc.bytes == 230
    assert pc.lookup(toks[:24]).tokens == 16 and pc.lookup(toks[:30]).tokens == 24
    assert pc.lookup([99] + toks[1:30]) is None
    s3 = pc.plan_save([5] * 9)              # needs 110 bytes: evicts the LRU entry (16), keeps shared blocks
    assert s3.evicted == 1 and s3.drops == [s1.state] and pc.lookup(toks[:30]).tokens == 24
    assert pc.plan_save(list(range(300))) is None     # larger than the whole cache: not saved


@pytest.mark.parametrize("overrides,message", [
    (["serve_decode_buckets=[2,4]"], "ending with serve_max_batch=8"),
    (["serve_decode_buckets=[8,2]"], "increasing distinct"),
    (["serve_decode_buckets=[0,8]"], "in 1..serve_max_batch"),
    (["serve_prefill_chunk=16", "serve_prefix_block=24"], "serve_prefix_block=24: must be a multiple of serve_prefill_chunk=16"),
])
def test_serve_cache_config_errors(overrides, message):
    with pytest.raises(C.ConfigError, match=message.replace("[", r"\[").replace(".", r"\.")):
        C.load(C.REPO_CONFIGS / "base.yml", ["serve_max_batch=8", *overrides])


def choice_ids(resp):
    """Each choice's token ids (return_tokens_as_token_ids), by index."""
    return [[int(t.split(":")[1]) for t in c.logprobs.tokens] for c in sorted(resp.choices, key=lambda c: c.index)]


def test_n_choices(served):
    """n=3: the copies share the prompt's prefill (a slot copy), then sample with their own seeds."""
    c, rng = served.client, np.random.default_rng(21)
    ids = [int(x) for x in rng.integers(0, served.tok.n_base, 2 * CHUNK + 3)]
    kw = dict(model=served.name, prompt=ids, max_tokens=6, n=3, seed=7, temperature=1.0, logprobs=1,
              extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True})
    a, b = c.completions.create(**kw), c.completions.create(**kw)
    assert [x.index for x in a.choices] == [0, 1, 2] and choice_ids(a) == choice_ids(b)
    assert len({tuple(t) for t in choice_ids(a)}) == 3                  # sampled: different choices
    assert (a.usage.prompt_tokens, a.usage.completion_tokens) == (len(ids), 18)
    streamed = {i: [] for i in range(3)}
    for chunk in c.completions.create(stream=True, **kw):
        for x in chunk.choices:
            streamed[x.index] += [int(t.split(":")[1]) for t in x.logprobs.tokens] if x.logprobs else []
    assert [streamed[i] for i in range(3)] == choice_ids(a)
    g = c.completions.create(**{**kw, "temperature": 0})
    assert choice_ids(g)[0] == choice_ids(g)[1] == choice_ids(g)[2]    # greedy copies are identical
    one = greedy_run(served, ids, 6)
    np.testing.assert_allclose([x.logprobs.token_logprobs for x in g.choices], [one[1]] * 3, rtol=1e-5, atol=1e-6)
    # chat: each choice parsed on its own; streaming equals the JSON body
    msgs = [{"role": "user", "content": "count to three"}]
    ck = dict(model=served.name, messages=msgs, max_tokens=5, n=2, seed=3, extra_body={"ignore_eos": True})
    full = c.chat.completions.create(**ck)
    parts = {0: "", 1: ""}
    for chunk in c.chat.completions.create(stream=True, **ck):
        for x in chunk.choices:
            parts[x.index] += x.delta.content or ""
    assert [parts[0], parts[1]] == [x.message.content for x in full.choices]
    assert full.usage.completion_tokens == 10 and served.engine.error is None


def test_echo_prompt_logprobs_equal_the_forward(served):
    """echo + logprobs (lm-eval's log-likelihood request): every prompt token's log-probability and
    top alternatives, equal to a forward over the same ids; max_tokens=0 returns only the prompt's."""
    ids = [int(x) for x in np.random.default_rng(8).integers(0, served.tok.n_base, 2 * CHUNK + 7)]
    status, _, body = post(served.url, "/v1/completions", {"model": served.name, "prompt": [ids], "echo": True,
                                                           "logprobs": 3, "max_tokens": 0, "temperature": 0,
                                                           "return_tokens_as_token_ids": True})
    assert status == 200, body
    ch = body["choices"][0]
    lp = ch["logprobs"]
    assert [int(t.split(":")[1]) for t in lp["tokens"]] == ids and ch["text"] == served.tok.decode(ids)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None and lp["text_offset"][0] == 0
    assert body["usage"]["completion_tokens"] == 0 and ch["finish_reason"] == "length"
    ref = np.asarray(nnx.jit(lambda m, t: jax.nn.log_softmax(m(t)[0][0]))(served.model, jax.numpy.asarray([ids])))
    np.testing.assert_allclose(lp["token_logprobs"][1:], ref[np.arange(len(ids) - 1), ids[1:]], atol=1e-4)
    tops = np.asarray([sorted(t.values(), reverse=True) for t in lp["top_logprobs"][1:]])
    np.testing.assert_allclose(tops, -np.sort(-ref[:-1], axis=-1)[:, :3], atol=1e-4)
    # lm-eval's batches: several prompts in one request, choice p for prompt p (ids[:10] is a prefix of ids)
    status, _, two = post(served.url, "/v1/completions", {"model": served.name, "prompt": [ids, ids[:10]], "echo": True,
                                                          "logprobs": 3, "max_tokens": 1, "temperature": 0})
    assert status == 200 and [x["index"] for x in two["choices"]] == [0, 1]
    assert two["usage"] == {"prompt_tokens": len(ids) + 10, "completion_tokens": 2, "total_tokens": len(ids) + 12}
    got = [x["logprobs"]["token_logprobs"] for x in two["choices"]]
    assert len(got[0]) == len(ids) + 1 and len(got[1]) == 11 and got[1][0] is None
    np.testing.assert_allclose(got[0][1:-1], lp["token_logprobs"][1:], atol=1e-6)
    np.testing.assert_allclose(got[1][1:-1], ref[np.arange(9), ids[1:10]], atol=1e-4)
    # a text prompt with a completion: the prompt's entries, then the completion's; text = prompt + completion
    text = "The quick brown fox jumps over the lazy dog"
    r = served.client.completions.create(model=served.name, prompt=text, echo=True, logprobs=2, max_tokens=3,
                                         temperature=0, extra_body={"ignore_eos": True})
    n = len(served.tok.encode(text))
    assert r.choices[0].text.startswith(text) and len(r.choices[0].logprobs.tokens) == n + 3
    assert r.choices[0].logprobs.text_offset[n] == len(text) and r.usage.completion_tokens == 3


def test_tokenizer_routes_round_trip(served):
    url, tok = served.url, served.tok
    text = "Hello, world: tokens and back."
    status, _, body = post(url, "/tokenize", {"prompt": text})
    assert status == 200 and body["tokens"] == tok.encode(text) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == CONTEXT
    assert post(url, "/detokenize", {"tokens": body["tokens"]})[2] == {"prompt": text}
    msgs = [{"role": "user", "content": "hi"}]
    status, _, body = post(url, "/tokenize", {"messages": msgs, "add_generation_prompt": True})
    assert status == 200 and body["tokens"] == chat_ids(tok, msgs)
    info = json.loads(urlget(url, "/tokenizer_info"))
    assert info["vocab_size"] == tok.vocab_size and info["eos_token_id"] == tok.eos_id
    assert post(url, "/tokenize", {"prompt": info["eos_token"]})[2]["tokens"] == [tok.eos_id]   # lm-eval's EOS lookup
    assert post(url, "/detokenize", {"tokens": [tok.vocab_size]})[0] == 400
    assert post(url, "/tokenize", {})[0] == 400


def test_lm_eval_harness_as_a_client(served, tmp_path):
    """lm-eval's local-completions (each choice's log-likelihood = a forward within 1e-4) and
    local-chat-completions (generate_until to completion) on local tasks: tests/lm_eval_client.py."""
    check_lm_eval(served, tmp_path, CONTEXT)
