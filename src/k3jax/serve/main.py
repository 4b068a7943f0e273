"""OpenAI-compatible server with continuous batching:
``python -m k3jax.serve configs/base.yml load_parameters_path=... serve_port=8000``.

Keys: serve_host, serve_port, serve_max_batch (slots), serve_max_queue, serve_prefill_chunk, serve_prefill_batch,
serve_decode_steps, serve_max_decode_wait, serve_api_key, serve_decode_buckets, serve_prefix_block, serve_prefix_cache_bytes,
serve_image_url_domains, serve_image_max_bytes, serve_image_fetch_timeout_s (chat image_url parts on a vision
model); each slot holds
max_target_length tokens (prompt + completion). The tokenizer is the checkpoint's (``tokenizer_path``
or the one recorded with it); chat prompts use its family's chat format (K3's own, rendered natively,
or the checkpoint's K2-family template). SIGTERM (or Ctrl-C)
drains: no new connections, running and queued requests finish, exit 0.
Several processes (``enable_distributed=true``, e.g. scripts/local_pod.sh) serve as one: process 0
runs HTTP and the scheduler and broadcasts each step's inputs, every process runs the step.
See docs/serving.md.
"""
from __future__ import annotations

import signal
import sys

import jax
import uvicorn

from k3jax.cli import run_tool
from k3jax.data.media import media_token_ids
from k3jax.data.vision_processor import from_config
from k3jax.inference.programs import Programs
from k3jax.runtime import load_tokenizer
from k3jax.serve.api import create_app
from k3jax.serve.engine import Engine
from k3jax.serve.metrics import ServeMetrics
from k3jax.serve.pod import follow
from k3jax.sharding import make_mesh
from k3jax.state import load_model


def build(cfg, mesh=None):
    """-> (engine, app, metrics) for ``cfg``: the model restored and its programs compiled (the engine
    thread is not started). ``mesh`` defaults to every device (``make_mesh(cfg)``)."""
    sv = cfg.serve
    tok = load_tokenizer(cfg)
    mesh = make_mesh(cfg) if mesh is None else mesh
    model = load_model(cfg, mesh)
    images = None
    if cfg.vision.vision_enabled:
        images = {"pcfg": from_config(cfg), "pad_id": media_token_ids(tok)[2], "domains": tuple(sv.serve_image_url_domains),
                  "max_bytes": sv.serve_image_max_bytes, "timeout": sv.serve_image_fetch_timeout_s}
    programs = Programs(model, mesh, slots=sv.serve_max_batch, length=cfg.train.max_target_length,
                        chunk=sv.serve_prefill_chunk, decode_sizes=sv.serve_decode_buckets,
                        prefix_block=(sv.serve_prefix_block or sv.serve_prefill_chunk) if sv.serve_prefix_cache_bytes else 0,
                        media=(images["pcfg"], images["pad_id"]) if images else None,
                        prefill_rows=sv.serve_prefill_batch, decode_steps=sv.serve_decode_steps)
    programs.warm()     # every bucket now: no request waits on a compile
    engine = Engine(programs, tok, max_queue=sv.serve_max_queue, stop_ids=(tok.eos_id, tok.im_end_id),
                    prefix_cache_bytes=sv.serve_prefix_cache_bytes, max_decode_wait=sv.serve_max_decode_wait)
    metrics = ServeMetrics(engine.stats)
    engine.metrics = metrics
    app = create_app(engine, tok, model_name=cfg.model_name, context=cfg.train.max_target_length,
                     api_key=sv.serve_api_key, metrics=metrics, images=images)
    return engine, app, metrics


def _run(cfg) -> int:
    engine, app, _ = build(cfg)
    if jax.process_index() != 0:    # a pod: process 0 serves HTTP and sends each step; the others run it
        return follow(engine.p, engine.link)
    engine.start()
    sv = cfg.serve
    print(f"serving {cfg.model_name} on http://{sv.serve_host}:{sv.serve_port}/v1 "
          f"({sv.serve_max_batch} slots of {cfg.train.max_target_length} tokens)", file=sys.stderr, flush=True)
    # uvicorn's own SIGTERM/SIGINT handling is the drain: it stops listening, lets every open request
    # finish (the engine keeps generating for them), then returns and re-raises the signal into the
    # handler that was there before it. For SIGTERM that is this no-op, so a drained server exits 0.
    signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        uvicorn.run(app, host=sv.serve_host, port=sv.serve_port, log_level="warning", timeout_graceful_shutdown=None)
    finally:
        engine.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_tool("serve", _run, argv, __doc__, local_devices=True)
