"""QK-clip (MuonClip, Kimi K2 §2.1) for gated MLA: a pure function of the MLA weights and the
per-layer, per-head max attention logits that the forward pass returns in ``aux``.

After each optimizer step, for every MLA layer and head h whose max pre-softmax logit
``S_max[h] = max_{b,t,s} scale * q_t^h . k_s^h`` (over the step's batch) exceeds tau::

    gamma_h = tau / S_max[h]                    (1 for heads at or below tau)
    q^C_h <- sqrt(gamma_h) q^C_h,   k^C_h <- sqrt(gamma_h) k^C_h     (per-head "nope" parts)
    q^R_h <- gamma_h q^R_h                                            (per-head "rope" part of q)
    k^R   untouched                              (shared by all heads: scaling it would clip them all)

so every logit of head h, ``q^C.k^C + q^R.k^R``, is multiplied by exactly gamma_h and the head's
max logit becomes tau. The parts are columns of the stored [in, out] weights (``y = x @ W``):

    q_b_proj (q LoRA; q_a_proj is shared by all heads and left alone) or q_proj
        [..., in, H*(dn+dr)]: head h owns columns h*(dn+dr) + [0, dn) (q^C) and + [dn, dn+dr) (q^R)
    kv_b_proj [..., R, H*(dn+dv)]: head h's key columns h*(dn+dv) + [0, dn) (k^C); values untouched
    kv_a_proj_with_mqa [..., D, R+Rr]: never touched (its last Rr columns are the shared k^R)

The latent RMSNorms sit before q_b_proj / kv_b_proj, so column scaling acts linearly on q and k.
Scan-stacked MLA layers have a leading [n] axis on the weights and [n, H] logits; gamma is computed
per slice, so each stacked layer is clipped independently. The rescale multiplies by exactly 1 for
unclipped heads, which leaves them bitwise unchanged.

With gradient accumulation, pass the max over the step's micro-batches.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from k3jax.optim.muon import param_path


def _mla_sites(aux, layout) -> list[tuple[tuple, jax.Array]]:
    """(path of the layer's self_attn in the params state, max logits [H] or [n, H]) per MLA layer.

    ``aux`` is a layout tree (``k3jax.layout``): MLA layers hold "max_logits", stacked [n, H] for
    the scanned period's layers."""
    return [(site.module_path + ("self_attn",), a["max_logits"]) for site, a in layout.items(aux)
            if "max_logits" in a]


def head_gamma(max_logits: jax.Array, threshold: float) -> jax.Array:
    """[..., H] f32 max logits -> [..., H] f32 gamma = tau / S_max where S_max > tau, else 1."""
    s = max_logits.astype(jnp.float32)
    clip = s > threshold
    # The where() guards the division: unclipped heads may have S_max <= 0 (or -inf when empty).
    return jnp.where(clip, threshold / jnp.where(clip, s, 1.0), 1.0)


def _column_scale(parts: list[tuple[int, jax.Array]]) -> jax.Array:
    """Per-head column factors [..., H, sum(widths)] -> [..., H*sum(widths)] (head-major columns,
    matching the reshape(..., H, width) the layer applies to its projection output)."""
    cols = [jnp.broadcast_to(f[..., None], f.shape + (w,)) for w, f in parts]
    s = jnp.concatenate(cols, axis=-1)
    return s.reshape(*s.shape[:-2], -1)


def _scale_columns(w: jax.Array, scale: jax.Array) -> jax.Array:
    """w [..., in, out] * scale [..., out] over the out axis, computed in f32, cast back."""
    return (w.astype(jnp.float32) * scale[..., None, :]).astype(w.dtype)


def qk_clip(params_state, aux, layout, *, threshold: float, cfg_model):
    """Rescale the q/k weights of every MLA head whose max logit exceeded ``threshold``.

    params_state: the parameter state (nnx.State of Variables or the same paths as pure dicts), with
      MLA weights at {prefix|tail}[i].self_attn.* ([in, out]) and periods.layers[j].self_attn.*
      ([n, in, out]).
    aux: the forward's side outputs (see ``_mla_sites``); max logits f32 [H] or [n, H].
    layout: the model's ``k3jax.layout.Layout`` (where each aux entry's layer sits).
    threshold: tau > 0. cfg_model: ModelConfig (heads and head dims, q_lora_rank).

    Returns (new params_state with the same structure, stats) with stats = {"clipped_heads": int32
    scalar (heads above tau, counted per stacked slice), "max_logit": f32 scalar over all MLA heads
    (-inf when the model has no MLA layer)}. Pure: the input state is not modified.
    """
    if not threshold > 0:
        raise ValueError(f"qk_clip threshold={threshold}: must be positive")
    c = cfg_model
    h, dn, dr, dv = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
    q_name = "q_b_proj" if c.q_lora_rank else "q_proj"
    scales = {}                                              # param path -> column scale [..., out]
    clipped = jnp.zeros((), jnp.int32)
    top = jnp.full((), -jnp.inf, jnp.float32)
    for site, m in _mla_sites(aux, layout):
        m = jnp.asarray(m, jnp.float32)
        if m.shape[-1] != h:
            raise ValueError(f"{'/'.join(map(str, site))}: max_logits shape {m.shape} does not end in H={h}")
        g = head_gamma(m, threshold)
        root = jnp.sqrt(g)
        scales[site + (q_name,)] = _column_scale([(dn, root), (dr, g)])
        scales[site + ("kv_b_proj",)] = _column_scale([(dn, root), (dv, jnp.ones_like(g))])
        clipped = clipped + jnp.sum(m > threshold).astype(jnp.int32)
        top = jnp.maximum(top, jnp.max(m))

    seen = set()

    def rescale(kp, w):
        p = param_path(kp)
        if p not in scales:
            return w
        seen.add(p)
        s = scales[p]
        if w.shape[:-2] != s.shape[:-1] or w.shape[-1] != s.shape[-1]:
            raise ValueError(f"{'/'.join(map(str, p))}: weight shape {w.shape} does not match the "
                             f"per-column scale {s.shape} from its max logits")
        return _scale_columns(w, s)

    new_state = jax.tree_util.tree_map_with_path(rescale, params_state)
    missing = set(scales) - seen
    if missing:
        raise KeyError(f"qk_clip: MLA weights {sorted('/'.join(map(str, p)) for p in missing)} not found in "
                       f"params_state (aux reports max logits for those layers)")
    return new_state, {"clipped_heads": clipped, "max_logit": top}
