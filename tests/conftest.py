"""Test set-up: 8 fake CPU devices (set before jax is imported), float32 matmuls, and one persistent
compilation cache for the whole session (xdist workers and the subprocesses tests start inherit it
through the environment, so a program compiled once is not compiled again)."""
import os
from pathlib import Path

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Several test processes compile for TPU topologies at once (xdist workers, subprocesses): libtpu
# otherwise takes an exclusive lock file and the second process aborts.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      str(Path(__file__).resolve().parents[1] / ".pytest_cache" / "jax-compilation-cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")

import jax  # noqa: E402

# Parity tests compare float32 numerics; the CPU default is already exact, keep it explicit.
jax.config.update("jax_default_matmul_precision", "highest")


import fcntl  # noqa: E402
import types  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """The tiny K3 trained for 4 steps in f32 by ``python -m k3jax.train`` (checkpoints at steps 2
    and 4), once per test session: under xdist the first worker trains it and the others wait on a
    lock, then everyone reads it. -> namespace(root, run, checkpoint, args): ``args`` are the
    training overrides plus base_output_directory, the key=values that load it again."""
    from helpers import TINY_TRAIN, run_tool
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "tiny-run"
    root.mkdir(parents=True, exist_ok=True)
    args = TINY_TRAIN + [f"base_output_directory={root}"]
    with open(root / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (root / "done").exists():
            run_tool("train", *args, "run_name=r", "steps=4", "checkpoint_period=2")
            (root / "done").write_text("ok")
        fcntl.flock(lock, fcntl.LOCK_UN)
    return types.SimpleNamespace(root=root, run=root / "r", checkpoint=root / "r" / "checkpoints" / "4", args=args)
