"""Serving speed on one CPU device: the OpenAI-compatible server under concurrent load vs the
one-prompt decode CLI, on the same checkpoint.

Makes a checkpoint of --config with random weights (speed only; orbax, like a trained one) and a
tokenizer directory for its vocabulary, then:

1. the one-prompt baseline: ``python -m k3jax.decode`` on a prompt of --prompt-len tokens with
   --new-tokens new tokens, as a user would run it; its own printed prefill / decode tokens/s
   (compilation excluded);
2. ``python -m k3jax.serve`` as a subprocess (serve_max_batch = the largest concurrency), and for
   each concurrency C in --concurrency, C client threads each sending --requests-per-client
   streaming completions (random prompts of --prompt-len token ids, max_tokens = --new-tokens,
   ignore_eos so every request generates exactly that many, greedy) back to back. Per level:
   output tokens/s = all generated tokens / wall time from the first request to the last answer
   ("x CLI": over the CLI's decode tokens/s, "x CLI end to end": over the CLI's new tokens / its
   prefill + decode time); a request's decode rate = its tokens after the first / the time from its
   first to its last token, median over requests ("x CLI decode": over the CLI's decode rate);
   time to first token (request sent -> first token received) and inter-token latency (gaps
   between consecutive tokens of a request) as p50 / p99 over all requests. A warm-up request runs
   first so compilation is not measured. The server compiles decode for its default batch buckets
   (powers of two up to serve_max_batch), so each step runs the smallest that holds the load;
   the largest level is also compared with ``generate()`` on the same model in this process, one
   batch of that many of the same prompts with the same new tokens (no stop token), output tokens /
   wall time of its second call (the first compiles), run before the server starts; the 1-minute
   load average is read before and after each side;
3. the shared-prefix run (skip with --prefix-len 0): two more servers (serve_max_batch 8, a context
   for the prefix, the suffix and --prefix-new-tokens), one with the prefix cache (its default
   size) and one with serve_prefix_cache_bytes=0. Prompts are one common --prefix-len-token prefix
   plus different --suffix-len-token suffixes; after a warm-up request with its own suffix (which
   fills the cache), --prefix-requests requests run one after another and their time to first
   token is the median. Both servers' greedy tokens must be identical; the cached server's
   prefix cache lines of /metrics are printed.

    .venv/bin/python benchmarks/serve.py                     # small, concurrency 1 8 32
    .venv/bin/python benchmarks/serve.py --config tiny --concurrency 1 8
Results: stdout table and benchmarks/results/serve.json (--out to change).
"""
from __future__ import annotations

import argparse
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

from common import ROOT, cpu_only, machine, print_table, result_path, write_json

cpu_only()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from k3jax import config as C  # noqa: E402
from k3jax.checkpoint import save_weights  # noqa: E402
from k3jax.data import tiny_tokenizer  # noqa: E402
from k3jax.sharding import make_mesh  # noqa: E402
from k3jax.state import init_state  # noqa: E402

SETTINGS = ["dtype=float32", "weight_dtype=float32"]


def make_checkpoint(name: str, work: str) -> tuple[list[str], str]:
    """Random-weight checkpoint + tokenizer of config ``name`` -> (key=value args, checkpoint path)."""
    cfg = C.load(overrides=[f"model_name={name}", *SETTINGS])
    tok = tiny_tokenizer.build(os.path.join(work, "tokenizer"), vocab_size=cfg.model.vocab_size,
                               num_reserved=256 if cfg.model.vocab_size >= 4096 else tiny_tokenizer.MIN_RESERVED)
    gdef, state, _ = init_state(cfg, make_mesh(cfg, jax.devices()[:1]))
    path = save_weights(os.path.join(work, "checkpoints"), state["params"], state["rest"])
    args = [f"model_name={name}", *SETTINGS, f"tokenizer_path={tok}", f"base_output_directory={work}"]
    return args, str(path)


