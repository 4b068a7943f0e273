"""Held-out evaluation of an RL policy: one completion per prompt of ``eval_dataset_path``, through the
same rollout path as training (``rl.rollout`` on the inference core's programs: no second generation
loop), scored by the same rewards.

The held-out prompts are read as the training prompts are (``rl.prompts``, ``held_out=True``: file
order, one pass); ``eval_steps`` counts batches of the programs' slots (-1 = every prompt). Greedy by
default (``temperature`` 0), so two evaluations of the same parameters give the same completions.

Metrics, named like the training loop's ``eval_*``:
    eval_pass@1         fraction of prompts whose completion gets every reward component's value >= 1
                        (each built-in verifier passed; for exact_match alone, the accuracy)
    eval_reward         mean total reward (the weighted sum, as in training)
    eval_reward/NAME    mean of each component
    eval_prompts        how many prompts were scored
"""
from __future__ import annotations

import dataclasses

import numpy as np

from k3jax.inference.generate import Generator, Sampling
from k3jax.rl.rewards import RewardSet, join_turns
from k3jax.rl.rollout import rollout


@dataclasses.dataclass
class EvalResult:
    metrics: dict                   # the eval_* metrics above
    completions: list[str]          # each prompt's final reply text, in order
    passed: np.ndarray              # bool [prompts]


def heldout_count(cfg, total: int, slots: int) -> int:
    """How many of ``total`` held-out prompts an evaluation scores: all with eval_steps=-1, else
    eval_steps batches of ``slots``."""
    steps = cfg.eval.eval_steps
    return total if steps < 0 else min(total, steps * slots)


def evaluate(gen: Generator, tok, prompts, rewards: RewardSet, *, max_new_tokens: int, max_turns: int = 1,
             tools=None, tool_timeout: float = 10.0, temperature: float = 0.0, seed: int = 0) -> EvalResult:
    """Score one completion per prompt (``rl.prompts.Prompt``s) -> ``EvalResult``. ``temperature`` 0 is
    greedy; > 0 samples (prompt i with seed ``seed + i``), e.g. to measure a starting policy's sampled
    success."""
    prompts = list(prompts)
    samples = rollout(gen, tok, prompts, generations=1, sampling=Sampling(temperature, 0, 1.0, seed=seed),
                      max_new_tokens=max_new_tokens * max_turns, max_turns=max_turns, tools=tools or {},
                      tool_timeout=tool_timeout)
    replies = [join_turns(s.replies) for s in samples]
    totals, comps, _ = rewards.score_batch([(prompts[s.prompt_index].record, prompts[s.prompt_index].where)
                                            for s in samples], replies)
    passed = np.all(np.stack([v >= 1.0 for v in comps.values()]), axis=0)
    metrics = {"eval_pass@1": float(passed.mean()), "eval_reward": float(totals.mean()),
               **{f"eval_reward/{k}": float(v.mean()) for k, v in comps.items()}, "eval_prompts": len(samples)}
    return EvalResult(metrics, [r.text for r in replies], passed)
