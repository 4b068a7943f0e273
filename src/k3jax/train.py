"""Training entry point: ``python -m k3jax.train configs/base.yml model_name=... steps=... key=value``.

One jitted step = one optimizer step (gradient accumulation is a scan over micro-batches inside it),
with donated state and output shardings pinned to the input shardings. After the update: QK-clip on
the MLA heads from the max logits the forward returned, and the aux-loss-free router-bias update
from the expert loads it returned. Checkpoints hold params, optimizer state, extra state (router
biases, step) and the data iterator, so a killed run resumes with the same batches and losses.
"""
from __future__ import annotations

import dataclasses
import logging
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import yaml
from flax import nnx

from k3jax import config as C
from k3jax import counts
from k3jax import model as M
from k3jax.checkpoint import Checkpointer, CheckpointError, load_extra, load_params
from k3jax.kernels.moe import balance
from k3jax.layers.common import RouterBias
from k3jax.loss import chunked_cross_entropy
from k3jax.metrics import MetricsWriter, peak_tflops_per_device
from k3jax.runtime import load_tokenizer
from k3jax.optim import init_sharded, make_optimizer, make_schedule, qk_clip
from k3jax.sharding import batch_sharding, make_mesh, maybe_initialize_distributed

log = logging.getLogger("k3jax.train")


class TrainingError(RuntimeError):
    """A run that cannot continue (e.g. a non-finite loss under nan_policy=stop)."""


def _moe_loads(aux):
    """All MoE layers' expert loads as one [L_moe, E] array (for balance metrics)."""
    loads = [a["expert_load"] for a in aux["prefix"] + aux["tail"] if "expert_load" in a]
    for a in aux["periods"] or []:
        if "expert_load" in a:
            loads.extend(list(a["expert_load"]))
    return jnp.stack(loads) if loads else None


def _sum_aux(aux, key):
    vals = [a[key] for a in aux["prefix"] + aux["tail"] if key in a]
    vals += [jnp.sum(a[key]) for a in aux["periods"] or [] if key in a]
    n = sum(1 for a in aux["prefix"] + aux["tail"] if key in a) + sum(
        a[key].shape[0] for a in aux["periods"] or [] if key in a)
    return (sum(vals) / max(n, 1)) if vals else jnp.zeros((), jnp.float32)


def _update_router_biases(model, aux, rate):
    """Aux-loss-free balancing: bias += rate * sign(mean load - load), per MoE layer."""
    def upd(moe, loads):
        moe.e_score_correction_bias[...] = balance.update_bias(moe.e_score_correction_bias[...], loads, rate)
    for layer, a in zip(list(model.prefix) + list(model.tail), aux["prefix"] + aux["tail"]):
        if "expert_load" in a:
            upd(layer.mlp, a["expert_load"])
    if model.layout.num_periods:
        for layer, a in zip(model.periods.layers, aux["periods"]):
            if "expert_load" in a:  # stacked [n, E] biases and loads: the update is elementwise
                upd(layer.mlp, a["expert_load"])


def _reduce_micro_aux(auxs):
    """Combine per-micro-batch side outputs (leading axis k): max logits by max, loads by sum."""
    def red(path, x):
        name = jax.tree_util.keystr(path[-1:])
        if "max_logits" in name:
            return jnp.max(x, 0)
        return jnp.sum(x, 0) if "expert_load" in name else jnp.mean(x, 0)
    return jax.tree_util.tree_map_with_path(red, auxs)