def run_decode_cli(args: list[str], prompt: str, new_tokens: int, context: int) -> dict:
    cmd = [sys.executable, "-m", "k3jax.decode", "configs/base.yml", *args, f"prompt={prompt}",
           f"max_new_tokens={new_tokens}", f"max_target_length={context}", "stream=false"]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=dict(os.environ))
    if p.returncode:
        raise SystemExit(f"decode failed:\n{p.stderr[-3000:]}")
    m = re.search(r"prefill ([\d.]+) tokens/s, decode ([\d.]+) tokens/s \((\d+) new tokens\)", p.stdout)
    return {"prefill_tokens_per_s": float(m[1]), "decode_tokens_per_s": float(m[2]), "new_tokens": int(m[3])}


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def start_server(args: list[str], slots: int, context: int, chunk: int, log: str, extra=()):
    port = free_port()
    cmd = [sys.executable, "-m", "k3jax.serve", "configs/base.yml", *args, f"serve_port={port}",
           f"serve_max_batch={slots}", f"serve_max_queue={4 * slots}", f"max_target_length={context}",
           f"serve_prefill_chunk={chunk}", *extra]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=dict(os.environ))
    deadline = time.time() + 3600
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited:\n{open(log).read()[-3000:]}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, port
        except OSError:
            time.sleep(1)
    raise SystemExit("server did not start")


def one_request(client, name, prompt, new_tokens) -> dict:
    """A streaming greedy completion -> send time, token arrival times, token ids."""
    t0 = time.perf_counter()
    times, ids = [], []
    for chunk in client.completions.create(model=name, prompt=prompt, max_tokens=new_tokens, stream=True,
                                           temperature=0, logprobs=0,
                                           extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True}):
        now = time.perf_counter()
        for c in chunk.choices:
            if c.logprobs is not None:
                times += [now] * len(c.logprobs.tokens)
                ids += [int(t.split(":")[1]) for t in c.logprobs.tokens]
    return {"start": t0, "times": times, "ids": ids}


def bucket_steps(args, slots: int, context: int, chunk: int, repeats: int = 5) -> list[dict]:
    """In process: ms per decode step of the server's programs with n active slots (the gather into
    bucket n and the scatter back), against ``model.decode_step`` on a cache of n rows alone (what a
    compacted batch would run; no gather), median of ``repeats`` after one warm-up."""
    from flax import nnx

    from k3jax.inference.programs import Programs
    from k3jax.state import load_model
    cfg = C.load(C.REPO_CONFIGS / "base.yml", args)
    mesh = make_mesh(cfg, jax.devices()[:1])
    model = load_model(cfg, mesh)
    progs = Programs(model, mesh, slots=slots, length=context, chunk=chunk)
    progs.warm()
    gdef, state = nnx.split(model)
    plain = jax.jit(lambda st, t, c, p: nnx.merge(gdef, st).decode_step(t, c, p, jnp.zeros_like(p)), donate_argnums=2)
    rows = []
    for n in progs.decode_sizes:
        active = np.arange(slots) < n
        z = np.zeros(slots, np.int32)
        cache = jax.tree.map(lambda s: jnp.zeros(s[0], s[1]), model.cache_spec(n, context),
                             is_leaf=lambda x: isinstance(x, tuple) and len(x) == 3 and isinstance(x[0], tuple))
        tok, pos = jnp.zeros(n, jnp.int32), jnp.full(n, 5, jnp.int32)
        g, c = [], []
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            progs.decode(z, z + 5, active, np.zeros(slots, np.float32), z, np.ones(slots, np.float32),
                         z.astype(np.uint32), z)
            g.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            logits, cache = plain(state, tok, cache, pos)
            jax.block_until_ready(logits)
            c.append(time.perf_counter() - t0)
        rows.append({"bucket": n, "gather_ms": 1e3 * float(np.median(g[1:])),
                     "contiguous_ms": 1e3 * float(np.median(c[1:]))})
    return rows


