"""Decode speed on one CPU device: generate() throughput, and per-token cost vs context length.

Part 1 runs `k3jax.inference.generate.generate` (chunked prefill into slots, multi-step decode calls) with
random weights (speed only) for each config and batch size, on random prompts of --prompt-len
tokens, greedy, --new-tokens new tokens per row (no stop ids, so every row runs to the end), and
reports its timing dict: prefill tokens/s (prompt tokens / prefill time) and decode tokens/s (new
tokens over all rows / decode-loop time); compilation is excluded (generate compiles first).

Part 2 times single jitted decode steps at cache lengths S in --lengths (1k/4k/16k by default)
without running a prefill of that length (too slow on CPU, and the cost of one step does not
depend on the cached values): a zero cache of the model's `cache_spec(B, S)`, writing slot S-1.
  model      the whole `model.decode_step` (all layers, MoE, lm_head)
  KDA mixer  one KDA layer's `decode` (recurrent state [B,H,K,V] + conv states): no S anywhere,
             so it must stay flat
  MLA mixer  one MLA layer's `decode` (absorbed latent attention over the [B,S,R+Rr] latent cache):
             reads the whole allocated cache, so it grows linearly in S
Part 3 is analytic: decode-cache bytes per sequence vs length, KDA vs MLA layers (as allocated,
float32), for the benchmark configs and the full-size Kimi models.

    .venv/bin/python benchmarks/decode.py                          # tiny small, batch 1 and 8
    .venv/bin/python benchmarks/decode.py --config small --lengths 1024 4096 16384 65536
    .venv/bin/python benchmarks/decode.py --config small --batch 8 --profile /tmp/prof
--profile DIR runs one more generate() per config (first --batch size) under jax.profiler.trace
(a perfetto trace under DIR/<config name or yml file stem>) and prints the top-15 ops by total time (compilation runs
on the Python thread and is left out).
Results: stdout tables and benchmarks/results/decode.json (--out to change).
"""
from __future__ import annotations

import argparse
import math
import os

from common import cpu_only, machine, median_time, print_table, profile_top_ops, result_path, write_json

cpu_only()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from k3jax import config as C  # noqa: E402
from k3jax.inference.generate import generate  # noqa: E402
from k3jax.layers.kda import kda_cache_shapes  # noqa: E402
from k3jax.layers.mla import mla_cache_shapes  # noqa: E402
from k3jax.sharding import make_mesh  # noqa: E402
from k3jax.state import init_state  # noqa: E402

SETTINGS = ["dtype=float32", "weight_dtype=float32", "scan_layers=true"]


def load(name: str, max_len: int, extra=()):
    """Config of a benchmark model; max_position_embeddings raised to cover the longest cache."""
    cfg = C.load(overrides=[f"model_name={name}", *SETTINGS, *extra])
    pos = max(cfg.model.max_position_embeddings, max_len)
    return C.load(overrides=[f"model_name={name}", *SETTINGS, *extra, f"max_position_embeddings={pos}"])


def bench_generate(cfg, mesh, model, batch: int, prompt_len: int, new_tokens: int) -> dict:
    """One generate() call on random prompts [batch, prompt_len] -> its timing dict as a row."""
    rng = np.random.default_rng(batch)
    prompts = rng.integers(1, cfg.model.vocab_size, size=(batch, prompt_len)).tolist()
    with jax.set_mesh(mesh):
        out, timing = generate(model, prompts, max_new_tokens=new_tokens)
    if out.shape != (batch, new_tokens) or (out < 0).any():
        raise RuntimeError(f"generate returned {out.shape} with stopped rows; expected every row to run")
    return {"batch": batch, "prompt_len": prompt_len, "new_tokens": new_tokens, **timing,
            "decode_ms_per_step": 1e3 * timing["decode_s"] / new_tokens}


def _zeros(spec):
    """cache_spec leaves (shape, dtype, axes) -> zero arrays (the values do not change the cost)."""
    return jax.tree.map(lambda s: jnp.zeros(s[0], s[1]), spec, is_leaf=lambda x: isinstance(x, tuple) and
                        len(x) == 3 and isinstance(x[0], tuple))


