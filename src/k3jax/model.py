"""The K3 / Kimi Linear text backbone: embed -> decoder layers -> (AttnRes output mix) -> head.

Layers are grouped as ``prefix`` (unrolled: the period holding the dense layer 0), ``periods`` (a
stack of identical super-blocks of one layer period, e.g. KDA, KDA, KDA, MLA, each with an MoE FFN,
run by ``lax.scan``) and ``tail`` (unrolled irregular layers, e.g. K3's final MLA layer 92). The
residual state (AttnRes blocks + partial sum, or the plain hidden state) is the scan carry; a per-
layer "starts an AttnRes block" flag is scanned alongside, so block boundaries may fall anywhere.

Per-layer side outputs are returned explicitly, in the same prefix/periods/tail structure as the
parameters: MLA max logits [H] (QK-clip), MoE expert loads [E], dropped fraction and aux loss.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from k3jax.layers.attn_res import AttnResSites, attn_res_mix
from k3jax.layers.common import MLP, CountingSampler, FlatSampler, RMSNorm, dtype_of, ones, param, zeros
from k3jax.layers.kda import KDA, kda_cache_shapes
from k3jax.layers.mla import MLA, mla_cache_shapes
from k3jax.layers.moe import MoE
from k3jax.sharding import constrain

REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "save_dot": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
    "save_mixer_out": jax.checkpoint_policies.save_only_these_names("mixer_out"),
}


@dataclasses.dataclass(frozen=True)
class Layout:
    """Which layers are unrolled before the scan, scanned as periods, and unrolled after."""
    prefix: tuple[int, ...]
    period: int
    num_periods: int
    tail: tuple[int, ...]

    @property
    def scan_start(self) -> int:
        return len(self.prefix)

    def period_layers(self, i: int) -> list[int]:
        s = self.scan_start + i * self.period
        return list(range(s, s + self.period))


def layout(cfg, scan: bool = True) -> Layout:
    """Find the longest run of identical all-MoE periods after the dense layers."""
    p = cfg.mla_every
    if p == 0:
        return Layout(tuple(range(cfg.num_layers)), 1, 0, ())
    sched = cfg.schedule
    pattern = [("kda", "moe")] * (p - 1) + [("mla", "moe")]
    start = math.ceil(cfg.first_k_dense / p) * p
    n = 0
    while start + (n + 1) * p <= cfg.num_layers and sched[start + n * p:start + (n + 1) * p] == pattern:
        n += 1
    if not scan or n < 2:
        return Layout(tuple(range(cfg.num_layers)), p, 0, ())
    return Layout(tuple(range(start)), p, n, tuple(range(start + n * p, cfg.num_layers)))


class DecoderLayer(nnx.Module):
    def __init__(self, cfg, kcfg, mixer: str, ffn: str, rngs, stack=(), dtype=jnp.float32):
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.cfg, self.mixer, self.ffn = cfg, mixer, ffn
        self.input_layernorm = RMSNorm(d, eps, rngs, stack, dtype)
        self.post_attention_layernorm = RMSNorm(d, eps, rngs, stack, dtype)
        self.self_attn = (KDA if mixer == "kda" else MLA)(cfg, kcfg, rngs, stack, dtype)
        self.mlp = MLP(cfg, cfg.intermediate_size, rngs, stack, dtype) if ffn == "dense" else \
            MoE(cfg, kcfg, rngs, stack, dtype)
        if cfg.attn_res:
            self.res = AttnResSites(d, rngs, stack, dtype)

    def _mix(self, res, w, gamma):
        return attn_res_mix(res["blocks"], res["n"], res["partial"], w[...], gamma[...], self.cfg.rms_norm_eps)

    def _pre_mixer(self, res, first: bool, block_start):
        """Mixer input and the residual state after a possible block boundary."""
        if not self.cfg.attn_res:
            return res["h"], res
        x = res["partial"] if first else self._mix(res, self.res.attn_res_proj, self.res.attn_res_norm)
        if block_start is not False:
            flag = jnp.asarray(block_start)
            blocks = jnp.where(flag, jax.lax.dynamic_update_index_in_dim(res["blocks"], res["partial"], res["n"], 0),
                               res["blocks"])
            res = {"blocks": blocks, "n": res["n"] + flag.astype(jnp.int32),
                   "partial": jnp.where(flag, jnp.zeros_like(res["partial"]), res["partial"])}
        return x, res

    def _post_mixer(self, res, a, mesh, compute_aux):
        key = "partial" if self.cfg.attn_res else "h"
        res = dict(res, **{key: res[key] + a})
        y = self._mix(res, self.res.mlp_res_proj, self.res.mlp_res_norm) if self.cfg.attn_res else res["h"]
        y = self.post_attention_layernorm(y)
        aux = {}
        if self.ffn == "dense":
            f = self.mlp(y)
        else:
            f, aux = self.mlp(y, mesh=mesh, compute_aux=compute_aux)
        res = dict(res, **{key: constrain(res[key] + f, ("batch", "seq", "act_embed"))})
        return res, aux

    def __call__(self, res, segment_ids, positions, *, first=False, block_start=False, mesh=None,
                 compute_aux=False, return_cache=False):
        x, res = self._pre_mixer(res, first, block_start)
        h = self.input_layernorm(x)
        cache = None
        if self.mixer == "kda":
            out = self.self_attn(h, segment_ids, return_cache=return_cache)
            a, cache = out if return_cache else (out, None)
            aux = {}
        else:
            out = self.self_attn(h, segment_ids, positions, return_cache=return_cache)
            a, m = out[:2]
            cache = {"c": out[2][0], "k_r": out[2][1]} if return_cache else None
            aux = {"max_logits": m}
        a = checkpoint_name(a, "mixer_out")
        res, ffn_aux = self._post_mixer(res, a, mesh, compute_aux)
        return res, {**aux, **ffn_aux}, cache

    def decode(self, res, cache, pos, start, *, first=False, block_start=False, mesh=None):
        """One token per row: res leaves are [B,1,D]; returns (res, new cache)."""
        x, res = self._pre_mixer(res, first, block_start)
        h = self.input_layernorm(x)[:, 0]
        if self.mixer == "kda":
            a, cache = self.self_attn.decode(h, cache)
        else:
            a, cache = self.self_attn.decode(h, cache, pos, start)
        res, _ = self._post_mixer(res, a[:, None], mesh, False)
        return res, cache


class Period(nnx.Module):
    """One layer period (e.g. KDA, KDA, KDA, MLA with MoE FFNs), stacked ``n`` deep for the scan."""

    def __init__(self, cfg, kcfg, rngs, n: int, dtype):
        p = cfg.mla_every
        kinds = [("kda", "moe")] * (p - 1) + [("mla", "moe")]
        self.layers = nnx.List([DecoderLayer(cfg, kcfg, m, f, rngs, (n,), dtype) for m, f in kinds])


class K3Model(nnx.Module):
    def __init__(self, cfg, kcfg, rngs: nnx.Rngs, *, scan: bool = True, dtype=jnp.float32,
                 compute_dtype=jnp.float32):
        self.cfg, self.kcfg, self.compute_dtype = cfg, kcfg, compute_dtype
        self.layout = layout(cfg, scan)
        d, v, std = cfg.hidden_size, cfg.vocab_size, cfg.initializer_range
        self.embed_tokens = param(rngs, (), (v, d), ("vocab", "embed"), std=std, dtype=dtype)
        mk = lambda l: DecoderLayer(cfg, kcfg, cfg.mixer(l), cfg.ffn(l), rngs, (), dtype)  # noqa: E731
        self.prefix = nnx.List([mk(l) for l in self.layout.prefix])
        if self.layout.num_periods:
            self.periods = Period(cfg, kcfg, rngs, self.layout.num_periods, dtype)
        self.tail = nnx.List([mk(l) for l in self.layout.tail])
        self.norm = RMSNorm(d, cfg.rms_norm_eps, rngs, (), dtype)
        if cfg.attn_res:
            self.output_attn_res_proj = param(rngs, (), (d,), ("norm",), init=zeros, dtype=dtype)
            self.output_attn_res_norm = param(rngs, (), (d,), ("norm",), init=ones, dtype=dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = param(rngs, (), (d, v), ("embed", "vocab"), std=std, dtype=dtype, matrix=None)

    # -- helpers ---------------------------------------------------------------------------------
    def _block_start(self, l: int) -> bool:
        return self.cfg.attn_res and l % self.cfg.attn_res_block_size == 0

    def _scan_flags(self):
        lay = self.layout
        return jnp.array([[self._block_start(l) for l in lay.period_layers(i)] for i in range(lay.num_periods)],
                         dtype=bool)

    def _initial_residual(self, x):
        if not self.cfg.attn_res:
            return {"h": x}
        nb = len(self.cfg.attn_res_block_starts)
        return {"blocks": jnp.zeros((nb,) + x.shape, x.dtype), "n": jnp.zeros((), jnp.int32), "partial": x}

    def embed(self, tokens):
        x = jnp.take(self.embed_tokens[...], tokens, axis=0).astype(self.compute_dtype)
        return constrain(x, ("batch", "seq", "act_embed"))

    def head_weight(self):
        return self.embed_tokens[...].T if self.cfg.tie_word_embeddings else self.lm_head[...]

    def final_hidden(self, res):
        """Residual state -> normalised final hidden [B,T,D] (the lm_head input)."""
        if self.cfg.attn_res:
            h = attn_res_mix(res["blocks"], res["n"], res["partial"], self.output_attn_res_proj[...],
                             self.output_attn_res_norm[...], self.cfg.rms_norm_eps)
        else:
            h = res["h"]
        return self.norm(h)

    # -- sequence forward ------------------------------------------------------------------------
    def hidden(self, tokens, segment_ids=None, positions=None, *, mesh=None, remat: str = "none",
               compute_aux: bool = False, return_cache: bool = False):
        """tokens [B,T] -> (final hidden [B,T,D], aux, caches) with aux/caches mirroring the layers."""
        b, t = tokens.shape
        segment_ids = jnp.ones((b, t), jnp.int32) if segment_ids is None else segment_ids
        positions = jnp.broadcast_to(jnp.arange(t), (b, t)) if positions is None else positions
        res = self._initial_residual(self.embed(tokens))
        kw = dict(mesh=mesh, compute_aux=compute_aux, return_cache=return_cache)
        aux = {"prefix": [], "periods": None, "tail": []}
        caches = {"prefix": [], "periods": None, "tail": []}
        policy = REMAT_POLICIES[remat]

        def unrolled(layer, res, **flags):
            """One prefix/tail layer, under the same remat policy as the scanned periods (without it
            their activations stay live for the backward: at K3 scale ~8 GB per MoE layer)."""
            if remat == "none":
                return layer(res, segment_ids, positions, **flags, **kw)
            gdef, st = nnx.split(layer)
            fn = lambda st, res: nnx.merge(gdef, st)(res, segment_ids, positions, **flags, **kw)  # noqa: E731
            return jax.checkpoint(fn, policy=policy, prevent_cse=False)(st, res)

        for l, layer in zip(self.layout.prefix, self.prefix):
            res, a, c = unrolled(layer, res, first=(l == 0), block_start=self._block_start(l))
            aux["prefix"].append(a)
            caches["prefix"].append(c)
        if self.layout.num_periods:
            gdef, state = nnx.split(self.periods)

            def body(res, xs):
                st, flags = xs
                period = nnx.merge(gdef, st)
                outs_a, outs_c = [], []
                for j, layer in enumerate(period.layers):
                    res, a, c = layer(res, segment_ids, positions, block_start=flags[j], **kw)
                    outs_a.append(a)
                    outs_c.append(c)
                return res, (outs_a, outs_c)

            if remat != "none":
                body = jax.checkpoint(body, policy=policy, prevent_cse=False)
            res, (aux["periods"], caches["periods"]) = jax.lax.scan(body, res, (state, self._scan_flags()))
        for l, layer in zip(self.layout.tail, self.tail):
            res, a, c = unrolled(layer, res, block_start=self._block_start(l))
            aux["tail"].append(a)
            caches["tail"].append(c)
        return self.final_hidden(res), aux, caches

    def __call__(self, tokens, segment_ids=None, positions=None, **kw):
        """Full logits [B,T,V] in f32 (tests, decode prefill); training uses ``k3jax.loss``."""
        h, aux, _ = self.hidden(tokens, segment_ids, positions, **kw)
        logits = jnp.einsum("btd,dv->btv", h, self.head_weight().astype(h.dtype),
                            preferred_element_type=jnp.float32)
        return logits, aux

    # -- decode ----------------------------------------------------------------------------------
    def cache_spec(self, batch: int, length: int):
        """Shapes, dtypes and logical axes of the decode cache (mirrors prefix/periods/tail)."""
        c = self.cfg

        def one(l, stack=()):
            shapes = kda_cache_shapes(c, batch) if c.mixer(l) == "kda" else mla_cache_shapes(c, batch, length)
            return {k: (stack + s, dt, ("layers",) * len(stack) + ax) for k, (s, dt, ax) in shapes.items()}

        lay = self.layout
        periods = None
        if lay.num_periods:
            periods = [one(l, (lay.num_periods,)) for l in lay.period_layers(0)]
        return {"prefix": [one(l) for l in lay.prefix], "periods": periods, "tail": [one(l) for l in lay.tail]}

    def decode_step(self, tokens, cache, pos, start, *, mesh=None):
        """tokens [B] at absolute slot ``pos`` -> (logits [B,V] f32, new cache)."""
        res = self._initial_residual(self.embed(tokens[:, None]))
        new = {"prefix": [], "periods": None, "tail": []}
        for l, layer, c in zip(self.layout.prefix, self.prefix, cache["prefix"]):
            res, c = layer.decode(res, c, pos, start, first=(l == 0), block_start=self._block_start(l), mesh=mesh)
            new["prefix"].append(c)
        if self.layout.num_periods:
            gdef, state = nnx.split(self.periods)

            def body(res, xs):
                st, flags, cs = xs
                period = nnx.merge(gdef, st)
                outs = []
                for j, layer in enumerate(period.layers):
                    res, cj = layer.decode(res, cs[j], pos, start, block_start=flags[j], mesh=mesh)
                    outs.append(cj)
                return res, outs

            res, new["periods"] = jax.lax.scan(body, res, (state, self._scan_flags(), cache["periods"]))
        for l, layer, c in zip(self.layout.tail, self.tail, cache["tail"]):
            res, c = layer.decode(res, c, pos, start, block_start=self._block_start(l), mesh=mesh)
            new["tail"].append(c)
        h = self.final_hidden(res)[:, 0]
        logits = jnp.einsum("bd,dv->bv", h, self.head_weight().astype(h.dtype), preferred_element_type=jnp.float32)
        return logits, new


FLAT_INIT_MAX_PARAMS = 2 ** 28  # below this, init draws from two flat buffers (fast CPU compiles)


def _sampler(cfg, seed: int):
    """FlatSampler for small models, else per-parameter keys. Both are deterministic in the seed."""
    counter = CountingSampler()
    nnx.eval_shape(lambda: _construct(cfg, counter))
    if counter.n_normal + counter.n_uniform > FLAT_INIT_MAX_PARAMS:
        return nnx.Rngs(seed)
    return FlatSampler(jax.random.key(seed), counter.n_normal, counter.n_uniform)


def _construct(cfg, rngs):
    return K3Model(cfg.model, cfg.kernel, rngs, scan=cfg.train.scan_layers, dtype=dtype_of(cfg.train.weight_dtype),
                   compute_dtype=dtype_of(cfg.train.dtype))


def build(cfg, rngs: nnx.Rngs | int = 0) -> K3Model:
    """Construct the model from a full Config (dtypes, scan flag and kernels from its sections).
    An int seed picks the sampler by size (see ``_sampler``); an nnx.Rngs uses per-leaf keys."""
    return _construct(cfg, _sampler(cfg, rngs) if isinstance(rngs, int) else rngs)


# ---- abstract state, shardings, sharded init ----------------------------------------------------

def _is_var(x):
    return isinstance(x, nnx.Variable)


def abstract(cfg):
    """(graphdef, abstract state): shapes, dtypes and logical axes, allocating nothing.
    Works for the full kimi-k3 (2.78T parameters) as well as the tiny config."""
    model = nnx.eval_shape(lambda: _construct(cfg, nnx.Rngs(0)))
    return nnx.split(model)


def state_shardings(state, mesh):
    """NamedSharding per variable, from its declared logical axes (same pytree as ``state``)."""
    from k3jax.sharding import param_sharding
    return jax.tree.map(lambda v: v.replace(param_sharding(mesh, v.shape, v.axes)), state, is_leaf=_is_var)


def count_params(state) -> int:
    return sum(math.prod(v.shape) for v in jax.tree.leaves(state, is_leaf=_is_var)
               if isinstance(v, (nnx.Param, nnx.Variable)))


def create_sharded(cfg, mesh, seed: int | None = None) -> K3Model:
    """Initialise parameters into their shardings.

    Pod-scale models are initialised by a jit whose out_shardings place every shard where it
    lives (nothing is gathered on one host). Models below FLAT_INIT_MAX_PARAMS fit one device by
    construction; they are built eagerly and then placed, because XLA:CPU's SPMD partitioning of
    the init graph alone took ~100 s for the tiny config on 8 devices.
    """
    seed = cfg.train.seed if seed is None else seed
    gdef, abs_state = abstract(cfg)
    shardings = state_shardings(abs_state, mesh)
    if count_params(abs_state) <= FLAT_INIT_MAX_PARAMS:
        return nnx.merge(gdef, jax.device_put(nnx.state(build(cfg, seed)), shardings))

    def init():
        return nnx.state(build(cfg, seed))

    with jax.set_mesh(mesh):
        state = jax.jit(init, out_shardings=shardings)()
    return nnx.merge(gdef, state)


def abstract_split(cfg, mesh):
    """(graphdef, abstract params, abstract router biases) with shardings attached: the restore
    targets for loading weights without materialising a random init first."""
    from k3jax.layers.common import RouterBias
    model = nnx.eval_shape(lambda: _construct(cfg, nnx.Rngs(0)))
    gdef, params, rest = nnx.split(model, nnx.Param, RouterBias)
    shard = lambda st: jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),  # noqa: E731
                                    st, state_shardings(st, mesh))
    return gdef, shard(params), shard(rest)
