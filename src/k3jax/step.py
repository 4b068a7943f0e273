"""The train step as a library: the jitted optimizer step, and the batch size it eats (the
batches themselves come from ``k3jax.data.iterator``).

One step = one optimizer update. With ``gradient_accumulation_steps`` = k the global batch is split
into k micro-batches along its rows, scanned, and their token-weighted gradients summed in f32, so k
micro-batches of B rows give the update of one batch of k x B rows. After the update: QK-clip on
the MLA heads from the max logits the forward returned, and the aux-loss-free router-bias update
from the expert loads it returned. Used by ``k3jax.train``, ``k3jax.compile`` and the benchmarks.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from k3jax.config import ConfigError
from k3jax.kernels.moe import balance
from k3jax.kernels.platform import target_platform
from k3jax.layers.common import REST
from k3jax.loss import (choose_vocab_axes, chunked_cross_entropy, resolve_loss_impl, tokamax_context,
                        tokamax_cross_entropy, tokamax_implementation, vocab_parallel_cross_entropy)
from k3jax.optim.qk_clip import qk_clip
from k3jax.remat import spec as remat_spec
from k3jax.sharding import BATCH_AXES, CONTEXT_AXIS, HEAD_AXIS, VOCAB_PARALLEL_AXES, stage_rows
from k3jax.stages import pipeline_of
from k3jax.vision.splice import slot_loss_mask


# ---- side outputs of the forward (layout trees, see k3jax.layout) -------------------------------

def moe_loads(layout, aux):
    """All MoE layers' expert loads as one [L_moe, E] array (balance metrics), or None."""
    loads = []
    for site, a in layout.items(aux):
        if "expert_load" in a:
            x = a["expert_load"]
            loads.extend(list(x) if site.stacked else [x])
    return jnp.stack(loads) if loads else None


def mean_aux(layout, aux, key):
    """Mean of a per-layer scalar ``key`` over the layers that report it (0 when none does)."""
    vals = [jnp.sum(a[key]) for _, a in layout.items(aux) if key in a]
    n = sum(len(s.layers) for s, a in layout.items(aux) if key in a)
    return sum(vals) / n if vals else jnp.zeros((), jnp.float32)


def update_router_biases(model, aux, rate):
    """Aux-loss-free balancing: bias += rate * sign(mean load - load), per MoE layer (stacked [n, E]
    biases and loads update elementwise, each layer from its own loads)."""
    for site, a in model.layout.items(aux):
        if "expert_load" in a:
            moe = model.layer(site).mlp
            moe.e_score_correction_bias[...] = balance.update_bias(moe.e_score_correction_bias[...],
                                                                   a["expert_load"], rate)


def _reduce_micro_aux(auxs):
    """Combine per-micro-batch side outputs (leading axis k): max logits by max, loads by sum."""
    def red(path, x):
        name = jax.tree_util.keystr(path[-1:])
        if "max_logits" in name:
            return jnp.max(x, 0)
        return jnp.sum(x, 0) if "expert_load" in name else jnp.mean(x, 0)
    return jax.tree_util.tree_map_with_path(red, auxs)


# ---- the step ---------------------------------------------------------------------------------

def check_trainable(cfg) -> None:
    """Packed MXFP4 experts have no gradient; training them must be asked for explicitly as frozen.
    Quantization-aware training of frozen experts would train nothing it is for."""
    if cfg.model.experts_qat != "none" and {"experts", "moe"} & set(cfg.train.freeze):
        raise ConfigError(f"experts_qat={cfg.model.experts_qat} trains the routed experts through their rounding, but "
                          f"freeze={cfg.train.freeze} freezes them; drop experts from freeze or set experts_qat=none")
    if cfg.model.experts_format == "mxfp4" and not {"experts", "moe"} & set(cfg.train.freeze):
        raise ConfigError(f"experts_format=mxfp4 keeps the routed experts packed (4-bit, not trainable), but "
                          f"freeze={cfg.train.freeze} does not freeze them; add experts to freeze "
                          f"(freeze=[experts]) or train with experts_format=dense")