def _first_layer(model, mixer: str):
    """An unstacked (prefix or tail) decoder layer with this mixer, or None."""
    layers = (model.layer(s) for s in model.layout.sites() if not s.stacked)
    return next((layer for layer in layers if layer.mixer == mixer), None)


def _mixer_fns(model, batch: int):
    """name -> (jitted mixer decode, args builder for cache length S) for one KDA and one MLA layer."""
    m = model.cfg
    x = jax.random.normal(jax.random.key(0), (batch, m.hidden_size), jnp.float32)
    start = jnp.zeros((batch,), jnp.int32)
    fns = {}
    kda, mla = _first_layer(model, "kda"), _first_layer(model, "mla")
    if kda is not None:
        kg, ks = nnx.split(kda.self_attn)
        f = jax.jit(lambda st, x, c: nnx.merge(kg, st).decode(x, c))
        fns["kda"] = (f, lambda s: (ks, x, _zeros(kda_cache_shapes(m, batch))))
    if mla is not None:
        mg, ms = nnx.split(mla.self_attn)
        g = jax.jit(lambda st, x, c, pos, start: nnx.merge(mg, st).decode(x, c, pos, start))
        fns["mla"] = (g, lambda s: (ms, x, _zeros(mla_cache_shapes(m, batch, s)), jnp.int32(s - 1), start))
    return fns


def bench_context(cfg, mesh, model, batch: int, lengths, warmup: int, repeats: int) -> list[dict]:
    """Median ms of one decode step (whole model, one KDA mixer, one MLA mixer) per cache length."""
    gdef, state = nnx.split(model)
    step = jax.jit(lambda st, tok, cache, pos, start: nnx.merge(gdef, st).decode_step(tok, cache, pos, start))
    tok = jnp.ones((batch,), jnp.int32)
    start = jnp.zeros((batch,), jnp.int32)
    mixers = _mixer_fns(model, batch)
    rows = []
    for s in lengths:
        row = {"batch": batch, "cache_len": s}
        with jax.set_mesh(mesh):
            args = (state, tok, _zeros(model.cache_spec(batch, s)), jnp.int32(s - 1), start)
            row["model_ms"] = 1e3 * median_time(lambda: jax.block_until_ready(step(*args)),
                                                warmup=warmup, repeats=repeats)[0]
            for name, (fn, make) in mixers.items():
                margs = make(s)   # built outside the timed calls
                row[f"{name}_mixer_ms"] = 1e3 * median_time(lambda: jax.block_until_ready(fn(*margs)),
                                                            warmup=warmup, repeats=repeats)[0]
        rows.append(row)
    for r in rows:   # growth relative to the shortest cache
        for k in ("model_ms", "kda_mixer_ms", "mla_mixer_ms"):
            if k in r:
                r[k[:-3] + "_x"] = r[k] / rows[0][k]
    return rows


