"""Helpers shared by every KDA path: reference, chunked, Pallas TPU and decode.

They sit here rather than in reference.py so that reference.py holds the oracle and nothing
else, and no fast path imports the module it is tested against. Because the reference uses
them too, a bug here would hide from the parity tests; tests/test_kda_reference.py pins the
reference (these helpers included) against an independent float64 numpy loop for that reason.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def mm(spec: str, *xs):
    """einsum at HIGHEST precision (the chunked path's f32 algebra: XLA's default precision may
    round f32 matmul operands to bf16 on TPU, far outside the parity tolerances)."""
    return jnp.einsum(spec, *xs, precision=lax.Precision.HIGHEST)


def compute_dtype(*arrays) -> jnp.dtype:
    """float32, or float64 when any input is float64 (only possible with jax_enable_x64)."""
    return jnp.result_type(jnp.float32, *[a.dtype for a in arrays if a is not None])


def match_vma(x: jax.Array, ref: jax.Array) -> jax.Array:
    """x made to vary over the same jax.shard_map axes as ref (no-op outside shard_map).

    Loop carries must keep their type: a zero state created inside a shard_map is replicated
    while the state after one step varies like q, so the initial carry is cast up front.
    """
    missing = tuple(sorted(jax.typeof(ref).mat.varying - jax.typeof(x).mat.varying))
    return lax.pcast(x, missing, to="varying") if missing else x


def reset_flags(segment_ids: jax.Array | None, batch: int, length: int) -> jax.Array:
    """reset[b, t] = segment_ids[b, t] != segment_ids[b, t-1] for t > 0, and False at t = 0.

    The initial state belongs to the first token's document, so t = 0 never resets.
    Returns bool [B, T].
    """
    if segment_ids is None:
        return jnp.zeros((batch, length), dtype=bool)
    seg = jnp.asarray(segment_ids)
    changed = seg[:, 1:] != seg[:, :-1]
    return jnp.concatenate([jnp.zeros((batch, 1), dtype=bool), changed], axis=1)
