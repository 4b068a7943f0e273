"""Images in the server (k3jax.serve.media, Programs.vision / prefill_media): chat image_url parts as
base64 data: URIs and as URLs from a local HTTP server on 127.0.0.1, against decode's images= (the
CLI in process); a different image changes the first token; the prefix cache keys on the image
content; two image sizes after start compile nothing; each misuse is one HTTP 400. One tiny vision
server (a K3 with one MLA layer, the tiny tower, random weights) for the whole module; 28x28 images."""
import base64
import http.server
import importlib
import io
import threading
import time
import types

import jax
import numpy as np
import openai
import pytest
from PIL import Image

from k3jax import config as C
from k3jax.serve.main import build
from k3jax.serve.api import create_app
from k3jax.serve.pod import Step, Wire
from k3jax.sharding import make_mesh

from test_serve import post, start_http

REPO = C.REPO_CONFIGS.parent
TOK = REPO / "data" / "demo" / "tokenizer"
# the text model and tower of tests/test_vision_model.py; patch buckets 16 (a 28x28 image: 4 patches)
# and 32 (84x56: 24 patches), so the two sizes run different tower programs
VISION = ["model_name=tiny", "vocab_size=1024", f"tokenizer_path={TOK}", "num_layers=1", "mla_extra_layers=[0]",
          "first_k_dense=1", "attn_res=false", "max_target_length=128", "vision_enabled=true",
          "vision_patch_buckets=[16,32]", "vision_attention_block=16", "vision_max_images=2"]
CHUNK = 32
MAX_BYTES = 16384
SERVE = [f"serve_prefill_chunk={CHUNK}", "serve_max_batch=2", "serve_decode_buckets=[2]", "serve_max_queue=4",
         "serve_image_url_domains=[127.0.0.1]", f"serve_image_max_bytes={MAX_BYTES}", "serve_image_fetch_timeout_s=1"]
TEXT = "Describe this picture in a few words, please, and say what colours you see in it."


def png(seed, w=28, h=28) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def data_uri(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


class Files(http.server.BaseHTTPRequestHandler):
    """/img/NAME: a stored file; /big: more than MAX_BYTES without a Content-Length; /slow: a body
    that trickles past the fetch timeout."""
    files: dict = {}

    def do_GET(self):  # noqa: N802
        if self.path == "/slow":
            self.send_response(200)
            self.send_header("Content-Length", "4000")
            self.end_headers()
            for _ in range(40):      # 100 bytes every 0.1 s: 4 s in all, the limit is 1 s
                try:
                    self.wfile.write(b"x" * 100)
                    self.wfile.flush()
                except OSError:
                    return
                time.sleep(0.1)
            return
        body = png(9, 100, 100) if self.path == "/big" else self.files.get(self.path)
        if body is None:
            self.send_error(404)
            return
        self.send_response(200)
        if self.path != "/big":
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_):
        pass


@pytest.fixture(scope="module")
def vs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("images")
    images = {"a": png(0), "b": png(1), "wide": png(2, 84, 56)}
    for name, data in images.items():
        (tmp / f"{name}.png").write_bytes(data)
        Files.files[f"/img/{name}.png"] = data
    files = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Files)
    threading.Thread(target=files.serve_forever, daemon=True).start()
    cfg = C.load(C.REPO_CONFIGS / "base.yml", VISION + SERVE)
    engine, app, metrics = build(cfg, make_mesh(cfg, jax.devices()[:1]))
    engine.start()
    server, thread, url = start_http(app)
    # the same engine behind the app a text-only model gets (build() with vision_enabled=false)
    text_server, text_thread, text_url = start_http(create_app(engine, engine.tok, model_name=cfg.model_name,
                                                               context=128))
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    yield types.SimpleNamespace(cfg=cfg, engine=engine, metrics=metrics, url=url, text_url=text_url, client=client,
                                tmp=tmp, images=images, files=f"http://127.0.0.1:{files.server_address[1]}")
    for s, t in ((server, thread), (text_server, text_thread)):
        s.should_exit = True
        t.join(30)
    engine.stop(30)
    files.shutdown()


def ask(vs, urls, max_tokens=1, text=TEXT):
    """A greedy chat request with the images first -> (token ids, first token's top log-probabilities)."""
    content = [{"type": "image_url", "image_url": {"url": u}} for u in urls] + [{"type": "text", "text": text}]
    r = vs.client.chat.completions.create(model=vs.cfg.model_name, messages=[{"role": "user", "content": content}],
                                          max_tokens=max_tokens, temperature=0, logprobs=True, top_logprobs=20,
                                          extra_body={"return_tokens_as_token_ids": True})
    lp = r.choices[0].logprobs.content
    ids = [int(t.token.split(":")[1]) for t in lp]
    return ids, {int(t.token.split(":")[1]): t.logprob for t in lp[0].top_logprobs}


