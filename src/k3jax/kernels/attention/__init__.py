"""MLA attention cores (pure jax): causal prefill attention with document masking, and the
absorbed latent-cache decode attention. See docs/kernels.md.

reference.py  causal_attention: the plain jnp oracle (also attention_impl="jnp")
prefill.py    blocked_attention, tokamax_attention: production prefill/training paths
decode.py     latent_attention / latent_decode_attention: absorbed attention over the latent cache
common.py     NEG_INF, max_logits: shared by all of the above
"""
from k3jax.kernels.attention.common import max_logits  # noqa: F401
from k3jax.kernels.attention.decode import latent_attention, latent_decode_attention  # noqa: F401
from k3jax.kernels.attention.prefill import blocked_attention, tokamax_attention
from k3jax.kernels.attention.reference import causal_attention

ATTENTION_IMPLS = {"jnp": causal_attention, "blocked": blocked_attention, "tokamax": tokamax_attention}


def get_attention_fn(name: str):
    """The prefill attention core called `name` (a key of ATTENTION_IMPLS); ValueError otherwise."""
    if name not in ATTENTION_IMPLS:
        raise ValueError(f"unknown attention_impl '{name}'; choose from {', '.join(ATTENTION_IMPLS)}")
    return ATTENTION_IMPLS[name]
