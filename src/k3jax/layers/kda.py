"""Kimi Delta Attention layer (k3-architecture.md §4): projections, short convs, gates, core, output.

The recurrence itself lives in ``k3jax.kernels.kda`` (chosen by ``kda_impl``); this module owns the
projections around it. Shapes: x [B,T,D]; P = H*dk; the core sees q,k [B,T,H,dk], v [B,T,H,dv].
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from k3jax.kernels.kda import get_kda_fn
from k3jax.kernels.kda.decode import kda_decode_step, short_conv, short_conv_step
from k3jax.layers import context as CP
from k3jax.layers.common import l2_normalize, ones, param, rms_norm, zeros
from k3jax import sharding as S
from k3jax.sharding import constrain


def _a_log_init(sampler, shape, dtype):
    # Pre-training init: A = U(1, 16), stored as log (NeMo; k3-architecture.md §4).
    return jnp.log(sampler.uniform(shape, 1.0, 16.0)).astype(dtype)


def _conv_init(width: int):
    # PyTorch's default depthwise Conv1d init: U(-1/sqrt(fan_in), 1/sqrt(fan_in)), fan_in = width.
    bound = width ** -0.5
    return lambda sampler, shape, dtype: sampler.uniform(shape, -bound, bound).astype(dtype)


class KDA(nnx.Module):
    def __init__(self, cfg, kcfg, rngs: nnx.Rngs, stack: tuple[int, ...] = (), dtype=jnp.float32):
        d, h, dk = cfg.hidden_size, cfg.kda_num_heads, cfg.kda_head_dim
        p, w, std = h * dk, cfg.kda_conv_size, cfg.initializer_range
        self.cfg, self.num_heads, self.head_dim = cfg, h, dk
        self.chunk_size = kcfg.kda_chunk_size
        # kda_impl=tokamax fuses the bounded gate into its kernels: the core takes the gate's
        # pre-activation with A_log and dt_bias instead of g (config.validate allows it only with
        # kda_gate=bounded).
        self.fused_gate = kcfg.kda_impl == "tokamax"
        # Rows over ``stage`` too where it is not manual (the unrolled layers outside the pipeline,
        # S.stage_rows); shard_kda keeps only the free axes, so inside the pipeline it drops out.
        self.core = get_kda_fn(kcfg.kda_impl, chunk_size=kcfg.kda_chunk_size, interpret=kcfg.pallas_interpret,
                               batch_axes=(S.STAGE_AXIS, *S.BATCH_AXES), head_axis=S.HEAD_AXIS,
                               lower_bound=cfg.kda_gate_lower_bound if cfg.kda_gate == "bounded" else None,
                               max_num_segments=kcfg.kda_tokamax_max_segments)
        self.cp_strategy = kcfg.context_parallel_strategy
        mat = dict(std=std, dtype=dtype, matrix=(0, 1))
        self.q_proj = param(rngs, stack, (d, p), ("embed", "heads"), **mat)
        self.k_proj = param(rngs, stack, (d, p), ("embed", "heads"), **mat)
        self.v_proj = param(rngs, stack, (d, p), ("embed", "heads"), **mat)
        # Convs, A_log, dt_bias and o_norm are kept in f32 (as in the released checkpoint).
        conv = dict(init=_conv_init(w), dtype=jnp.float32)
        self.q_conv = param(rngs, stack, (p, w), ("heads", None), **conv)
        self.k_conv = param(rngs, stack, (p, w), ("heads", None), **conv)
        self.v_conv = param(rngs, stack, (p, w), ("heads", None), **conv)
        self.f_a_proj = param(rngs, stack, (d, cfg.kda_gate_rank), ("embed", "rank"), **mat)
        self.f_b_proj = param(rngs, stack, (cfg.kda_gate_rank, p), ("rank", "heads"), **mat)
        self.A_log = param(rngs, stack, (h,), ("norm",), init=_a_log_init, dtype=jnp.float32)
        self.dt_bias = param(rngs, stack, (p,), ("heads",), init=zeros, dtype=jnp.float32)
        self.b_proj = param(rngs, stack, (d, h), ("embed", None), **mat)
        if cfg.kda_output_gate == "full":
            self.g_proj = param(rngs, stack, (d, p), ("embed", "heads"), **mat)
        else:
            r = cfg.kda_output_gate_rank
            self.g_a_proj = param(rngs, stack, (d, r), ("embed", "rank"), **mat)
            self.g_b_proj = param(rngs, stack, (r, p), ("rank", "heads"), **mat)
        self.o_norm = param(rngs, stack, (dk,), ("norm",), init=ones,
                            dtype=jnp.float32)
        self.o_proj = param(rngs, stack, (p, d), ("heads", "embed"), **mat)

    # -- pieces shared by the sequence and the single-token paths ------------------------------
    def _proj(self, x, w):
        return jnp.einsum("...d,dp->...p", x, w[...].astype(x.dtype))

    def _gate_pre(self, x):
        """The gate's pre-activation f (before dt_bias), f32, shape [..., H, dk]."""
        f = self._proj(self._proj(x, self.f_a_proj), self.f_b_proj).astype(jnp.float32)
        return f.reshape(*f.shape[:-1], self.num_heads, self.head_dim)

    def _gate(self, x):
        """Per-channel log-decay g <= 0, f32, shape [..., H, dk]."""
        c = self.cfg
        u = self._gate_pre(x) + self._heads(self.dt_bias[...])
        a = jnp.exp(self.A_log[...])[:, None]                       # [H, 1]
        if c.kda_gate == "bounded":
            return c.kda_gate_lower_bound * jax.nn.sigmoid(a * u)    # in (lb, 0)
        return -a * jax.nn.softplus(u)

    def _output(self, o, x):
        """Per-head gated RMSNorm then o_proj. o: [..., H, dv] f32; x: the layer input."""
        if self.cfg.kda_output_gate == "full":
            gate = self._proj(x, self.g_proj)
        else:
            gate = self._proj(self._proj(x, self.g_a_proj), self.g_b_proj)
        gate = gate.reshape(*gate.shape[:-1], self.num_heads, self.head_dim).astype(jnp.float32)
        o = rms_norm(o.astype(jnp.float32), self.o_norm[...], self.cfg.rms_norm_eps) * jax.nn.sigmoid(gate)
        o = o.reshape(*o.shape[:-2], -1).astype(x.dtype)
        return jnp.einsum("...p,pd->...d", o, self.o_proj[...].astype(x.dtype))

    def _heads(self, t):
        return t.reshape(*t.shape[:-1], self.num_heads, self.head_dim)

    def _gate_params(self):
        """What the fused-gate (tokamax) core takes besides f: A_log [H], dt_bias [H, dk]."""
        return {"a_log": self.A_log[...], "dt_bias": self._heads(self.dt_bias[...])}

    # -- sequence path (training, prefill) ------------------------------------------------------
    def __call__(self, x, segment_ids, positions=None, return_cache: bool = False):
        """x [B,T,D], segment_ids [B,T] -> (out [B,T,D], aux {}, decode cache or None), the mixer
        contract MLA shares (``positions`` is unused: KDA has no position encoding).

        Tokens with segment id 0 (padding) contribute zero to the convolutions, so a left-padded
        prompt leaves no trace in the conv state.
        """
        keep = (segment_ids != 0)[..., None].astype(x.dtype)
        cp = CP.context_size() > 1                   # the sequence is split over the context axis
        conv = CP.short_conv if cp else short_conv
        conv_in = {}
        outs = []
        for name, w, cw in (("q", self.q_proj, self.q_conv), ("k", self.k_proj, self.k_conv),
                            ("v", self.v_proj, self.v_conv)):
            z = self._proj(x, w) * keep
            y, conv_state = conv(z.astype(jnp.float32), cw[...], segment_ids=segment_ids)
            conv_in[name] = conv_state
            outs.append(self._heads(jax.nn.silu(y)))
        q, k, v = outs
        q, k = l2_normalize(q), l2_normalize(k)
        beta = jax.nn.sigmoid(self._proj(x, self.b_proj).astype(jnp.float32))
        q = constrain(q, ("batch", "seq", "act_heads", None))
        k = constrain(k, ("batch", "seq", "act_heads", None))
        if self.fused_gate:
            if cp:
                raise ValueError("kda_impl=tokamax does not run under context parallelism (config.validate "
                                 "refuses it); use kda_impl=chunked")
            o, state = self.core(q, k, v, self._gate_pre(x), beta, **self._gate_params(),
                                 scale=self.head_dim ** -0.5, segment_ids=segment_ids)
        elif cp:
            o, state = CP.kda(self.core, q, k, v, self._gate(x), beta, scale=self.head_dim ** -0.5,
                              segment_ids=segment_ids, strategy=self.cp_strategy)
        else:
            o, state = self.core(q, k, v, self._gate(x), beta, scale=self.head_dim ** -0.5,
                                 segment_ids=segment_ids)
        # named for remat policies (k3jax.remat): with it and the chunk states kept, the backward
        # does not rerun the recurrence
        o = checkpoint_name(o, "kda_core_out")
        out = self._output(o, x)
        if not return_cache:
            return out, {}, None
        return out, {}, {"conv_q": conv_in["q"], "conv_k": conv_in["k"], "conv_v": conv_in["v"], "state": state}

    # -- single-token path (decode) -------------------------------------------------------------
    def decode(self, x, cache, pos=None, start=None):
        """x [B,D] -> out [B,D], new cache. Constant cost in the context length (``pos`` and
        ``start``, the cache slot and first valid slot MLA needs, are unused here)."""
        new = {}
        outs = []
        for name, w, cw in (("q", self.q_proj, self.q_conv), ("k", self.k_proj, self.k_conv),
                            ("v", self.v_proj, self.v_conv)):
            y, new[f"conv_{name}"] = short_conv_step(self._proj(x, w).astype(jnp.float32),
                                                     cache[f"conv_{name}"], cw[...])
            outs.append(self._heads(jax.nn.silu(y)))
        q, k, v = outs
        q, k = l2_normalize(q), l2_normalize(k)
        beta = jax.nn.sigmoid(self._proj(x, self.b_proj).astype(jnp.float32))
        o, new["state"] = kda_decode_step(q, k, v, self._gate(x), beta, cache["state"],
                                          scale=self.head_dim ** -0.5)
        return self._output(o, x), new


    # -- chunk path (chunked prefill continuing a cache) ---------------------------------------
    def extend(self, x, cache, lengths):
        """x [B,T,D]: the next T tokens of each row, of which the first lengths[b] are real and the
        rest pad a fixed-size chunk; cache: the per-row state after the row's earlier tokens.
        Returns (out [B,T,D], cache after the real tokens) -> exactly the state a single pass over
        all the row's tokens would leave (tests/test_serve_model.py).

        Padding is made a no-op rather than a new document (segment ids would reset the carried
        state): its inputs to the convolutions are zero, and its decay g = 0 and write strength
        beta = 0 leave the recurrent state as it is (S' = exp(0) S + k (0 * ...)^T). The conv
        state is the window of inputs ending at each row's last real token.
        """
        t = x.shape[1]
        keep = jnp.arange(t)[None, :] < lengths[:, None]                       # [B,T]
        new = {}
        outs = []
        for name, w, cw in (("q", self.q_proj, self.q_conv), ("k", self.k_proj, self.k_conv),
                            ("v", self.v_proj, self.v_conv)):
            z = (self._proj(x, w) * keep[..., None].astype(x.dtype)).astype(jnp.float32)
            prev = cache[f"conv_{name}"]                                        # [B,C,W-1]
            y, _ = short_conv(z, cw[...], initial_state=prev)
            window = jnp.concatenate([jnp.swapaxes(prev, 1, 2).astype(z.dtype), z], axis=1)  # [B,W-1+T,C]
            idx = lengths[:, None] + jnp.arange(prev.shape[-1])[None, :]       # inputs ending at the last real one
            new[f"conv_{name}"] = jnp.swapaxes(jnp.take_along_axis(window, idx[..., None], axis=1), 1, 2)
            outs.append(self._heads(jax.nn.silu(y)))
        q, k, v = outs
        q, k = l2_normalize(q), l2_normalize(k)
        beta = jnp.where(keep[..., None], jax.nn.sigmoid(self._proj(x, self.b_proj).astype(jnp.float32)), 0.0)
        q = constrain(q, ("batch", "seq", "act_heads", None))
        k = constrain(k, ("batch", "seq", "act_heads", None))
        if self.fused_gate:
            # g = lb * sigmoid(A * (f + dt)) is exactly 0 where A * (f + dt) underflows sigmoid:
            # f = -1e30 on padding (A = exp(A_log) would have to fall below 1e-25 to miss it).
            f = jnp.where(keep[..., None, None], self._gate_pre(x), -1e30)
            o, new["state"] = self.core(q, k, v, f, beta, **self._gate_params(),
                                        scale=self.head_dim ** -0.5, initial_state=cache["state"])
        else:
            g = jnp.where(keep[..., None, None], self._gate(x), 0.0)
            o, new["state"] = self.core(q, k, v, g, beta, scale=self.head_dim ** -0.5,
                                        initial_state=cache["state"])
        return self._output(o, x), new


def kda_cache_shapes(cfg, batch: int) -> dict[str, tuple[tuple[int, ...], jnp.dtype, tuple]]:
    """Per-layer KDA decode cache: three conv states and the f32 recurrent state (length-free)."""
    p = cfg.kda_num_heads * cfg.kda_head_dim
    conv = ((batch, p, cfg.kda_conv_size - 1), jnp.float32, ("batch", "heads", None))
    return {"conv_q": conv, "conv_k": conv, "conv_v": conv,
            "state": ((batch, cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_head_dim), jnp.float32,
                      ("batch", "act_heads", None, None))}