def reused(vs) -> float:
    return vs.metrics.registry.get_sample_value("k3jax_prefix_cache_reused_tokens_total")


def test_decode_equals_the_server_as_data_uri_and_as_url(vs, capsys):
    """decode images=[a.png] chat=true (the CLI in process) prints what the server generates for the
    same image sent as a data: URI and as a URL of the local file server."""
    argv = [str(C.REPO_CONFIGS / "base.yml"), *VISION, "chat=true", "stream=false", "max_new_tokens=6",
            f"prompt={TEXT}", f"images=[{vs.tmp / 'a.png'}]"]
    assert importlib.import_module("k3jax.decode").main(argv) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[-1].startswith("prefill ")
    decoded = "\n".join(printed[:-1])
    stops = vs.engine.stop_ids
    for url in (data_uri(vs.images["a"]), f"{vs.files}/img/a.png"):
        ids, lp = ask(vs, [url], max_tokens=6)
        assert TEXT + vs.engine.tok.decode([t for t in ids if t not in stops]) == decoded, url[:40]
        # the first token's log-probabilities equal the whole-prompt forward with the image spliced
        # (K3Model.hidden(media=)) to 1e-5: the image moves them by ~4e-4, so a missed splice fails
        want = _forward_logprobs(vs, vs.images["a"])
        assert max(abs(v - want[t]) for t, v in lp.items()) < 1e-5


def _forward_logprobs(vs, *images: bytes) -> np.ndarray:
    """log-softmax of the next token after the chat prompt with these images, by one model forward."""
    import jax.numpy as jnp
    from flax import nnx

    from k3jax.data.chat_template import chat_ids
    from k3jax.data.vision_processor import from_config, process_image
    from k3jax.data.media import media_inputs
    pcfg = from_config(vs.cfg)
    items = [process_image(Image.open(io.BytesIO(d)), pcfg) for d in images]
    content = [{"type": "image"}] * len(items) + [{"type": "text", "text": TEXT}]
    toks = np.array([chat_ids(vs.engine.tok, [{"role": "user", "content": content}],
                              media=[it.prompt for it in items])], np.int32)
    model = nnx.merge(vs.engine.p.gdef, *vs.engine.p.state)
    mi = media_inputs(model.vision.vision_tower.vcfg, pcfg, items, toks, vs.engine.p.media_pad)
    logits = nnx.jit(lambda m, t, media: m(t, media=media)[0][:, -1])(model, jnp.asarray(toks), mi.arrays())
    return np.asarray(jax.nn.log_softmax(logits[0]))


def test_prefix_cache_keys_on_the_image(vs):
    """Same text, another image: no cached state is shared, and the first token's log-probabilities
    differ; the same image again restores its prefix (pads included: the tower does not run)."""
    from k3jax.data.chat_template import chat_ids
    from k3jax.data.vision_processor import from_config, process_image
    item = process_image(Image.open(io.BytesIO(vs.images["a"])), from_config(vs.cfg))
    content = [{"type": "image"}, {"type": "text", "text": TEXT}]
    ids = chat_ids(vs.engine.tok, [{"role": "user", "content": content}], media=[item.prompt])
    cached = (len(ids) - 1) // CHUNK * CHUNK     # the cache's entry: full blocks before the last token
    assert ids.index(vs.engine.p.media_pad) < cached, "the test's prompt must put the image in a cached block"
    a, b = data_uri(vs.images["a"]), data_uri(vs.images["b"])
    _, lp_a = ask(vs, [a])
    start, runs = reused(vs), vs.engine.tower_runs
    _, lp_a2 = ask(vs, [a])
    assert reused(vs) - start == cached and vs.engine.tower_runs == runs
    _, lp_b = ask(vs, [b])
    assert reused(vs) - start == cached, "the other image reused the first image's cached state"
    assert vs.engine.tower_runs == runs + 1
    _, lp_b2 = ask(vs, [b])
    assert reused(vs) - start == 2 * cached
    def gap(x, y):
        common = set(x) & set(y)
        assert len(common) >= 10
        return max(abs(x[t] - y[t]) for t in common)

    # restored from the cache = prefilled (1e-5, the server's bound); the image moves them (4.4e-4 here)
    same, other = max(gap(lp_a, lp_a2), gap(lp_b, lp_b2)), gap(lp_a, lp_b)
    assert same < 1e-5 and other > 1e-4, (same, other)


def test_two_image_sizes_after_start_compile_nothing(vs):
    """A 28x28 and an 84x56 image (patch buckets 16 and 32, both compiled at start): no compilation
    and no tracing while they are served (jax.monitoring's compile and trace events)."""
    events = []

    def listener(name, *_, **__):
        if "compile" in name or "trace" in name:
            events.append(name)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        small, _ = ask(vs, [data_uri(png(5))], max_tokens=3)
        wide, _ = ask(vs, [data_uri(vs.images["wide"])], max_tokens=3)
        both, _ = ask(vs, [f"{vs.files}/img/a.png", data_uri(vs.images["wide"])], max_tokens=3)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert not events, events
    assert len(small) == len(wide) == len(both) == 3


