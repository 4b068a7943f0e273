"""The inference core (k3jax.inference): it reproduces the left-padded path it replaced (tokens and
log-probabilities recorded in tests/assets/decode_golden.npz), matches a full forward, continues a
live slot as if the whole conversation had been prefilled, reports the log-probabilities of the
distribution it sampled from, and takes new weights from another sharding without compiling
anything, after which the prefix cache restores nothing computed with the old ones.

One tiny K3 and one set of programs (two slots, 4 decode steps per call, a prefix block of 16)
serve the module's tests."""
import importlib.util
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import randomize
from k3jax import config as C
from k3jax import model as M
from k3jax import sharding as S
from k3jax.inference.generate import Generator, Sampling, generator_for, programs_for
from k3jax.inference.programs import Programs
from k3jax.runtime import load_tokenizer
from k3jax.serve.engine import Engine, Request
from k3jax.state import init_state

REPO = C.REPO_CONFIGS.parent
ASSET = REPO / "tests" / "assets" / "decode_golden.npz"
ARGS = ["model_name=tiny", "vocab_size=1024", f"tokenizer_path={REPO / 'data' / 'demo' / 'tokenizer'}",
        "max_target_length=64"]


def _goldens_script():
    spec = importlib.util.spec_from_file_location("make_decode_goldens", REPO / "scripts" / "make_decode_goldens.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def core():
    cfg = C.load(C.REPO_CONFIGS / "base.yml", ARGS)
    model = randomize(M.build(cfg, 0))
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape((1,) * len(S.MESH_AXES)), S.MESH_AXES)
    progs = Programs(model, mesh, slots=2, length=64, chunk=16, prefill_rows=2, decode_steps=4, prefix_block=16)
    progs.warm()
    return cfg, model, progs


def _forward_logprobs(model, seq):
    logits, _ = nnx.jit(lambda m, t: m(t))(model, jnp.asarray([seq], jnp.int32))
    return np.asarray(jax.nn.log_softmax(logits[0].astype(jnp.float32), -1))


def test_core_reproduces_the_left_padded_path():
    """Greedy tokens of a mixed-length batch and of two image prompts equal those the left-padded
    prefill + while_loop decode gave (recorded before it was replaced), log-probabilities within
    1e-5: the chunked prefill into per-row slots (no padding) computes the same thing."""
    g = _goldens_script()
    want = np.load(ASSET)
    model, prompts = g.text_case()
    res = generator_for(model, prompts, g.TEXT_NEW).run(prompts, max_new_tokens=g.TEXT_NEW)
    np.testing.assert_array_equal(res.tokens, want["text_tokens"])
    np.testing.assert_allclose(res.logprobs, want["text_logprobs"], atol=1e-5, rtol=0)
    assert (res.sampled_logprobs == 0).all()        # greedy: a point mass
    vmodel, cases, pad, pcfg = g.vision_case()
    for (ids, items), tok, lp in zip(cases, want["vision_tokens"], want["vision_logprobs"]):
        gen = generator_for(vmodel, [ids], g.VISION_NEW, media=items, media_pad_id=pad, processor=pcfg)
        res = gen.run([ids], max_new_tokens=g.VISION_NEW, media=[items])
        np.testing.assert_array_equal(res.tokens[0], tok)
        np.testing.assert_allclose(res.logprobs[0], lp, atol=1e-5, rtol=0)


def test_generation_matches_a_full_forward_and_stops_on_device(core):
    """Every generated token's log-probability equals the full forward's over prompt + tokens
    (1e-4); a row stopped by a stop id mid-call keeps -1 after the stop and its slot holds exactly
    its tokens (``pos``), and the next call reuses the programs (no compile)."""
    cfg, model, progs = core
    gen = Generator(progs)
    rng = np.random.default_rng(0)
    prompts = [list(map(int, rng.integers(5, 1000, n))) for n in (21, 9)]
    res = gen.run(prompts, max_new_tokens=7)
    for p, toks, lps in zip(prompts, res.tokens, res.logprobs):
        full = _forward_logprobs(model, p + toks.tolist())
        np.testing.assert_allclose(lps, full[np.arange(len(p) - 1, len(p) + 6), toks], atol=1e-4, rtol=0)
    row = res.tokens[0].tolist()
    k = next(i for i in range(1, 7) if row[i] not in row[:i])       # a token not sampled before it
    before = progs.compile_s
    res2 = Generator(progs).run(prompts, max_new_tokens=7, stop_ids=(row[k],))
    assert progs.compile_s == before
    assert res2.tokens[0].tolist() == row[:k + 1] + [-1] * (6 - k)
    assert res2.tokens[1].tolist() == res.tokens[1].tolist() or row[k] in res.tokens[1].tolist()


