"""Preemption: SIGTERM (a TPU maintenance event, GKE evicting a pod, the local pod launcher) asks a
run to save and stop. Every process must save the same step, so the step is agreed on first.

In a job of several processes JAX's preemption service (started by ``jax.distributed.initialize``)
catches SIGTERM on any process and the processes agree on the next safe step
(``multihost_utils.reached_preemption_sync_point``); a single process catches SIGTERM itself. The
training loop asks ``due(step)`` after every step; when it is True the run saves a checkpoint of
that step, prints one line and exits with status ``EXIT_STATUS`` (128 + SIGTERM), the status
JobSet / GKE restart policies treat as a preemption.
"""
from __future__ import annotations

import signal

import jax
from jax.experimental import multihost_utils

EXIT_STATUS = 128 + signal.SIGTERM   # 143


class Preemption:
    def __init__(self):
        self.multi = jax.distributed.is_initialized() and bool(jax.config.jax_enable_preemption_service)
        self.signalled = False
        self._previous = None
        if not self.multi:
            self._previous = signal.signal(signal.SIGTERM, self._catch)

    def _catch(self, signum, frame):
        self.signalled = True

    def due(self, step: int) -> bool:
        """True on every process at the same ``step`` once any of them was sent SIGTERM (call it
        after every step, on every process)."""
        if self.multi:
            return multihost_utils.reached_preemption_sync_point(step)
        return self.signalled

    def close(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None
