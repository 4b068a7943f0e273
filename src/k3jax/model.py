"""The K3 / Kimi Linear text backbone: embed -> decoder layers -> (AttnRes output mix) -> head.

Layers are grouped by ``k3jax.layout``: ``prefix`` (unrolled), ``periods`` (a stack of identical
super-blocks of one layer period run by ``lax.scan``) and ``tail`` (unrolled). The residual state
(AttnRes blocks + partial sum, or the plain hidden state) is the carry of one walker,
``K3Model._walk``, shared by the sequence forward and the decode step; a per-layer "starts an
AttnRes block" flag is scanned alongside, so block boundaries may fall anywhere.

Per-layer side outputs are returned explicitly as layout trees: MLA max logits [H] (QK-clip), MoE
expert loads [E], dropped fraction and aux loss. Both mixers return ``(out, aux, cache)``.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import numpy as np
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from k3jax.layers.attn_res import AttnResSites, attn_res_mix
from k3jax.layers.common import MLP, CountingSampler, FlatSampler, RMSNorm, is_variable, ones, param, zeros
from k3jax.layers.kda import KDA, kda_cache_shapes
from k3jax.layers.mla import MLA, mla_cache_shapes
from k3jax.layers.moe import MoE
from k3jax.layout import Layout, Site, layout, period_kinds
from k3jax.sharding import constrain
from k3jax.vision.splice import splice
from k3jax.vision.tower import VisionEncoder

REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "save_dot": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
    "save_mixer_out": jax.checkpoint_policies.save_only_these_names("mixer_out"),
}


def remat_policy(remat):
    """The jax policy of a ``remat`` argument: a REMAT_POLICIES key, or ``remat.Custom(save, offload)``
    (k3jax.remat.spec): those names kept on device, these offloaded to pinned host memory."""
    if isinstance(remat, str):
        return REMAT_POLICIES[remat]
    return jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=list(remat.save), names_which_can_be_offloaded=list(remat.offload),
        offload_src="device", offload_dst="pinned_host")

MIXERS = {"kda": KDA, "mla": MLA}


class DecoderLayer(nnx.Module):
    def __init__(self, cfg, kcfg, mixer: str, ffn: str, rngs, stack=(), dtype=jnp.float32):
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.cfg, self.mixer, self.ffn = cfg, mixer, ffn
        self.input_layernorm = RMSNorm(d, eps, rngs, stack, dtype)
        self.post_attention_layernorm = RMSNorm(d, eps, rngs, stack, dtype)
        self.self_attn = MIXERS[mixer](cfg, kcfg, rngs, stack, dtype)
        self.mlp = MLP(cfg, cfg.intermediate_size, rngs, stack, dtype) if ffn == "dense" else \
            MoE(cfg, kcfg, rngs, stack, dtype)
        if cfg.attn_res:
            self.res = AttnResSites(d, rngs, stack, dtype)

    def _mix(self, res, w, gamma):
        with jax.named_scope("residual_mix"):
            return attn_res_mix(res["blocks"], res["n"], res["partial"], w[...], gamma[...], self.cfg.rms_norm_eps)

    def _pre_mixer(self, res, first: bool, block_start, block_closed=False):
        """Mixer input and the residual state after a possible block boundary.

        ``block_closed`` (traced bool, segment scan only): the boundary before this layer was already
        taken, res["blocks"][n-1] holds the finished block and res["partial"] is zero; the mixer input
        is then mixed from blocks[:n-1] + [blocks[n-1]], the very sources (and order) the unsegmented
        walk mixes before it closes the block (slot n-1 is masked there, so its contents add 0)."""
        if not self.cfg.attn_res:
            return res["h"], res
        if block_closed is not False:
            closed = jnp.asarray(block_closed)
            n = res["n"] - closed.astype(jnp.int32)
            last = jax.lax.dynamic_index_in_dim(res["blocks"], jnp.maximum(n, 0), 0, keepdims=False)
            mixed = {"blocks": res["blocks"], "n": n, "partial": jnp.where(closed, last, res["partial"])}
            return self._mix(mixed, self.res.attn_res_proj, self.res.attn_res_norm), res
        x = res["partial"] if first else self._mix(res, self.res.attn_res_proj, self.res.attn_res_norm)
        if block_start is not False:
            flag = jnp.asarray(block_start)
            blocks = jnp.where(flag, jax.lax.dynamic_update_index_in_dim(res["blocks"], res["partial"], res["n"], 0),
                               res["blocks"])
            res = {"blocks": blocks, "n": res["n"] + flag.astype(jnp.int32),
                   "partial": jnp.where(flag, jnp.zeros_like(res["partial"]), res["partial"])}
        return x, res

    def _post_mixer(self, res, a, compute_aux):
        key = "partial" if self.cfg.attn_res else "h"
        res = dict(res, **{key: res[key] + a})
        y = self._mix(res, self.res.mlp_res_proj, self.res.mlp_res_norm) if self.cfg.attn_res else res["h"]
        y = self.post_attention_layernorm(y)
        with jax.named_scope("ffn"):
            if self.ffn == "dense":
                f, aux = self.mlp(y), {}
            else:
                f, aux = self.mlp(y, compute_aux=compute_aux)
        f = checkpoint_name(f, "ffn_out")
        res = dict(res, **{key: constrain(res[key] + f, ("batch", "seq", "act_embed"))})
        return res, aux

    def __call__(self, res, segment_ids, positions, *, first=False, block_start=False, block_closed=False,
                 compute_aux=False, return_cache=False):
        """Sequence path -> (res, aux, cache or None)."""
        x, res = self._pre_mixer(res, first, block_start, block_closed)
        h = self.input_layernorm(x)
        with jax.named_scope("mixer"):
            a, aux, cache = self.self_attn(h, segment_ids, positions, return_cache=return_cache)
        a = checkpoint_name(a, "mixer_out")     # k3jax.remat.NAMES: the names a remat policy may keep
        res, ffn_aux = self._post_mixer(res, a, compute_aux)
        return res, {**aux, **ffn_aux}, cache

    def decode(self, res, cache, pos, start, *, first=False, block_start=False):
        """One token per row: res leaves are [B,1,D]; returns (res, new cache)."""
        x, res = self._pre_mixer(res, first, block_start)
        h = self.input_layernorm(x)[:, 0]
        with jax.named_scope("mixer"):
            a, cache = self.self_attn.decode(h, cache, pos, start)
        res, _ = self._post_mixer(res, a[:, None], False)
        return res, cache

    def extend(self, res, cache, pos, lengths, *, first=False, block_start=False):
        """A chunk of tokens per row continuing its cache (chunked prefill): res leaves [B,T,D];
        pos [B] tokens already cached, lengths [B] real tokens in the chunk -> (res, new cache)."""
        x, res = self._pre_mixer(res, first, block_start)
        h = self.input_layernorm(x)
        with jax.named_scope("mixer"):
            if self.mixer == "kda":
                a, cache = self.self_attn.extend(h, cache, lengths)
            else:
                a, cache = self.self_attn.extend(h, cache, pos)
        res, _ = self._post_mixer(res, a, False)
        return res, cache


class Period(nnx.Module):
    """One layer period (e.g. KDA, KDA, KDA, MLA with MoE FFNs), stacked ``n`` deep for the scan."""

    def __init__(self, cfg, kcfg, rngs, n: int, dtype):
        self.layers = nnx.List([DecoderLayer(cfg, kcfg, m, f, rngs, (n,), dtype) for m, f in period_kinds(cfg)])


class K3Model(nnx.Module):
    def __init__(self, cfg, kcfg, rngs: nnx.Rngs, *, scan: bool = True, segment_scan: bool = False,
                 dtype=jnp.float32, compute_dtype=jnp.float32, vision=None):
        """``vision``: a VisionConfig with ``vision_enabled`` adds the tower and projector as
        ``self.vision`` (params["vision"]: the converter's ``CKPT/vision`` tree), built after the
        text layers; None or disabled leaves the text model and its parameter tree as they are.
        The model knows no pipeline stages: a step that pipelines passes its periods runner to
        ``hidden(periods=...)`` (k3jax.stages)."""
        self.cfg, self.kcfg, self.compute_dtype = cfg, kcfg, compute_dtype
        self.segment_scan = segment_scan
        self.layout: Layout = layout(cfg, scan)
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
        if vision is not None and vision.vision_enabled:
            self.vision = VisionEncoder(vision, d, rngs, std=std, dtype=dtype, compute_dtype=compute_dtype,
                                        interpret=kcfg.pallas_interpret)

    # -- helpers ---------------------------------------------------------------------------------
    def layer(self, site: Site) -> DecoderLayer:
        """The DecoderLayer at a layout site (stacked for a period site)."""
        node = self
        for k in site.module_path:
            node = node[k] if isinstance(k, int) else getattr(node, k)
        return node

    def _block_start(self, l: int) -> bool:
        return self.cfg.attn_res and l % self.cfg.attn_res_block_size == 0

    def _initial_residual(self, x):
        if not self.cfg.attn_res:
            return {"h": x}
        nb = len(self.cfg.attn_res_block_starts)
        return {"blocks": jnp.zeros((nb,) + x.shape, x.dtype), "n": jnp.zeros((), jnp.int32), "partial": x}

    def embed(self, tokens):
        x = jnp.take(self.embed_tokens[...], tokens, axis=0).astype(self.compute_dtype)
        return constrain(x, ("batch", "seq", "act_embed"))

    def embed_media(self, tokens, media=None, *, remat: bool = False):
        """Token embeddings with the media features spliced in: the tower and projector run once
        on the packed media (``k3jax.data.media.MediaInputs.arrays()``) and row j of their output
        replaces the embedding at flat position media["slots"][j]. Without media: ``embed``."""
        x = self.embed(tokens)
        if media is None:
            return x
        if not hasattr(self, "vision"):
            raise ValueError("media given to a model built without the vision tower (vision_enabled=false)")
        with jax.named_scope("vision"):
            feats = self.vision(media["patches"], media, remat=remat)
        return constrain(splice(x, feats, media["slots"]), ("batch", "seq", "act_embed"))

    def head_weight(self):
        return self.embed_tokens[...].T if self.cfg.tie_word_embeddings else self.lm_head[...]

    def final_hidden(self, res):
        """Residual state -> normalised final hidden [B,T,D] (the lm_head input)."""
        if self.cfg.attn_res:
            with jax.named_scope("residual_mix"):
                h = attn_res_mix(res["blocks"], res["n"], res["partial"], self.output_attn_res_proj[...],
                                 self.output_attn_res_norm[...], self.cfg.rms_norm_eps)
        else:
            h = res["h"]
        return self.norm(h)

    def _walk(self, res, step, per_site=None, remat="none", periods=None):
        """Thread the residual state through every decoder layer in order: the prefix and tail
        unrolled, the periods by ``lax.scan`` over their stacked parameters.

        step(layer, res, flags, entry) -> (res, out); flags = {"first", "block_start"} (Python
        bools for unrolled layers, a traced bool for block_start inside the scan); entry = the
        layer's entry of the layout tree ``per_site`` (e.g. its decode cache) or None. Under a
        remat policy every unrolled layer and the scan body are rematerialised (without it the
        prefix/tail activations stay live for the backward: at K3 scale ~8 GB per MoE layer).
        ``periods(gdef, state, res) -> (res, outs)``, when given, runs the periods instead of the
        scan (the pipeline, k3jax.stages). Returns (res, layout tree of the outs).
        """
        lay = self.layout
        policy = remat_policy(remat)
        outs = {"prefix": [], "periods": None, "tail": []}

        def unrolled(site, res):
            l = site.layer
            flags = {"first": l == 0, "block_start": self._block_start(l)}
            entry = None if per_site is None else per_site[site.group][site.index]
            layer = self.layer(site)
            if remat == "none":
                return step(layer, res, flags, entry)
            gdef, st = nnx.split(layer)
            fn = lambda st, res, entry: step(nnx.merge(gdef, st), res, flags, entry)  # noqa: E731
            # prevent_cse=True here (unlike the scan bodies): outside a loop XLA would otherwise
            # merge the backward's recomputation with the forward it repeats and keep the forward's
            # activations alive through the whole backward (K3 v5p-2048: ~13 GiB of prefix-layer
            # values at the peak, read off the compiler's live-range report; 86.9 -> 66.3 GiB).
            return jax.checkpoint(fn, policy=policy, prevent_cse=True)(st, res, entry)

        for site in lay.sites():
            if site.group == "prefix":
                res, o = unrolled(site, res)
                outs["prefix"].append(o)
        if lay.num_periods:
            gdef, state = nnx.split(self.periods)
            flags = np.array([[self._block_start(l) for l in lay.period_layers(i)] for i in range(lay.num_periods)],
                             dtype=bool)
            entries = None if per_site is None else per_site["periods"]

            def body(res, xs):
                st, fl, es = xs
                period = nnx.merge(gdef, st)
                out = []
                for j, layer in enumerate(period.layers):
                    res, o = step(layer, res, {"first": False, "block_start": fl[j]}, None if es is None else es[j])
                    out.append(o)
                return res, out

            runs = self._segment_runs(flags) if per_site is None else None
            if periods is not None:
                res, outs["periods"] = periods(gdef, state, res)
            elif runs is not None:
                res, outs["periods"] = self._scan_segments(gdef, state, res, step, runs, remat)
            else:
                if remat != "none":
                    body = jax.checkpoint(body, policy=policy, prevent_cse=False)
                res, outs["periods"] = jax.lax.scan(body, res, (state, flags, entries))
        for site in lay.sites():
            if site.group == "tail":
                res, o = unrolled(site, res)
                outs["tail"].append(o)
        return res, outs

    def _segment_runs(self, flags):
        """The periods cut at AttnRes block starts, for ``_scan_segments``: [(first period, segments,
        periods per segment, segments start a block)], consecutive equal segments in one run; None
        when the flat scan is used (no AttnRes, ``attn_res_segment_scan=false``, or a block start
        inside a period rather than at its first layer).

        Why: the flat scan carries the block buffer [NB, B, T, D] through every period, and its
        backward keeps that carry once per period (K3: 22 x 8 blocks of [B, 4096, 7168], 9.6 GiB per
        device) although it changes only at a block start (every third K3 period)."""
        if not (self.cfg.attn_res and self.segment_scan) or flags[:, 1:].any():
            return None
        cuts = [0] + [i for i in range(1, len(flags)) if flags[i, 0]] + [len(flags)]
        segs = [(a, b - a, bool(flags[a, 0])) for a, b in zip(cuts[:-1], cuts[1:])]
        runs = []
        for first, length, starts in segs:
            if runs and tuple(runs[-1][2:]) == (length, starts):
                runs[-1][1] += 1
            else:
                runs.append([first, 1, length, starts])
        return [tuple(r) for r in runs]

    def _scan_segments(self, gdef, state, res, step, runs, remat):
        """The periods as scans over AttnRes segments: an outer scan over the segments of a run,
        whose body closes the block (if the segment starts one) and runs an inner scan over the
        segment's periods carrying only the partial sum; the block buffer is a constant of the inner
        scan, so the backward keeps it once per segment. Same arithmetic as the flat scan (see
        ``DecoderLayer._pre_mixer``'s block_closed). Parameters stay one stacked tree, indexed by
        period number (no sliced copies of the weights). Returns (res, per-layer outs stacked over
        all periods, as the flat scan returns them)."""
        policy = remat_policy(remat)
        parts = []
        for first, count, length, starts in runs:
            def inner(carry, k, starts=starts):
                blocks, n, partial, p0 = carry
                period = nnx.merge(gdef, jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, p0 + k, 0, False),
                                                      state))
                r = {"blocks": blocks, "n": n, "partial": partial}
                out = []
                for j, layer in enumerate(period.layers):
                    closed = (k == 0) if (starts and j == 0) else False
                    r, o = step(layer, r, {"first": False, "block_start": False, "block_closed": closed}, None)
                    out.append(o)
                return r["partial"], out

            if remat != "none":
                inner = jax.checkpoint(inner, policy=policy, prevent_cse=False)

            def segment(res, i, first=first, length=length, starts=starts, inner=inner):
                blocks, n, partial = res["blocks"], res["n"], res["partial"]
                if starts:
                    blocks = jax.lax.dynamic_update_index_in_dim(blocks, partial, n, 0)
                    n, partial = n + 1, jnp.zeros_like(partial)
                p0 = first + i * length

                def body(partial, k):
                    return inner((blocks, n, partial, p0), k)

                partial, out = jax.lax.scan(body, partial, jnp.arange(length))
                return {"blocks": blocks, "n": n, "partial": partial}, out

            res, out = jax.lax.scan(segment, res, jnp.arange(count))
            parts.append(jax.tree.map(lambda x: x.reshape((count * length,) + x.shape[2:]), out))
        outs = parts[0] if len(parts) == 1 else jax.tree.map(lambda *xs: jnp.concatenate(xs, 0), *parts)
        return res, outs

    # -- sequence forward ------------------------------------------------------------------------
    def hidden(self, tokens, segment_ids=None, positions=None, *, remat="none",
               compute_aux: bool = False, return_cache: bool = False, media=None, periods=None):
        """tokens [B,T] -> (final hidden [B,T,D], aux, caches); aux and caches are layout trees
        (caches' entries None unless ``return_cache``). ``media``: see ``embed_media``. ``remat``: a
        REMAT_POLICIES key or ``k3jax.remat.Custom`` (names kept on device / offloaded to host).
        ``periods``: a runner of the scanned periods in place of the scan, called as
        ``periods(gdef, state, res, segment_ids=, positions=, compute_aux=, remat=, policy=)`` (the
        pipeline: ``k3jax.stages.pipeline_of``; the periods' leaves are then in its memory order)."""
        b, t = tokens.shape
        segment_ids = jnp.ones((b, t), jnp.int32) if segment_ids is None else segment_ids
        positions = jnp.broadcast_to(jnp.arange(t), (b, t)) if positions is None else positions
        res = self._initial_residual(self.embed_media(tokens, media, remat=remat != "none"))

        def step(layer, res, flags, _):
            res, aux, cache = layer(res, segment_ids, positions, compute_aux=compute_aux, return_cache=return_cache,
                                    **flags)
            return res, (aux, cache)

        run = None
        if periods is not None and self.layout.num_periods:
            if return_cache:
                raise ValueError("return_cache with a periods runner (pipeline stages): prefill runs without stages")
            run = functools.partial(periods, segment_ids=segment_ids, positions=positions, compute_aux=compute_aux,
                                    remat=remat, policy=remat_policy(remat))
        res, outs = self._walk(res, step, remat=remat, periods=run)
        aux = self.layout.map(lambda _, o: o[0], outs)
        caches = self.layout.map(lambda _, o: o[1], outs)
        return self.final_hidden(res), aux, caches

    def __call__(self, tokens, segment_ids=None, positions=None, **kw):
        """Full logits [B,T,V] in f32 (tests, decode prefill); training uses ``k3jax.loss``."""
        h, aux, _ = self.hidden(tokens, segment_ids, positions, **kw)
        logits = jnp.einsum("btd,dv->btv", h, self.head_weight().astype(h.dtype),
                            preferred_element_type=jnp.float32)
        return logits, aux

    # -- decode ----------------------------------------------------------------------------------
    def cache_spec(self, batch: int, length: int):
        """Layout tree of the decode cache: per leaf (shape, dtype, logical axes)."""
        c = self.cfg

        def one(site: Site):
            shapes = (kda_cache_shapes(c, batch) if c.mixer(site.layer) == "kda"
                      else mla_cache_shapes(c, batch, length))
            stack = (len(site.layers),) if site.stacked else ()
            return {k: (stack + s, dt, ("layers",) * len(stack) + ax) for k, (s, dt, ax) in shapes.items()}

        return self.layout.map(one)

    def _logits(self, h):
        return jnp.einsum("bd,dv->bv", h, self.head_weight().astype(h.dtype), preferred_element_type=jnp.float32)

    def decode_step(self, tokens, cache, pos, start):
        """tokens [B] at cache slot ``pos`` (a scalar for rows aligned by left padding, or [B]: each
        row at its own slot, as in a continuous batch) -> (logits [B,V] f32, new cache)."""
        res = self._initial_residual(self.embed(tokens[:, None]))

        def step(layer, res, flags, c):
            return layer.decode(res, c, pos, start, **flags)

        res, new = self._walk(res, step, per_site=cache)
        return self._logits(self.final_hidden(res)[:, 0]), new

    def extend(self, tokens, cache, pos, lengths, *, all_positions: bool = False, embeddings=None):
        """Chunked prefill: tokens [B,T], the next T tokens of each row, continuing a cache that
        holds the row's first pos[b] tokens in slots 0..pos[b]-1 (rows start at slot 0: no left
        padding). The first lengths[b] >= 1 tokens are real, the rest pad the chunk to a fixed
        shape. Returns (logits [B,V] f32 after each row's last real token, new cache), the cache
        as if the row's tokens so far had been prefilled in one piece. ``all_positions``: the
        logits of every position instead, [B,T,V] f32 (the server's prompt log-probabilities).
        ``embeddings``: the chunk's input rows [B,T,D] in place of ``embed(tokens)`` (image rows
        spliced at media pads by the server)."""
        res = self._initial_residual(self.embed(tokens) if embeddings is None else embeddings)

        def step(layer, res, flags, c):
            return layer.extend(res, c, pos, lengths, **flags)

        res, new = self._walk(res, step, per_site=cache)
        h = self.final_hidden(res)
        if all_positions:
            return jnp.einsum("btd,dv->btv", h, self.head_weight().astype(h.dtype),
                              preferred_element_type=jnp.float32), new
        last = jnp.take_along_axis(h, (lengths - 1)[:, None, None], axis=1)[:, 0]
        return self._logits(last), new


FLAT_INIT_MAX_PARAMS = 2 ** 28  # below this, init draws from two flat buffers (fast CPU compiles)


def _sampler(cfg, seed: int):
    """FlatSampler for small models, else per-parameter keys. Both are deterministic in the seed."""
    counter = CountingSampler()
    nnx.eval_shape(lambda: _construct(cfg, counter))
    if counter.n_normal + counter.n_uniform > FLAT_INIT_MAX_PARAMS:
        return nnx.Rngs(seed)
    return FlatSampler(jax.random.key(seed), counter.n_normal, counter.n_uniform)


def _construct(cfg, rngs):
    return K3Model(cfg.model, cfg.kernel, rngs, scan=cfg.train.scan_layers,
                   segment_scan=cfg.train.attn_res_segment_scan, dtype=jnp.dtype(cfg.train.weight_dtype),
                   compute_dtype=jnp.dtype(cfg.train.dtype), vision=getattr(cfg, "vision", None))


def text_only(cfg):
    """``cfg`` with the vision tower off: the text model's parameter tree (the converter's
    ``params`` item; the tower is its ``vision`` item)."""
    if not cfg.vision.vision_enabled:
        return cfg
    return dataclasses.replace(cfg, vision=dataclasses.replace(cfg.vision, vision_enabled=False))


def build(cfg, rngs: nnx.Rngs | int = 0) -> K3Model:
    """Construct the model from a full Config (dtypes, scan flag and kernels from its sections).
    An int seed picks the sampler by size (see ``_sampler``); an nnx.Rngs uses per-leaf keys.
    The periods are in layer order whatever the stage count (the same values as without stages);
    the state boundary (k3jax.state) puts them in a pipeline's memory order."""
    return _construct(cfg, _sampler(cfg, rngs) if isinstance(rngs, int) else rngs)


def count_params(state) -> int:
    return sum(math.prod(v.shape) for v in jax.tree.leaves(state, is_leaf=is_variable))
