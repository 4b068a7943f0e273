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
