"""Pieces every MLA attention path shares: the masking constant and the max-logit statistic.

The oracle (reference.py), the prefill kernels (prefill.py) and the decode kernel (decode.py)
all import from here, so no production path has to import the oracle for a helper.
"""
from __future__ import annotations

import jax.numpy as jnp

NEG_INF = -1e30  # large finite: fully masked rows (padding) stay NaN-free


def max_logits(logits, mask):
    """Per-head max of valid logits: logits [B,H,T,S] f32, mask [B,1,T,S] -> [H] f32."""
    return jnp.max(jnp.where(mask, logits, -jnp.inf), axis=(0, 2, 3))