def make_loss(cfg):
    """(h [B,T,D], lm head [D,V], targets, loss_mask) -> (masked loss sum, mask sum, correct) by
    ``loss_impl`` (k3jax.loss). With tokamax, ``correct`` is a 0 placeholder (no logits formed)."""
    if cfg.kernel.loss_impl == "tokamax":
        def fn(h, w, targets, mask):
            # rows split over the batch (led by stage: the loss runs outside the pipeline), context and
            # tensor axes (loss.tokamax_cross_entropy)
            rows = stage_rows(BATCH_AXES, jax.sharding.get_abstract_mesh())
            return tokamax_cross_entropy(h, w, targets, mask, implementation=tokamax_implementation(target_platform()),
                                         row_axes=(*rows, CONTEXT_AXIS, HEAD_AXIS))
        return fn
    if cfg.kernel.loss_impl == "vocab_parallel":
        def fn(h, w, targets, mask):
            # the vocabulary group is picked per traced shape (a micro-batch has fewer rows)
            mesh = jax.sharding.get_abstract_mesh()
            rows = stage_rows(BATCH_AXES, mesh)           # led by stage: the loss runs outside the pipeline
            axes = () if mesh.empty else choose_vocab_axes(
                mesh, h.shape[0], h.shape[1], w.shape[1], batch_axes=rows, seq_axis=CONTEXT_AXIS,
                candidates=VOCAB_PARALLEL_AXES)
            return vocab_parallel_cross_entropy(h, w, targets, mask, chunk=cfg.kernel.loss_chunk_size,
                                                z_loss_weight=cfg.train.z_loss_weight, vocab_axes=axes,
                                                batch_axes=rows, seq_axis=CONTEXT_AXIS)
        return fn
    return lambda h, w, targets, mask: chunked_cross_entropy(
        h, w, targets, mask, chunk=cfg.kernel.loss_chunk_size, z_loss_weight=cfg.train.z_loss_weight,
        grad_in_forward=resolve_loss_impl(cfg.kernel.loss_impl, target_platform()) == "chunked_fused")


