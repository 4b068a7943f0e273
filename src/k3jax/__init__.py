"""k3jax: JAX/TPU training and decoding for Kimi K3 (KDA + gated MLA + latent MoE + AttnRes)."""

__version__ = "0.1.0"

# Before any tool touches a device: a host with libtpu installed and no TPU starts jax on its CPU
# without libtpu's start-up errors (k3jax.jax_platforms.quiet_cpu_start; a set JAX_PLATFORMS wins).
from k3jax.jax_platforms import quiet_cpu_start as _quiet_cpu_start  # noqa: E402

_quiet_cpu_start()
