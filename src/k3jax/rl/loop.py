"""The RL loop: ``python -m k3jax.rl configs/base.yml load_parameters_path=... dataset_path=P.jsonl
dataset_type=jsonl rl_rewards=[exact_match] steps=N``.

Each step: the step's prompts (``rl.prompts``; ``global batch rows / rl_num_generations`` of them),
``rl_num_generations`` rollouts of each from the inference core on the same devices
(``rl.rollout``: behaviour log-probs, multi-turn through ``rl_tools``), their rewards
(``rl.rewards``), one optimizer step on ``rl.objectives.rl_loss`` over prompt + completion with the
loss mask of the rollout, then the new parameters into the programs (``Programs.update_weights``: no
recompilation; its seconds are ``weight_sync_s``). Metrics go to stdout and ``metrics.jsonl`` in
the run directory; the last step's parameters are saved there (``checkpoints/``), loadable with
``load_parameters_path`` by train, decode and serve.

Held-out evaluation (``eval_dataset_path``, read like dataset_path: the same keys as train's
evaluation): greedy completions of the held-out prompts through the same programs (``rl.evaluate``:
``eval_pass@1``, ``eval_reward`` and its components) before the first step (a record of step 0: the
starting policy), every ``eval_interval`` steps and after the last, in that step's record.

``rl_shuffle_rewards`` (a control for experiments): each group's rewards go to another prompt's group
before the advantages (a derangement of the groups, seeded by the step), so the reward scale and
spread stay and only their link to the completions is cut; learning under it is what the loop does
without the reward's information.

Not yet: resume of an interrupted run, several processes (a pod), the reference model of
``rl_beta > 0``, ``rl_num_iterations > 1`` (each needs old log-probs the loop does not keep): each
is refused with a one-line error.
"""
from __future__ import annotations

import functools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from k3jax import config as C
from k3jax import paths
from k3jax.checkpoint import save_weights
from k3jax.inference.generate import Generator, Sampling
from k3jax.inference.programs import Programs
from k3jax.metrics import MetricsWriter
from k3jax.optim.muon import make_optimizer
from k3jax.rl.evaluate import evaluate, heldout_count
from k3jax.rl.objectives import rl_loss
from k3jax.rl.prompts import check_prompts, prompt_dataset
from k3jax.rl.rewards import RewardSet, join_turns
from k3jax.rl.rollout import load_tools, rollout
from k3jax.runtime import load_tokenizer
from k3jax.sharding import make_mesh
from k3jax.state import load_model
from k3jax.step import check_batch

DECODE_STEPS = 16


def check_supported(cfg) -> None:
    rl = cfg.rl
    if jax.process_count() > 1:
        raise C.ConfigError("python -m k3jax.rl runs in one process so far; run it without enable_distributed")
    if rl.rl_beta > 0:
        raise C.ConfigError("rl_beta > 0 needs a reference model, which the RL loop does not hold yet; set rl_beta=0")
    if rl.rl_num_iterations != 1:
        raise C.ConfigError("rl_num_iterations > 1 needs the rollout's old log-probs, which the RL loop does not "
                            "keep yet; set rl_num_iterations=1")


def make_step(cfg, gdef, tx, params, opt_state):
    """-> jitted (params, rest, opt_state, tokens [B,T], mask [B,T], rewards [B], rollout [B,T]) ->
    (params, opt_state, loss, metrics): logp of each token given the ones before it, the RL loss
    on the completion tokens, one optimizer update. The new params and optimizer state keep the
    shardings of the given ones, so the next step reuses the program and the inference programs
    take the params as they are (``update_weights`` moves nothing)."""
    def loss_fn(params, rest, tokens, mask, rewards, behaviour):
        logits, _ = nnx.merge(gdef, params, rest)(tokens)
        lp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), -1)
        logp = jnp.take_along_axis(lp, tokens[:, 1:, None], -1)[..., 0]
        return rl_loss(cfg.rl, logp, mask[:, 1:], rewards, rollout=behaviour[:, 1:])

    keep = (jax.tree.map(lambda x: x.sharding, params), jax.tree.map(lambda x: x.sharding, opt_state), None, None)

    @functools.partial(jax.jit, out_shardings=keep)
    def step(params, rest, opt_state, tokens, mask, rewards, behaviour):
        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, rest, tokens, mask, rewards,
                                                                          behaviour)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, metrics
    return step


def batch_arrays(prompts, samples, length: int):
    """Rollouts -> tokens [B, length] (prompt then completion, zero-padded), the loss mask (the
    rollout's mask on the completion, 0 on the prompt and padding) and the behaviour log-probs
    aligned with the tokens."""
    b = len(samples)
    tokens, mask, beh = np.zeros((b, length), np.int32), np.zeros((b, length), np.float32), np.zeros((b, length),
                                                                                                        np.float32)
    for i, s in enumerate(samples):
        ids = list(prompts[s.prompt_index].ids)
        seq = (ids + s.tokens)[:length]
        n = len(seq)
        tokens[i, :n] = seq
        mask[i, len(ids):n] = s.mask[:n - len(ids)]
        beh[i, len(ids):n] = s.logprobs[:n - len(ids)]
    return tokens, mask, beh


def shuffle_groups(rewards: np.ndarray, num_generations: int, seed: int) -> np.ndarray:
    """The control of ``rl_shuffle_rewards``: rewards [B] in groups of ``num_generations`` -> the same
    groups, each moved to another group's rows (a random derangement: no group keeps its own, except a
    lone group, which has nowhere to go)."""
    groups = rewards.reshape(-1, num_generations)
    n = len(groups)
    order = np.random.default_rng(seed).permutation(n)
    out = groups.copy()
    out[order] = groups[np.roll(order, -1)]       # order[i]'s rows get order[i + 1]'s rewards
    return out.reshape(-1)


