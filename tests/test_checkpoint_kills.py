"""Checkpoints cannot be torn: SIGKILLs at random moments of a process saving through the project's
async ``Checkpointer`` always leave the newest committed step restorable with its own contents,
and a save that runs out of disk space ends the run with one line, the earlier steps readable."""
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from k3jax.checkpoint import Checkpointer
from k3jax.errors import guard

from checkpoint_worker import data_iter, state
from helpers import REPO, tool_env

KILLS = 20
HERE = Path(__file__).parent


def _abstract(tree):
    dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=dev), tree)


def restore_problems(directory, *, with_data=True) -> tuple[int | None, list[str]]:
    """(latest step, what is wrong with any step on disk): every listed step must restore, hold
    arrays filled with its step number and (with data) the iterator position it was saved at."""
    ckpt = Checkpointer(directory, max_to_keep=3, async_save=False, with_data=with_data)
    problems = []
    try:
        latest = ckpt.latest_step()
        for step in ckpt.mngr.all_steps():
            want = state(step)
            it = data_iter() if with_data else None
            try:
                got = ckpt.restore(step, *[_abstract(x) for x in want], it)
            except Exception as e:  # noqa: BLE001 - any failure to restore is a torn checkpoint
                problems.append(f"step {step}: {type(e).__name__}: {e}")
                continue
            if not all(np.array_equal(np.asarray(g), w) for g, w in
                       zip(jax.tree.leaves(got), jax.tree.leaves(want))):
                problems.append(f"step {step}: arrays of another step")
            if with_data:
                ref = data_iter()
                for _ in range(step):
                    next(ref)
                if not np.array_equal(next(it)["tokens"], next(ref)["tokens"]):
                    problems.append(f"step {step}: data iterator at the wrong position")
    finally:
        ckpt.close()
    return latest, problems


def test_sigkill_at_random_moments_never_tears_a_checkpoint(tmp_path):
    env = dict(tool_env(), PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    zygote = subprocess.Popen([sys.executable, str(HERE / "checkpoint_worker.py")], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=env, cwd=REPO)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(l.strip()) for l in zygote.stdout], daemon=True).start()
    committed = 0

    def expect(prefix, timeout=120):
        nonlocal committed
        deadline = time.time() + timeout
        while True:
            line = lines.get(timeout=max(deadline - time.time(), 0.01))
            if line.startswith("committed "):
                committed = max(committed, int(line.split()[1]))
            if line.startswith(prefix):
                return line

    def drain():
        while True:
            try:
                expect("\0", timeout=0.2)
            except queue.Empty:
                return

    rng = random.Random(1234)
    directory = tmp_path / "checkpoints"
    torn, latest, t0, progressed = [], None, time.time(), 0
    try:
        expect("zygote ready")
        for kill in range(KILLS):
            zygote.stdin.write(f"fork {directory}\n")
            zygote.stdin.flush()
            pid = int(expect("pid ").split()[1])
            ready = int(expect("ready ").split()[1])
            assert ready == (latest or 0), (kill, ready, latest)   # the restarted saver finds the same step
            before = committed
            time.sleep(rng.uniform(0.0, 1.0))
            os.kill(pid, signal.SIGKILL)
            deadline = time.time() + 20
            while time.time() < deadline:
                try:
                    os.kill(pid, 0)
                    time.sleep(0.01)
                except ProcessLookupError:
                    break
            drain()
            progressed += committed > before
            latest, problems = restore_problems(directory)
            torn += [f"kill {kill}: {p}" for p in problems]
            # The newest step on disk is at least the last one the saver reported committed (none yet
            # when a kill lands before the first save finished).
            assert (latest or 0) >= committed, (kill, latest, committed)
    finally:
        zygote.kill()
        zygote.wait()
    print(f"{KILLS} kills in {time.time() - t0:.1f} s, {progressed} during a run that had committed a step, "
          f"last step {latest}, torn checkpoints found: {len(torn)}")
    assert not torn, torn
    assert (latest or 0) >= KILLS // 2 and progressed >= KILLS // 4   # the kills fell between and inside real saves


def test_a_full_disk_ends_the_run_with_one_line(tmp_path, capsys):
    mnt = tmp_path / "small_disk"
    mnt.mkdir()
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if p.returncode:
        pytest.fail(f"cannot mount a 1 MiB tmpfs at {mnt} (tests run as root): {p.stderr.strip()}")
    try:
        saved = []

        def run():   # what the train loop does: save every step, close at the end
            ckpt = Checkpointer(mnt / "checkpoints", max_to_keep=100, async_save=True, with_data=False)
            try:
                for step in range(1, 200):
                    ckpt.save(step, *state(step))
                    saved.append(step)
            finally:
                ckpt.close()
        assert guard(run) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and err.count("\n") == 1, err
        assert err.startswith("error: ") and str(mnt) in err and "No space left on device" in err, err
        latest, problems = restore_problems(mnt / "checkpoints", with_data=False)
        assert not problems, problems
        assert latest is not None and latest >= 3 and latest < saved[-1] + 1, (latest, saved[-1])
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
