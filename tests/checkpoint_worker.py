"""Helper process of tests/test_checkpoint_kills.py (not a test): imports jax, orbax and grain
once, then on each line ``fork DIR`` on stdin forks a child that saves through the project's
async ``Checkpointer`` in a loop until it is killed, so every SIGKILL hits a fresh process without
paying the imports again. The backend is never initialised here, only in the children.

Child protocol (stdout): ``pid N`` (from the parent), ``ready S`` after opening DIR (S = the latest
step found), ``committed S`` once step S is on disk (the wait before the next save returned).
Each line goes out in one ``os.write`` (atomic on a pipe): with ``PYTHONUNBUFFERED`` a ``print`` writes
the text and its newline separately, and a SIGKILL between the two glued "committed 17" to the
parent's next "pid N".
Step s holds arrays filled with s and a grain iterator advanced s times, so a restore can tell
a complete step from a torn one.
"""
import os
import signal
import sys

import numpy as np

from k3jax.checkpoint import Checkpointer
from k3jax.data.pipeline import make_pipeline


def state(step: int):
    params = {"w": np.full((256, 256), step, np.float32), "b": np.full((256,), step, np.float32)}
    opt = {"mu": np.full((256, 256), -step, np.float32)}
    extra = {"bias": np.full((16,), step, np.float32)}
    return params, opt, extra


def data_iter():
    return make_pipeline(dataset_type="synthetic", paths=None, tokenizer=None, seq_len=8, batch_size=1, seed=0,
                         shuffle=False, process_index=0, process_count=1, vocab_size=64, read_threads=1,
                         prefetch=1)


def say(line: str) -> None:
    os.write(1, (line + "\n").encode())


def child(directory: str) -> None:
    ckpt = Checkpointer(directory, max_to_keep=3, async_save=True)
    step = ckpt.latest_step() or 0
    it = data_iter()
    for _ in range(step):
        next(it)
    say(f"ready {step}")
    while True:
        step += 1
        next(it)
        ckpt.save(step, *state(step), it)
        ckpt.wait()
        say(f"committed {step}")


def main() -> None:
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)   # killed children are reaped at once
    say("zygote ready")
    for line in sys.stdin:
        cmd, directory = line.split()
        assert cmd == "fork"
        pid = os.fork()
        if pid == 0:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            try:
                child(directory)
            finally:
                os._exit(1)
        say(f"pid {pid}")


if __name__ == "__main__":
    main()