def make_train_step(cfg, gdef, tx):
    """step(state, batch) -> (new state, metrics) for state = {"params", "opt_state", "rest"} and a
    batch of [B, T] arrays (tokens, targets, segment_ids, positions, loss_mask), plus optionally
    "media" (``MediaInputs.arrays()``: spliced in, and no loss on targets that are media slots). Trace it under
    ``jax.set_mesh(mesh)``: the model reads the ambient mesh (expert parallelism, constraints)."""
    t = cfg.train
    check_trainable(cfg)
    cross_entropy = make_loss(cfg)
    periods = pipeline_of(cfg)          # the pipeline over the stage axis, or None (k3jax.stages)

    def loss_fn(params, rest, batch):
        model = nnx.merge(gdef, params, rest)
        media = batch.get("media")      # k3jax.data.media.MediaInputs.arrays(), or absent
        h, aux, _ = model.hidden(batch["tokens"], batch["segment_ids"], batch["positions"],
                                 remat=remat_spec(t), compute_aux=t.moe_aux_loss_coef > 0, media=media,
                                 periods=periods)
        mask = batch["loss_mask"]
        if media is not None:
            mask = slot_loss_mask(mask, media["slots"])
        with jax.named_scope("loss"):
            loss_sum, weight, correct = cross_entropy(h, model.head_weight(), batch["targets"], mask)
        loss = loss_sum / jnp.maximum(weight, 1.0)
        total = loss + t.moe_aux_loss_coef * mean_aux(model.layout, aux, "aux_loss")
        return total, (loss, weight, correct, aux)

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def step(state, batch):
        # tokamax's Mosaic kernels (loss, grouped matmul) check the host's device when traced,
        # the backward included, which is traced here, outside loss_fn (k3jax.loss.tokamax_context)
        uses_tokamax = cfg.kernel.loss_impl == "tokamax" or cfg.kernel.moe_impl == "tokamax_ragged_dot"
        with tokamax_context(tokamax_implementation(target_platform()) if uses_tokamax else "none"):
            return _step(state, batch)

    def _step(state, batch):
        params, opt_state, rest = state["params"], state["opt_state"], state["rest"]
        k = t.gradient_accumulation_steps
        if k > 1 and "media" in batch and batch["media"]["slots"].ndim == 1:
            raise ConfigError(f"gradient_accumulation_steps={k} with media packed flat: they are one array per "
                              f"batch, not per row; group them per row (media.grouped_media_inputs, as "
                              f"dataset_type=mm_sft does) or use gradient_accumulation_steps=1")
        if k == 1:
            (_, (loss, weight, correct, aux)), grads = grad_fn(params, rest, batch)
        else:  # micro-batches along the batch axis, token-weighted gradients summed in f32
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
        model = nnx.merge(gdef, params, rest)
        layout = model.layout
        grad_norm = optax.global_norm(grads)
        with jax.named_scope("optimizer"):     # a profile's ops group by these scopes (docs/benchmarks.md)
            updates, new_opt = tx.update(grads, opt_state, params)
            new_params = optax.apply_updates(params, updates)
        metrics = {"loss": loss, "grad_norm": grad_norm, "loss_tokens": weight}
        if cfg.kernel.loss_impl != "tokamax":   # tokamax's fused CE forms no logits to take an argmax of
            metrics["accuracy"] = correct / jnp.maximum(weight, 1)
        if t.use_qk_clip and any("max_logits" in a for _, a in layout.items(aux)):
            new_params, clip = qk_clip(new_params, aux, layout, threshold=t.qk_clip_threshold, cfg_model=cfg.model)
            metrics["qk_clipped_heads"] = clip["clipped_heads"]
            metrics["max_logit"] = clip["max_logit"]
        model = nnx.merge(gdef, new_params, rest)
        if t.router_bias_update_rate > 0:
            update_router_biases(model, aux, t.router_bias_update_rate)
        new_rest = nnx.state(model, REST)
        loads = moe_loads(layout, aux)
        if loads is not None:
            metrics["expert_load_max_over_mean"] = jnp.mean(jnp.max(loads, -1) / jnp.maximum(jnp.mean(loads, -1), 1e-9))
            metrics["dropped_fraction"] = mean_aux(layout, aux, "dropped_fraction")
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        metrics["finite"] = finite
        if t.nan_policy == "skip":  # keep the old state on a non-finite step
            keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)  # noqa: E731
            new_params, new_opt, new_rest = keep(new_params, params), keep(new_opt, opt_state), keep(new_rest, rest)
        return {"params": new_params, "opt_state": new_opt, "rest": new_rest}, metrics

    return step


def jit_train_step(cfg, gdef, tx, state):
    """The jitted step with the state donated and its output shardings pinned to ``state``'s (a
    concrete or abstract state): otherwise the compiler may pick other output shardings, and the
    next call would recompile or reject its input (ecosystem.md §1)."""
    shardings = jax.tree.map(lambda x: x.sharding, state)
    return jax.jit(make_train_step(cfg, gdef, tx), donate_argnums=0, out_shardings=(shardings, None))


# ---- batches ----------------------------------------------------------------------------------

def check_batch(cfg, num_devices: int) -> int:
    """Global batch for ``num_devices``; it must split into the gradient-accumulation micro-batches."""
    gb = cfg.global_batch_size(num_devices)
    k = cfg.train.gradient_accumulation_steps
    if gb % k:
        raise ConfigError(f"global batch {gb} is not divisible by gradient_accumulation_steps={k}")
    return gb