def make_train_step(cfg, gdef, tx, mesh):
    t = cfg.train

    def loss_fn(params, rest, batch):
        model = nnx.merge(gdef, params, rest)
        h, aux, _ = model.hidden(batch["tokens"], batch["segment_ids"], batch["positions"], mesh=mesh,
                                 remat=t.remat_policy, compute_aux=t.moe_aux_loss_coef > 0)
        loss_sum, weight, correct = chunked_cross_entropy(h, model.head_weight(), batch["targets"],
                                                          batch["loss_mask"], chunk=cfg.kernel.loss_chunk_size,
                                                          z_loss_weight=t.z_loss_weight)
        loss = loss_sum / jnp.maximum(weight, 1.0)
        total = loss + t.moe_aux_loss_coef * _sum_aux(aux, "aux_loss")
        return total, (loss, weight, correct, aux)

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def step(state, batch):
        params, opt_state, rest = state["params"], state["opt_state"], state["rest"]
        k = t.gradient_accumulation_steps
        if k == 1:
            (_, (loss, weight, correct, aux)), grads = grad_fn(params, rest, batch)
        else:  # micro-batches along the batch axis, gradients summed in f32
            micro = jax.tree.map(lambda x: x.reshape(k, x.shape[0] // k, *x.shape[1:]), batch)

            def body(acc, mb):
                (_, (l, w, c, a)), g = grad_fn(params, rest, mb)
                acc = jax.tree.map(jnp.add, acc, (jax.tree.map(lambda x: x * w, g), l * w, w, c))
                return acc, a
            zeros = (jax.tree.map(jnp.zeros_like, params), 0.0, 0.0, 0.0)
            (gsum, lsum, weight, correct), auxs = jax.lax.scan(body, zeros, micro)
            grads = jax.tree.map(lambda g: g / jnp.maximum(weight, 1.0), gsum)
            loss = lsum / jnp.maximum(weight, 1.0)
            aux = _reduce_micro_aux(auxs)
        grad_norm = optax.global_norm(grads)
        updates, new_opt = tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        metrics = {"loss": loss, "grad_norm": grad_norm, "loss_tokens": weight,
                   "accuracy": correct / jnp.maximum(weight, 1)}
        if t.use_qk_clip and any("max_logits" in a for a in aux["prefix"] + aux["tail"] + (aux["periods"] or [])):
            new_params, clip = qk_clip(new_params, aux, threshold=t.qk_clip_threshold, cfg_model=cfg.model)
            metrics["qk_clipped_heads"] = clip["clipped_heads"]
            metrics["max_logit"] = clip["max_logit"]
        model = nnx.merge(gdef, new_params, rest)
        if t.router_bias_update_rate > 0:
            _update_router_biases(model, aux, t.router_bias_update_rate)
        new_rest = nnx.state(model, RouterBias)
        loads = _moe_loads(aux)
        if loads is not None:
            metrics["expert_load_max_over_mean"] = jnp.mean(jnp.max(loads, -1) / jnp.maximum(jnp.mean(loads, -1), 1e-9))
            metrics["dropped_fraction"] = _sum_aux(aux, "dropped_fraction")
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        metrics["finite"] = finite
        if t.nan_policy == "skip":  # keep the old state on a non-finite step
            keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)  # noqa: E731
            new_params, new_opt, new_rest = keep(new_params, params), keep(new_opt, opt_state), keep(new_rest, rest)
        return {"params": new_params, "opt_state": new_opt, "rest": new_rest}, metrics

    return step


def _data_iterator(cfg, global_batch: int):
    from k3jax.data import pipeline as P
    tok = None
    if cfg.data.dataset_type != "synthetic" or cfg.data.tokenizer_path:
        tok = load_tokenizer(cfg)
    per_host = global_batch // jax.process_count()
    return P.make_pipeline(dataset_type=cfg.data.dataset_type, paths=cfg.data.dataset_path, tokenizer=tok,
                           seq_len=cfg.train.max_target_length, batch_size=per_host, seed=cfg.data.data_seed,
                           shuffle=cfg.data.data_shuffle, bad_data=cfg.data.bad_data,
                           vocab_size=cfg.model.vocab_size, text_key=cfg.data.text_key)


def _global_batch(batch, mesh, global_shape_rows):
    sh = batch_sharding(mesh, 2)
    return {k: jax.make_array_from_process_local_data(sh, np.asarray(v), (global_shape_rows,) + v.shape[1:])
            for k, v in batch.items()}


def setup_state(cfg, mesh, tx_cfg=None):
    """Abstract state -> sharded init (or the shapes only); returns gdef, state, tx, shardings."""
    model = M.create_sharded(cfg, mesh)
    gdef, params, rest = nnx.split(model, nnx.Param, RouterBias)
    if cfg.checkpoint.load_parameters_path:
        abs_params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), params)
        params = load_params(cfg.checkpoint.load_parameters_path, abs_params)
        rest = load_extra(cfg.checkpoint.load_parameters_path, rest)
        print(f"loaded parameters from {cfg.checkpoint.load_parameters_path}")
    tx = make_optimizer(tx_cfg or dataclasses.replace(cfg.train, gradient_accumulation_steps=1), params)
    with jax.set_mesh(mesh):
        opt_state = init_sharded(tx, params)  # moments born with their params' shardings
    state = {"params": params, "opt_state": opt_state, "rest": rest}
    return gdef, state, tx