def run(cfg, devices=None) -> dict:
    """The RL run of ``cfg`` on ``devices`` (default: all of this process's) -> its history, final
    params, checkpoint and programs."""
    check_supported(cfg)
    rl = cfg.rl
    mesh = make_mesh(cfg, devices)
    rows = check_batch(cfg, mesh.devices.size)
    g = rl.rl_num_generations
    n_prompts = max(1, rows // g)
    tok = load_tokenizer(cfg)
    rewards = RewardSet.from_config(rl)
    check_prompts(cfg, tok, rewards.fields)
    prompts = prompt_dataset(cfg, tok, rewards.fields)
    if cfg.eval.eval_dataset_path:
        check_prompts(cfg, tok, rewards.fields, held_out=True)
        heldout = prompt_dataset(cfg, tok, rewards.fields, held_out=True)
        heldout = [heldout[k] for k in range(heldout_count(cfg, len(heldout), n_prompts * g))]
    tools = load_tools(rl.rl_tools) if rl.rl_tools else {}
    model = load_model(cfg, mesh)
    length = cfg.train.max_target_length
    with jax.set_mesh(mesh):
        progs = Programs(model, mesh, slots=n_prompts * g, length=length, chunk=min(256, length),
                         decode_sizes=[n_prompts * g], prefill_rows=n_prompts * g, decode_steps=DECODE_STEPS,
                         top_logprobs=0)
    gen = Generator(progs)
    gdef, params, rest = nnx.split(model, nnx.Param, ...)
    tx = make_optimizer(cfg.train, params)
    with jax.set_mesh(mesh):
        opt_state = jax.jit(tx.init)(params)
    step = make_step(cfg, gdef, tx, params, opt_state)
    run_dir = paths.run_dir(cfg)
    writer = MetricsWriter(run_dir, tensorboard=False)
    history = []

    def held_out_eval() -> dict:
        if not cfg.eval.eval_dataset_path:
            return {}
        t = time.perf_counter()
        with jax.set_mesh(mesh):
            res = evaluate(gen, tok, heldout, rewards, max_new_tokens=rl.rl_max_new_tokens, max_turns=rl.rl_max_turns,
                           tools=tools, tool_timeout=rl.rl_tool_timeout_s)
        return {**res.metrics, "eval_s": time.perf_counter() - t}

    def log(rec):
        writer.write(rec)
        print(json.dumps({k: (round(v, 5) if isinstance(v, float) else v) for k, v in rec.items()}), flush=True)

    start = held_out_eval()
    if start:
        log({"step": 0, **start})
    for i in range(cfg.train.steps):
        t0 = time.perf_counter()
        if cfg.data.num_epoch and (i + 1) * n_prompts > len(prompts):   # grain would wrap around
            print(f"the prompt set is used up after {i} steps (num_epoch={cfg.data.num_epoch}); stopping",
                  flush=True)
            break
        batch = [prompts[k] for k in range(i * n_prompts, (i + 1) * n_prompts)]
        samples = rollout(gen, tok, batch, generations=g,
                          sampling=Sampling(rl.rl_temperature, 0, rl.rl_top_p, seed=cfg.train.seed * 1_000_003 + i),
                          max_new_tokens=rl.rl_max_new_tokens * rl.rl_max_turns, max_turns=rl.rl_max_turns,
                          tools=tools, tool_timeout=rl.rl_tool_timeout_s)
        t_roll = time.perf_counter() - t0
        replies = [join_turns(s.replies) for s in samples]
        totals, comps, errors = rewards.score_batch([(batch[s.prompt_index].record, batch[s.prompt_index].where)
                                                     for s in samples], replies)
        tokens, mask, beh = batch_arrays(batch, samples, length)
        trained = shuffle_groups(totals, g, cfg.train.seed * 1_000_003 + i) if rl.rl_shuffle_rewards else totals
        with jax.set_mesh(mesh):
            params, opt_state, loss, metrics = step(params, rest, opt_state, tokens, mask, trained, beh)
            t1 = time.perf_counter()
            progs.update_weights(params)
            jax.block_until_ready(progs.state)
        rec = {"step": i + 1, "loss": float(loss), "reward": float(np.mean(totals)),
               **{f"reward/{k}": float(np.mean(v)) for k, v in comps.items()},
               **{f"reward_errors/{k}": v for k, v in errors.items() if v},
               **{k: float(v) for k, v in metrics.items()},
               "tool_errors": sum(s.tool_errors for s in samples),
               "completion_tokens": int(sum(sum(s.mask) for s in samples)),
               "rollout_s": t_roll, "weight_sync_s": time.perf_counter() - t1, "step_s": time.perf_counter() - t0}
        if (i + 1) % cfg.eval.eval_interval == 0 or i + 1 == cfg.train.steps:
            rec.update(held_out_eval())
        history.append(rec)
        log(rec)
    if history and cfg.eval.eval_dataset_path and "eval_pass@1" not in history[-1]:    # stopped early
        log({"step": history[-1]["step"], **held_out_eval()})
    writer.close()
    saved = save_weights(run_dir / "checkpoints", params, rest, len(history))
    print(f"saved {saved}")
    return {"history": history, "start_eval": start, "params": params, "checkpoint": saved, "programs": progs}
