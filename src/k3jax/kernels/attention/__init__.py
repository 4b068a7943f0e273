"""MLA attention cores (pure jax): causal prefill attention with document masking, and the
absorbed latent-cache decode attention. See docs/kernels.md."""
from k3jax.kernels.attention.reference import (  # noqa: F401
    ATTENTION_IMPLS, causal_attention, get_attention_fn, latent_decode_attention, max_logits)
