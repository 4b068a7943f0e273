"""Make tests/assets/agent_tiny: the tiny K3-shaped model fine-tuned to call two tools by itself.

The data are synthetic tool-use conversations over two tools, `get_weather(city)` and
`get_time(city)`: a templated user question, the assistant's call whose JSON arguments name the
question's city, a `tool` message with a result, and a short assistant reply built from the result
(plus a few chats that need no tool). Choices meant to make it learnable in minutes on a CPU:
- a tokenizer learned on this domain (vocabulary 512, the shared test checkpoint's, so the served
  programs are the same; `tiny_tokenizer.build` with this corpus): every city is one token
  (` Lisbon` in the question, `Lisbon` in the JSON; asserted), as are the tool names and JSON keys;
- tools declared by name only, a one-line system prompt: a prompt is 57 tokens;
- a closed set of 8 cities; the questions the test asks (`HELD_OUT`) are phrasings x cities that
  never occur together in the fine-tuning set (asserted); two of them use phrasings never trained.
Each record carries the tools in its `tools` field, which the SFT pipeline declares as the server
declares a request's tools (the rendered prompt equals `chat_ids(..., tools=TOOLS)`: checked).

Echo turns ("Say Lima." -> "Lima", 30% of the records, same tools and system prompt) teach the one
skill the call's arguments need, copying a word of the question: in the tool conversations it is
two tokens of about thirty trained, under random temperatures and times, and without the echo turns
no run formed it (AdamW 3e-3 for 525 and 600 steps, hidden 64 for 200, Muon 0.01 for 400: the same
city whatever the question named). With them, the default run (Muon, constant learning rate 0.005,
600 steps, about 15 min on 2 busy cores) calls the right tool with the right city for all four
held-out questions and for the trained phrasings, and replies after the tool's result; the same
tiny model learns the echo alone in about 100 steps.

Then `python -m k3jax.train ... dataset_type=sft model_name=tiny` fine-tunes from random weights on
CPU, and the last step's `params` and `extra` (router biases) plus the tokenizer are copied to
--out, which the server loads with `load_parameters_path` (the tokenizer beside it is found).

    JAX_PLATFORMS=cpu nice .venv/bin/python scripts/make_agent_checkpoint.py [--steps N] [--out DIR]

``--family k3`` makes the same data in Kimi K3's own chat format (XTML, data/k3_chat.py): a tokenizer
with K3's control tokens, whose merges are also learned on the format's fixed strings (tags, the tool
declaration's and thinking-effort turn's text), so the SFT pipeline and the server render and parse
every conversation the K3 way (the demo run of the K3 format, by hand; the committed asset is K2's).

Deterministic data (seeded numpy); training on CPU varies in the last bits between runs.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
SYSTEM = "Use tools."
WARMUP = 30     # steps, whatever --steps: a shorter run is the start of a longer one
VOCAB = 512     # the shared test checkpoint's: the served programs are the same, compiled once
# Names only (OpenAI's parameters are optional): every declared token dilutes the attention that
# has to find the city in the question.
TOOLS = [{"type": "function", "function": {"name": "get_weather"}},
         {"type": "function", "function": {"name": "get_time"}}]
CITIES = ["Paris", "London", "Tokyo", "Cairo", "Lima", "Oslo", "Seoul", "Lisbon"]
ASK = {"get_weather": ["What is the weather in {c}?", "Weather in {c}?",
                       "How is the weather in {c}?", "Is it raining in {c}?"],
       "get_time": ["What time is it in {c}?", "Tell me the time in {c}.",
                    "What is the time in {c}?", "Current time in {c}?"]}
# Asked by tests/test_serve_agent.py, never in the fine-tuning set: the first two pair a trained
# phrasing with a city it is never trained with; the last two use a phrasing never trained at all.
HELD_OUT = [("What is the weather in Lisbon?", "get_weather", {"city": "Lisbon"}),
            ("What time is it in Cairo?", "get_time", {"city": "Cairo"}),
            ("Is it sunny in Oslo?", "get_weather", {"city": "Oslo"}),
            ("Do you know the time in Seoul?", "get_time", {"city": "Seoul"})]
SKIES = ["sunny", "cloudy", "rainy", "windy", "snowy"]
CHATS = [("Hello!", "Hello! Ask me about the weather or the time in a city."),
         ("Who are you?", "I can look up the weather and the time in a city."),
         ("Thanks!", "You are welcome.")]


def tool_result(name: str, rng) -> tuple[str, str]:
    """-> (the tool's JSON result, the assistant's reply template with {c})."""
    if name == "get_weather":
        temp, sky = int(rng.integers(-9, 36)), str(rng.choice(SKIES))
        return json.dumps({"temp": temp, "sky": sky}), f"It is {temp} C and {sky} in {{c}}."
    hour, minute = int(rng.integers(0, 24)), int(rng.choice([0, 15, 30, 45]))
    return json.dumps({"time": f"{hour:02d}:{minute:02d}"}), f"It is {hour:02d}:{minute:02d} in {{c}}."


def conversation(rng, echo: float = 0.0) -> dict:
    """One record: the tools; system, user, then the call, its result and the reply. With
    probability ``echo`` an echo turn instead ("Say Lima." -> "Lima"): copying a word of the
    question is the one skill the call's arguments need, and in the tool conversations it is two
    tokens of about thirty trained, under the random temperatures and times."""
    head = [{"role": "system", "content": SYSTEM}]
    if rng.random() < echo:
        c = str(rng.choice(CITIES))
        return {"tools": TOOLS, "messages": head + [{"role": "user", "content": f"Say {c}."},
                                                    {"role": "assistant", "content": c}]}
    if rng.random() < 0.08:
        ask, reply = CHATS[int(rng.integers(len(CHATS)))]
        return {"tools": TOOLS, "messages": head + [{"role": "user", "content": ask},
                                                    {"role": "assistant", "content": reply}]}
    held = {q for q, _, _ in HELD_OUT}
    while True:
        name = str(rng.choice(list(ASK)))
        c = str(rng.choice(CITIES))
        ask = str(rng.choice(ASK[name])).format(c=c)
        if ask not in held:
            break
    result, reply = tool_result(name, rng)
    call_id = f"functions.{name}:0"
    return {"tools": TOOLS, "messages": head + [
        {"role": "user", "content": ask},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps({"city": c})}}]},
        {"role": "tool", "tool_call_id": call_id, "content": result},
        {"role": "assistant", "content": reply.format(c=c)}]}


def corpus(records: list[dict], family: str = "k2") -> str:
    """The text the tokenizer's merges are learned on: the conversations' strings, plus each city
    in both of its forms often enough that it becomes one token (K3: and the format's own strings,
    as the renderer writes them with the markers left out)."""
    parts = []
    if family == "k3":
        from k3jax.data import k3_chat
        for r in records[:200]:
            parts += [v for kind, v, _ in k3_chat.segments(r["messages"], tools=r["tools"],
                                                           add_generation_prompt=False) if kind == "text"]
    for r in records:
        parts += ["tool_declare", json.dumps(r["tools"])]     # the declaration turn's strings
        for m in r["messages"]:
            parts.append(m.get("name") or m["role"])
            parts.append(m.get("content") or "")
            for t in m.get("tool_calls", []):
                parts += [t["id"], t["function"]["arguments"]]
    parts += [f"in {c}, \"{c}\"" for c in CITIES for _ in range(240)]
    return "\n".join(parts)


def check_tokens(tok_dir: Path, record: dict, family: str = "k2") -> None:
    """Every city is one token in both forms; the training rendering of a record starts with the
    server's prompt (chat_ids with tools=); prints the lengths."""
    from k3jax.data import sft
    from k3jax.data.chat_template import chat_ids
    from k3jax.data.tokenizer import KimiTokenizer
    tok = KimiTokenizer.from_dir(tok_dir)
    if family == "k3":
        from k3jax.data import k3_chat
        assert k3_chat.is_k3(tok), "the K3 tokenizer lacks K3's markers"
    split = {c: (len(tok.encode(" " + c)), len(tok.encode(c))) for c in CITIES}
    assert all(v == (1, 1) for v in split.values()), f"cities split into several tokens: {split}"
    served = chat_ids(tok, record["messages"][:2], tools=TOOLS)
    full, mask = sft.conversation_to_example(tok, sft.record_to_messages(record, "messages"))
    assert list(full[:len(served)]) == served and not mask[:len(served)].any(), \
        "the SFT rendering of a record with tools does not start with the server's prompt"
    print(f"prompt {len(served)} tokens; one conversation {len(full)} tokens, {int(mask.sum())} trained")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--examples", type=int, default=4000)
    ap.add_argument("--lr", type=float, default=5e-3)
    ap.add_argument("--echo", type=float, default=0.3, help="fraction of echo turns in the fine-tuning set")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--work", default="runs/agent-tiny")
    ap.add_argument("--out", default="tests/assets/agent_tiny")
    ap.add_argument("--data-only", action="store_true", help="write the data and tokenizer, do not train")
    ap.add_argument("--family", choices=("k2", "k3"), default="k2",
                    help="chat format of the tokenizer and so of the data: K2's markup (the asset) or K3's XTML")
    ap.add_argument("--max-target-length", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=VOCAB, help="tokenizer and model vocabulary (K3's format "
                    "compresses well with 1024: its fixed strings become a few tokens)")
    ap.add_argument("overrides", nargs="*", help="extra key=value for k3jax.train")
    a = ap.parse_args()
    os.chdir(REPO)
    # tiktoken caches every file it loads under /tmp/data-gym-cache keyed by its path, so a tokenizer
    # rewritten at the same path would be read stale: off, here and in the training process.
    os.environ["TIKTOKEN_CACHE_DIR"] = ""
    from k3jax.data import tiny_tokenizer
    work, out = Path(a.work).resolve(), Path(a.out).resolve()
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    rng = np.random.default_rng(37)
    records = [conversation(rng, a.echo) for _ in range(a.examples)]
    asked = {r["messages"][1]["content"] for r in records}
    assert not asked & {q for q, _, _ in HELD_OUT}, "a held-out question is in the fine-tuning set"
    tiny_tokenizer.build(work / "tokenizer", vocab_size=a.vocab, num_reserved=tiny_tokenizer.MIN_RESERVED,
                         corpus=corpus(records[:500], a.family), family=a.family)
    check_tokens(work / "tokenizer", next(r for r in records if len(r["messages"]) > 3), a.family)
    with open(work / "train.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    if a.data_only:
        return
    cmd = [sys.executable, "-m", "k3jax.train", "configs/base.yml", "model_name=tiny", f"vocab_size={a.vocab}",
           f"tokenizer_path={work / 'tokenizer'}", "dataset_type=sft", f"dataset_path={work / 'train.jsonl'}",
           f"max_target_length={a.max_target_length}", f"per_device_batch_size={a.batch}", f"steps={a.steps}",
           "opt_type=muon",
           f"learning_rate={a.lr}", "lr_schedule=constant", f"warmup_steps_fraction={WARMUP / a.steps}", "weight_dtype=float32",
           f"checkpoint_period={a.steps}", "log_period=25", "enable_tensorboard=false",
           "async_checkpointing=false", "peak_tflops=0.1", f"base_output_directory={work}", "run_name=sft",
           *a.overrides]
    subprocess.run(cmd, check=True, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    ckpt = work / "sft" / "checkpoints" / str(a.steps)
    for item in ("params", "extra"):    # extra: the router biases, which load_parameters_path needs
        shutil.copytree(ckpt / item, out / item)
    for name in ("_CHECKPOINT_METADATA", "commit_success.txt"):
        if (ckpt / name).exists():
            shutil.copy(ckpt / name, out / name)
    shutil.copytree(work / "tokenizer", out / "tokenizer")
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"wrote {out}: {size} bytes")


if __name__ == "__main__":
    main()
