"""Optimizer: Muon/AdamW grouped by declared parameter metadata, LR schedules, QK-clip.

See docs/optimizer.md. ``make_optimizer(cfg.train, params_state)`` builds the optax transformation;
``qk_clip`` is applied to the params after each update with the forward's per-head max logits.
"""
from k3jax.optim.muon import (  # noqa: F401
    FREEZE_GROUPS, dimension_number, dimension_numbers, frozen_mask, init_sharded, leaf_groups,
    make_optimizer, opt_state_shardings, param_labels, param_path)
from k3jax.optim.qk_clip import head_gamma, qk_clip  # noqa: F401
from k3jax.optim.schedule import make_schedule, schedule_boundaries  # noqa: F401
