"""An independent float64 numpy reference of the K3 / Kimi Linear text backbone, written directly
from k3-architecture.md (§3 AttnRes, §4 KDA with the token-serial recurrence, §5 gated MLA, §6
SiTU / latent MoE, §7 norms). It shares no code with k3jax: only the parameter values are read from
the model, through ``layer_params`` which names them per layer.
"""
from __future__ import annotations

import numpy as np
from flax import nnx


def rms(x, w, eps):
    return w * (x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps))


def sigmoid(x):
    return 1 / (1 + np.exp(-x))


def silu(x):
    return x * sigmoid(x)


def softplus(x):
    return np.logaddexp(0, x)


def glu(c, a, b):
    if c.ffn_activation == "situ":
        return (c.situ_beta * np.tanh(a / c.situ_beta) * sigmoid(a)) * (c.situ_linear_beta * np.tanh(b / c.situ_linear_beta))
    return silu(a) * b


def layer_params(model) -> list[dict]:
    """Per decoder layer, a flat dict 'self_attn.q_proj' -> float64 array (unstacking the scan)."""
    def flat(module, idx=None):
        out = {}
        for path, v in nnx.to_flat_state(nnx.state(module)):
            a = np.asarray(v.get_value() if hasattr(v, "get_value") else v.value, np.float64)
            out[".".join(str(p) for p in path)] = a if idx is None else a[idx]
        return out
    layers = {}
    for site in model.layout.sites():
        for i, l in enumerate(site.layers):
            layers[l] = flat(model.layer(site), i if site.stacked else None)
    return [layers[l] for l in sorted(layers)]


def kda(c, p, x, seg):
    t, h, dk = x.shape[0], c.kda_num_heads, c.kda_head_dim

    def conv(z, w):  # z [T,P], w [P,W]: y_t = sum_j w[:, j] z_{t-W+1+j}, within the document
        width = w.shape[1]
        y = np.zeros_like(z)
        for i in range(t):
            for j in range(width):
                s = i - width + 1 + j
                if s >= 0 and seg[s] == seg[i]:
                    y[i] += w[:, j] * z[s]
        return y
    keep = (seg != 0)[:, None]
    q = silu(conv((x @ p["self_attn.q_proj"]) * keep, p["self_attn.q_conv"])).reshape(t, h, dk)
    k = silu(conv((x @ p["self_attn.k_proj"]) * keep, p["self_attn.k_conv"])).reshape(t, h, dk)
    v = silu(conv((x @ p["self_attn.v_proj"]) * keep, p["self_attn.v_conv"])).reshape(t, h, dk)
    q = q / np.sqrt(np.sum(q * q, -1, keepdims=True) + 1e-6) * dk ** -0.5
    k = k / np.sqrt(np.sum(k * k, -1, keepdims=True) + 1e-6)
    f = (x @ p["self_attn.f_a_proj"]) @ p["self_attn.f_b_proj"]
    u = (f + p["self_attn.dt_bias"]).reshape(t, h, dk)
    a = np.exp(p["self_attn.A_log"])[:, None]
    g = c.kda_gate_lower_bound * sigmoid(a * u) if c.kda_gate == "bounded" else -a * softplus(u)
    beta = sigmoid(x @ p["self_attn.b_proj"])
    o = np.zeros((t, h, dk))
    for hh in range(h):
        S = np.zeros((dk, dk))
        for i in range(t):
            if i > 0 and seg[i] != seg[i - 1]:
                S = np.zeros((dk, dk))
            S = np.exp(g[i, hh])[:, None] * S
            S = S + beta[i, hh] * np.outer(k[i, hh], v[i, hh] - S.T @ k[i, hh])
            o[i, hh] = S.T @ q[i, hh]
    if c.kda_output_gate == "full":
        gate = x @ p["self_attn.g_proj"]
    else:
        gate = (x @ p["self_attn.g_a_proj"]) @ p["self_attn.g_b_proj"]
    o = rms(o, p["self_attn.o_norm"], c.rms_norm_eps) * sigmoid(gate.reshape(t, h, dk))
    return o.reshape(t, -1) @ p["self_attn.o_proj"]


