"""Gated Multi-head Latent Attention (k3-architecture.md §5), NoPE by default.

Training/prefill: full per-head keys/values from the latent. Decode and chunked prefill (``extend``,
a chunk continuing a cache): only the normalised latent ``c`` [R] and the shared key slice ``k_r``
[Rr] are cached (576 values per token for K3) and ``kv_b`` is absorbed into the query (W_UK) and
output (W_UV) sides.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.kernels.attention import get_attention_fn
from k3jax.kernels.attention.decode import latent_attention
from k3jax.layers import context as CP
from k3jax.layers.common import ones, param, rms_norm
from k3jax.layers.rope import apply_rope, softmax_scale
from k3jax.sharding import constrain

LATENT_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm are built without eps (class default 1e-6)


class MLA(nnx.Module):
    def __init__(self, cfg, kcfg, rngs: nnx.Rngs, stack: tuple[int, ...] = (), dtype=jnp.float32):
        d, h = cfg.hidden_size, cfg.num_attention_heads
        self.cfg, self.num_heads = cfg, h
        self.attention = get_attention_fn(kcfg.attention_impl)
        self.cp_load_balance = kcfg.context_parallel_load_balance
        self.scale = softmax_scale(cfg)
        mat = dict(std=cfg.initializer_range, dtype=dtype, matrix=(0, 1))
        qk, r, rr = cfg.qk_head_dim, cfg.kv_lora_rank, cfg.qk_rope_head_dim
        if cfg.q_lora_rank:
            self.q_a_proj = param(rngs, stack, (d, cfg.q_lora_rank), ("embed", "rank"), **mat)
            self.q_a_layernorm = param(rngs, stack, (cfg.q_lora_rank,), ("norm",), init=ones, dtype=dtype)
            self.q_b_proj = param(rngs, stack, (cfg.q_lora_rank, h * qk), ("rank", "heads"), **mat)
        else:
            self.q_proj = param(rngs, stack, (d, h * qk), ("embed", "heads"), **mat)
        self.kv_a_proj_with_mqa = param(rngs, stack, (d, r + rr), ("embed", "rank"), **mat)
        self.kv_a_layernorm = param(rngs, stack, (r,), ("norm",), init=ones, dtype=dtype)
        self.kv_b_proj = param(rngs, stack, (r, h * (cfg.qk_nope_head_dim + cfg.v_head_dim)),
                               ("rank", "heads"), **mat)
        if cfg.mla_use_output_gate:
            self.g_proj = param(rngs, stack, (d, h * cfg.v_head_dim), ("embed", "heads"), **mat)
        self.o_proj = param(rngs, stack, (h * cfg.v_head_dim, d), ("heads", "embed"), **mat)

    def _w(self, p, dt):
        return p[...].astype(dt)

    def _query(self, x):
        """x [...,D] -> (q_nope [...,H,dn], q_rope [...,H,dr])."""
        c, dt = self.cfg, x.dtype
        if c.q_lora_rank:
            cq = rms_norm(jnp.einsum("...d,dr->...r", x, self._w(self.q_a_proj, dt)),
                          self.q_a_layernorm[...], LATENT_EPS)
            q = jnp.einsum("...r,rq->...q", cq, self._w(self.q_b_proj, dt))
        else:
            q = jnp.einsum("...d,dq->...q", x, self._w(self.q_proj, dt))
        q = q.reshape(*q.shape[:-1], self.num_heads, c.qk_head_dim)
        return q[..., :c.qk_nope_head_dim], q[..., c.qk_nope_head_dim:]

    def _latent(self, x):
        """x [...,D] -> (normalised c [...,R], k_r [...,Rr])."""
        c = self.cfg
        ckv = jnp.einsum("...d,dr->...r", x, self._w(self.kv_a_proj_with_mqa, x.dtype))
        lat = rms_norm(ckv[..., :c.kv_lora_rank], self.kv_a_layernorm[...], LATENT_EPS)
        return lat, ckv[..., c.kv_lora_rank:]

    def _finish(self, o, x):
        """o [...,H,dv] -> gate -> o_proj [...,D]."""
        o = o.reshape(*o.shape[:-2], -1).astype(x.dtype)
        if self.cfg.mla_use_output_gate:
            gate = jnp.einsum("...d,dp->...p", x, self._w(self.g_proj, x.dtype))
            o = o * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(x.dtype)
        return jnp.einsum("...p,pd->...d", o, self._w(self.o_proj, x.dtype))

    def __call__(self, x, segment_ids, positions, return_cache: bool = False):
        """x [B,T,D] -> (out [B,T,D], aux {"max_logits": [H] f32}, latent cache {"c", "k_r"} or None)."""
        c = self.cfg
        q_nope, q_rope = self._query(x)
        lat, k_r = self._latent(x)
        if c.mla_use_rope:
            q_rope = apply_rope(q_rope, positions, c)
            k_r = apply_rope(k_r[..., None, :], positions, c)[..., 0, :]
        q = constrain(jnp.concatenate([q_nope, q_rope], -1), ("batch", "seq", "act_heads", None))
        if CP.context_size() > 1:
            # The sequence is split over the context axis: all-gather the latent, not keys/values.
            o, m = CP.mla_attention(q, lat, k_r, self._w(self.kv_b_proj, x.dtype), segment_ids,
                                    scale=self.scale, load_balance=self.cp_load_balance)
        else:
            kv = jnp.einsum("btr,rq->btq", lat, self._w(self.kv_b_proj, x.dtype))
            kv = kv.reshape(*kv.shape[:-1], self.num_heads, -1)
            k_nope, v = kv[..., :c.qk_nope_head_dim], kv[..., c.qk_nope_head_dim:]
            k_rope = jnp.broadcast_to(k_r[..., None, :], (*k_r.shape[:-1], self.num_heads, k_r.shape[-1]))
            k = constrain(jnp.concatenate([k_nope, k_rope], -1), ("batch", "seq", "act_heads", None))
            o, m = self.attention(q, k, v, segment_ids, scale=self.scale)
        out = self._finish(o, x)
        return out, {"max_logits": m}, ({"c": lat, "k_r": k_r} if return_cache else None)

    def _write(self, cache, lat, k_r, slots):
        """Scatter the new tokens' latents into each row's cache: lat [B,T,R], k_r [B,T,Rr] at
        slots [B,T]. Slots past the cache end are dropped (a padded chunk tail, an idle row)."""
        rows = jnp.arange(lat.shape[0])[:, None]
        return {"c": cache["c"].at[rows, slots].set(lat.astype(cache["c"].dtype), mode="drop"),
                "k_r": cache["k_r"].at[rows, slots].set(k_r.astype(cache["k_r"].dtype), mode="drop")}

    def _attend_cache(self, x, cache, slots, valid, rope_pos):
        """The absorbed path shared by decode and chunked prefill: x [B,T,D] at cache slots [B,T]
        (rope positions rope_pos [B,T]), valid [B,T,S] -> (out [B,T,D], new cache)."""
        c = self.cfg
        q_nope, q_rope = self._query(x)                                   # [B,T,H,dn], [B,T,H,dr]
        lat, k_r = self._latent(x)
        if c.mla_use_rope:
            q_rope = apply_rope(q_rope, rope_pos, c)
            k_r = apply_rope(k_r[..., None, :], rope_pos, c)[..., 0, :]
        new = self._write(cache, lat, k_r, slots)
        w = self._w(self.kv_b_proj, jnp.float32).reshape(c.kv_lora_rank, self.num_heads, -1)
        w_uk, w_uv = w[..., :c.qk_nope_head_dim], w[..., c.qk_nope_head_dim:]
        q_lat = jnp.einsum("bthn,rhn->bthr", q_nope.astype(jnp.float32), w_uk)
        o_lat = latent_attention(q_lat, q_rope.astype(jnp.float32), new["c"], new["k_r"], valid, scale=self.scale)
        o = jnp.einsum("bthr,rhv->bthv", o_lat, w_uv)
        return self._finish(o, x), new

    def decode(self, x, cache, pos, start):
        """One token per row. x [B,D]; cache {"c": [B,S,R], "k_r": [B,S,Rr]}; pos: the write slot,
        a scalar (rows aligned by left padding) or [B] (each row at its own slot, as the slots of a
        continuous batch are; a slot >= S writes nothing); start [B]: first valid cache slot per row."""
        pos = jnp.broadcast_to(jnp.asarray(pos, jnp.int32), start.shape)
        s = jnp.arange(cache["c"].shape[1])
        valid = (s[None, :] >= start[:, None]) & (s[None, :] <= pos[:, None])
        out, new = self._attend_cache(x[:, None], cache, pos[:, None], valid[:, None], (pos - start)[:, None])
        return out[:, 0], new

    def extend(self, x, cache, pos):
        """Chunked prefill: x [B,T,D], the next T tokens of each row, continuing a cache that holds
        each row's first pos[b] tokens in slots 0..pos[b]-1 (no left padding). Token t sits at slot
        pos[b] + t and sees slots 0..pos[b] + t: the cached latent plus the chunk's causal prefix.
        Returns (out [B,T,D], new cache). Tokens past a row's real length (a padded chunk tail)
        write slots later tokens overwrite before anything reads them."""
        t = x.shape[1]
        slots = pos[:, None] + jnp.arange(t)[None, :]                       # [B,T]
        valid = jnp.arange(cache["c"].shape[1])[None, None, :] <= slots[..., None]
        return self._attend_cache(x, cache, slots, valid, slots)


def mla_cache_shapes(cfg, batch: int, length: int, dtype=jnp.float32):
    return {"c": ((batch, length, cfg.kv_lora_rank), dtype, ("batch", "cache_seq", None)),
            "k_r": ((batch, length, cfg.qk_rope_head_dim), dtype, ("batch", "cache_seq", None))}
