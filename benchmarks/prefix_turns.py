"""Prefix cache at turn boundaries: chats sharing a long system prompt + tool list, each asking a
different short question, against a server with the prefix cache on and one with it off.

Makes a random-weight checkpoint of --config (``serve.make_checkpoint``), then for each server
(``serve_prefix_cache_bytes`` default vs 0, the same settings otherwise): one warm-up chat with its
own question (fills the cache), then --questions chats one after another, each streamed, greedy,
--new-tokens tokens. The shared prefix (the system turn with the declared tools) is at least
--system-len tokens. The questions diverge right after the system turn, inside the block a cached
prompt's last snapshot covers, so only a snapshot at the system turn's end can serve them. Reported per server: median / min / max time to
first token; for the cache on: the share of the shared prefix each request restored (reused
tokens / shared prefix tokens, from /metrics), and whether every reply equals the cache-off one.

    .venv/bin/python benchmarks/prefix_turns.py                          # small, 32 questions
    .venv/bin/python benchmarks/prefix_turns.py --config tiny --questions 8
Results: stdout table and benchmarks/results/prefix_turns.json (--out to change).
"""
from __future__ import annotations

import argparse
import os
import re
import tempfile
import time
import urllib.request

from common import machine, print_table, result_path, write_json
from serve import make_checkpoint, start_server   # runs common.cpu_only() before jax is imported

import numpy as np  # noqa: E402
import openai  # noqa: E402

from k3jax import config as C  # noqa: E402
from k3jax.data.chat_template import chat_ids  # noqa: E402
from k3jax.runtime import load_tokenizer  # noqa: E402

TOOLS = [{"type": "function", "function": {"name": f"tool_{i}", "description": f"does thing number {i}",
                                           "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}}
         for i in range(4)]
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def reused(port) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
    return float(re.search(r"^k3jax_prefix_cache_reused_tokens_total (\S+)$", text, re.M)[1])


def run(args, work, a, system, questions, cache: bool) -> dict:
    extra = ["serve_prefill_batch=1"] + ([] if cache else ["serve_prefix_cache_bytes=0"])
    proc, port = start_server(args, 2, a.context, a.prefill_chunk, os.path.join(work, f"turns-{cache}.log"), extra)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=3600)
        name = client.models.list().data[0].id
        ttft, replies, shares = [], [], []
        for i, q in enumerate(questions):
            msgs = [{"role": "system", "content": system}, {"role": "user", "content": q}]
            before = reused(port) if cache else 0.0
            t0 = time.perf_counter()
            first, text = None, ""
            for chunk in client.chat.completions.create(model=name, messages=msgs, tools=TOOLS, stream=True,
                                                        max_tokens=a.new_tokens, temperature=0):
                d = chunk.choices[0].delta if chunk.choices else None
                if first is None and d is not None and (d.content or getattr(d, "reasoning_content", None)
                                                        or d.tool_calls):
                    first = time.perf_counter()
                for c in chunk.choices:
                    text += c.delta.content or ""
            if i:                                          # the first (warm-up) fills the cache
                ttft.append((first or time.perf_counter()) - t0)
                replies.append(text)
                if cache:
                    shares.append(reused(port) - before)
    finally:
        proc.terminate()
        proc.wait(600)
    return {"ttft": ttft, "replies": replies, "reused": shares}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="small")
    p.add_argument("--questions", type=int, default=32)
    p.add_argument("--system-len", type=int, default=1000, help="tokens of the shared prefix: system turn + tools")
    p.add_argument("--new-tokens", type=int, default=4)
    p.add_argument("--prefill-chunk", type=int, default=128)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--out", default=result_path("prefix_turns"))
    a = p.parse_args(argv)
    work = tempfile.mkdtemp(prefix="k3jax-prefix-turns-")
    args, ckpt = make_checkpoint(a.config, work)
    args = [*args, f"load_parameters_path={ckpt}"]
    tok = load_tokenizer(C.load(overrides=args))
    rng = np.random.default_rng(0)
    words = []

    def prefix_len():
        return len(chat_ids(tok, [{"role": "system", "content": " ".join(words)}], tools=TOOLS,
                            add_generation_prompt=False))
    while prefix_len() < a.system_len:
        words += [str(w) for w in rng.choice(WORDS, max(1, (a.system_len - prefix_len()) // 2))]
    system = " ".join(words)
    questions = [f"Question {i}: what is {rng.choice(WORDS)} plus {rng.choice(WORDS)}?" for i in range(a.questions + 1)]
    shared = len(chat_ids(tok, [{"role": "system", "content": system}], tools=TOOLS, add_generation_prompt=False))
    on = run(args, work, a, system, questions, True)
    off = run(args, work, a, system, questions, False)
    share = [r / shared for r in on["reused"]]
    rows = [{"cache": name, "requests": len(r["ttft"]), "ttft_p50_ms": 1e3 * float(np.median(r["ttft"])),
             "ttft_min_ms": 1e3 * min(r["ttft"]), "ttft_max_ms": 1e3 * max(r["ttft"])}
            for name, r in (("on", on), ("off", off))]
    rows[0]["reuse_min"] = min(share)
    rows[0]["reuse_p50"] = float(np.median(share))
    rows[0]["speedup_p50"] = rows[1]["ttft_p50_ms"] / rows[0]["ttft_p50_ms"]
    same = on["replies"] == off["replies"]
    print(f"shared prefix (system turn + {len(TOOLS)} tools): {shared} tokens; block = chunk = {a.prefill_chunk}; "
          f"replies with the cache equal those without: {same}")
    print_table(rows, [("cache", "cache", ""), ("requests", "requests", "d"), ("TTFT p50 ms", "ttft_p50_ms", ".0f"),
                       ("min", "ttft_min_ms", ".0f"), ("max", "ttft_max_ms", ".0f"),
                       ("reused share p50", "reuse_p50", ".3f"), ("min", "reuse_min", ".3f"),
                       ("TTFT off/on", "speedup_p50", ".1f")])
    write_json(a.out, {"machine": machine(), "args": vars(a), "shared_tokens": shared, "same_replies": same,
                       "rows": rows, "reused": on["reused"]})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
