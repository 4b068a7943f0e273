"""The platform a trace lowers for: what every kernel or implementation choice that differs
between CPU, GPU and TPU asks (kda_impl, moe_impl=auto, loss_impl=auto, tokamax's implementation)."""
from __future__ import annotations

import jax


def target_platform() -> str:
    """Platform the current trace lowers for: the active mesh's (jax.set_mesh), else default.

    Ahead-of-time compilation for a TPU topology from a CPU host sets a mesh of TPU devices, so
    the kernels lower for TPU although the default backend is CPU.
    """
    device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    return device.platform if device is not None else jax.default_backend()