def generate_batch(args, prompts: list[list[int]], new_tokens: int, repeats: int = 1) -> dict:
    """``generate()`` on all ``prompts`` as one batch, in process: output tokens / wall seconds of the
    calls after the first (the first compiles; the others reuse its programs, compile_s 0), the
    median of ``repeats`` such calls."""
    from k3jax.inference.generate import generate
    from k3jax.state import load_model
    cfg = C.load(C.REPO_CONFIGS / "base.yml", args)
    mesh = make_mesh(cfg, jax.devices()[:1])
    model = load_model(cfg, mesh)
    load0 = os.getloadavg()[0]
    with jax.set_mesh(mesh):
        generate(model, prompts, max_new_tokens=new_tokens)
        walls = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            out, timing = generate(model, prompts, max_new_tokens=new_tokens)
            walls.append(time.perf_counter() - t0)
    wall = float(np.median(walls))
    tokens = int((out >= 0).sum())
    return {"batch": len(prompts), "output_tokens": tokens, "wall_s": wall, "output_tokens_per_s": tokens / wall,
            "output_tokens_per_s_runs": [tokens / w for w in walls],
            "prefill_s": timing["prefill_s"], "decode_s": timing["decode_s"], "compile_s": timing["compile_s"],
            "load_before": load0, "load_after": os.getloadavg()[0]}


def prefix_run(args, work, tok, a, cache: bool) -> dict:
    """The shared-prefix prompts on a server with the prefix cache on or off -> TTFT median, tokens."""
    rng = np.random.default_rng(1)
    prefix = [int(x) for x in rng.integers(0, tok.n_base, a.prefix_len)]
    prompts = [prefix + [int(x) for x in rng.integers(0, tok.n_base, a.suffix_len)]
               for _ in range(a.prefix_requests + 1)]
    context = a.prefix_len + a.suffix_len + a.prefix_new_tokens
    extra = [] if cache else ["serve_prefix_cache_bytes=0"]
    proc, port = start_server(args, 8, context, a.prefill_chunk, os.path.join(work, f"prefix-{cache}.log"), extra)
    try:
        import openai
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=3600)
        name = client.models.list().data[0].id
        one_request(client, name, prompts[0], a.prefix_new_tokens)      # warm-up (fills the cache)
        runs = [one_request(client, name, p, a.prefix_new_tokens) for p in prompts[1:]]
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
    finally:
        proc.terminate()
        proc.wait(600)
    ttft = [r["times"][0] - r["start"] for r in runs]
    return {"cache": "on" if cache else "off", "requests": len(runs), "ttft_p50_ms": 1e3 * float(np.median(ttft)),
            "ttft_min_ms": 1e3 * min(ttft), "ttft_max_ms": 1e3 * max(ttft), "ids": [r["ids"] for r in runs],
            "metrics": [line for line in metrics.splitlines()
                        if line.startswith("k3jax_prefix_cache") and "_created" not in line]}