def cache_bytes(m, length: int) -> dict:
    """Analytic decode-cache bytes of ONE sequence at cache length ``length``, split by mixer."""
    out = {"kda": 0, "mla": 0}
    for layer in range(m.num_layers):
        kind = m.mixer(layer)
        shapes = kda_cache_shapes(m, 1) if kind == "kda" else mla_cache_shapes(m, 1, length)
        out[kind] += sum(math.prod(shape) * jnp.dtype(dt).itemsize for shape, dt, _ in shapes.values())
    return {"kda_layers": m.num_layers - len(m.mla_layer_set), "mla_layers": len(m.mla_layer_set),
            "kda_bytes": out["kda"], "mla_bytes": out["mla"], "total_bytes": out["kda"] + out["mla"]}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", nargs="+", default=["tiny", "small"])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="generate() batch sizes")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384], help="cache lengths")
    p.add_argument("--context-config", nargs="*", default=["small"], help="configs of the length sweep")
    p.add_argument("--context-batch", type=int, default=1)
    p.add_argument("--cache-lengths", type=int, nargs="+", default=[4096, 16384, 131072, 1048576],
                   help="cache lengths of the analytic cache-size table")
    p.add_argument("--cache-config", nargs="*", default=["tiny", "small", "kimi-linear-48b", "kimi-k3"],
                   help="configs of the analytic cache-size table")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=10, help="timed decode steps per length (median)")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides for every model")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="trace one more generate() per config into DIR/<config>; print the top-15 ops")
    p.add_argument("--out", default=result_path("decode"))
    a = p.parse_args(argv)
    info = machine()
    longest = max(a.lengths + [a.prompt_len + a.new_tokens])
    gen_rows, ctx_rows, models, top_ops = [], [], {}, {}

    def get(name):
        if name not in models:
            try:
                cfg = load(name, longest, a.set)
            except C.ConfigError as e:
                raise SystemExit(f"error: {name}: {e}") from None
            mesh = make_mesh(cfg, devices=jax.devices()[:1])
            gdef, state, _ = init_state(cfg, mesh)
            models[name] = (cfg, mesh, nnx.merge(gdef, state["params"], state["rest"]))
        return models[name]

    for name in a.config:
        cfg, mesh, model = get(name)
        for b in a.batch:
            gen_rows.append({"config": name, **bench_generate(cfg, mesh, model, b, a.prompt_len, a.new_tokens)})
        if a.profile:
            b = a.batch[0]
            top_ops[name] = profile_top_ops(
                lambda: bench_generate(cfg, mesh, model, b, a.prompt_len, a.new_tokens),
                os.path.join(a.profile, os.path.splitext(os.path.basename(name))[0]))
    for name in a.context_config:
        cfg, mesh, model = get(name)
        ctx_rows += [{"config": name, **r} for r in
                     bench_context(cfg, mesh, model, a.context_batch, a.lengths, a.warmup, a.repeats)]
    cache_rows = []
    for name in a.cache_config:
        m = C.load(overrides=[f"model_name={name}"]).model
        cache_rows += [{"config": name, "cache_len": s, **cache_bytes(m, s)} for s in a.cache_lengths]

    hdr = f"one {info['backend']} device ({info['cpu_count']} cores, load {info['load_avg_1min']:.1f}), float32"
    print(f"\ngenerate(): random weights, prompt {a.prompt_len} tokens, {a.new_tokens} new tokens per row, {hdr}")
    print_table(gen_rows, [("config", "config", "s"), ("batch", "batch", "d"),
                           ("prefill tok/s", "prefill_tokens_per_s", ".0f"), ("prefill s", "prefill_s", ".3f"),
                           ("decode tok/s", "decode_tokens_per_s", ".1f"),
                           ("ms/step", "decode_ms_per_step", ".2f")])
    print(f"\nOne decode step vs cache length, batch {a.context_batch}, median of {a.repeats} (ms; x = vs "
          f"{a.lengths[0]})")
    print_table(ctx_rows, [("config", "config", "s"), ("cache len", "cache_len", "d"),
                           ("model ms", "model_ms", ".2f"), ("x", "model_x", ".2f"),
                           ("KDA mixer ms", "kda_mixer_ms", ".3f"), ("x", "kda_mixer_x", ".2f"),
                           ("MLA mixer ms", "mla_mixer_ms", ".3f"), ("x", "mla_mixer_x", ".2f")])
    print("\nDecode cache per sequence (analytic, float32 as allocated), MiB")
    view = [dict(r, kda_mib=r["kda_bytes"] / 2 ** 20, mla_mib=r["mla_bytes"] / 2 ** 20,
                 total_mib=r["total_bytes"] / 2 ** 20, layers=f"{r['kda_layers']} / {r['mla_layers']}",
                 mla_share=100 * r["mla_bytes"] / r["total_bytes"]) for r in cache_rows]
    print_table(view, [("config", "config", "s"), ("KDA / MLA layers", "layers", "s"), ("cache len", "cache_len", "d"),
                       ("KDA MiB", "kda_mib", ".3f"), ("MLA MiB", "mla_mib", ".3f"),
                       ("total MiB", "total_mib", ".3f"), ("MLA %", "mla_share", ".1f")])
    write_json(a.out, {"benchmark": "decode", "machine": info, "settings": vars(a), "generate": gen_rows,
                       "context": ctx_rows, "cache_bytes": cache_rows, "top_ops": top_ops or None})


if __name__ == "__main__":
    main()
