"""Test set-up: 8 fake CPU devices (set before jax is imported) and float32 matmuls."""
import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Several test processes compile for TPU topologies at once (xdist workers, subprocesses): libtpu
# otherwise takes an exclusive lock file and the second process aborts.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402

# Parity tests compare float32 numerics; the CPU default is already exact, keep it explicit.
jax.config.update("jax_default_matmul_precision", "highest")
