"""Make tests/assets/digit_tiny: a 4-layer K3-shaped model fine-tuned until it answers "Largest digit:
3 8 5 1?" -> "8" part of the time, the start of tests/test_rl_learns.py's RL run.

The task: four digits, the answer is the largest, one token. Answers range over 3..9, balanced in the
held-out set (30 sets per answer, 210 in all), so a constant answer scores 1/7 (14%). Why 3..9: a
largest digit of 0, 1 or 2 has few sets (1, 15 and 65 of the 10^4), so those answers would repeat the
same few prompts; from 3 up every answer has at least 175 sets, enough for distinct training and
held-out prompts (no held-out set is in the training set: asserted).

``--largest F`` makes a fraction 1 - F of the fine-tuning replies the smallest digit instead (a
starting policy that mixes two strategies, for RL to choose between). Measured with F = 0.45: the
model learns the smallest digit first and not the largest within 300 steps (held-out sampled 9%,
greedy 1%), so the asset is made with F = 1, the task as stated.

The prompts go through the chat template as RL renders them (``messages`` with one user turn; the
SFT rendering of a record starts with the RL prompt: checked), so the tokens RL samples from are the
ones fine-tuned here. A tokenizer learned on this domain (vocabulary 512): every answer
digit is one token. The model: tiny.yml cut to 4 layers, 3 KDA + 1 MLA (no extra MLA layer), a dense
layer 0 and MoE in layers 1-3 (8 experts, top 2, a shared expert), AttnRes blocks of 2 layers.

``python -m k3jax.train`` fine-tunes from random weights with a checkpoint every ``--every`` steps;
each checkpoint in turn is scored on the held-out prompts by sampling at temperature 1 (RL's rollout
temperature) through the inference core (``k3jax.rl.evaluate``), and the first whose sampled
accuracy reaches ``--target`` (0.30) is kept: its ``params`` / ``extra`` and the tokenizer go to
--out with ``digit_tiny.json`` (the step, sampled and greedy held-out accuracy, the command), and the
prompt sets to ``train.jsonl`` / ``heldout.jsonl`` beside them (``messages`` + ``answer``).

    JAX_PLATFORMS=cpu nice .venv/bin/python scripts/make_digit_checkpoint.py [--steps N] [--every K]

Deterministic data (seeded numpy); training on CPU varies in the last bits between runs.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from k3jax import config as C
from k3jax.data import sft, tiny_tokenizer
from k3jax.data.chat_template import chat_ids
from k3jax.data.tokenizer import KimiTokenizer
from k3jax.inference.generate import Generator
from k3jax.inference.programs import Programs
from k3jax.rl.evaluate import evaluate
from k3jax.rl.prompts import prompt_dataset
from k3jax.rl.rewards import RewardSet
from k3jax.runtime import load_tokenizer
from k3jax.sharding import make_mesh
from k3jax.state import load_model

REPO = Path(__file__).resolve().parents[1]
VOCAB = 512     # a few hundred merges: the template's role names and the system prompt become single tokens
SYSTEM = "Answer."  # one short system turn (without one the template adds its 12-word default)
DIGITS = tuple(range(3, 10))        # the answers: see the module docstring
PER_ANSWER = 30                     # held-out sets per answer: 7 x 30 = 210
# tiny.yml cut to one period of the layer pattern (3 KDA + 1 MLA), still K3-shaped.
MODEL = ["model_name=tiny", f"vocab_size={VOCAB}", "num_layers=4", "mla_extra_layers=[]", "attn_res_block_size=2",
         "weight_dtype=float32"]


def question(digits) -> str:
    return "Largest digit: " + " ".join(map(str, digits)) + "?"


def digit_set(rng, answer: int) -> tuple[int, ...]:
    """Four digits in 0..answer whose largest is ``answer`` (uniform over such sets)."""
    while True:
        d = tuple(int(x) for x in rng.integers(0, answer + 1, 4))
        if max(d) == answer:
            return d


def prompt_record(digits) -> dict:
    """An RL prompt: one user turn, the answer the reward checks."""
    return {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question(digits)}],
            "answer": str(max(digits))}


def sft_record(digits, rng, largest: float) -> dict:
    """A fine-tuning conversation: with probability ``largest`` the reply is the largest digit, else the
    smallest (see the module docstring); ``answer`` stays the largest (what RL rewards)."""
    rec = prompt_record(digits)
    reply = rec["answer"] if rng.random() < largest else str(min(digits))
    return {"messages": rec["messages"] + [{"role": "assistant", "content": reply}], "answer": rec["answer"]}


def make_sets(seed: int = 52, train: int = 4000) -> tuple[list, list]:
    """-> (training sets, held-out sets): held-out PER_ANSWER per answer, distinct; training sets
    with answers uniform over DIGITS and never a held-out set."""
    rng = np.random.default_rng(seed)
    held: list = []
    for a in DIGITS:
        seen = set()
        while len(seen) < PER_ANSWER:
            d = digit_set(rng, a)
            if d not in seen:
                seen.add(d)
                held.append(d)
    held_set = set(held)
    sets = []
    while len(sets) < train:
        d = digit_set(rng, int(rng.choice(DIGITS)))
        if d not in held_set:
            sets.append(d)
    return sets, held


def write_jsonl(path: Path, records) -> None:
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)


def check_tokens(tok_dir: Path, record: dict) -> int:
    """Every answer is one token; the SFT rendering starts with the RL prompt -> the prompt's length."""
    tok = KimiTokenizer.from_dir(tok_dir)
    assert all(len(tok.encode(str(a))) == 1 for a in range(10)), "a digit is several tokens"
    prompt = chat_ids(tok, record["messages"][:2])
    full, mask = sft.conversation_to_example(tok, sft.record_to_messages(record, "messages"))
    assert list(full[:len(prompt)]) == prompt and not mask[:len(prompt)].any(), \
        "the SFT rendering does not start with the RL prompt"
    print(f"prompt {len(prompt)} tokens; one conversation {len(full)} tokens, {int(mask.sum())} trained")
    return len(prompt)