def test_a_continued_slot_equals_the_conversation_prefilled_whole(core):
    """Generate, stop on a token, append a tool result to the live slot and generate on: the tokens
    (and log-probabilities, 1e-5) equal those of the whole conversation prefilled from scratch in
    another slot."""
    _, _, progs = core
    gen = Generator(progs)
    rng = np.random.default_rng(1)
    prompt, tool = list(map(int, rng.integers(5, 1000, 12))), list(map(int, rng.integers(5, 1000, 7)))
    free = gen.run([prompt], max_new_tokens=6).tokens[0].tolist()
    k = next(i for i in range(1, 6) if free[i] not in free[:i])
    first = gen.start([0], [prompt], [Sampling()])[0]
    turn = [first[0]] + gen.decode([0], [5], stop_ids=(free[k],))[0][0]
    assert turn == free[:k + 1] and gen.pending[0] == free[k] and gen.pos[0] == len(prompt) + k
    nxt = gen.extend(0, tool)
    cont = [nxt[0]] + gen.decode([0], [4])[0][0]
    whole = prompt + turn + tool
    fresh = gen.start([1], [whole], [Sampling()])[1]
    again = [fresh[0]] + gen.decode([1], [4])[1][0]
    assert cont == again
    assert abs(nxt[1] - fresh[1]) <= 1e-5
    with pytest.raises(ValueError, match="exceed"):
        gen.extend(1, [5] * 64)


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 5, 1.0), (1.3, 0, 0.8)], ids=["topk", "topp"])
def test_behaviour_logprobs_are_the_sampled_distributions(core, temperature, top_k, top_p):
    """Sampled tokens carry log softmax(logits / T) over what top-k / top-p kept, at the token
    (numpy from the full forward's logits, 1e-4); the model log-probability stays the raw one."""
    _, model, progs = core
    gen = Generator(progs)
    prompt = list(map(int, np.random.default_rng(2).integers(5, 1000, 10)))
    res = gen.run([prompt], max_new_tokens=5, sampling=[Sampling(temperature, top_k, top_p, seed=3)])
    toks = res.tokens[0].tolist()
    logits, _ = nnx.jit(lambda m, t: m(t))(model, jnp.asarray([prompt + toks], jnp.int32))
    logits = np.asarray(logits[0], np.float64)
    for i, t in enumerate(toks):
        x = logits[len(prompt) - 1 + i] / temperature
        order = np.argsort(-x)
        keep = np.zeros(len(x), bool)
        keep[order[:top_k or len(x)]] = True
        srt = np.where(keep[order], x[order], -np.inf)
        p = np.exp(srt - srt.max())
        p /= p.sum()
        head = (np.cumsum(p) - p < top_p) & keep[order]
        cutoff = srt[head].min()
        kept = np.where(x >= cutoff, x, -np.inf)
        assert kept[t] > -np.inf, f"token {i} was outside the kept set"
        want = kept[t] - np.log(np.exp(kept[kept > -np.inf] - kept.max()).sum()) - kept.max()
        assert abs(res.sampled_logprobs[0, i] - want) <= 1e-4, (i, res.sampled_logprobs[0, i], want)
        raw = logits[len(prompt) - 1 + i]
        assert abs(res.logprobs[0, i] - (raw[t] - np.log(np.exp(raw - raw.max()).sum()) - raw.max())) <= 1e-4


def test_weight_update_from_the_fsdp_layout_compiles_nothing_and_skips_stale_prefixes(core):
    """New parameters born in the fsdp=8 training layout go into the programs (resharded) with no
    trace, lowering or compilation; the next request's log-probabilities equal fresh programs built
    on the new weights (1e-6), and a prompt the prefix cache held before the update is prefilled
    again (0 tokens restored), then cached under the new version."""
    cfg, model, progs = core
    tok = load_tokenizer(cfg)
    engine = Engine(progs, tok, max_queue=4, prefix_cache_bytes=1 << 24)
    engine.start()
    prompt = list(map(int, np.random.default_rng(4).integers(5, 1000, 40)))

    def ask():
        done, out, lps, req = threading.Event(), [], [], None

        def sink(e):
            out.extend(e.tokens)
            lps.extend(x["logprob"] for x in e.logprobs)
            if e.finish_reason:
                done.set()
        req = Request(prompt=list(prompt), max_tokens=4, sink=sink, temperature=0.0, ignore_eos=True, logprobs=0)
        engine.submit(req)
        assert done.wait(300)
        return out, np.asarray(lps), req.reused

    old = nnx.split(model, nnx.Param, ...)[1:]
    try:
        assert ask()[2] == 0 and ask()[2] == 32   # the second time its first 2 blocks come from the cache
        fsdp = S.make_mesh(C.load(C.REPO_CONFIGS / "base.yml", ARGS + ["ici_fsdp_parallelism=8"]))
        gdef, st, _ = init_state(C.load(C.REPO_CONFIGS / "base.yml", ARGS + ["ici_fsdp_parallelism=8"]), fsdp, seed=7)
        assert any(len(x.sharding.device_set) == 8 for x in jax.tree.leaves(st["params"]))
        events = []

        def listener(name, *a, **k):
            if any(w in name for w in ("trace", "lower", "compile")):
                events.append(name)
        jax.monitoring.register_event_duration_secs_listener(listener)
        jax.monitoring.register_event_listener(listener)
        try:
            assert engine.update_weights(st["params"], st["rest"]) == 1
            toks, lps, reused = ask()
        finally:
            jax.monitoring.unregister_event_duration_listener(listener)
            jax.monitoring.unregister_event_listener(listener)
        assert not events, events
        assert reused == 0
        assert ask()[2] == 32                     # cached again, under the new version
    finally:
        engine.stop(60)
        progs.update_weights(*old)
    one = jax.devices()[0]
    new_model = nnx.merge(gdef, jax.device_put(st["params"], one), jax.device_put(st["rest"], one))
    fresh = Generator(programs_for(new_model, batch=1, length=64, chunk=16, rows=1, steps=3)[0])
    want = fresh.run([prompt], max_new_tokens=4)
    assert toks == want.tokens[0].tolist()
    np.testing.assert_allclose(lps, want.logprobs[0], atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="shape"):
        bad = jax.tree.map(lambda x: jnp.zeros((3,) + x.shape[1:], x.dtype) if x.ndim else x, old[0])
        progs.update_weights(bad)