def test_requests_admitted_together_share_one_tower_call(vs):
    """Two image requests (one 28x28 image, one 28x28 + one 84x56) admitted in the same engine
    iteration go through the tower in one call, and each one's first-token log-probabilities equal
    the whole-prompt forward with its own images to 1e-5 (its rows sliced from the shared output at
    its own offset; a wrong offset hands it the other request's image, which moves them by ~4e-4,
    see test_prefix_cache_keys_on_the_image)."""
    import queue

    from k3jax.data.chat_template import chat_ids
    from k3jax.data.vision_processor import from_config, process_image
    from k3jax.serve.engine import Request
    from k3jax.serve.media import media_keys
    pcfg, tok, pad = from_config(vs.cfg), vs.engine.tok, vs.engine.p.media_pad

    def request(images, sink):     # fresh images (seeds 11-13): none is in the prefix cache
        items = [process_image(Image.open(io.BytesIO(d)), pcfg) for d in images]
        content = [{"type": "image"}] * len(items) + [{"type": "text", "text": TEXT}]
        ids = chat_ids(tok, [{"role": "user", "content": content}], media=[it.prompt for it in items])
        return Request(prompt=ids, max_tokens=3, sink=sink, temperature=0.0, logprobs=20, images=tuple(items),
                       media=media_keys(ids, items, pad))

    def answer(events: queue.Queue):
        ids, first = [], None
        while True:
            ev = events.get(timeout=120)
            ids += ev.tokens
            if first is None and ev.logprobs:
                first = {i: v for i, _, v in ev.logprobs[0]["top"]}
            if ev.finish_reason is not None:
                return ids, first

    sets = [[png(11)], [png(12), png(13, 84, 56)]]
    together = [queue.Queue() for _ in sets]
    runs, reqs = vs.engine.tower_runs, vs.engine.tower_requests
    with vs.engine._cv:            # the engine thread admits both at its next iteration
        for images, q in zip(sets, together):
            vs.engine.submit(request(images, q.put))
    got = [answer(q) for q in together]
    assert (vs.engine.tower_runs - runs, vs.engine.tower_requests - reqs) == (1, 2)
    for images, (ids, first) in zip(sets, got):
        want = _forward_logprobs(vs, *images)
        assert len(ids) == 3 and max(abs(v - want[t]) for t, v in first.items()) < 1e-5


def _chat(url, parts):
    return post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": parts}], "max_tokens": 2})


def _img(u):
    return {"type": "image_url", "image_url": {"url": u}}


@pytest.mark.parametrize("case,code,fragment", [
    ("other-host", "image_url_not_allowed", "'localhost' is not in serve_image_url_domains"),
    ("too-large-data", "image_too_large", f"over serve_image_max_bytes={MAX_BYTES}"),
    ("too-large-url", "image_too_large", f"over serve_image_max_bytes={MAX_BYTES}"),
    ("too-slow", "image_fetch_timeout", "not fetched within serve_image_fetch_timeout_s=1"),
    ("unreadable", "invalid_image", "unreadable image"),
    ("not-base64", "invalid_image", "not valid base64"),
    ("missing", "image_fetch_failed", "HTTP 404"),
    ("too-many", "too_many_images", "over vision_max_images=2"),
    ("too-many-patches", "images_too_large", "48 patches, over the 32"),
    ("text-model", "images_not_supported", "vision_enabled=false"),
])
def test_image_mistakes_are_one_400(vs, case, code, fragment):
    port = vs.files.rsplit(":", 1)[1]
    parts = {"other-host": [_img(f"http://localhost:{port}/img/a.png")],
             "too-large-data": [_img(data_uri(png(9, 100, 100)))],
             "too-large-url": [_img(f"{vs.files}/big")],
             "too-slow": [_img(f"{vs.files}/slow")],
             "unreadable": [_img(data_uri(b"this is not an image"))],
             "not-base64": [_img("data:image/png;base64,@@@@")],
             "missing": [_img(f"{vs.files}/img/none.png")],
             "too-many": [_img(data_uri(vs.images["a"]))] * 3,
             "too-many-patches": [_img(data_uri(vs.images["wide"]))] * 2,
             "text-model": [_img(data_uri(vs.images["a"]))]}[case] + [{"type": "text", "text": "hi"}]
    t0 = time.perf_counter()
    status, _, body = _chat(vs.text_url if case == "text-model" else vs.url, parts)
    assert status == 400, body
    err = body["error"]
    assert err["code"] == code and fragment in err["message"] and "\n" not in err["message"], err
    assert time.perf_counter() - t0 < 3.5      # the slow fetch is cut at its 1 s limit


