"""KDA through tokamax 0.0.17's `kimi_delta_attention`, with K3's bounded gate fused in its kernels.

tokamax computes the gate itself (use_gate_in_kernel=True): from the pre-activation f [B,T,H,K],
a_log [H] and dt_bias [H*K] it forms g = lower_bound * sigmoid(exp(a_log) * (f + dt_bias)), the
K3 gate of layers/kda.py, so the caller hands over f rather than g. Everything else follows the
common KDA contract (kernels/kda/__init__.py); the conversions to tokamax's contract live here:

  * layout: ours [B, T, H, D] <-> tokamax's head-first [H, B, T, D]; beta [B,T,H] <-> [H,B,T].
  * documents: ours reset the state where segment_ids changes (id 0 is a document like any
    other); tokamax's ids are 1-indexed runs with 0 = padding (skipped: no output, no update) and
    one state slot per run, [B, N, H, K, V] with N = max_num_segments static. We pass the run
    number, cumsum(resets) + 1, so every token is real and the semantics are exactly ours; our
    initial state goes into run 1's slot and our final state is the last run's slot.
  * max_num_segments: tokamax pads each run to a multiple of 64 tokens, so its kernels work on
    T + 63 * N tokens (rounded up to 64) and hold N states per row: the bound is a cost, not a
    formality. A row with more runs than the bound would lose its last runs' tokens silently in
    tokamax (zero output); here every output and state of the call becomes NaN instead, so the
    loss shows it at once.
  * T % 64 != 0 without segment ids: tokamax's fixed-length path needs T % 64 == 0, so such a
    call goes through the varlen path as one run (tokamax pads it to the next chunk itself).

implementation: "xla_chunked" (plain XLA, any backend) or "mosaic" (Pallas Mosaic TPU forward and
custom-VJP backward; TPU only). Both need chunk 64 and a lower bound in [-5, 0). tokamax is
imported when the function runs, so k3jax imports without it.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

import contextlib

from k3jax.kernels.kda.chunked import check_inputs
from k3jax.kernels.kda.common import reset_flags
from k3jax.kernels.platform import target_platform

TOKAMAX_CHUNK = 64
TOKAMAX_IMPLEMENTATIONS = ("xla_chunked", "mosaic")


def _head_first(x):
    """[B, T, H, ...] -> [H, B, T, ...]."""
    return jnp.moveaxis(x, 2, 0)


def kda_tokamax(q, k, v, f, beta, *, a_log, dt_bias, lower_bound: float, scale: float | None = None,
                initial_state=None, segment_ids=None, max_num_segments: int = 1,
                implementation: str = "xla_chunked"):
    """tokamax's chunked KDA with the gate activated in its kernel.

    Args:
      q, k: [B, T, H, K] float32 or bfloat16 (l2-normalised by the caller).
      v: [B, T, H, V] in q's dtype.
      f: [B, T, H, K] float32 pre-activation gate (before dt_bias).
      beta: [B, T, H] float32 in [0, 1].
      a_log: [H] float32; dt_bias: [H, K] or [H*K] float32.
      lower_bound: the bounded gate's lower bound, in [-5, 0).
      scale: multiplies q inside the core; None -> K ** -0.5.
      initial_state: [B, H, K, V] float32 or None (zeros).
      segment_ids: [B, T] int32 or None; the state resets where the id changes.
      max_num_segments: static bound on documents (runs of equal ids) per row; see the module
        docstring for its cost and what happens above it.
      implementation: "xla_chunked" or "mosaic".

    Returns:
      o [B, T, H, V] in v.dtype and the final state [B, H, K, V] float32.
    """
    import tokamax  # lazy: a slow import (seconds), paid only when a tokamax implementation runs

    check_inputs(q, k, v, f, beta, initial_state, segment_ids)
    if implementation not in TOKAMAX_IMPLEMENTATIONS:
        raise ValueError(f"implementation={implementation!r}: tokamax KDA runs {TOKAMAX_IMPLEMENTATIONS}")
    if not -5.0 <= lower_bound < 0.0:
        raise ValueError(f"lower_bound={lower_bound}: tokamax's fused gate needs it in [-5, 0)")
    if max_num_segments < 1:
        raise ValueError(f"max_num_segments={max_num_segments}: must be >= 1")
    B, T, H, K = q.shape
    V = v.shape[-1]
    dt_bias = jnp.reshape(dt_bias, (H * K,)).astype(jnp.float32)
    varlen = segment_ids is not None or T % TOKAMAX_CHUNK != 0
    n = max_num_segments if varlen else 1
    runs = seg = None
    if varlen:
        runs = jnp.cumsum(reset_flags(segment_ids, B, T).astype(jnp.int32), axis=1) + 1     # [B,T]
        seg = runs
    h0 = jnp.zeros((B, n, H, K, V), jnp.float32)
    if initial_state is not None:
        h0 = h0.at[:, 0].set(initial_state.astype(jnp.float32))
    # tokamax refuses Mosaic unless the default device is a TPU; compiling ahead of time for a TPU
    # mesh from a CPU host (the mesh's devices say TPU) is its documented cross-compile case.
    cross = implementation == "mosaic" and target_platform() == "tpu" != jax.default_backend()
    with tokamax.config.cross_compile(True) if cross else contextlib.nullcontext():
        o, states = _call(tokamax, q, k, v, f, beta, a_log, dt_bias, scale, h0, seg, lower_bound,
                          n if varlen else None, implementation)
    o = jnp.moveaxis(o, 0, 2).astype(v.dtype)                     # [H,B,T,V] -> [B,T,H,V]
    if not varlen:
        return o, states[:, 0]
    last = runs[:, -1] - 1                                        # [B] slot of each row's last run
    state = jnp.take_along_axis(states, jnp.minimum(last, n - 1)[:, None, None, None, None],
                                axis=1)[:, 0]
    over = jnp.max(runs[:, -1]) > n                               # a row has more runs than slots
    return jnp.where(over, jnp.nan, o).astype(v.dtype), jnp.where(over, jnp.nan, state)


def _call(tokamax, q, k, v, f, beta, a_log, dt_bias, scale, h0, seg, lower_bound, n, implementation):
    """tokamax's op on head-first inputs -> (o [H, B, T, V], states [B, N, H, K, V])."""
    return tokamax.ops.kimi_delta_attention(
        _head_first(q), _head_first(k), _head_first(v), _head_first(f.astype(jnp.float32)),
        jnp.moveaxis(beta.astype(jnp.float32), 2, 0),
        a_log=a_log.astype(jnp.float32), delta_time_bias=dt_bias, scale=scale,
        initial_state=h0, output_final_state=True, use_gate_in_kernel=True,
        segment_ids=seg, lower_bound=float(lower_bound), max_num_segments=n,
        implementation=implementation)


def default_implementation(platform: str) -> str:
    """The tokamax implementation for a target platform: Mosaic kernels on TPU, XLA elsewhere."""
    return "mosaic" if platform == "tpu" else "xla_chunked"
