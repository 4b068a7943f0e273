"""Expert-parallel MoE under `jax.shard_map`: tokens travel to the devices that own their experts.

Layout (per device of a mesh with `token_axes` + `expert_axis`):

    x, weights, idx   [N, ...] sharded over (*token_axes, expert_axis): n = N / #shards rows
    w_gate, w_up      [E, D, F] sharded P(expert_axis, d_axes, None): E_l = E / ep experts
    w_down            [E, F, D] sharded P(expert_axis, None, d_axes)

`d_axes` (FSDP on the model dim of expert weights) is `weight_d_axes` when given, else read
from the weights' Explicit-mesh type (Auto meshes carry no layout in the type: there None means
unsharded). Such weights are all-gathered over `d_axes` inside the shard_map (once per call,
i.e. per layer and micro-batch); the transpose reduce-scatters the weight gradients. Tokens
move only along `expert_axis`: the devices of one expert group (same token-axes coordinates)
hold all E experts between them.

mode="dropless" (exact; equals `dispatch.moe_dropless`):
  1. sort the n*k local (token, slot) rows by expert: they are then grouped by destination
     device (expert e lives on device e // E_l);
  2. exchange per-(device, local expert) counts with a tiny all_to_all, derive offsets;
  3. `jax.lax.ragged_all_to_all` the rows into a receive buffer (source-major, then local
     expert), re-sort it by local expert, grouped matmuls over the E_l local experts;
  4. the reverse ragged_all_to_all returns each row to its source, which un-sorts and combines.
  Static shapes force a worst-case receive buffer of ep * n * min(k, E_l) rows (every source
  sends all its rows here; assumes the k experts of a token are distinct, as top_k gives). That
  is ep times the average, so at large ep use mode="capacity" for bounded memory.
mode="capacity" (GShard groups; equals `dispatch.moe_capacity` applied to each token shard):
  C = ceil(capacity_factor * n * k / E) per expert and per source shard; [E, C, D] buffers
  move with a fixed-size `jax.lax.all_to_all`; assignments past C are dropped.

transport="ragged" uses `jax.lax.ragged_all_to_all` (TPU, GPU). XLA:CPU has no ragged-all-to-all
(jax-ml/jax#34755), so CPU tests pass transport="padded": the same arguments (offsets, sizes)
fed to an exact emulation by a dense all_to_all of worst-case-padded chunks. Nothing switches
transport behind the caller's back.

Mesh requirement: the axes named here must be all Explicit (inputs are `reshard`ed to the
specs above, a no-op when already so sharded) or all Auto (GSPMD moves inputs to the specs at
the shard_map boundary; pass `weight_d_axes=("fsdp",)` for FSDP-sharded experts, or GSPMD
gathers them there and all-reduces their gradients instead of reduce-scattering). Both are
tested. The experts' F dim must be unsharded inside: on Auto meshes GSPMD gathers a
tensor-sharded F at the boundary, on Explicit meshes it is an error.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from k3jax.kernels.moe.dispatch import (
    Act, capacity_collect, capacity_dispatch, capacity_of, capacity_slots, combine,
    expert_ffn_batched, expert_ffn_grouped, sort_by_expert)
from k3jax.kernels.moe.gmm import row_group_ids
from k3jax.kernels.moe.quantized import MXFP4

__all__ = ["moe_expert_parallel", "padded_ragged_all_to_all", "dispatch_bytes_per_token"]


def _exclusive_cumsum(v: jax.Array) -> jax.Array:
    return jnp.cumsum(v) - v


def padded_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                             recv_sizes, *, axis_name: str, chunk_rows: int) -> jax.Array:
    """`jax.lax.ragged_all_to_all` semantics from a dense all_to_all (one slice per device).

    Each device cuts `chunk_rows` rows at `input_offsets[j]` for every peer j (rows past
    `send_sizes[j]` masked to 0), exchanges the [ep, chunk_rows, ...] block with `all_to_all`,
    and scatters the first `recv_sizes[i]` rows from source i at the offset source i chose
    (`all_to_all(output_offsets)`). Moves ep * chunk_rows rows whatever the sizes: a test
    transport for XLA:CPU, not a fast path. Differentiable (gathers / scatters / all_to_all).

    Args:
      operand: [M, ...]; output: [R, ...] initial result (same trailing dims and dtype).
      input_offsets, send_sizes, output_offsets, recv_sizes: [ep] int32 (ragged_all_to_all
        meaning; one slice per peer).
      axis_name: mesh axis of size ep.
      chunk_rows: static bound on every send_sizes / recv_sizes entry.
    Returns:
      [R, ...] = output with the received rows written.
    """
    ep = send_sizes.shape[0]
    j = jnp.arange(chunk_rows, dtype=jnp.int32)
    src = jnp.clip(input_offsets[:, None] + j[None], 0, operand.shape[0] - 1)   # [ep, L]
    live = (j[None] < send_sizes[:, None]).reshape(ep, chunk_rows, *[1] * (operand.ndim - 1))
    chunks = jnp.where(live, operand[src], jnp.zeros((), operand.dtype))         # [ep, L, ...]
    flat = chunks.reshape(ep * chunk_rows, *operand.shape[1:])
    got = jax.lax.all_to_all(flat, axis_name, 0, 0, tiled=True)      # block i from source i
    dst_off = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)    # [ep]
    dst = jnp.where(j[None] < recv_sizes[:, None], dst_off[:, None] + j[None], output.shape[0])
    return output.at[dst.reshape(-1)].set(got, mode="drop")


def _transport(kind: str, axis_name: str, chunk_rows: int):
    if kind == "ragged":
        return functools.partial(jax.lax.ragged_all_to_all, axis_name=axis_name)
    if kind == "padded":
        return functools.partial(padded_ragged_all_to_all, axis_name=axis_name,
                                 chunk_rows=chunk_rows)
    raise ValueError(f"transport must be 'ragged' or 'padded', got {kind!r}")


def _gather_d(w_gate, w_up, w_down, d_axes):
    """All-gather FSDP shards of the model dim (D) of the local expert weights."""
    if not d_axes:
        return w_gate, w_up, w_down
    def ag(w, ax):
        g = lambda a: jax.lax.all_gather(a, d_axes, axis=ax, tiled=True)  # noqa: E731
        if isinstance(w, MXFP4):   # scales of a K-sharded (gate/up) stack arrive whole: see _specs
            return MXFP4(g(w.codes), w.scales if ax == 1 else g(w.scales))
        return g(w)
    return ag(w_gate, 1), ag(w_up, 1), ag(w_down, 2)


def _ffn_reduce(ffn_axis):
    """psum over the tensor axis sharding F (each shard's down projection is a partial sum)."""
    return None if ffn_axis is None else (lambda y: jax.lax.psum(y, ffn_axis))


def _dropless_local(x, weights, idx, w_gate, w_up, w_down, *, act, axis, ep, d_axes, ffn_axis, impl,
                    interpret, tiling, transport):
    """Per-device dropless body. x [n, D], weights/idx [n, k], w_* local [E_l, ...]."""
    w_gate, w_up, w_down = _gather_d(w_gate, w_up, w_down, d_axes)
    n, k = idx.shape
    d = x.shape[1]
    e_local = w_gate.shape[0]
    order, inverse, counts = sort_by_expert(idx, ep * e_local)           # counts [E]
    xs = x[order // k]                                                    # [n*k, D] by dest
    per_dev = counts.reshape(ep, e_local)                                 # [dest, E_l]
    send = per_dev.sum(1)                                                 # [ep]
    in_off = _exclusive_cumsum(send)
    # recv_counts[i, l]: rows source i sends to my local expert l.
    recv_counts = jax.lax.all_to_all(per_dev, axis, 0, 0, tiled=True)     # [src, E_l]
    recv = recv_counts.sum(1)                                             # [ep]
    recv_off = _exclusive_cumsum(recv)          # my buffer holds source i at recv_off[i]
    out_off = jax.lax.all_to_all(recv_off, axis, 0, 0, tiled=True)        # my rows' slot at j
    chunk = n * min(k, e_local)                 # most rows one source sends one device
    rows = ep * chunk
    a2a = _transport(transport, axis, chunk)
    buf = a2a(xs, jnp.zeros((rows, d), x.dtype), in_off, send, out_off, recv)   # [rows, D]
    # Buffer order is (source, local expert); re-sort by local expert for the grouped matmul.
    # Unused tail rows get id E_l and sort last, past sum(group_sizes): they come out as 0.
    seg = row_group_ids(recv_counts.reshape(-1), rows)                    # [rows]
    local_e = jnp.where(seg < ep * e_local, seg % e_local, e_local)
    perm = jnp.argsort(local_e, stable=True)
    inv_perm = jnp.zeros_like(perm).at[perm].set(jnp.arange(rows, dtype=perm.dtype))
    ys = expert_ffn_grouped(buf[perm], recv_counts.sum(0), w_gate, w_up, w_down, act,
                            impl=impl, interpret=interpret, tiling=tiling,
                            reduce=_ffn_reduce(ffn_axis))                   # [rows, D]
    # Reverse trip: my slice for source i sits at recv_off[i]; it goes back to where source i
    # cut it from (its in_off[me]).
    src_off = jax.lax.all_to_all(in_off, axis, 0, 0, tiled=True)
    back = a2a(ys[inv_perm], jnp.zeros((n * k, d), x.dtype), recv_off, recv, src_off, send)
    return combine(weights, back[inverse].reshape(n, k, d))


def _capacity_local(x, weights, idx, w_gate, w_up, w_down, *, act, axis, ep, d_axes, ffn_axis,
                    capacity_factor, batch_axes):
    """Per-device capacity body (GShard): fixed [E, C, D] buffers over all_to_all."""
    w_gate, w_up, w_down = _gather_d(w_gate, w_up, w_down, d_axes)
    n, k = idx.shape
    d = x.shape[1]
    e_local = w_gate.shape[0]
    e = ep * e_local
    c = capacity_of(n, k, e, capacity_factor)
    slot, keep = capacity_slots(idx, e, c)
    buf = capacity_dispatch(x, slot, e, c, k)                             # [E, C, D]
    got = jax.lax.all_to_all(buf, axis, 0, 0, tiled=True)                 # [(src, E_l), C, D]
    got = got.reshape(ep, e_local, c, d).swapaxes(0, 1).reshape(e_local, ep * c, d)
    y = expert_ffn_batched(got, w_gate, w_up, w_down, act, _ffn_reduce(ffn_axis))  # [E_l, ep*C, D]
    y = y.reshape(e_local, ep, c, d).swapaxes(0, 1).reshape(e, c, d)      # [(src, E_l), C, D]
    back = jax.lax.all_to_all(y, axis, 0, 0, tiled=True)                  # [E, C, D] mine
    out = combine(weights, capacity_collect(back, slot, n, k))
    dropped = jax.lax.psum(jnp.sum(~keep).astype(jnp.float32), batch_axes)
    total = jax.lax.psum(jnp.float32(n * k), batch_axes)
    return out, dropped / total


def _axis_names(spec_entry) -> tuple[str, ...]:
    if spec_entry is None:
        return ()
    return tuple(spec_entry) if isinstance(spec_entry, tuple) else (spec_entry,)


def _weight_d_axes(ws, d_dims, expert_axis, token_axes, explicit, given, ffn_axis=None) -> tuple[str, ...]:
    """FSDP axes of the experts' D dim: `given`, else read from the (Explicit) sharding types."""
    if given is not None:
        if not set(given) <= set(token_axes):
            raise ValueError(f"weight_d_axes {given} must be token axes {token_axes}")
        return tuple(given)
    if not explicit:
        return ()
    found = set()
    for w, d_dim in zip(ws, d_dims):
        w = w.codes if isinstance(w, MXFP4) else w    # scales share the codes' sharding
        spec = tuple(jax.typeof(w).sharding.spec) + (None,) * 3
        for dim in range(3):
            names = _axis_names(spec[dim])
            if dim == 0 and names not in ((), (expert_axis,)):
                raise ValueError(f"expert dim of {jax.typeof(w)} must be sharded over "
                                 f"{expert_axis!r} or replicated")
            if dim == d_dim:
                if not set(names) <= set(token_axes):
                    raise ValueError(f"D dim of {jax.typeof(w)} may only be sharded over the "
                                     f"token axes {token_axes}")
                found.add(names)
            elif dim != 0 and names and names != ((ffn_axis,) if ffn_axis else ()):
                raise ValueError(f"ffn dim of {jax.typeof(w)} must be unsharded or sharded over "
                                 f"ffn_axis={ffn_axis!r}")
    if len(found) != 1:
        raise ValueError(f"w_gate, w_up, w_down must share one D sharding, got {found}")
    return found.pop()


def moe_expert_parallel(x, weights, idx, w_gate, w_up, w_down, act: Act, *, mesh,
                        expert_axis: str, token_axes: tuple[str, ...],
                        impl: str = "ragged_dot", mode: str = "dropless",
                        capacity_factor: float | None = None, transport: str = "ragged",
                        weight_d_axes: tuple[str, ...] | None = None, interpret: bool = False,
                        tiling: tuple[int, int, int] = (128, 128, 128), ffn_axis: str | None = None,
                        row_axes: tuple[str, ...] | None = None):
    """Expert-parallel MoE; same results as the single-device functions (module docstring).

    Args:
      x: [N, D] tokens; weights: [N, k] f32; idx: [N, k] int32 (from `routing.route`).
      w_gate, w_up: [E, D, F]; w_down: [E, F, D]; D may be sharded over token axes (FSDP).
      act: f32 elementwise `act(gate, up)`.
      mesh: jax Mesh containing `expert_axis` and every name in `token_axes` (other axes, e.g.
        tensor, see replicated tokens and compute redundantly).
      expert_axis: mesh axis that shards experts (ep = its size; E % ep == 0).
      token_axes: further mesh axes sharding the tokens (any N: rows are padded to a multiple
        of prod(sizes) * ep with zero routing weight and cut off again).
      impl: local grouped-matmul impl for dropless ("ragged_dot" | "megablox" | "dense").
      mode: "dropless" or "capacity" (then `capacity_factor` is required).
      transport: dropless exchange, "ragged" (`ragged_all_to_all`) or "padded" (CPU tests).
      weight_d_axes: token axes sharding the experts' D dim (FSDP); None reads them from
        Explicit sharding types (unsharded on Auto meshes).
      interpret, tiling: megablox interpret mode (required off TPU) and (tm, tk, tn) tiles.
      ffn_axis: a mesh axis (not a token axis; e.g. tensor) sharding the experts' F dim: every
        device of it gets the same tokens, runs its F slice, and the down projections are psum'd
        over it in f32 (expert x tensor parallelism for serving: no expert is ever gathered).
      row_axes: the order of the mesh axes splitting the N rows, a permutation of
        (*token_axes, expert_axis) (the default). Which rows a device holds does not change the
        result; passing the layout the caller's rows already have (e.g. [B, T] flattened with B over
        (data, fsdp, expert) and T over context: (data, fsdp, expert, context)) spares the
        permutation of every token at the shard_map boundary.
    Returns:
      dropless: out [N, D] f32 sharded P(row_axes, None).
      capacity: (out, dropped_fraction f32 scalar over the whole batch).
    """
    token_axes = tuple(token_axes)
    batch_axes = (*token_axes, expert_axis)
    if row_axes is not None:
        if sorted(row_axes) != sorted(batch_axes):
            raise ValueError(f"row_axes {tuple(row_axes)} must order the axes {batch_axes}")
        batch_axes = tuple(row_axes)
    missing = [a for a in batch_axes if a not in mesh.shape]
    if missing:
        raise ValueError(f"mesh {dict(mesh.shape)} lacks axes {missing}")
    types = {a: mesh.axis_types[mesh.axis_names.index(a)] for a in batch_axes}
    explicit = all(t == AxisType.Explicit for t in types.values())
    if not explicit and not all(t == AxisType.Auto for t in types.values()):
        raise ValueError(f"axes {batch_axes} must be all Explicit or all Auto, got {types}")
    ep = mesh.shape[expert_axis]
    shards = math.prod(mesh.shape[a] for a in batch_axes)
    n_tokens, e = x.shape[0], w_gate.shape[0]
    if e % ep:
        raise ValueError(f"need E={e} divisible by ep={ep}")
    # Any token count (a decode batch, a prompt chunk): pad with rows of routing weight 0 up to a
    # multiple of the shard count. They sit after the real rows, so in capacity mode they only take
    # slots no real token wanted; their outputs are cut off below.
    pad = -n_tokens % shards
    if pad:
        x = jnp.pad(x, ((0, pad), (0, 0)))
        weights = jnp.pad(weights, ((0, pad), (0, 0)))
        idx = jnp.pad(idx, ((0, pad), (0, 0)))

    if ffn_axis is not None and (ffn_axis in batch_axes or ffn_axis not in mesh.shape):
        raise ValueError(f"ffn_axis={ffn_axis!r} must be a mesh axis other than {batch_axes}")
    if ffn_axis is not None and isinstance(w_down, MXFP4) and w_down.scales.shape[-2] % mesh.shape[ffn_axis]:
        raise ValueError(f"MXFP4 experts: F/32={w_down.scales.shape[-2]} scale rows of w_down do not split over "
                         f"{ffn_axis}={mesh.shape[ffn_axis]}; use a tensor parallelism dividing it")
    d_axes = _weight_d_axes((w_gate, w_up, w_down), (1, 1, 2), expert_axis, token_axes,
                            explicit, weight_d_axes, ffn_axis)
    d_entry = None if not d_axes else (d_axes[0] if len(d_axes) == 1 else d_axes)
    tok = P(batch_axes, None)
    w_in = P(expert_axis, d_entry, ffn_axis)
    w_out = P(expert_axis, ffn_axis, d_entry)
    # Packed experts (MXFP4) keep the dense layout's dims. Their codes shard as the dense weights;
    # the scales of gate/up, whose K/32 dim an FSDP axis need not divide, come unsharded over D
    # (1/16 of the codes' bytes); w_down's scales shard over D (its N dim) as its codes.
    def like(w, spec, scales_spec):
        return MXFP4(spec, scales_spec) if isinstance(w, MXFP4) else spec
    w_in_scales = P(expert_axis, None, ffn_axis)
    in_specs = (tok, tok, tok, like(w_gate, w_in, w_in_scales), like(w_up, w_in, w_in_scales),
                like(w_down, w_out, w_out))
    args = (x, weights, idx, w_gate, w_up, w_down)
    if explicit:
        args = jax.tree.map(lambda a, s: jax.sharding.reshard(a, NamedSharding(mesh, s)), args, in_specs,
                            is_leaf=lambda v: isinstance(v, P))

    common = dict(act=act, axis=expert_axis, ep=ep, d_axes=d_axes, ffn_axis=ffn_axis)
    if mode == "dropless":
        body = functools.partial(_dropless_local, impl=impl, interpret=interpret,
                                 tiling=tuple(tiling), transport=transport, **common)
        out_specs = tok
    elif mode == "capacity":
        if capacity_factor is None or capacity_factor <= 0:
            raise ValueError("mode='capacity' needs capacity_factor > 0")
        body = functools.partial(_capacity_local, capacity_factor=capacity_factor,
                                 batch_axes=batch_axes, **common)
        out_specs = (tok, P())
    else:
        raise ValueError(f"mode must be 'dropless' or 'capacity', got {mode!r}")
    # megablox's (and tokamax's Mosaic) pallas_call declares no varying-manual-axes type for its output, which
    # check_vma=True rejects. With check_vma=False shard_map transposes the classic way (input
    # cotangents psum'd over the axes their spec leaves out), correct here because every output
    # is replicated over the axes its spec leaves out.
    check_vma = not (mode == "dropless" and impl in ("megablox", "tokamax_ragged_dot"))
    out = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                        check_vma=check_vma)(*args)
    if pad:
        out = (out[0][:n_tokens], out[1]) if mode == "capacity" else out[:n_tokens]
    return out


def dispatch_bytes_per_token(*, d_model: int, top_k: int, ep: int, bytes_per_elem: int = 2,
                             mode: str = "dropless", capacity_factor: float = 1.0) -> dict:
    """Analytic EP communication per token (bytes leaving a device), forward and backward.

    Dropless: a token's k rows of D elements go out (dispatch) and come back (combine); a
    fraction (ep - 1) / ep of them leave the device under uniform routing. The backward pass
    runs the transposes: combine's cotangent travels out, dispatch's back, the same volume.
    Capacity: each device always ships its full [E, C, D] buffer, C*E = capacity_factor * n*k
    rows, so the per-token volume scales with capacity_factor instead of the real load.
    Counts metadata ([ep, E_l] int32 per device) and FSDP weight gathers are not per token and
    are left out.

    Returns:
      dict of floats: forward, backward, total bytes per token (and rows per token).
    """
    rows = top_k * (capacity_factor if mode == "capacity" else 1.0)
    one_way = rows * d_model * bytes_per_elem * (ep - 1) / ep
    return {"rows_per_token": rows, "forward": 2 * one_way, "backward": 2 * one_way,
            "total": 4 * one_way}