def load_level(client, name, prompts, conc: int, per_client: int, new_tokens: int) -> dict:
    results, lock = [], threading.Lock()

    def worker(k):
        for j in range(per_client):
            r = one_request(client, name, prompts[(k * per_client + j) % len(prompts)], new_tokens)
            with lock:
                results.append(r)

    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(k,)) for k in range(conc)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ttft = [r["times"][0] - r["start"] for r in results]
    itl = [b - a for r in results for a, b in zip(r["times"], r["times"][1:])]
    pct = lambda xs, q: float(np.percentile(xs, q)) if xs else None  # noqa: E731
    tokens = sum(len(r["times"]) for r in results)
    # a request's own decode rate: its tokens after the first over the time from first to last
    decode = [(len(r["times"]) - 1) / (r["times"][-1] - r["times"][0]) for r in results if len(r["times"]) > 1]
    return {"decode_tokens_per_s_per_request": float(np.median(decode)) if decode else None,
            "concurrency": conc, "requests": len(results), "output_tokens": tokens, "wall_s": wall,
            "output_tokens_per_s": tokens / wall, "ttft_p50_ms": 1e3 * pct(ttft, 50), "ttft_p99_ms": 1e3 * pct(ttft, 99),
            "itl_p50_ms": 1e3 * pct(itl, 50), "itl_p99_ms": 1e3 * pct(itl, 99),
            "tokens_per_request_ok": all(len(r["times"]) == new_tokens for r in results),
            "load_before": load0, "load_after": os.getloadavg()[0]}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="small")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--prefill-chunk", type=int, default=128)
    p.add_argument("--no-bucket-steps", action="store_true", help="skip the in-process decode step per bucket")
    p.add_argument("--prefix-len", type=int, default=1024, help="shared prefix of the prefix run (0 = skip it)")
    p.add_argument("--suffix-len", type=int, default=32)
    p.add_argument("--prefix-requests", type=int, default=8)
    p.add_argument("--prefix-new-tokens", type=int, default=8)
    p.add_argument("--repeats", type=int, default=1, help="runs of generate() and of the largest level; the "
                   "ratio is of their medians")
    p.add_argument("--server-args", nargs="*", default=[], help="more key=value settings of the load-level server "
                   "(e.g. serve_prefill_batch=16)")
    p.add_argument("--out", default=result_path("serve"))
    a = p.parse_args(argv)
    import openai

    info = machine()
    work = tempfile.mkdtemp(prefix="k3jax-serve-bench-")
    args, ckpt = make_checkpoint(a.config, work)
    args.append(f"load_parameters_path={ckpt}")
    context = a.prompt_len + a.new_tokens
    from k3jax.data.tokenizer import KimiTokenizer
    tok = KimiTokenizer.from_dir(os.path.join(work, "tokenizer"))
    rng = np.random.default_rng(0)
    prompts = [[int(x) for x in rng.integers(0, tok.n_base, a.prompt_len)] for _ in range(64)]
    # The CLI takes text: English words until the prompt is --prompt-len tokens.
    words = "the quick brown fox jumps over the lazy dog while a cat sleeps in the warm sun".split()
    text = ""
    while len(tok.encode(text)) < a.prompt_len:
        text += words[len(text.split()) % len(words)] + " "
    cli = run_decode_cli(args, text.strip(), a.new_tokens, 4 * a.prompt_len)
    print(f"decode CLI (one prompt): prefill {cli['prefill_tokens_per_s']:.1f} tok/s, decode "
          f"{cli['decode_tokens_per_s']:.1f} tok/s", flush=True)

    steps = []
    if not a.no_bucket_steps:
        steps = bucket_steps(args, max(a.concurrency), context, a.prefill_chunk)
        print(f"\ndecode step, serve_max_batch {max(a.concurrency)}, context {context}: n active slots gathered into "
              f"bucket n vs decode_step on n contiguous rows")
        print_table(steps, [("bucket", "bucket", "d"), ("gather step ms", "gather_ms", ".1f"),
                            ("contiguous step ms", "contiguous_ms", ".1f")])
    top = max(a.concurrency)
    gen = generate_batch(args, prompts[:top], a.new_tokens, a.repeats)
    print(f"generate() batch {top}: {gen['output_tokens_per_s']:.1f} output tok/s (runs: "
          f"{', '.join(f'{x:.1f}' for x in gen['output_tokens_per_s_runs'])}; last run prefill {gen['prefill_s']:.2f} s, "
          f"decode {gen['decode_s']:.2f} s, load {gen['load_before']:.1f} -> {gen['load_after']:.1f})", flush=True)
    proc, port = start_server(args, top, context, a.prefill_chunk, os.path.join(work, "server.log"), a.server_args)
    rows = []
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=3600)
        name = client.models.list().data[0].id
        one_request(client, name, prompts[0], a.new_tokens)          # warm-up
        for conc in a.concurrency:
            runs = [load_level(client, name, prompts, conc, a.requests_per_client, a.new_tokens)
                    for _ in range(a.repeats if conc == top else 1)]
            runs.sort(key=lambda r: r["output_tokens_per_s"])
            rows.append(dict(runs[len(runs) // 2], output_tokens_per_s_runs=[r["output_tokens_per_s"] for r in runs]))
            print(f"concurrency {conc}: {rows[-1]['output_tokens_per_s']:.1f} output tok/s "
                  f"(runs: {', '.join(f'{x:.1f}' for x in rows[-1]['output_tokens_per_s_runs'])})", flush=True)
    finally:
        proc.terminate()
        proc.wait(600)
    base = cli["decode_tokens_per_s"]
    # the CLI's own end to end rate for one prompt: its new tokens over its prefill + decode time
    cli["output_tokens_per_s"] = a.new_tokens / (a.prompt_len / cli["prefill_tokens_per_s"] + a.new_tokens / base)
    for r in rows:
        r["x_decode_cli"] = r["output_tokens_per_s"] / base
        r["x_cli_end_to_end"] = r["output_tokens_per_s"] / cli["output_tokens_per_s"]
        r["x_cli_decode_per_request"] = r["decode_tokens_per_s_per_request"] / base
        r["x_generate"] = r["output_tokens_per_s"] / gen["output_tokens_per_s"] if r["concurrency"] == top else None
    print(f"\n{a.config}: prompt {a.prompt_len} tokens, {a.new_tokens} new tokens per request, one "
          f"{info['backend']} device ({info['cpu_count']} cores, load {info['load_avg_1min']:.1f}), float32; "
          f"decode CLI (one prompt) decode {base:.1f} tok/s, end to end {cli['output_tokens_per_s']:.1f} tok/s")
    print_table(rows, [("concurrency", "concurrency", "d"), ("requests", "requests", "d"),
                       ("output tok/s", "output_tokens_per_s", ".1f"), ("x CLI", "x_decode_cli", ".2f"),
                       ("x CLI end to end", "x_cli_end_to_end", ".2f"),
                       ("decode tok/s per request", "decode_tokens_per_s_per_request", ".1f"),
                       ("x CLI decode", "x_cli_decode_per_request", ".2f"), ("x generate()", "x_generate", ".2f"),
                       ("TTFT p50 ms", "ttft_p50_ms", ".0f"), ("TTFT p99 ms", "ttft_p99_ms", ".0f"),
                       ("ITL p50 ms", "itl_p50_ms", ".1f"), ("ITL p99 ms", "itl_p99_ms", ".1f"),
                       ("load before", "load_before", ".1f"), ("load after", "load_after", ".1f")])
    top_row = next(r for r in rows if r["concurrency"] == top)
    print(f"concurrency {top} vs generate() batch {top} ({gen['output_tokens_per_s']:.1f} output tok/s, the same "
          f"prompts and new tokens): {top_row['x_generate']:.2f}x")
    prefix = []
    if a.prefix_len:
        prefix = [prefix_run(args, work, tok, a, cache) for cache in (True, False)]
        same = prefix[0].pop("ids") == prefix[1].pop("ids")
        speedup = prefix[1]["ttft_p50_ms"] / prefix[0]["ttft_p50_ms"]
        print(f"\nshared prefix: {a.prefix_len}-token prefix + {a.suffix_len}-token suffixes, "
              f"{a.prefix_new_tokens} new tokens, serve_max_batch 8, chunk {a.prefill_chunk}; time to first token (warm, one request at a time) "
              f"{speedup:.1f}x faster with the cache; tokens identical: {same}")
        print_table(prefix, [("prefix cache", "cache", ""), ("requests", "requests", "d"),
                             ("TTFT p50 ms", "ttft_p50_ms", ".0f"), ("TTFT min ms", "ttft_min_ms", ".0f"),
                             ("TTFT max ms", "ttft_max_ms", ".0f")])
        print("\n/metrics of the cached server:\n" + "\n".join(prefix[0]["metrics"]))
        prefix = {"runs": prefix, "ttft_speedup": speedup, "tokens_identical": same}
    write_json(a.out, {"benchmark": "serve", "machine": info, "settings": vars(a), "decode_cli": cli,
                       "generate": gen, "levels": rows, "bucket_steps": steps, "prefix": prefix})


if __name__ == "__main__":
    main()
