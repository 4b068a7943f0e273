"""Run a KDA core per device under `jax.shard_map`, so Pallas kernels work on multi-device meshes.

Why: GSPMD partitions XLA ops by propagating shardings through them, but a Pallas TPU kernel is
a Mosaic custom call it cannot look into; on a mesh of more than one device XLA stops with
"Mosaic kernels cannot be automatically partitioned". The KDA recurrence is independent per
batch row and per head, so `shard_kda` hands each device its own rows and heads inside a
`jax.shard_map` and the kernel runs on those unchanged: no collectives, forward or backward.

Layout (letters b, t, h, k, v as in docs/kernels.md; `b_ax` / `h_ax` the mesh axes below):

    q, k, g   [B, T, H, K]   P(b_ax, None, h_ax, None)   -> per device [B/nb, T, H/nh, K]
    v         [B, T, H, V]   P(b_ax, None, h_ax, None)
    beta      [B, T, H]      P(b_ax, None, h_ax)
    h0, state [B, H, K, V]   P(b_ax, h_ax, None, None)
    seg ids   [B, T]         P(b_ax, None)
    o         [B, T, H, V]   P(b_ax, None, h_ax, None)

`b_ax` is `batch_axes` and `h_ax` is `head_axis`, given by the caller (the model passes
k3jax.sharding.BATCH_AXES = data, fsdp, expert and HEAD_AXIS = tensor: the mesh axes of its
"batch" and "act_heads" activation axes; kernels never import sharding), restricted to axes the mesh has that are not already
manual (size-1 axes stay in the specs; they split nothing). As in sharding._fits, a dimension
their size product does not divide is replicated (a tiny config on a big mesh): the specs then
equal the activations' own shardings, so entering and leaving the map moves no data.
Time is not split here: under context parallelism (the "seq" axis on the context mesh axis) the
layer has already made that axis manual (layers/context.py) and hands this wrapper its slice.

The map is manual over every non-manual mesh axis, so inside it no axis is left for GSPMD to
partition the kernel over; axes the specs leave out hold replicas that compute the same thing.
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

import jax
from jax.sharding import AxisType, PartitionSpec as P

def _free_axes(mesh) -> dict[str, int]:
    """{name: size} of the mesh axes this map may make manual (not manual already)."""
    return {a: s for a, s in mesh.shape.items() if a not in mesh.manual_axes}


def _dim_entry(free: dict[str, int], axes: Sequence[str], dim: int):
    """PartitionSpec entry splitting a dim of size `dim` over `axes` (None, a name or a tuple).

    Keeps the axes present in `free`; if their size product does not divide `dim` the dim stays
    whole (sharding._fits), so the spec matches how the activation is laid out. Size-1 axes stay
    in: an axis no spec names is "unmentioned", and the backward psums over those (a useless
    one-device all-reduce that XLA:CPU keeps in the program).
    """
    use = tuple(a for a in axes if a in free)
    if not use or dim % math.prod(free[a] for a in use):
        return None
    return use[0] if len(use) == 1 else use


def shard_kda(fn: Callable, mesh=None, *, batch_axes: Sequence[str], head_axis: str | None) -> Callable:
    """Wrap a KDA core `fn` (the common signature) to run per device under jax.shard_map.

    Args:
      fn: fn(q, k, v, g, beta, *, scale, initial_state, segment_ids) -> (o, final_state), e.g.
        functools.partial(kda_pallas, interpret=...). It must treat rows and heads independently
        (every KDA core does).
      mesh: a jax.sharding.Mesh / AbstractMesh, or None for the ambient mesh of `jax.set_mesh`
        (read when the wrapped function is called, i.e. while tracing under jit).
      batch_axes, head_axis: mesh axes for the batch and head dims (see the module docstring).

    Returns:
      wrapped(q [B,T,H,K], k [B,T,H,K], v [B,T,H,V], g [B,T,H,K] f32, beta [B,T,H] f32, *,
              scale=None, initial_state=[B,H,K,V] f32 | None, segment_ids=[B,T] int32 | None,
              **head_params)
        -> (o [B,T,H,V] in v.dtype, final_state [B,H,K,V] f32), the same values as `fn`.
      head_params (e.g. the tokamax core's a_log [H] and dt_bias [H, K]) are arrays with heads
      on their first dim, split like the heads and passed on to `fn` by name.
      With no mesh, or when the mesh's non-manual axes hold one device in all (1-device meshes,
      or inside a shard_map already manual over every axis), it calls `fn` directly. Inside a
      partly manual shard_map it maps over the remaining axes only. Mesh axes must be Auto or
      Manual: on Explicit axes shard_map would need the inputs resharded first, which this
      wrapper does not do, so it raises ValueError rather than move data behind the caller.
    """
    batch_axes = tuple(batch_axes)

    def wrapped(q, k, v, g, beta, *, scale=None, initial_state=None, segment_ids=None, **head_params):
        m = jax.sharding.get_abstract_mesh() if mesh is None else mesh.abstract_mesh
        free = {} if m.empty else _free_axes(m)
        if math.prod(free.values()) <= 1:
            return fn(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                      segment_ids=segment_ids, **head_params)
        explicit = [a for a in free if m.axis_types[m.axis_names.index(a)] == AxisType.Explicit]
        if explicit:
            raise ValueError(f"shard_kda needs Auto mesh axes; {explicit} are Explicit")
        B, _, H, _ = q.shape
        b = _dim_entry(free, batch_axes, B)
        h = _dim_entry(free, (head_axis,), H)
        row = P(b, None, h, None)                          # q, k, v, g, o
        state = P(b, h, None, None)                        # initial and final state
        # shard_map maps over positional arrays only: pass the optional ones when present and
        # rebuild the keyword call inside.
        extra, extra_specs = [], []
        if initial_state is not None:
            extra.append(initial_state)
            extra_specs.append(state)
        if segment_ids is not None:
            extra.append(segment_ids)
            extra_specs.append(P(b, None))
        names = sorted(head_params)                        # per-head parameters: heads first
        extra += [head_params[n] for n in names]
        extra_specs += [P(h, *[None] * (head_params[n].ndim - 1)) for n in names]

        def local(q, k, v, g, beta, *rest):
            rest = list(rest)
            h0 = rest.pop(0) if initial_state is not None else None
            seg = rest.pop(0) if segment_ids is not None else None
            return fn(q, k, v, g, beta, scale=scale, initial_state=h0, segment_ids=seg,
                      **dict(zip(names, rest)))

        # check_vma=False: under check_vma=True interpret-mode Pallas fails (its VMEM scratch
        # is typed as not varying, so dots of it with the varying blocks are rejected), and one
        # setting for interpret and Mosaic keeps the CPU tests on the TPU code path. The classic
        # transpose it implies (output cotangents divided by, input cotangents psum'd over the
        # axes a spec leaves out) is exact here: every float input and output names the same
        # axes, and replicas over the others compute identical values.
        mapped = jax.shard_map(
            local, mesh=m, in_specs=(row, row, row, row, P(b, None, h), *extra_specs),
            out_specs=(row, state), axis_names=frozenset(free), check_vma=False)
        return mapped(q, k, v, g, beta, *extra)

    return wrapped