def mla(c, p, x, seg):
    t, h = x.shape[0], c.num_attention_heads
    dn, dr, dv, r = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank
    if c.q_lora_rank:
        q = rms(x @ p["self_attn.q_a_proj"], p["self_attn.q_a_layernorm"], 1e-6) @ p["self_attn.q_b_proj"]
    else:
        q = x @ p["self_attn.q_proj"]
    q = q.reshape(t, h, dn + dr)
    ckv = x @ p["self_attn.kv_a_proj_with_mqa"]
    cl = rms(ckv[:, :r], p["self_attn.kv_a_layernorm"], 1e-6)
    kv = (cl @ p["self_attn.kv_b_proj"]).reshape(t, h, dn + dv)
    k = np.concatenate([kv[..., :dn], np.broadcast_to(ckv[:, None, r:], (t, h, dr))], -1)
    vv = kv[..., dn:]
    s = np.einsum("thk,shk->hts", q, k) * (dn + dr) ** -0.5
    mask = (np.arange(t)[None, :] <= np.arange(t)[:, None]) & (seg[:, None] == seg[None, :])
    s = np.where(mask[None], s, -np.inf)
    pr = np.exp(s - s.max(-1, keepdims=True))
    pr /= pr.sum(-1, keepdims=True)
    o = np.einsum("hts,shv->thv", pr, vv).reshape(t, -1)
    if c.mla_use_output_gate:
        o = o * sigmoid(x @ p["self_attn.g_proj"])
    return o @ p["self_attn.o_proj"]


def ffn(c, p, x, l):
    if l < c.first_k_dense:
        return glu(c, x @ p["mlp.gate_proj"], x @ p["mlp.up_proj"]) @ p["mlp.down_proj"]
    s = sigmoid(x @ p["mlp.router"])
    choice = s + p["mlp.e_score_correction_bias"]
    out = np.zeros((x.shape[0], c.routed_width))
    z = x @ p["mlp.latent_down"] if c.moe_latent_size else x
    for i in range(x.shape[0]):
        idx = np.argsort(-choice[i], kind="stable")[:c.num_experts_per_token]
        w = (choice if c.router_weights_from_biased else s)[i, idx]
        if c.moe_renormalize:
            w = w / (w.sum() + 1e-20)
        w = w * c.routed_scaling_factor
        for wj, e in zip(w, idx):
            out[i] += wj * (glu(c, z[i] @ p["mlp.w_gate"][e], z[i] @ p["mlp.w_up"][e]) @ p["mlp.w_down"][e])
    if c.moe_latent_size:
        if c.moe_latent_norm:
            out = rms(out, p["mlp.latent_norm"], c.rms_norm_eps)
        out = out @ p["mlp.latent_up"]
    if c.num_shared_experts:
        sh = "mlp.shared_experts."
        out = out + glu(c, x @ p[sh + "gate_proj"], x @ p[sh + "up_proj"]) @ p[sh + "down_proj"]
    return out


def attn_res(sources, w, gamma, eps):
    V = np.stack(sources)                                   # [S, T, D]
    K = V / np.sqrt(np.mean(V * V, -1, keepdims=True) + eps)
    s = np.einsum("std,d->st", K, gamma * w)
    a = np.exp(s - s.max(0))
    a /= a.sum(0)
    return np.einsum("st,std->td", a, V)


def forward(c, model, tokens, seg=None) -> np.ndarray:
    """tokens [T] -> logits [T,V] float64, for one row."""
    t = len(tokens)
    seg = np.ones(t, np.int64) if seg is None else np.asarray(seg)
    st = {k: np.asarray(v[...], np.float64) for k, v in
          [("embed", model.embed_tokens), ("norm", model.norm.weight)]}
    layers = layer_params(model)
    emb = st["embed"][np.asarray(tokens)]
    eps = c.rms_norm_eps
    if not c.attn_res:
        h = emb
        for l, p in enumerate(layers):
            mix = kda if c.mixer(l) == "kda" else mla
            h = h + mix(c, p, rms(h, p["input_layernorm.weight"], eps), seg)
            h = h + ffn(c, p, rms(h, p["post_attention_layernorm.weight"], eps), l)
    else:
        partial, blocks = emb, []
        for l, p in enumerate(layers):
            x = partial if not blocks else attn_res(blocks + [partial], p["res.attn_res_proj"], p["res.attn_res_norm"], eps)
            if l % c.attn_res_block_size == 0:
                blocks.append(partial)
                partial = None
            mix = kda if c.mixer(l) == "kda" else mla
            a = mix(c, p, rms(x, p["input_layernorm.weight"], eps), seg)
            partial = a if partial is None else partial + a
            y = attn_res(blocks + [partial], p["res.mlp_res_proj"], p["res.mlp_res_norm"], eps)
            partial = partial + ffn(c, p, rms(y, p["post_attention_layernorm.weight"], eps), l)
        h = attn_res(blocks + [partial], np.asarray(model.output_attn_res_proj[...], np.float64),
                     np.asarray(model.output_attn_res_norm[...], np.float64), eps)
    head = st["embed"].T if c.tie_word_embeddings else np.asarray(model.lm_head[...], np.float64)
    return rms(h, st["norm"], eps) @ head