def train(cfg, *, on_step=None) -> dict:
    maybe_initialize_distributed(cfg)
    mesh = make_mesh(cfg)
    n_dev = mesh.devices.size
    gb = cfg.global_batch_size(n_dev)
    if gb % cfg.train.gradient_accumulation_steps:
        raise C.ConfigError(f"global batch {gb} is not divisible by gradient_accumulation_steps="
                            f"{cfg.train.gradient_accumulation_steps}")
    run_dir = cfg.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yml").write_text(yaml.safe_dump(cfg.flat(), sort_keys=False))
    gdef, state, tx = setup_state(cfg, mesh)
    shardings = jax.tree.map(lambda x: x.sharding, state)
    data = _data_iterator(cfg, gb)
    ckpt = None
    start = 0
    if cfg.checkpoint.enable_checkpointing:
        ckpt = Checkpointer(run_dir / "checkpoints", max_to_keep=cfg.checkpoint.max_checkpoints_to_keep,
                            async_save=cfg.checkpoint.async_checkpointing)
        last = ckpt.latest_step()
        if last is not None:
            abs_ = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
            p, o, r = ckpt.restore(last, abs_["params"], abs_["opt_state"], abs_["rest"], data)
            state = {"params": p, "opt_state": o, "rest": r}
            start = last
            print(f"resumed from {run_dir / 'checkpoints' / str(last)} at step {last}")
    step_fn = jax.jit(make_train_step(cfg, gdef, tx, mesh), donate_argnums=0,
                      out_shardings=(shardings, None))
    flops_tok = counts.train_flops_per_token(cfg.model, cfg.train.max_target_length, cfg.kernel.kda_chunk_size)
    peak = peak_tflops_per_device(cfg.train.peak_tflops)
    writer = MetricsWriter(run_dir, cfg.train.enable_tensorboard)
    schedule = make_schedule(cfg.train)
    tty = sys.stdout.isatty()
    history = []
    t_last = time.perf_counter()
    try:
        for step in range(start, cfg.train.steps):
            batch = _global_batch(next(data), mesh, gb)
            with jax.set_mesh(mesh):
                state, m = step_fn(state, batch)
            m = jax.device_get(m)
            if not bool(m["finite"]) and cfg.train.nan_policy == "stop":
                raise TrainingError(f"non-finite loss at step {step + 1} (loss={float(m['loss'])}, grad_norm="
                                    f"{float(m['grad_norm'])}); stopped without saving; the last good checkpoint "
                                    f"is kept (set nan_policy=skip to skip such steps)")
            now = time.perf_counter()
            dt, t_last = now - t_last, now
            tokens = float(gb * cfg.train.max_target_length)  # processed, padding included
            rec = {"step": step + 1, **{k: float(v) for k, v in m.items() if k != "finite"},
                   "learning_rate": float(schedule(step)), "step_time_s": dt, "tokens_per_s": tokens / dt,
                   "tflops_per_device": tokens * flops_tok / dt / n_dev / 1e12}
            rec["mfu"] = rec["tflops_per_device"] / peak
            history.append(rec)
            writer.write(rec)
            if on_step:
                on_step(rec)
            if (step + 1) % cfg.train.log_period == 0 or step == start or step + 1 == cfg.train.steps:
                line = (f"step {step + 1:>6}  loss {rec['loss']:.4f}  grad_norm {rec['grad_norm']:.3f}  "
                        f"lr {rec['learning_rate']:.2e}  tok/s {rec['tokens_per_s']:.0f}  "
                        f"TFLOP/s/dev {rec['tflops_per_device']:.3f}  MFU {100 * rec['mfu']:.2f}%")
                print(("\r" if tty else "") + line, flush=True)
            if ckpt and ((step + 1) % cfg.checkpoint.checkpoint_period == 0 or step + 1 == cfg.train.steps):
                ckpt.save(step + 1, state["params"], state["opt_state"], state["rest"], data,
                          force=step + 1 == cfg.train.steps)
    finally:
        if ckpt:
            ckpt.close()
        writer.close()
    return {"history": history, "state": state, "run_dir": run_dir}


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    argv = sys.argv[1:] if argv is None else argv
    try:
        cfg = C.load_from_argv(argv)
        C.validate(cfg, num_devices=len(jax.devices()))
        out = train(cfg)
    except (C.ConfigError, CheckpointError, TrainingError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    h = out["history"]
    if h:
        print(f"done: {len(h)} steps, loss {h[0]['loss']:.4f} -> {h[-1]['loss']:.4f}; run dir {out['run_dir']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
