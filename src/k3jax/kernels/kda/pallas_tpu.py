"""Kimi Delta Attention with the chunk walk as Pallas TPU kernels (forward and backward).

Split of the work (kda.md §5, plan step 1):
  * XLA: gates' cumsum, relation matrices, (I + L)^-1, the WY factors W/U, QG, Kg and the chunk
    decay (intra.py, batched over all chunks, no sequential dependency), and their backward.
  * Pallas: the sequential state walk over chunks, forward (Vn, O, S) and reverse (dS and the
    cotangents of the walk inputs). Grid (B*H, NT): heads "parallel", chunks "arbitrary" (last,
    sequential), the state [K, V] f32 carried in a VMEM scratch across grid steps, initialised
    under pl.when(n == 0) and written out under pl.when(n == NT - 1) into a resident block.

Layout in HBM is head-major [B*H, NT*C, D] so every block is a lane-dense (C, D) tile; chunk
decays are [B*H, NT, K, 1] so a block (K, 1) is a column that scales the state's rows. All
blocks' last two dims equal full array dims or are multiples of (8, 128) for C in {64, 128}.

Precision: the state, carries and accumulation are f32. f32 inputs: dots at
Precision.HIGHEST (Mosaic's default f32 dot may truncate operands to bf16). bf16 inputs: the walk
operands (W, U, QG, Kg, Aqk and the state as an operand) go through the MXU as bf16 with f32
accumulation; the intra-chunk algebra stays f32 in XLA either way.

jax.grad cannot pass through pallas_call, so the entry point is a jax.custom_vjp. Under
differentiation the forward kernel also emits the chunk-start states (T/C x [K, V] f32 per head,
the only residual besides the inputs, tagged "kda_chunk_states"); the backward recomputes the
intra factors in XLA, runs the reverse kernel, then the intra backward.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from k3jax.kernels.kda.chunked import check_inputs, chunk_resets, from_chunks, to_chunks
from k3jax.kernels.kda.common import compute_dtype, match_vma
from k3jax.kernels.kda.intra import IntraOut, intra_backward, intra_forward
from k3jax.kernels.platform import target_platform

_F32 = jnp.float32


def check_platform(interpret: bool) -> None:
    """Raise if compiled Mosaic kernels are requested where they cannot run."""
    if interpret:
        return
    platform = target_platform()
    if platform != "tpu":
        raise RuntimeError(
            f"kda_pallas compiles Mosaic TPU kernels, but the target platform is {platform!r}. "
            "Pass interpret=True to run the kernels in the Pallas interpreter, or use "
            "kda_impl='chunked' (the XLA implementation) on this backend.")


def _dot(a, b, mm_dtype, *, ta: bool = False, tb: bool = False):
    """a @ b (a^T if ta, b^T if tb) with f32 accumulation; HIGHEST precision for f32 operands."""
    a, b = a.astype(mm_dtype), b.astype(mm_dtype)
    dims = (((0 if ta else 1,), (1 if tb else 0,)), ((), ()))
    prec = lax.Precision.HIGHEST if mm_dtype == jnp.float32 else lax.Precision.DEFAULT
    return lax.dot_general(a, b, dims, precision=prec, preferred_element_type=_F32)


# ---------------------------------------------------------------------------------------------
# Kernels. Per grid step (b, n): one head, one chunk. Refs are the squeezed blocks.
# ---------------------------------------------------------------------------------------------

def _fwd_kernel(aqk, w, u, qg, kg, dec, h0, o, hT, *rest, mm_dtype, nt, with_states):
    """Vn = U - W S;  O = QG S + Aqk Vn;  S <- dec * S + Kg^T Vn."""
    states, S_ref = (rest[0], rest[1]) if with_states else (None, rest[0])
    n = pl.program_id(1)

    @pl.when(n == 0)
    def _():
        S_ref[...] = h0[...].astype(_F32)

    S = S_ref[...]
    if with_states:
        states[...] = S                                    # chunk-start state for the backward
    vn = u[...].astype(_F32) - _dot(w[...], S, mm_dtype)
    o[...] = (_dot(qg[...], S, mm_dtype) + _dot(aqk[...], vn, mm_dtype)).astype(o.dtype)
    S_new = dec[...].astype(_F32) * S + _dot(kg[...], vn, mm_dtype, ta=True)
    S_ref[...] = S_new

    @pl.when(n == nt - 1)
    def _():
        hT[...] = S_new


def _bwd_kernel(aqk, w, u, qg, kg, dec, states, do, dhT,
                daqk, dw, dvn_out, dqg, dkg, ddec, dh0, dS_ref, *, mm_dtype, nt):
    """Reverse walk over chunks n = NT-1 .. 0 carrying dS (kda.md §3.1)."""
    n = pl.program_id(1)

    @pl.when(n == 0)
    def _():
        dS_ref[...] = dhT[...].astype(_F32)

    dS = dS_ref[...]
    S = states[...]
    g_o = do[...].astype(_F32)
    vn = u[...].astype(_F32) - _dot(w[...], S, mm_dtype)
    dvn = _dot(aqk[...], g_o, mm_dtype, ta=True) + _dot(kg[...], dS, mm_dtype)
    daqk[...] = _dot(g_o, vn, mm_dtype, tb=True)
    dqg[...] = _dot(g_o, S, mm_dtype, tb=True)
    dw[...] = -_dot(dvn, S, mm_dtype, tb=True)
    dkg[...] = _dot(vn, dS, mm_dtype, tb=True)
    dvn_out[...] = dvn
    ddec[...] = jnp.sum(S * dS, axis=1, keepdims=True)
    dS_prev = (dec[...].astype(_F32) * dS + _dot(qg[...], g_o, mm_dtype, ta=True)
               - _dot(w[...], dvn, mm_dtype, ta=True))
    dS_ref[...] = dS_prev

    @pl.when(n == nt - 1)
    def _():
        dh0[...] = dS_prev


# ---------------------------------------------------------------------------------------------
# pallas_call wrappers on chunk-major tensors [B, H, NT, C, D].
# ---------------------------------------------------------------------------------------------

def _flat(x):
    """[B, H, NT, C, D] -> [B*H, NT*C, D] (free reshape)."""
    B, H, nt, C, D = x.shape
    return x.reshape(B * H, nt * C, D)


def _specs(nt, C, K, V, reverse):
    chunk = (lambda n: nt - 1 - n) if reverse else (lambda n: n)
    rows = lambda d: pl.BlockSpec((None, C, d), lambda b, n: (b, chunk(n), 0))  # noqa: E731
    return dict(
        rows=rows,
        dec=pl.BlockSpec((None, None, K, 1), lambda b, n: (b, chunk(n), 0, 0)),
        state=pl.BlockSpec((None, K, V), lambda b, n: (b, 0, 0)),
        states=pl.BlockSpec((None, None, K, V), lambda b, n: (b, chunk(n), 0, 0)),
    )


def _vary_all(args):
    """Make every operand vary over the same shard_map axes; return them and that axis type.

    Under jax.shard_map (check_vma=True) a pallas_call's out_shape must state how its outputs
    vary across manual mesh axes: the union over the inputs (a zero initial state created inside
    the map is not varying while q is, so those are cast up first). Outside shard_map this is
    the empty set and changes nothing.
    """
    axes = frozenset().union(*(jax.typeof(a).mat.varying for a in args))
    out = []
    for a in args:
        missing = tuple(sorted(axes - jax.typeof(a).mat.varying))
        out.append(lax.pcast(a, missing, to="varying") if missing else a)
    return out, jax.sharding.ManualAxisType(varying=axes)


def _params():
    return pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"))


def walk_forward_pallas(f: IntraOut, h0, *, mm_dtype, interpret: bool, with_states: bool):
    """Pallas chunk walk. f fields [B, H, NT, ...] (f32 or mm_dtype), h0 [B, H, K, V] f32.

    Returns O [B, H, NT, C, V] f32, the final state [B, H, K, V] f32 and, if with_states, the
    chunk-start states [B, H, NT, K, V] f32 (else None).
    """
    B, H, nt, C, K = f.w.shape
    V = f.u.shape[-1]
    s = _specs(nt, C, K, V, reverse=False)
    cast = lambda x: _flat(x).astype(mm_dtype)  # noqa: E731
    args = (cast(f.aqk), cast(f.w), cast(f.u), cast(f.qg), cast(f.kg),
            f.dec.reshape(B * H, nt, K, 1).astype(_F32), h0.reshape(B * H, K, V).astype(_F32))
    args, mat = _vary_all(args)
    sds = functools.partial(jax.ShapeDtypeStruct, manual_axis_type=mat)
    in_specs = [s["rows"](C), s["rows"](K), s["rows"](V), s["rows"](K), s["rows"](K), s["dec"],
                s["state"]]
    out_shape = [sds((B * H, nt * C, V), _F32), sds((B * H, K, V), _F32)]
    out_specs = [s["rows"](V), s["state"]]
    if with_states:
        out_shape.append(sds((B * H, nt, K, V), _F32))
        out_specs.append(s["states"])
    outs = pl.pallas_call(
        functools.partial(_fwd_kernel, mm_dtype=mm_dtype, nt=nt, with_states=with_states),
        out_shape=out_shape, grid=(B * H, nt), in_specs=in_specs, out_specs=out_specs,
        scratch_shapes=[pltpu.VMEM((K, V), _F32)], compiler_params=_params(),
        interpret=interpret, name="kda_walk_fwd")(*args)
    o = outs[0].reshape(B, H, nt, C, V)
    S = outs[1].reshape(B, H, K, V)
    states = outs[2].reshape(B, H, nt, K, V) if with_states else None
    return o, S, states


def walk_backward_pallas(f: IntraOut, states, do, dS, *, mm_dtype, interpret: bool):
    """Reverse Pallas walk. Returns (IntraOut of f32 cotangents, d.aqk unmasked; dh0 [B,H,K,V])."""
    B, H, nt, C, K = f.w.shape
    V = f.u.shape[-1]
    s = _specs(nt, C, K, V, reverse=True)
    cast = lambda x: _flat(x).astype(mm_dtype)  # noqa: E731
    args = (cast(f.aqk), cast(f.w), cast(f.u), cast(f.qg), cast(f.kg),
            f.dec.reshape(B * H, nt, K, 1).astype(_F32),
            states.reshape(B * H, nt, K, V).astype(_F32), _flat(do).astype(_F32),
            dS.reshape(B * H, K, V).astype(_F32))
    args, mat = _vary_all(args)
    sds = functools.partial(jax.ShapeDtypeStruct, manual_axis_type=mat)
    in_specs = [s["rows"](C), s["rows"](K), s["rows"](V), s["rows"](K), s["rows"](K), s["dec"],
                s["states"], s["rows"](V), s["state"]]
    rows = lambda d: sds((B * H, nt * C, d), _F32)  # noqa: E731
    out_shape = [rows(C), rows(K), rows(V), rows(K), rows(K), sds((B * H, nt, K, 1), _F32),
                 sds((B * H, K, V), _F32)]
    out_specs = [s["rows"](C), s["rows"](K), s["rows"](V), s["rows"](K), s["rows"](K), s["dec"],
                 s["state"]]
    daqk, dw, dvn, dqg, dkg, ddec, dh0 = pl.pallas_call(
        functools.partial(_bwd_kernel, mm_dtype=mm_dtype, nt=nt),
        out_shape=out_shape, grid=(B * H, nt), in_specs=in_specs, out_specs=out_specs,
        scratch_shapes=[pltpu.VMEM((K, V), _F32)], compiler_params=_params(),
        interpret=interpret, name="kda_walk_bwd")(*args)
    unflat = lambda x: x.reshape(B, H, nt, C, x.shape[-1])  # noqa: E731
    d = IntraOut(unflat(daqk), unflat(dw), unflat(dvn), unflat(dqg), unflat(dkg),
                 ddec.reshape(B, H, nt, K))
    return d, dh0.reshape(B, H, K, V)


# ---------------------------------------------------------------------------------------------
# custom_vjp core and public entry point.
# ---------------------------------------------------------------------------------------------

@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10))
def _core(q, k, v, g, beta, h0, reset, scale, dtype, mm_dtype, interpret):
    f, _ = intra_forward(q, k, v, g, beta, reset, scale=scale, dtype=dtype)
    o, S, _ = walk_forward_pallas(f, h0, mm_dtype=mm_dtype, interpret=interpret,
                                  with_states=False)
    return o, S


def _core_fwd(q, k, v, g, beta, h0, reset, scale, dtype, mm_dtype, interpret):
    f, _ = intra_forward(q, k, v, g, beta, reset, scale=scale, dtype=dtype)
    o, S, states = walk_forward_pallas(f, h0, mm_dtype=mm_dtype, interpret=interpret,
                                       with_states=True)
    # Chunk-start states: the only non-input residual, O(T); named for remat policies.
    states = checkpoint_name(states, "kda_chunk_states")
    return (o, S), (q, k, v, g, beta, h0, reset, states)


def _core_bwd(scale, dtype, mm_dtype, interpret, res, cts):
    q, k, v, g, beta, h0, reset, states = res
    do, dS = cts
    f, saved = intra_forward(q, k, v, g, beta, reset, scale=scale, dtype=dtype)
    d, dh0 = walk_backward_pallas(f, states, do, dS, mm_dtype=mm_dtype, interpret=interpret)
    d = IntraOut(*(x.astype(dtype) for x in d))
    dq, dk, dv, dg, dbeta = intra_backward(d, f, saved, k, v, beta, scale=scale)
    grads = (dq, dk, dv, dg, dbeta, dh0)
    return tuple(x.astype(p.dtype) for x, p in zip(grads, res[:6])) + (None,)


_core.defvjp(_core_fwd, _core_bwd)


def kda_pallas(q, k, v, g, beta, *, scale: float | None = None, initial_state=None,
               segment_ids=None, chunk_size: int = 64, interpret: bool = False):
    """KDA with Pallas TPU walk kernels; same contract as kda_reference / kda_chunked.

    Args:
      q, k: [B, T, H, K] bf16 or f32 (already l2-normalised).  v: [B, T, H, V] same dtype.
      g: [B, T, H, K] f32 log-decay (<= 0).  beta: [B, T, H] f32.
      scale: multiplies q inside the core; None -> K ** -0.5.
      initial_state: [B, H, K, V] f32 or None.  segment_ids: [B, T] int32 or None.
      chunk_size: C, a power of two >= 16 (64 or 128 keep the (8, 128) tiling on TPU).
      interpret: run the kernels in the Pallas interpreter (any backend, for tests). With
        interpret=False the target platform must be TPU, else RuntimeError (no fallback).

    Returns:
      o [B, T, H, V] in v.dtype, final_state [B, H, K, V] f32.
    """
    check_platform(interpret)
    check_inputs(q, k, v, g, beta, initial_state, segment_ids, chunk_size)
    B, T, H, K = q.shape
    V = v.shape[-1]
    dtype = compute_dtype(q, k, v, g, beta, initial_state)
    mm_dtype = jnp.dtype(jnp.bfloat16 if q.dtype == jnp.bfloat16 else dtype)
    scale = float(K ** -0.5 if scale is None else scale)
    h0 = (jnp.zeros((B, H, K, V), dtype) if initial_state is None
          else initial_state.astype(dtype))
    h0 = match_vma(h0, q)                                  # a zero state inside shard_map
    C = chunk_size
    reset = chunk_resets(segment_ids, B, T, C)
    o, S = _core(to_chunks(q, C), to_chunks(k, C), to_chunks(v, C), to_chunks(g, C),
                 to_chunks(beta[..., None], C)[..., 0], h0, reset, scale, jnp.dtype(dtype),
                 mm_dtype, bool(interpret))
    return from_chunks(o, T).astype(v.dtype), S.astype(dtype)
