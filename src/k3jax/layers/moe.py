"""Mixture of experts FFN (k3-architecture.md §6): sigmoid router with selection-only bias, top-k,
renormalisation, routed scaling, shared experts and, for K3, the latent down/up projections with
the routed-expert RMSNorm after the combine. Dispatch kernels live in ``k3jax.kernels.moe``.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax import sharding as S
from k3jax.kernels.moe import balance, dispatch, routing
from k3jax.kernels.moe.expert_parallel import moe_expert_parallel
from k3jax.kernels.moe.gmm import resolve_impl as resolve_moe_impl
from k3jax.kernels.platform import resolve
from k3jax.kernels.moe.quantized import MX_BLOCK, MXFP4, fake_mxfp4
from k3jax.layers.common import MLP, Packed, RouterBias, glu_activation, ones, param, rms_norm, zeros


class PackedExperts(nnx.Module):
    """One routed-expert matrix stack [E, K, N] kept as MXFP4 (``quantized.MXFP4`` layout):
    ``codes`` uint8 [E, K/2, N] and ``scales`` uint8 [E, K/32, N], with the dense weight's logical
    axes (so they shard over the expert axis, and K/N as the dense ones). Not trainable (``Packed``
    variables are outside nnx.Param); built as zeros, filled by ``load_parameters_path``."""

    def __init__(self, rngs, stack, e: int, k: int, n: int, axes):
        u8 = dict(init=zeros, dtype=jnp.uint8, kind=Packed)
        self.codes = param(rngs, stack, (e, k // 2, n), axes, **u8)
        self.scales = param(rngs, stack, (e, k // MX_BLOCK, n), axes, **u8)

    def operand(self) -> MXFP4:
        return MXFP4(self.codes[...], self.scales[...])


class MoE(nnx.Module):
    def __init__(self, cfg, kcfg, rngs: nnx.Rngs, stack: tuple[int, ...] = (), dtype=jnp.float32):
        d, e, f, lw = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, cfg.routed_width
        self.cfg, self.kcfg = cfg, kcfg
        self.act = glu_activation(cfg)
        std = cfg.initializer_range
        # The router runs in f32 (scores decide discrete choices); stored in f32.
        self.router = param(rngs, stack, (d, e), ("embed", None), std=std, dtype=jnp.float32, matrix=(0, 1))
        self.e_score_correction_bias = param(rngs, stack, (e,), ("norm",), init=zeros, dtype=jnp.float32,
                                             kind=RouterBias)
        if cfg.moe_latent_size:
            mat = dict(std=std, dtype=dtype, matrix=(0, 1))
            self.latent_down = param(rngs, stack, (d, lw), ("embed", "mlp"), **mat)
            self.latent_up = param(rngs, stack, (lw, d), ("mlp", "embed"), **mat)
            if cfg.moe_latent_norm:
                self.latent_norm = param(rngs, stack, (lw,), ("norm",), init=ones, dtype=dtype)
        # Expert weights [E, in, out]; the matrix axes exclude E so Muon treats experts separately.
        if cfg.experts_format == "mxfp4":
            self.w_gate = PackedExperts(rngs, stack, e, lw, f, ("exp", "embed", "mlp"))
            self.w_up = PackedExperts(rngs, stack, e, lw, f, ("exp", "embed", "mlp"))
            self.w_down = PackedExperts(rngs, stack, e, f, lw, ("exp", "mlp", "embed"))
        else:
            ex = dict(std=std, dtype=dtype, matrix=(1, 2))
            self.w_gate = param(rngs, stack, (e, lw, f), ("exp", "embed", "mlp"), **ex)
            self.w_up = param(rngs, stack, (e, lw, f), ("exp", "embed", "mlp"), **ex)
            self.w_down = param(rngs, stack, (e, f, lw), ("exp", "mlp", "embed"), **ex)
        if cfg.num_shared_experts:
            self.shared_experts = MLP(cfg, cfg.num_shared_experts * f, rngs, stack, dtype)

    def route(self, x):
        """x [N,D] -> (weights [N,k] f32, idx [N,k] int32, scores [N,E] f32)."""
        c = self.cfg
        logits = jnp.einsum("nd,de->ne", x.astype(jnp.float32), self.router[...])
        w, idx = routing.route(logits, self.e_score_correction_bias[...], top_k=c.num_experts_per_token,
                               renormalize=c.moe_renormalize, scaling_factor=c.routed_scaling_factor,
                               weights_from_biased=c.router_weights_from_biased, n_group=c.n_group,
                               topk_group=c.topk_group)
        return w, idx, jax.nn.sigmoid(logits)

    def __call__(self, x, compute_aux: bool = False):
        """x [B,T,D] -> (out [B,T,D], stats): per-expert loads [E] f32 (balancing, metrics), the
        dropped fraction (capacity mode) and, when ``compute_aux``, the sequence balance loss.

        With an ``expert`` axis of size > 1 in the ambient mesh (``jax.set_mesh``), experts are
        dispatched expert-parallel; otherwise locally."""
        c = self.cfg
        b, t, d = x.shape
        xf = x.reshape(b * t, d)
        with jax.named_scope("router"):
            w, idx, scores = self.route(xf)
        with jax.named_scope("dispatch"):
            r, dropped = self._dispatch(xf, w, idx)
        out = r.reshape(b, t, d)
        if c.num_shared_experts:
            out = out + self.shared_experts(x)
        aux = jnp.zeros((), jnp.float32)
        if compute_aux:
            aux = balance.sequence_aux_loss(scores.reshape(b, t, -1), idx.reshape(b, t, -1),
                                            c.num_experts_per_token)
        stats = {"expert_load": balance.expert_load(idx, c.num_experts),
                 "dropped_fraction": jnp.asarray(dropped, jnp.float32), "aux_loss": aux}
        return out, stats

    def experts(self, dtype):
        """(w_gate, w_up, w_down) as the dispatch kernels take them: dense arrays cast to the
        activation ``dtype``, or packed ``MXFP4`` operands (decoded tile by tile in the grouped
        matmul; see kernels/moe/quantized.py)."""
        ws = (self.w_gate, self.w_up, self.w_down)
        if self.cfg.experts_format == "mxfp4":
            return tuple(w.operand() for w in ws)
        if self.cfg.experts_qat == "mxfp4":      # the packed export's values, straight-through gradient
            return tuple(fake_mxfp4(w[...]).astype(dtype) for w in ws)
        return tuple(jnp.asarray(w[...], dtype) for w in ws)   # a jax array even from numpy values (indexed by tracers)

    def _dispatch(self, x, w, idx):
        """Routed experts (latent projections included): x [N,D] -> ([N,D] in x.dtype, dropped)."""
        c, k = self.cfg, self.kcfg
        z = x
        if c.moe_latent_size:
            z = jnp.einsum("nd,dl->nl", x, self.latent_down[...].astype(x.dtype))
        experts = self.experts(x.dtype)
        dropped = jnp.zeros((), jnp.float32)
        mesh = jax.sharding.get_abstract_mesh()
        impl = resolve_moe_impl(k.moe_impl)
        # Inside a pipeline stage the dispatch is this shard_map even with no expert axis (ep = 1:
        # each device sorts and runs its own rows): GSPMD's partitioning of the global sort's token
        # gather there aborts XLA with context parallelism in the stage (a CHECK in
        # ExpandDeviceGroupsWithIota, jax 0.12.0; moe_mode=capacity too).
        if not mesh.empty and (mesh.shape.get(S.EXPERT_AXIS, 1) > 1 or S.in_stage(mesh)):
            transport = resolve("moe_ep_transport", k.moe_ep_transport, mesh.abstract_device.platform)
            if transport == "ragged" and mesh.abstract_device.platform == "cpu":
                raise ValueError("moe_ep_transport=ragged needs ragged_all_to_all, which XLA:CPU does not "
                                 "implement; set moe_ep_transport=auto or padded on CPU")
            # F stays sharded over the tensor axis (expert x tensor parallelism), never gathered.
            ffn_axis = S.EXPERT_FFN_AXIS if mesh.shape.get(S.EXPERT_FFN_AXIS, 1) > 1 else None
            # Rows in the layout the flattened [B, T] tokens already have (sequence slices are
            # token shards), led by ``stage`` outside the pipeline (S.stage_rows: the unrolled
            # prefix/tail layers); axes a hand-built mesh lacks are left out.
            rows = tuple(a for a in S.stage_rows(S.MOE_ROW_AXES, mesh) if a in mesh.shape)
            # Without an expert axis the experts enter whole (GSPMD gathers them at the boundary, or
            # pipeline_fsdp_ag_once already has), not split over fsdp to be gathered again inside.
            ep = mesh.shape.get(S.EXPERT_AXIS, 1)
            r = moe_expert_parallel(z, w, idx, *experts, self.act, mesh=mesh, expert_axis=S.EXPERT_AXIS,
                                    ffn_axis=ffn_axis, row_axes=rows,
                                    token_axes=tuple(a for a in rows if a != S.EXPERT_AXIS), impl=impl,
                                    mode=k.moe_mode, capacity_factor=k.capacity_factor,
                                    transport=transport, weight_d_axes=S.WEIGHT_EMBED_AXES if ep > 1 else (),
                                    interpret=k.pallas_interpret)
            if isinstance(r, tuple):
                r, dropped = r
        elif k.moe_mode == "capacity":
            r, dropped = dispatch.moe_capacity(z, w, idx, *experts, self.act, capacity_factor=k.capacity_factor)
        elif impl == "dense":
            r = dispatch.moe_dense_reference(z, w, idx, *experts, self.act)
        elif path := dispatch.few_token_path(x.shape[0], c.num_experts_per_token, c.num_experts,
                                             k.moe_gather_max_tokens, impl=impl):
            # Decode steps and short prefills: gather the chosen experts, one-hot over all, or
            # (moe_impl=blocked) loop over the used expert blocks; no ragged matmul; same
            # routing and result as dropless (docs/moe.md).
            r = dispatch.moe_few_tokens(z, w, idx, *experts, self.act, path=path)
        else:
            r = dispatch.moe_dropless(z, w, idx, *experts, self.act, impl=impl,
                                      interpret=k.pallas_interpret)
        r = r.astype(x.dtype)
        if c.moe_latent_size:
            if c.moe_latent_norm:
                r = rms_norm(r, self.latent_norm[...], c.rms_norm_eps)
            r = jnp.einsum("nl,ld->nd", r, self.latent_up[...].astype(x.dtype))
        return r, dropped
