"""k3jax: JAX/TPU training and decoding for Kimi K3 (KDA + gated MLA + latent MoE + AttnRes)."""

__version__ = "0.1.0"
