"""Pipeline parallelism: the scanned layer periods as a circular SPMD pipeline over the ``stage`` mesh axis.

Schedule (the "circular" pipeline of MaxText and praxis, one period per stage per visit): with S
stages, P scanned periods and R = P / S repeats, period p = r*S + s runs on stage s at its r-th
visit. The B rows of a batch split into M microbatches (M a multiple of S); microbatch m is the rows
b with b % M == m, so every device's contiguous rows hold an equal share of each microbatch. At
iteration t stage s works on k = t - s, valid while 0 <= k < M*R: microbatch k % M at repeat k // M.
After each iteration every stage hands its output to the next (one collective-permute s -> s+1 mod
S). Stage 0 takes a fresh microbatch on repeat 0 and, later, the microbatch the last stage handed
back, kept in a circular store of M slots: what arrives at iteration t is microbatch (t - S) mod M,
read again at iteration t + M - S. M*R + S - 1 iterations; the bubble is (S-1) / (M*R + S - 1).

What crosses a stage boundary is one microbatch's residual state without its block count: the
partial sum [mb, T, D] and the AttnRes blocks (without AttnRes, the hidden state [mb, T, D]). The
block count n and the per-layer block-start flags follow from the period number (static tables),
so blocks may start anywhere, mid-period and across stages. Blocks, once finished, never change,
so with the block cache (the default, ``pipeline_attn_res_cache``) a hop carries only the K newest
[K, mb, T, D] (``cache_depth``: the most blocks finished in the S - 1 periods a microbatch spends
elsewhere between two visits to a stage; K3 at 2 stages: 1, a hop of 2x the hidden state instead
of 9x). Each stage keeps every microbatch's buffer [M, NB, mb, T, D] as it last saw it (at the
start, the pipeline's input), writes the K arriving blocks into it and its own period's output
back, and the last stage's copies are the output buffers. Without the cache a hop carries the
whole buffer [NB, mb, T, D]. Segment ids and positions are indexed per stage from their [M, mb, T]
copies, not sent. The embedding, the unrolled prefix and tail layers, the output mix and the loss
run outside, data-parallel over ``stage``.

Parameters: the periods' stacked leaves are held stage-major (``stage_major``: memory index s*R + r
holds period r*S + s), so splitting the stacked axis over ``stage`` (k3jax.sharding.param_sharding)
gives each stage its own periods in visit order, and nothing but activations crosses stages. The
side outputs come back in the same order, so QK-clip and the router-bias update stay elementwise.
``reorder_state`` converts a state to and from layer order (what a checkpoint stores and what
``model.build`` draws) at the state boundary (k3jax.state).

Applied from outside the model, as torchtitan applies its pipeline: ``K3Model`` knows no stages.
``pipeline_of(cfg)`` is the periods runner (a ``Pipeline``, or None without stages) that the train
step and the eval step pass to ``K3Model.hidden(periods=...)``, which hands it the periods' split
state and the residual state after the prefix layers.

Bubbles: an iteration outside the schedule computes on zeros (its input is replaced, so nothing the
buffers held reaches the layers: not even NaN) and its side outputs are masked: MLA max logits by
-inf, expert loads and the other entries by 0. Per period, max logits are the max over microbatches,
loads their sum, other entries (dropped fraction, aux loss) their mean, as under gradient
accumulation (k3jax.step). Outputs are read only from valid iterations.

Implementation: one ``jax.shard_map`` manual over ``stage`` only; the other mesh axes stay automatic
inside it, so the layers' sharding constraints and the expert-parallel shard_map nest unchanged. A
``lax.scan`` runs the iterations, the period call rematerialised under the remat policy as the flat
scan's body is (its saved residual is the microbatch state it starts from); the backward is autodiff.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from k3jax.layout import layout
from k3jax.sharding import EXPERT_AXIS, param_sharding
from k3jax.validation import num_stages, pipeline_microbatches

STAGE = "stage"


def stage_major(num_periods: int, stages: int) -> np.ndarray:
    """The periods in memory order: index s*R + r holds period r*S + s (R = num_periods / stages)."""
    if num_periods % stages:
        raise ValueError(f"{stages} stages do not divide {num_periods} periods")
    r = num_periods // stages
    return np.array([i * stages + s for s in range(stages) for i in range(r)])


def bubble_fraction(stages: int, microbatches: int, repeats: int) -> float:
    return (stages - 1) / (microbatches * repeats + stages - 1)


# ---- microbatches: row b of the batch is row b // M of microbatch b % M ------------------------

def _split(x, axis: int, m: int):
    """[..., B at ``axis``, ...] -> [M, ..., B/M at ``axis``, ...]."""
    x = x.reshape(x.shape[:axis] + (x.shape[axis] // m, m) + x.shape[axis + 1:])
    return jnp.moveaxis(x, axis + 1, 0)


def _merge(x, axis: int):
    """Inverse of ``_split``."""
    x = jnp.moveaxis(x, 0, axis + 1)
    return x.reshape(x.shape[:axis] + (-1,) + x.shape[axis + 2:])


def _row_axis(name: str) -> int:
    return 1 if name == "blocks" else 0     # blocks [NB, B, T, D]; partial / h [B, T, D]


def _take(tree, i):
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, 0, keepdims=False), tree)


# ---- side outputs ----------------------------------------------------------------------------

def _kind(path) -> str:
    name = jax.tree_util.keystr(path[-1:])
    return "max" if "max_logits" in name else "sum" if "expert_load" in name else "mean"


def _neutral(kind: str, dtype):
    if kind != "max":
        return jnp.zeros((), dtype)
    return jnp.array(-jnp.inf if jnp.issubdtype(dtype, jnp.floating) else jnp.iinfo(dtype).min, dtype)


def _aux_init(shapes, repeats: int):
    return jax.tree_util.tree_map_with_path(
        lambda p, s: jnp.full((repeats,) + s.shape, _neutral(_kind(p), s.dtype), s.dtype), shapes)


def _aux_add(acc, aux, r, valid):
    """Fold one iteration's side outputs into repeat r's slot; bubble iterations add nothing."""
    def add(path, a, x):
        kind = _kind(path)
        x = jnp.where(valid, x, _neutral(kind, x.dtype))
        old = jax.lax.dynamic_index_in_dim(a, r, 0, keepdims=False)
        new = jnp.maximum(old, x) if kind == "max" else old + x
        return jax.lax.dynamic_update_index_in_dim(a, new, r, 0)
    return jax.tree_util.tree_map_with_path(add, acc, aux)


def _aux_finish(acc, microbatches: int):
    return jax.tree_util.tree_map_with_path(
        lambda p, a: a / microbatches if _kind(p) == "mean" else a, acc)


# ---- gathering a stage's weights once (pipeline_fsdp_ag_once) --------------------------------

# The mesh axes a stage's period weights are gathered over: the in-stage data axes that shard them
# FSDP-style (k3jax.sharding.PARAM_SHARD_AXES); the tensor axis is refused at stage > 1.
GATHER_AXES = ("fsdp", "context", "expert")


def _gathered_specs(state, mesh) -> list[P]:
    """Per leaf of the periods' state (``jax.tree.leaves`` order), its placement once gathered,
    without the period axis: the stored placement (k3jax.sharding.param_sharding) with GATHER_AXES
    dropped. Routed-expert weights keep theirs under expert parallelism: the expert-parallel
    shard_map takes them split over the expert axis and gathers their model dimension itself."""
    out = []
    for v in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable)):
        axes = v.get_metadata().get("axes") if isinstance(v, nnx.Variable) else None
        shape = np.shape(v[...] if isinstance(v, nnx.Variable) else v)
        if axes is None:
            raise ValueError(f"a period leaf of shape {shape} declares no logical axes; its gathered placement is unknown")
        spec = [(() if a is None else (a,) if isinstance(a, str) else tuple(a))
                for a in param_sharding(mesh, shape, axes).spec[1:]]
        spec += [()] * (len(shape) - 1 - len(spec))
        if not ("exp" in axes and mesh.shape.get(EXPERT_AXIS, 1) > 1):
            spec = [tuple(a for a in d if a not in GATHER_AXES) for d in spec]
        out.append(P(*[None if not d else d[0] if len(d) == 1 else d for d in spec]))
    return out


# ---- the pipeline ----------------------------------------------------------------------------

def block_flags(mcfg, lay) -> np.ndarray:
    """[periods, layers per period] bool: which layers of each scanned period (layer order) start an
    AttnRes block (``mcfg.attn_res_block_starts``; none without AttnRes)."""
    starts = set(mcfg.attn_res_block_starts)
    return np.array([[l in starts for l in lay.period_layers(p)] for p in range(lay.num_periods)], bool)


def cache_depth(flags: np.ndarray, stages: int) -> int:
    """K of the block cache: the most AttnRes blocks a stage has not seen when a microbatch reaches
    it, i.e. the block starts of the S - 1 periods since its last visit (or since the pipeline's
    input, on the first repeat), at least 1. ``flags``: [periods, layers] block starts in layer order."""
    starts = flags.sum(1)
    return max([1] + [int(starts[max(0, p - stages + 1):p].sum()) for p in range(1, len(starts))])


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """The periods as a pipeline of ``stages`` stages and ``microbatches`` microbatches: the runner
    ``K3Model.hidden(periods=...)`` calls in place of its scan (``pipeline_of`` builds it from a config).

    ``flags``: [periods, layers per period] AttnRes block starts in layer order (``block_flags``).
    ``gather_once`` (``pipeline_fsdp_ag_once``): each stage all-gathers its period weights over the
    in-stage parameter axes once, before the schedule (``_gathered_specs``), instead of GSPMD
    gathering them inside every iteration. ``block_cache`` (``pipeline_attn_res_cache``; AttnRes
    only): a hop carries the partial sum and the K newest blocks (``cache_depth``) instead of the
    whole block buffer; each stage keeps every microbatch's buffer as it last saw it, and the last
    stage's copies are the output buffers. ``fill``: what the hand-off and circular buffers hold
    before data reaches them (0; a test passes NaN, traced)."""
    stages: int
    microbatches: int
    flags: np.ndarray
    gather_once: bool = False
    block_cache: bool = True
    fill: Any = 0.0

    def __call__(self, gdef, state, res, *, segment_ids, positions, compute_aux: bool = False,
                 remat: str = "none", policy=None):
        """gdef, state: ``nnx.split`` of the model's periods (leaves [P, ...] in memory order, split
        over ``stage``); res: the residual state after the prefix layers (rows B); segment_ids,
        positions [B, T]. ``policy``: the remat policy of ``remat`` (``model.remat_policy``).
        Returns (res after the last period, [(aux of layer j of the period, None)] with aux leaves
        stacked [P, ...] in memory order), as the flat scan of ``K3Model._walk`` returns them."""
        return _run(self, gdef, state, res, segment_ids=segment_ids, positions=positions,
                    compute_aux=compute_aux, remat=remat, policy=policy)


def pipeline_of(cfg) -> Pipeline | None:
    """The periods runner of ``cfg`` (None without pipeline stages or scanned periods)."""
    lay = layout(cfg.model, cfg.train.scan_layers)
    stages = num_stages(cfg)
    if stages == 1 or not lay.num_periods:
        return None
    return Pipeline(stages, pipeline_microbatches(cfg), block_flags(cfg.model, lay),
                    gather_once=cfg.train.pipeline_fsdp_ag_once, block_cache=cfg.train.pipeline_attn_res_cache)


def _run(pipe: Pipeline, gdef, state, res, *, segment_ids, positions, compute_aux, remat, policy):
    """``Pipeline.__call__``: the schedule of the module docstring."""
    n_stages, n_micro, flags = pipe.stages, pipe.microbatches, pipe.flags
    gather_once, block_cache, fill = pipe.gather_once, pipe.block_cache, pipe.fill
    n_periods = flags.shape[0]
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.shape.get(STAGE, 1) != n_stages:
        raise ValueError(f"the pipeline of {n_stages} stages runs under a mesh with a '{STAGE}' axis of that size "
                         f"(jax.set_mesh(k3jax.sharding.make_mesh(cfg))); got {dict(mesh.shape) or 'no mesh'}")
    if n_periods % n_stages or n_micro % n_stages or segment_ids.shape[0] % n_micro:
        raise ValueError(f"{n_stages} stages, {n_micro} microbatches, {n_periods} periods, {segment_ids.shape[0]} "
                         f"rows: stages must divide periods and microbatches, microbatches the rows")
    repeats = n_periods // n_stages
    order = stage_major(n_periods, n_stages)
    starts_before = np.concatenate([[0], np.cumsum(flags.sum(1))[:-1]]).astype(np.int32)
    flag_tab = jnp.asarray(flags[order].reshape(n_stages, repeats, -1))
    n_tab = jnp.asarray(starts_before[order].reshape(n_stages, repeats))
    attn_res = "n" in res
    cached = attn_res and block_cache
    depth = cache_depth(flags, n_stages) if cached else 0
    # blocks finished once period p has run (layer order), for the cache's write offsets
    after_tab = jnp.asarray(np.cumsum(flags.sum(1)).astype(np.int32))
    n0 = res["n"] if attn_res else jnp.zeros((), jnp.int32)
    micro = {k: _split(v, _row_axis(k), n_micro) for k, v in res.items() if k != "n"}
    seg, pos = _split(segment_ids, 0, n_micro), _split(positions, 0, n_micro)
    dtype = micro["partial" if attn_res else "h"].dtype
    fill = jnp.asarray(fill, dtype)
    shift = [(i, (i + 1) % n_stages) for i in range(n_stages)]
    specs = _gathered_specs(state, mesh) if gather_once else None

    def gathered(st, spec_of):
        """``st`` pinned to the gathered placement (spec_of: a leaf's spec without the period axis -> its spec)."""
        if specs is None:
            return st
        leaves, tdef = jax.tree.flatten(st)
        return jax.tree.unflatten(tdef, [jax.lax.with_sharding_constraint(x, spec_of(sp))
                                         for x, sp in zip(leaves, specs)])

    def period(st, x, seg_m, pos_m, fl, n):
        """One period on one microbatch's state x (no n) -> (state, [aux per layer])."""
        r_state = dict(x, n=n) if attn_res else dict(x)
        out = []
        for j, layer in enumerate(nnx.merge(gdef, st).layers):
            r_state, aux, _ = layer(r_state, seg_m, pos_m, first=False, block_start=fl[j], compute_aux=compute_aux)
            out.append(aux)
        return {k: v for k, v in r_state.items() if k != "n"}, out

    if remat != "none":
        period = jax.checkpoint(period, policy=policy, prevent_cse=False)

    def stage_fn(st, micro, seg, pos, flag_tab, n_tab, after_tab, n0, fill):
        s = jax.lax.axis_index(STAGE)
        st = gathered(st, lambda sp: P(None, *sp))         # this stage's [R, ...] slab, gathered once
        flag_tab, n_tab = flag_tab[0], n_tab[0]            # this stage's [R, period], [R]
        zero = jax.tree.map(lambda x: jnp.zeros_like(x[0]), micro)
        aux_shapes = jax.eval_shape(lambda: period(_take(st, 0), zero, seg[0], pos[0], flag_tab[0], n0)[1])

        last = (repeats - 1) * n_micro + n_stages - 1      # the last stage finishes microbatch m at last + m

        n_blocks = micro["blocks"].shape[1] if cached else 0

        def offset(p):
            """Where the K blocks a hop after period p carries start in the buffer (the newest K)."""
            done = n0 + after_tab[jnp.clip(p, 0, n_periods - 1)]
            return jnp.clip(done - depth, 0, n_blocks - depth)

        def put(buf, i, x, keep):
            """buf[i] = x where ``keep``, else unchanged."""
            old = jax.lax.dynamic_index_in_dim(buf, i, 0, keepdims=False)
            return jax.lax.dynamic_update_index_in_dim(buf, jnp.where(keep, x, old), i, 0)

        def iteration(carry, t):
            recv, circ, outs, cache, acc = carry
            k = t - s
            valid = (k >= 0) & (k < n_micro * repeats)
            kc = jnp.clip(k, 0, n_micro * repeats - 1)
            m, r = kc % n_micro, kc // n_micro
            # What arrived: stage s > 0 gets microbatch k from stage s - 1 (its period r*S + s - 1);
            # stage 0 gets what the last stage handed over, microbatch (t - S) mod M, and files it for
            # that microbatch's next repeat (the circular store).
            rk = jnp.where(s == 0, t - n_stages, k)
            got = (rk >= 0) & (rk < n_micro * repeats)
            rkc = jnp.clip(rk, 0, n_micro * repeats - 1)
            rm = rkc % n_micro
            keep = (s == 0) & got
            carried = {key: v for key, v in recv.items() if key != "new"}
            circ = jax.tree.map(lambda c, x: put(c, rm, x, keep), circ, carried)
            if cached:      # the newest blocks go into that microbatch's copy of the buffer
                sender = (rkc // n_micro) * n_stages + jnp.mod(s - 1, n_stages)
                mine = jax.lax.dynamic_index_in_dim(cache, rm, 0, keepdims=False)
                cache = put(cache, rm, jax.lax.dynamic_update_slice_in_dim(mine, recv["new"], offset(sender), 0), got)
            first, stored = _take(micro, m), _take(circ, m)
            x = jax.tree.map(lambda a, b, c: jnp.where(valid, jnp.where(s == 0, jnp.where(r == 0, a, b), c), 0),
                             {key: first[key] for key in carried}, stored, carried)
            if cached:
                x["blocks"] = jnp.where(valid, jax.lax.dynamic_index_in_dim(cache, m, 0, keepdims=False), 0)
            # (the gathered placement pinned again on the repeat's slice, so GSPMD keeps it gathered
            # through the loop rather than re-sharding the slab and gathering per iteration)
            w = gathered(_take(st, r), lambda sp: sp)
            y, aux = period(w, x, _take(seg, m), _take(pos, m), flag_tab[r], n0 + n_tab[r])
            acc = _aux_add(acc, aux, r, valid)
            send = y
            if cached:
                cache = put(cache, m, y["blocks"], valid)
                send = {"partial": y["partial"],
                        "new": jax.lax.dynamic_slice_in_dim(y["blocks"], offset(r * n_stages + s), depth, 0)}
            # Outputs of the final M iterations, kept on every stage (the last stage's are read; with
            # the cache, the blocks are its copies).
            o = jnp.clip(t - last, 0, n_micro - 1)
            outs = jax.tree.map(lambda b, v: put(b, o, v, t >= last), outs, {key: y[key] for key in outs})
            return (jax.lax.ppermute(send, STAGE, shift), circ, outs, cache, acc), None

        held = {key: v for key, v in zero.items() if not (cached and key == "blocks")}
        buffers = jax.tree.map(lambda z: jnp.full((n_micro,) + z.shape, fill, z.dtype), held)
        recv = jax.tree.map(lambda z: jnp.full_like(z, fill), held)
        if cached:
            recv["new"] = jnp.full((depth,) + zero["blocks"].shape[1:], fill, zero["blocks"].dtype)
        cache = micro["blocks"] if cached else jnp.zeros((), dtype)
        carry = (recv, buffers, buffers, cache, _aux_init(aux_shapes, repeats))
        (_, _, outs, cache, acc), _ = jax.lax.scan(iteration, carry, jnp.arange(last + n_micro))
        if cached:
            outs = dict(outs, blocks=cache)
        return jax.tree.map(lambda y: y[None], outs), _aux_finish(acc, n_micro)

    run = jax.shard_map(stage_fn, mesh=mesh, in_specs=(P(STAGE), P(), P(), P(), P(STAGE), P(STAGE), P(), P(), P()),
                        out_specs=(P(STAGE), P(STAGE)), axis_names={STAGE}, check_vma=False)
    ys, aux = run(state, micro, seg, pos, flag_tab, n_tab, after_tab, n0, fill)
    out = {k: _merge(v[-1], _row_axis(k)) for k, v in ys.items()}
    if attn_res:
        out["n"] = n0 + int(flags.sum())
    return out, [(a, None) for a in aux]


# ---- checkpoints: layer order on disk, stage-major in memory ---------------------------------

def under_periods(path) -> bool:
    """Whether a tree path runs through a ``periods`` node: the scanned periods' stacked leaves, in
    the parameters, the router biases / packed experts and the optimizer state's mirrors of them."""
    return any(isinstance(k, jax.tree_util.DictKey) and k.key == "periods" for k in path)


def period_order(num_periods: int, stages: int, to: str) -> np.ndarray:
    """The gather along the period axis that puts leaves ``to`` "canonical" (layer order) from the
    pipeline's memory order, or ``to`` "stage_major" from layer order."""
    order = stage_major(num_periods, stages)
    if to == "canonical":
        return np.argsort(order)
    if to != "stage_major":
        raise ValueError(f"to={to!r}: 'canonical' or 'stage_major'")
    return order


def reorder_state(tree, stages: int, num_periods: int, to: str):
    """Every leaf of ``tree`` under a ``periods`` node put in layer order (``to="canonical"``) or the
    pipeline's memory order (``to="stage_major"``), the other leaves untouched. The moved leaves go
    through one jit that donates them and keeps each leaf's sharding, so no second copy of the state
    stays on the devices (jax arrays; the period axis split over ``stage`` makes it an exchange of
    about (S-1)/S of those bytes across stages). A leaf under ``periods`` whose axis 0 is not
    ``num_periods`` raises ValueError: it would be written out of layer order."""
    if stages == 1 or not num_periods:
        return tree
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    picked = [i for i, (p, _) in enumerate(flat) if under_periods(p)]
    for i in picked:
        p, x = flat[i]
        if not np.shape(x) or np.shape(x)[0] != num_periods:
            raise ValueError(f"{jax.tree_util.keystr(p)} lies under 'periods' but its shape {np.shape(x)} is not "
                             f"stacked over the {num_periods} periods on axis 0; it cannot be put in layer order")
    if not picked:
        return tree
    leaves = [x for _, x in flat]
    moved = [leaves[i] for i in picked]
    order = period_order(num_periods, stages, to)
    if all(isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) for x in moved):
        permute = jax.jit(_gather, static_argnums=1, donate_argnums=0, out_shardings=[x.sharding for x in moved])
        moved = permute(moved, tuple(order.tolist()))
    else:
        moved = [x[order] for x in moved]
    for i, x in zip(picked, moved):
        leaves[i] = x
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _gather(xs, order):
    idx = np.asarray(order)
    return [x[idx] for x in xs]
