"""Chunked Kimi Delta Attention in plain JAX (XLA): WY/UT intra-chunk algebra plus a state walk.

Per (b, h) and chunk of C tokens (kda.md §2.1), with the intra-chunk factors of intra.py:

    Vn  = U - W @ S                       # residual values after the incoming state's erase
    O   = QG @ S + Aqk @ Vn               # history read + intra-chunk causal read
    S'  = dec[:, None] * S + Kg^T @ Vn    # carry to the next chunk

One `lax.scan` step handles a group of G chunks (chunks_per_step): the intra-chunk algebra
batched over the group, then the walk over its chunks (serially only Vn and S', the two
matmuls that need the state; O for the whole group afterwards), so the working set is
O(G * C) tokens however long T is. The gradient is a `jax.custom_vjp` (kda.md §3.1): residuals are the inputs
and the chunk-start states (T/C x [K, V] per head, O(T), tagged "kda_chunk_states" for remat
policies); one reverse scan recomputes each group's intra factors, walks back carrying dS and
applies the intra backward. Gradients flow to q, k, v, g, beta and the initial state.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from k3jax.kernels.kda.common import compute_dtype, match_vma, mm, reset_flags
from k3jax.kernels.kda.intra import SUB, IntraOut, intra_backward, intra_forward, midpoint_block



# ---------------------------------------------------------------------------------------------
# Layouts: [B, T, H, D] <-> head-major chunks [B, H, NT, C, D] (Pallas) or groups of G chunks
# [NG, B, G * C, H, D] (the scans here; [G, B, H, C, D] inside a step), padding T up to NT * C.
# ---------------------------------------------------------------------------------------------

def valid_chunk_size(chunk_size: int) -> bool:
    """A chunk the chunked kernels can split: a power of two, at least one SUB-row relation block."""
    return chunk_size >= SUB and not chunk_size & (chunk_size - 1)


def check_inputs(q, k, v, g, beta, initial_state, segment_ids, chunk_size: int | None = None):
    """Raise ValueError on inconsistent shapes (shared by all KDA entry points)."""
    if q.ndim != 4:
        raise ValueError(f"q must be [B,T,H,K], got shape {q.shape}")
    B, T, H, K = q.shape
    if k.shape != q.shape or g.shape != q.shape:
        raise ValueError(f"k {k.shape} and g {g.shape} must match q {q.shape}")
    if v.ndim != 4 or v.shape[:3] != (B, T, H):
        raise ValueError(f"v must be [B,T,H,V] with B,T,H = {(B, T, H)}, got {v.shape}")
    if beta.shape != (B, T, H):
        raise ValueError(f"beta must be [B,T,H] = {(B, T, H)}, got {beta.shape}")
    if initial_state is not None and initial_state.shape != (B, H, K, v.shape[-1]):
        raise ValueError(f"initial_state must be [B,H,K,V] = {(B, H, K, v.shape[-1])}, "
                         f"got {initial_state.shape}")
    if segment_ids is not None and segment_ids.shape != (B, T):
        raise ValueError(f"segment_ids must be [B,T] = {(B, T)}, got {segment_ids.shape}")
    if chunk_size is not None and not valid_chunk_size(chunk_size):
        raise ValueError(f"chunk_size must be a power of two >= {SUB}, got {chunk_size}")


def to_chunks(x: jax.Array, chunk: int, n_chunks: int | None = None) -> jax.Array:
    """[B, T, H, *D] -> [B, H, NT, C, *D], zero-padding T to NT * C (NT = n_chunks or the
    fewest chunks that hold T)."""
    B, T, H = x.shape[:3]
    nt = -(-T // chunk) if n_chunks is None else n_chunks
    pad = [(0, 0)] * x.ndim
    pad[1] = (0, nt * chunk - T)
    x = jnp.pad(x, pad)
    x = x.reshape((B, nt, chunk, H) + x.shape[3:])
    return jnp.moveaxis(x, 3, 1)


def from_chunks(x: jax.Array, length: int) -> jax.Array:
    """[B, H, NT, C, D] -> [B, T, H, D] (drops the padding)."""
    B, H, nt, C, D = x.shape
    return jnp.moveaxis(x, 1, 3).reshape(B, nt * C, H, D)[:, :length]


def chunk_resets(segment_ids, B: int, T: int, chunk: int, n_chunks: int | None = None):
    """Reset flags [B, 1, NT, C] (bool); padding tokens never reset, so the state passes."""
    reset = reset_flags(segment_ids, B, T)
    nt = -(-T // chunk) if n_chunks is None else n_chunks
    reset = jnp.pad(reset, ((0, 0), (0, nt * chunk - T)))
    return reset.reshape(B, 1, nt, chunk)


def to_groups(x: jax.Array, chunk: int, n_chunks: int, group: int) -> jax.Array:
    """[B, T, *R] -> [NG, B, G * C, *R] (NG = n_chunks / group), zero-padding T to NT * C.

    Tokens keep their [..., H, D] order: only the group axis moves in front of the batch, a
    free bitcast when B = 1 and a copy of contiguous G * C-token runs otherwise. The scans
    bring each step's slice (cache-sized) into the [G, B, H, C, D] order of the algebra
    (_local), instead of transposing whole inputs: on CPU a fresh buffer of T tokens costs as
    much as the copy itself (page faults), and four inputs plus the output were ~20% of the
    forward at T = 8192.
    """
    B, T = x.shape[:2]
    if n_chunks * chunk != T:
        x = jnp.pad(x, [(0, 0), (0, n_chunks * chunk - T)] + [(0, 0)] * (x.ndim - 2))
    x = x.reshape((B, n_chunks // group, group * chunk) + x.shape[2:])
    return jnp.moveaxis(x, 1, 0)


def from_groups(x: jax.Array, length: int) -> jax.Array:
    """[NG, B, G * C, *R] -> [B, T, *R] (drops the padding); the inverse of to_groups."""
    x = jnp.moveaxis(x, 0, 1)
    return x.reshape((x.shape[0], -1) + x.shape[3:])[:, :length]


def _local(x: jax.Array, chunk: int) -> jax.Array:
    """One scan step's slice [B, G * C, H, D] -> [G, B, H, C, D] (chunk-major, heads outside)."""
    B, GC, H = x.shape[:3]
    x = x.reshape((B, GC // chunk, chunk, H) + x.shape[3:])
    return jnp.moveaxis(x, (1, 3), (0, 2))


def _unlocal(x: jax.Array) -> jax.Array:
    """[G, B, H, C, D] -> [B, G * C, H, D]; the inverse of _local."""
    G, B, H, C = x.shape[:4]
    return jnp.moveaxis(x, (0, 2), (1, 3)).reshape((B, G * C, H) + x.shape[4:])


# ---------------------------------------------------------------------------------------------
# State walk over chunks (forward and reverse), jnp version, time-major [N, B, H, ...].
# ---------------------------------------------------------------------------------------------

def walk_forward(f: IntraOut, h0: jax.Array):
    """Sequential chunk walk. f: IntraOut with leading [N, B, H] (N chunks in time order).

    Only what needs the state runs serially (Vn = U - W S and S' = dec S + Kg^T Vn, two
    matmuls per chunk); the output O = QG S + Aqk Vn depends on no later chunk, so it is one
    matmul pair batched over the N chunks afterwards, from the chunk-start states and Vn.

    Returns O [N, B, H, C, V], the final state [B, H, K, V] and the chunk-start states
    [N, B, H, K, V] (all in h0.dtype).
    """
    def step(S, xs):
        w, u, kgt, dec = xs
        vn = u - mm("...ck,...kv->...cv", w, S)
        return dec[..., None] * S + mm("...kc,...cv->...kv", kgt, vn), (vn, S)

    # Kg^T for all N chunks in one transpose: contracting Kg's row axis inside the step made
    # XLA:CPU fall back from its fast matmul path to a slower transposed-operand dot.
    kgt = jnp.swapaxes(f.kg, -1, -2)
    S, (vn, states) = lax.scan(step, match_vma(h0, f.u), (f.w, f.u, kgt, f.dec))
    o = mm("...ck,...kv->...cv", f.qg, states) + mm("...cj,...jv->...cv", f.aqk, vn)
    return o, S, states


def walk_backward(f: IntraOut, states: jax.Array, do: jax.Array, dS: jax.Array):
    """Reverse chunk walk carrying dS (kda.md §3.1), time-major like walk_forward.

    Args: f, chunk-start states [N, B, H, K, V], dO [N, B, H, C, V], dS = cotangent of the
    final state [B, H, K, V]. Returns (IntraOut of cotangents, d.aqk not yet masked; dh0).
    """
    def step(dS, xs):
        aqk, w, u, qg, kg, dec, S, do_c = xs
        vn = u - mm("...ck,...kv->...cv", w, S)
        dvn = mm("...ij,...iv->...jv", aqk, do_c) + mm("...ck,...kv->...cv", kg, dS)
        daqk = mm("...iv,...jv->...ij", do_c, vn)
        dqg = mm("...cv,...kv->...ck", do_c, S)
        dw = -mm("...cv,...kv->...ck", dvn, S)
        dkg = mm("...cv,...kv->...ck", vn, dS)
        dS_prev = (dec[..., None] * dS + mm("...ck,...cv->...kv", qg, do_c)
                   - mm("...ck,...cv->...kv", w, dvn))
        return dS_prev, (daqk, dw, dvn, dqg, dkg, dS)

    dh0, (*d, dS_all) = lax.scan(step, match_vma(dS, do), (*f, states, do), reverse=True)
    # d dec = rowsum(S_n * dS_n), batched over the chunks after the sequential part.
    return IntraOut(*d, jnp.sum(states * dS_all, axis=-1)), dh0


# ---------------------------------------------------------------------------------------------
# custom_vjp core on grouped tensors [NG, B, G * C, ...] (to_groups: NG groups of G chunks).
# ---------------------------------------------------------------------------------------------

def _local_inputs(x, chunk: int):
    """A step's (q, k, v, g, beta, reset) slices in the layout of intra_forward."""
    q, k, v, g, beta, reset = x
    B, GC = reset.shape
    reset = jnp.moveaxis(reset.reshape(B, GC // chunk, 1, chunk), 1, 0)   # [G, B, 1, C]
    return (*(_local(t, chunk) for t in (q, k, v, g)), _local(beta[..., None], chunk)[..., 0],
            reset)


def _scan_forward(q, k, v, g, beta, h0, reset, scale, dtype, block, chunk, keep_states: bool):
    def body(S, x):
        f, _ = intra_forward(*_local_inputs(x, chunk), scale=scale, dtype=dtype, block=block)
        o, S, states = walk_forward(f, S)
        return S, (_unlocal(o), states) if keep_states else _unlocal(o)

    return lax.scan(body, h0, (q, k, v, g, beta, reset))


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10))
def _core(q, k, v, g, beta, h0, reset, scale, dtype, block, chunk):
    S, o = _scan_forward(q, k, v, g, beta, h0, reset, scale, dtype, block, chunk,
                         keep_states=False)
    return o, S


def _core_fwd(q, k, v, g, beta, h0, reset, scale, dtype, block, chunk):
    S, (o, states) = _scan_forward(q, k, v, g, beta, h0, reset, scale, dtype, block, chunk,
                                   keep_states=True)
    # The chunk-start states are the only non-input residual: T/C x [K, V] per head, O(T).
    # Named so that a remat policy can choose to drop them (then the forward reruns).
    states = checkpoint_name(states, "kda_chunk_states")
    return (o, S), (q, k, v, g, beta, h0, reset, states)


def _core_bwd(scale, dtype, block, chunk, res, cts):
    q, k, v, g, beta, h0, reset, states = res
    do, dS = cts

    def reverse(dS, x):
        *x, states_g, do_g = x
        x = _local_inputs(x, chunk)
        f, saved = intra_forward(*x, scale=scale, dtype=dtype, block=block)
        d, dS_prev = walk_backward(f, states_g, _local(do_g, chunk).astype(dtype), dS)
        dq, dk, dv, dg, dbeta = intra_backward(d, f, saved, x[1], x[2], x[4], scale=scale,
                                               block=block)
        return dS_prev, (*(_unlocal(t) for t in (dq, dk, dv, dg)), _unlocal(dbeta[..., None])[..., 0])

    dh0, grads = lax.scan(reverse, match_vma(dS.astype(dtype), do),
                          (q, k, v, g, beta, reset, states, do), reverse=True)
    grads = grads + (dh0,)
    return tuple(x.astype(p.dtype) for x, p in zip(grads, res[:6])) + (None,)


_core.defvjp(_core_fwd, _core_bwd)


def kda_chunked(q, k, v, g, beta, *, scale: float | None = None, initial_state=None,
                segment_ids=None, chunk_size: int = 64, chunks_per_step: int | None = 2,
                lower_bound: float | None = None):
    """Chunked KDA forward with a memory-O(T) custom gradient.

    Args:
      q, k: [B, T, H, K] float (bf16/f32/f64), already l2-normalised by the caller.
      v: [B, T, H, V].
      g: [B, T, H, K] float32 log-decay (<= 0).  beta: [B, T, H] float32.
      scale: multiplies q inside the core; None -> K ** -0.5.
      initial_state: [B, H, K, V] float32 or None (zeros).
      segment_ids: [B, T] int32 or None; the state resets where the id changes (never at t = 0).
      chunk_size: C, a power of two >= 16. Any T works (padded internally with q=k=v=beta=g=0).
      chunks_per_step: G, chunks whose intra-chunk algebra is batched in one step of the
        sequential scan (None: all chunks in one step). A small G keeps the working set at
        O(G * C) tokens, cache-resident on CPU; it never changes the result (2 was fastest of
        1, 2, 4 and 8 on CPU at T = 8192, docs/kernels.md).
      lower_bound: None for any gate g <= 0, or a bound the caller guarantees, g >= lower_bound
        (K3's bounded gate: -5). Then the relation matrices take the bounded form of
        intra.rel_forward_mid (one matmul per 16-row block instead of exact elementwise
        diagonal blocks), the same algebra with every exponential factor finite. A gate below
        the bound breaks that guarantee; bounds below -20 get the general form.

    Returns:
      o [B, T, H, V] in v.dtype; final_state [B, H, K, V] float32 (float64 for float64 inputs).
    """
    check_inputs(q, k, v, g, beta, initial_state, segment_ids, chunk_size)
    if lower_bound is not None and not -float("inf") < lower_bound < 0:
        raise ValueError(f"lower_bound must be a finite negative gate bound or None, got {lower_bound}")
    B, T, H, K = q.shape
    V = v.shape[-1]
    dtype = compute_dtype(q, k, v, g, beta, initial_state)
    scale = float(K ** -0.5 if scale is None else scale)
    h0 = (jnp.zeros((B, H, K, V), dtype) if initial_state is None
          else initial_state.astype(dtype))
    h0 = match_vma(h0, q)                                  # a zero state inside shard_map
    C = chunk_size
    nt = -(-T // C)
    G = nt if chunks_per_step is None else max(1, min(chunks_per_step, nt))
    nt = -(-nt // G) * G                                   # whole groups; padding passes S
    groups = lambda x: to_groups(x, C, nt, G)              # noqa: E731
    o, S = _core(groups(q), groups(k), groups(v), groups(g), groups(beta), h0,
                 groups(reset_flags(segment_ids, B, T)), scale, jnp.dtype(dtype),
                 midpoint_block(lower_bound, C), C)
    return from_groups(o, T).astype(v.dtype), S


def chunked_flops_per_token(H: int, K: int, V: int, chunk: int) -> float:
    """Analytic matmul FLOPs of one chunked KDA forward, per token (all H heads).

    Counts 2 x the multiply-adds of the dense products of one chunk of C tokens, divided by C,
    masked triangles in full (that is what a matrix unit executes): Aqk, Rkk and W = A @ Xw
    (3 C^2 K), U = A @ Xu and Aqk @ Vn (2 C^2 V), W @ S, QG @ S and Kg^T @ Vn (3 C K V), plus the
    triangular inverse (~C^3 / 3). Exponentials, masks and cumsums are excluded. The backward
    costs about twice this (plus one recomputation of the intra-chunk part).
    """
    C = chunk
    per_chunk = 2 * (3 * C * C * K + 2 * C * C * V + 3 * C * K * V) + 2 * C ** 3 / 3
    return H * per_chunk / C
