"""The platform a trace lowers for, and what each ``auto`` kernel key picks on it.

Every kernel or implementation choice that differs between CPU, GPU and TPU (``moe_impl``,
``loss_impl``, ``moe_ep_transport``, ``kda_impl``, ``attention_impl``, tokamax's implementation)
asks ``target_platform()``; the ``auto`` value of each key resolves here, in ``AUTO``, and nowhere
else (docs/kernels.md, "Platform defaults", gives the evidence for each entry).
"""
from __future__ import annotations

import jax

# What ``auto`` picks per key and platform. An explicit value is always used as given.
AUTO = {
    # XLA:CPU's ragged_dot runs every expert on every row (docs/moe.md); TPU and GPU lower it grouped.
    "moe_impl": {"cpu": "blocked", "gpu": "ragged_dot", "tpu": "ragged_dot"},
    # One host's memory holds the kept head gradient; a pod's gathered K3 head (4.4 GiB) must not.
    "loss_impl": {"cpu": "chunked_fused", "gpu": "chunked", "tpu": "chunked"},
    # XLA:CPU has no ragged_all_to_all; the padded exchange emulates it with a fixed-size all_to_all.
    "moe_ep_transport": {"cpu": "padded", "gpu": "ragged", "tpu": "ragged"},
    # The chunked XLA core runs under every mesh (context parallelism included) and plans 9x less
    # temporary memory than pallas_tpu on v5p; tokamax's KDA has no GPU kernel (Mosaic TPU only).
    # Never tokamax here: its core takes the gate's pre-activation, which the layer decides up front.
    "kda_impl": {"cpu": "chunked", "gpu": "chunked", "tpu": "chunked"},
    # cuDNN flash attention on GPU where its dtypes and head dims allow (else GPU_ATTENTION_FALLBACK);
    # O(T) memory on TPU (jnp holds 6.4 GB of logits per K3 MLA layer); jnp on CPU up to one query
    # block of blocked, blocked beyond (attention.resolve_attention).
    "attention_impl": {"cpu": "jnp", "gpu": "cudnn", "tpu": "blocked"},
}
# attention_impl=auto on a GPU when cuDNN cannot take the call (float32, head dims over its limit).
GPU_ATTENTION_FALLBACK = "blocked"


def target_platform() -> str:
    """Platform the current trace lowers for: the active mesh's (jax.set_mesh), else default.

    Ahead-of-time compilation for a TPU topology from a CPU host sets a mesh of TPU devices, so
    the kernels lower for TPU although the default backend is CPU.
    """
    device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    return device.platform if device is not None else jax.default_backend()


def platform_family(platform: str) -> str:
    """cpu | gpu | tpu for a jax platform name (``cuda`` and ``rocm`` devices are GPUs)."""
    return "gpu" if platform in ("gpu", "cuda", "rocm") else platform


def resolve(key: str, value: str, platform: str | None = None) -> str:
    """``value`` of kernel key ``key``, with ``auto`` replaced by ``AUTO[key]`` for devices of
    ``platform`` (None: the ambient mesh's, else the default backend's, so an AOT compile for a TPU
    topology on a CPU host resolves for TPU). Any other value is returned unchanged."""
    if value != "auto":
        return value
    family = platform_family(platform or target_platform())
    picks = AUTO[key]
    if family not in picks:
        raise ValueError(f"{key}=auto has no choice for platform {platform!r}; set {key} explicitly "
                         f"(one of {sorted(set(picks.values()))})")
    return picks[family]
