"""Learning-rate schedules: linear warm-up, then WSD, cosine or constant.

All three share the warm-up ``lr(s) = peak * s / W`` for ``s < W`` (W = round(warmup_steps_fraction *
steps)), so step 0 has lr 0 and step W reaches the peak. After it:

- ``wsd`` (warmup-stable-decay): the peak until ``steps - Dd`` (Dd = round(lr_decay_fraction *
  steps)), then linear to ``lr_final_fraction * peak`` at ``steps``.
- ``cosine``: half a cosine from the peak at W to ``lr_final_fraction * peak`` at ``steps``.
- ``constant``: the peak (``lr_final_fraction`` is not used).

Past ``steps`` every schedule holds its final value. Steps count optimizer updates: one per train
step, whatever ``gradient_accumulation_steps`` is (the micro-batches are scanned inside the step).
"""
from __future__ import annotations

import optax

from k3jax.config import ConfigError


def schedule_boundaries(train_cfg) -> tuple[int, int]:
    """(warm-up steps W, first step of the WSD decay) for ``train_cfg``; validates the fractions."""
    t = train_cfg
    for name in ("warmup_steps_fraction", "lr_decay_fraction", "lr_final_fraction"):
        v = getattr(t, name)
        if not 0.0 <= v <= 1.0:
            raise ConfigError(f"{name}={v}: must be within [0, 1]")
    warmup = int(round(t.warmup_steps_fraction * t.steps))
    decay = int(round(t.lr_decay_fraction * t.steps)) if t.lr_schedule == "wsd" else 0
    if warmup + decay > t.steps:
        raise ConfigError(f"warmup_steps_fraction={t.warmup_steps_fraction} + lr_decay_fraction="
                          f"{t.lr_decay_fraction} exceed the {t.steps} training steps")
    return warmup, t.steps - decay


def make_schedule(train_cfg) -> optax.Schedule:
    """Step (int32 scalar, traced ok) -> learning rate (f32 scalar) for the TrainConfig section."""
    t = train_cfg
    peak, final = t.learning_rate, t.lr_final_fraction * t.learning_rate
    warmup, decay_start = schedule_boundaries(t)
    # (first step, piece) pairs; optax.join_schedules evaluates each piece at (step - first step).
    pieces = [(0, optax.linear_schedule(0.0, peak, warmup))] if warmup else []
    if t.lr_schedule == "wsd":
        pieces.append((warmup, optax.constant_schedule(peak)))
        if t.steps > decay_start:
            pieces.append((decay_start, optax.linear_schedule(peak, final, t.steps - decay_start)))
    elif t.lr_schedule == "cosine":
        if t.steps > warmup:
            # alpha: the final value as a fraction of the peak.
            pieces.append((warmup, optax.cosine_decay_schedule(peak, t.steps - warmup, alpha=t.lr_final_fraction)))
        else:
            pieces.append((warmup, optax.constant_schedule(final)))
    elif t.lr_schedule == "constant":
        pieces.append((warmup, optax.constant_schedule(peak)))
    else:
        raise ConfigError(f"lr_schedule={t.lr_schedule!r}: must be one of wsd, cosine, constant")
    if len(pieces) == 1:
        return pieces[0][1]
    return optax.join_schedules([p for _, p in pieces], [s for s, _ in pieces[1:]])
