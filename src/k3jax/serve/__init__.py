"""OpenAI-compatible server with continuous batching:
``python -m k3jax.serve configs/base.yml load_parameters_path=... serve_port=8000`` (main.py: the
tool, its keys in its docstring).

prefix_cache.py  the prefix cache's index (hash-chained blocks, KDA snapshots, LRU)
media.py     chat image_url parts: data: URIs and allowed http(s) URLs -> processed images, digests
engine.py    the queue, the slots and the scheduler thread (continuous batching)
protocol.py  OpenAI request / response bodies
api.py       create_app: the FastAPI app (its state, routes, error handlers)
state.py     ServerState: what every route reads (engine, tokenizer, settings), held on the app
routes_chat.py  POST /v1/chat/completions: the chat prompt, tool choice, images
routes.py    the other routes: completions, models, health, metrics, tokenize / detokenize
reply.py     a request's choices through the engine: submit, then stream or collect the answer
metrics.py   Prometheus metrics
pod.py       steps as fixed-size vectors, broadcast from process 0; the other processes' loop
main.py      the tool: build (model, programs, engine, app) and run
The device side (slot cache, compiled programs, sampling) is k3jax.inference; the reply parsers
(detokenisation with stop strings, K2-family and K3 tool calls and thinking) are k3jax.data's
reply_text, toolcalls and k3_toolcalls, which RL's rewards read too. See docs/serving.md.
"""
