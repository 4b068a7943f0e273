"""MLA prefill/training attention through cuDNN's flash attention (``attention_impl=cudnn``, and
``attention_impl=auto`` on a GPU where ``cudnn_misfit`` finds nothing against the call).

``jax.nn.dot_product_attention(implementation="cudnn")`` with a causal mask and the document mask
as a boolean mask. Same contract as ``reference.causal_attention``: (o [B,T,H,Dv] in v.dtype,
max_logit [H] f32); the max logit, which the fused kernel does not return, comes from a blockwise
pass without gradients (as for tokamax). ``jax.nn.dot_product_attention`` wants value heads as wide
as key heads: when MLA's differ (qk 192 with RoPE, v 128) the narrower side is zero-padded to the
wider width and the output sliced back, exact but costing the padded columns' work.

cuDNN takes bf16 / fp16 only, head dims that are multiples of 8, at most 128 (256 from Hopper,
compute capability 9.0), and with a mask an even sequence length (``cudnn_misfit``). ``implementation="xla"`` runs the same call through XLA on any platform:
the CPU tests exercise this path with it.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from k3jax.kernels.attention.prefill import _max_logits_blockwise
from k3jax.kernels.platform import platform_family, target_platform

CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)


def head_dim_limit() -> int:
    """cuDNN's largest head dim on this host's GPU: 256 from Hopper (9.0) on, 128 before."""
    try:
        cc = jax.local_devices(backend="gpu")[0].compute_capability
    except (RuntimeError, IndexError, AttributeError):
        return 128
    return 256 if tuple(int(x) for x in cc.split(".")) >= (9, 0) else 128


def cudnn_misfit(q, k, v) -> str | None:
    """Why cuDNN cannot take this call (a phrase), or None when it can."""
    d = max(q.shape[-1], v.shape[-1])
    if q.dtype not in CUDNN_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"it takes bfloat16 or float16 inputs, got {q.dtype}"
    if d % 8 or d > head_dim_limit():
        return (f"its head dims must be multiples of 8 and at most {head_dim_limit()} here, got qk "
                f"{q.shape[-1]}, v {v.shape[-1]}")
    if q.shape[1] % 2:
        return f"with a mask it needs an even sequence length, got {q.shape[1]}"
    return None


def cudnn_attention(q, k, v, segment_ids, *, scale: float, implementation: str = "cudnn"):
    """Causal, document-masked attention by ``jax.nn.dot_product_attention``.

    q, k [B,T,H,Dqk], v [B,T,H,Dv], segment_ids [B,T] int32 -> (o [B,T,H,Dv] in v.dtype, max_logit
    [H] f32). ``implementation="cudnn"`` needs a GPU target and ``cudnn_misfit`` None (ValueError
    naming the problem otherwise); ``"xla"`` runs the same call through XLA anywhere.
    """
    if implementation == "cudnn":
        platform = target_platform()
        if platform_family(platform) != "gpu":
            raise ValueError(f"attention_impl=cudnn runs cuDNN's GPU kernel but the target platform is "
                             f"{platform}; use attention_impl=auto (or jnp / blocked)")
        why = cudnn_misfit(q, k, v)
        if why is not None:
            raise ValueError(f"attention_impl=cudnn: cuDNN cannot take this attention ({why}); use "
                             f"attention_impl=auto or blocked, or dtype=bfloat16")
    dv, d = v.shape[-1], max(q.shape[-1], v.shape[-1])
    widen = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, d - x.shape[-1])))   # zero columns: exact
    mask = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]     # [B,1,T,T] same document
    o = jax.nn.dot_product_attention(widen(q), widen(k), widen(v), mask=mask, scale=scale, is_causal=True,
                                     implementation=implementation)
    return o[..., :dv].astype(v.dtype), _max_logits_blockwise(q, k, segment_ids, scale)