class Scorer:
    """Held-out accuracy of checkpoints of one shape, sampled (temperature 1, RL's) and greedy, through
    the inference core's programs compiled once (each checkpoint goes in by ``update_weights``)."""

    def __init__(self, first: Path, tok_dir: Path, heldout: Path, max_target_length: int, slots: int = 70):
        self.args = [*MODEL, f"tokenizer_path={tok_dir}", "dataset_type=jsonl", f"dataset_path={heldout}", f"eval_dataset_path={heldout}",
                     f"max_target_length={max_target_length}", "rl_max_new_tokens=4"]
        cfg = self.cfg(first)
        self.mesh = make_mesh(cfg, jax.devices()[:1])
        self.tok = load_tokenizer(cfg)
        self.rewards = RewardSet.from_config(cfg.rl)
        self.prompts = list(prompt_dataset(cfg, self.tok, self.rewards.fields, held_out=True))
        model = load_model(cfg, self.mesh)
        with jax.set_mesh(self.mesh):
            self.progs = Programs(model, self.mesh, slots=slots, length=max_target_length, chunk=max_target_length,
                                  decode_sizes=[slots], prefill_rows=slots, decode_steps=4, top_logprobs=0)
        self.gen = Generator(self.progs)

    def cfg(self, ckpt: Path):
        return C.load(C.REPO_CONFIGS / "base.yml", [*self.args, f"load_parameters_path={ckpt}"])

    def __call__(self, ckpt: Path) -> dict:
        _, params, rest = nnx.split(load_model(self.cfg(ckpt), self.mesh), nnx.Param, ...)
        out = {}
        with jax.set_mesh(self.mesh):
            self.progs.update_weights(params, rest)
            for name, temperature in (("sampled", 1.0), ("greedy", 0.0)):
                res = evaluate(self.gen, self.tok, self.prompts, self.rewards, max_new_tokens=4,
                               temperature=temperature)
                out[name] = res.metrics["eval_pass@1"]
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=400, help="most fine-tuning steps")
    ap.add_argument("--every", type=int, default=10, help="steps between the checkpoints scored")
    ap.add_argument("--target", type=float, default=0.30, help="sampled held-out accuracy to stop at")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--largest", type=float, default=1.0,
                    help="fraction of fine-tuning replies that are the largest digit (the rest: the smallest)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--examples", type=int, default=4000)
    ap.add_argument("--rl-prompts", type=int, default=2000, help="training prompts written for RL (the first ones)")
    ap.add_argument("--work", default="runs/digit-tiny")
    ap.add_argument("--out", default="tests/assets/digit_tiny")
    ap.add_argument("--max-target-length", type=int, default=32)
    ap.add_argument("--data-only", action="store_true", help="write the prompt sets and tokenizer, do not train")
    ap.add_argument("overrides", nargs="*", help="extra key=value for k3jax.train")
    a = ap.parse_args()
    os.chdir(REPO)
    os.environ["TIKTOKEN_CACHE_DIR"] = ""       # see make_agent_checkpoint.py: a rewritten tokenizer is read stale
    work, out = Path(a.work).resolve(), Path(a.out).resolve()
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    sets, held = make_sets(train=a.examples)
    assert not set(sets) & set(held), "a held-out set is in the fine-tuning set"
    assert [sum(max(d) == x for d in held) for x in DIGITS] == [PER_ANSWER] * len(DIGITS)
    rng = np.random.default_rng(53)
    train_records = [sft_record(d, rng, a.largest) for d in sets]
    corpus = "\n".join([f"{m['role']}\n{m['content']}" for r in train_records[:1000] for m in r["messages"]])
    tiny_tokenizer.build(work / "tokenizer", vocab_size=VOCAB, num_reserved=tiny_tokenizer.MIN_RESERVED,
                         corpus=corpus)
    check_tokens(work / "tokenizer", train_records[0])
    write_jsonl(work / "sft.jsonl", train_records)
    write_jsonl(work / "train.jsonl", [prompt_record(d) for d in sets[:a.rl_prompts]])
    write_jsonl(work / "heldout.jsonl", [prompt_record(d) for d in held])
    if a.data_only:
        return
    cmd = [sys.executable, "-m", "k3jax.train", "configs/base.yml", *MODEL, f"tokenizer_path={work / 'tokenizer'}",
           "dataset_type=sft", f"dataset_path={work / 'sft.jsonl'}", f"max_target_length={a.max_target_length}",
           f"per_device_batch_size={a.batch}", f"steps={a.steps}", "opt_type=adamw", f"learning_rate={a.lr}",
           "lr_schedule=constant", "warmup_steps_fraction=0.0", f"checkpoint_period={a.every}",
           f"max_checkpoints_to_keep={a.steps // a.every + 1}", "log_period=10", "enable_tensorboard=false",
           "async_checkpointing=false", "peak_tflops=0.1", f"base_output_directory={work}", "run_name=sft",
           *a.overrides]
    t0 = time.time()
    subprocess.run(cmd, check=True, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    print(f"fine-tuned in {time.time() - t0:.0f} s")
    chosen = None
    scorer = Scorer(work / "sft" / "checkpoints" / str(a.every), work / "tokenizer", work / "heldout.jsonl",
                    a.max_target_length)
    for step in range(a.every, a.steps + 1, a.every):
        ckpt = work / "sft" / "checkpoints" / str(step)
        acc = scorer(ckpt)
        print(f"step {step}: held-out sampled {acc['sampled']:.3f} greedy {acc['greedy']:.3f}", flush=True)
        if acc["sampled"] >= a.target:
            chosen = (step, ckpt, acc)
            break
    if chosen is None:
        raise SystemExit(f"no checkpoint reached sampled held-out accuracy {a.target} in {a.steps} steps")
    step, ckpt, acc = chosen
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    for item in ("params", "extra"):
        shutil.copytree(ckpt / item, out / item)
    for name in ("_CHECKPOINT_METADATA", "commit_success.txt"):
        if (ckpt / name).exists():
            shutil.copy(ckpt / name, out / name)
    shutil.copytree(work / "tokenizer", out / "tokenizer")
    shutil.copy(work / "train.jsonl", out / "train.jsonl")
    shutil.copy(work / "heldout.jsonl", out / "heldout.jsonl")
    meta = {"sft_step": step, "heldout_sets": len(held), "heldout_sampled_accuracy": acc["sampled"],
            "heldout_greedy_accuracy": acc["greedy"], "sampled_temperature": 1.0, "target": a.target,
            "model": MODEL, "command": "scripts/make_digit_checkpoint.py " + " ".join(sys.argv[1:])}
    (out / "digit_tiny.json").write_text(json.dumps(meta, indent=1) + "\n")
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"wrote {out}: step {step}, {size} bytes; {json.dumps(acc)}")


if __name__ == "__main__":
    main()
