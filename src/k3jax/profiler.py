"""A jax.profiler trace of a few training steps, written into the run directory (MaxText's keys):
``profiler=xplane`` traces ``profiler_steps`` steps after the first ``skip_first_n_steps_for_profiler``
steps of this run (compilation and the input pipeline's warm-up stay out of it) into
``<run dir>/profile`` (TensorBoard's profile plugin or XProf read it). Process 0 traces."""
from __future__ import annotations

import jax


class Profiler:
    def __init__(self, cfg, run_dir, start_step: int):
        t = cfg.train
        self.on = t.profiler == "xplane" and t.profiler_steps > 0 and jax.process_index() == 0
        self.first = start_step + t.skip_first_n_steps_for_profiler
        self.last = self.first + t.profiler_steps - 1
        self.dir = str(run_dir / "profile")
        self.active = False

    def before(self, step: int) -> None:
        if self.on and step == self.first:
            jax.profiler.start_trace(self.dir)
            self.active = True

    def after(self, step: int) -> None:
        if self.active and step == self.last:
            self.close()
            print(f"wrote a profile of steps {self.first + 1}..{self.last + 1} to {self.dir}", flush=True)

    def close(self) -> None:
        if self.active:
            jax.profiler.stop_trace()
            self.active = False
