"""A jax.profiler trace of a few training steps, written into the run directory (MaxText's keys):
``profiler=xplane`` traces ``profiler_steps`` steps after the first ``skip_first_n_steps_for_profiler``
steps of this run (compilation and the input pipeline's warm-up stay out of it) into
``<run dir>/profile`` (TensorBoard's profile plugin or XProf read it). Process 0 traces. With the
run directory on gs:// the trace is written to a local temporary directory and uploaded when it
stops (the profiler's own writer reaches local disk only)."""
from __future__ import annotations

import shutil
import tempfile

import jax

from k3jax import paths


class Profiler:
    def __init__(self, cfg, run_dir, start_step: int):
        t = cfg.train
        self.on = t.profiler == "xplane" and t.profiler_steps > 0 and jax.process_index() == 0
        self.first = start_step + t.skip_first_n_steps_for_profiler
        self.last = self.first + t.profiler_steps - 1
        self.dir = str(run_dir / "profile")
        self.local = None   # the local directory traced into when self.dir is remote
        self.active = False

    def before(self, step: int) -> None:
        if self.on and step == self.first:
            self.local = tempfile.mkdtemp(prefix="k3jax-profile-") if paths.is_remote(self.dir) else None
            jax.profiler.start_trace(self.local or self.dir)
            self.active = True

    def after(self, step: int) -> None:
        if self.active and step == self.last:
            self.close()
            print(f"wrote a profile of steps {self.first + 1}..{self.last + 1} to {self.dir}", flush=True)

    def close(self) -> None:
        if self.active:
            jax.profiler.stop_trace()
            self.active = False
            if self.local:
                paths.upload(self.local, self.dir)
                shutil.rmtree(self.local, ignore_errors=True)
