"""MLA attention cores (pure jax): causal prefill attention with document masking, and the
absorbed latent-cache decode attention. See docs/kernels.md.

reference.py  causal_attention: the plain jnp oracle (also attention_impl="jnp")
prefill.py    blocked_attention, tokamax_attention: production prefill/training paths
cudnn.py      cudnn_attention: jax.nn.dot_product_attention's cuDNN flash kernel (GPU)
decode.py     latent_attention / latent_decode_attention: absorbed attention over the latent cache
common.py     NEG_INF, max_logits: shared by all of the above
"""
from k3jax.kernels.attention.common import max_logits  # noqa: F401
from k3jax.kernels.attention.cudnn import cudnn_attention, cudnn_misfit
from k3jax.kernels.attention.decode import latent_attention, latent_decode_attention  # noqa: F401
from k3jax.kernels.attention.prefill import QUERY_BLOCK, blocked_attention, tokamax_attention
from k3jax.kernels.attention.reference import causal_attention
from k3jax.kernels.platform import GPU_ATTENTION_FALLBACK, resolve

ATTENTION_IMPLS = {"jnp": causal_attention, "blocked": blocked_attention, "tokamax": tokamax_attention,
                   "cudnn": cudnn_attention}


def resolve_attention(name: str, q, k, v, platform: str | None = None) -> str:
    """`name` with ``auto`` resolved for the target platform (kernels.platform.AUTO) and this call:
    on a GPU, cudnn where ``cudnn_misfit`` finds nothing against it, else GPU_ATTENTION_FALLBACK; on
    CPU, jnp while the sequence fits one query block of ``blocked`` (the same arithmetic without the
    recompute), blocked above it (faster there and O(T) memory: docs/kernels.md)."""
    picked = resolve("attention_impl", name, platform)
    if name == "auto" and picked == "cudnn" and cudnn_misfit(q, k, v) is not None:
        return GPU_ATTENTION_FALLBACK
    if name == "auto" and picked == "jnp" and q.shape[1] > QUERY_BLOCK:
        return "blocked"
    return picked


def auto_attention(q, k, v, segment_ids, *, scale: float):
    """``attention_impl=auto``: the implementation is picked when the call is traced, for the
    platform it lowers for (so an AOT compile for a TPU topology from a CPU host picks TPU's)."""
    return ATTENTION_IMPLS[resolve_attention("auto", q, k, v)](q, k, v, segment_ids, scale=scale)


def get_attention_fn(name: str):
    """The prefill attention core called `name` (a key of ATTENTION_IMPLS, or ``auto``); ValueError
    otherwise."""
    if name == "auto":
        return auto_attention
    if name not in ATTENTION_IMPLS:
        raise ValueError(f"unknown attention_impl '{name}'; choose from auto, {', '.join(ATTENTION_IMPLS)}")
    return ATTENTION_IMPLS[name]