def test_prefill_media_step_crosses_the_wire():
    """The pod's step encoding carries a media prefill chunk (its image rows' id and first row)."""
    wire = Wire(2, CHUNK)
    step = Step.prefill_media(1, [5, 6, 7], 40, 0.5, 3, 0.9, 1234, 2, key=7, first=3)
    got = wire.unpack(wire.pack(step))
    assert got.kind == "prefill_media" and got.args[0] == 1 and list(got.args[1]) == [5, 6, 7]
    assert got.args[2:] == step.args[2:]
    drop = wire.unpack(wire.pack(Step.ints("drop_media", 7)))
    assert (drop.kind, drop.args) == ("drop_media", (7,))


def test_tower_step_crosses_the_wire():
    """The pod's tower step: the vector carries the media id, the bucket and each image's grid and
    token count, the patches go as one [bucket, patch_dim] array; the followers' images equal the
    sender's (a 28x28 and an 84x56 image, 4 + 24 patches in the 32 bucket)."""
    from k3jax.data.vision_processor import from_config, process_image
    pcfg = from_config(C.load(C.REPO_CONFIGS / "base.yml", VISION))
    items = [process_image(Image.open(io.BytesIO(png(0))), pcfg), process_image(Image.open(io.BytesIO(png(2, 84, 56))), pcfg)]
    wire = Wire(2, CHUNK, media_items=2, patch_dim=pcfg.patch_dim)
    step = Step.vision(5, 32, items)
    head = wire.unpack(wire.pack(step))
    assert head.args == (5, 32, ((1, 2, 2, 1), (1, 4, 6, 6)))
    payload = wire.payload(step, 32)
    assert payload.shape == (32, pcfg.patch_dim) and not payload[28:].any()
    got = wire.attach(head, payload)
    assert got.args[:2] == (5, 32)
    for a, b in zip(got.args[2], items):
        assert (a.grid_thw, a.tokens) == (tuple(b.grid_thw), b.tokens)
        np.testing.assert_array_equal(a.patches, b.patches)
    with pytest.raises(ValueError, match="a tower step of 3 images; the wire holds 2"):
        wire.pack(Step.vision(5, 32, items + items[:1]))


@pytest.mark.parametrize("arg,fragment", [
    ("serve_image_url_domains=[http://a.example.com]", "without scheme, port or path"),
    ("serve_image_max_bytes=0", "serve_image_max_bytes=0: must be >= 1"),
    ("serve_image_fetch_timeout_s=0", "serve_image_fetch_timeout_s=0.0: must be > 0"),
])
def test_image_key_mistakes(arg, fragment):
    with pytest.raises(C.ConfigError, match=fragment.replace("[", r"\[")):
        C.load(C.REPO_CONFIGS / "base.yml", VISION + [arg])


def test_allowed_hosts():
    from k3jax.serve.media import host_allowed
    assert host_allowed("img.example.com", [".example.com"]) and host_allowed("Example.COM.", ["example.com"])
    assert not host_allowed("example.com", [".example.com"]) and not host_allowed("evil-example.com", ["example.com"])
    assert not host_allowed("127.0.0.1", [])


def test_a_pod_of_two_processes_serves_images_like_one(vs, tmp_path):
    """``k3jax.serve`` as a pod of 2 processes x 1 device (scripts/local_pod.sh; the weights split over
    both, so every process must run each tower step): image requests (one 28x28, one 84x56, two
    images at once) give the in-process server's tokens and log-probabilities (1e-5), and the pod
    stops cleanly on SIGTERM."""
    import os
    import signal
    import sys

    from test_serve_cli import free_port, start
    reqs = [[vs.images["a"]], [vs.images["wide"]], [vs.images["b"], vs.images["a"]]]
    port = free_port()
    pod, log = start(["bash", "scripts/local_pod.sh", "2", "1", sys.executable, "-m", "k3jax.serve",
                      str(C.REPO_CONFIGS / "base.yml"), *VISION, *SERVE, f"serve_port={port}"], port, tmp_path)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=300)
        for imgs in reqs:
            want = ask(vs, [data_uri(d) for d in imgs], max_tokens=4)
            got = ask(types.SimpleNamespace(client=client, cfg=vs.cfg), [data_uri(d) for d in imgs], max_tokens=4)
            assert got[0] == want[0]
            assert max(abs(v - want[1][t]) for t, v in got[1].items()) < 1e-5
        pod.send_signal(signal.SIGTERM)
        assert pod.wait(120) == 0, open(log).read()[-4000:]
        assert "Traceback" not in open(log).read()
    finally:
        if pod.poll() is None:
            os.killpg(pod.pid, signal.SIGKILL)
