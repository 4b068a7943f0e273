"""The Hugging Face <-> k3jax name map: a pure, tested table.

For one decoder layer (or the global tensors) it lists rules ``(our name, hf names, to_ours,
to_hf)``: ``our name`` is the parameter's dotted path inside a k3jax ``DecoderLayer`` (or the model),
``to_ours`` turns the HF arrays into ours, ``to_hf`` the reverse. Two HF layouts are known:

- ``native``: transformers' ``kimi_linear`` (fused ``conv1d``, ``forget_gate.*``, ``mlp.experts.gate_up_proj``).
- ``remote``: the Kimi remote-code / released K3 layout (``{q,k,v}_conv1d``, ``block_sparse_moe``,
  per-expert ``w1/w2/w3``, K3's ``routed_expert_*`` and AttnRes ``*_res_{proj,norm}``, ``A_log`` [128]);
  ``remote_prefixed`` is K3's, under ``language_model.``; ``remote_hf`` is what transformers 5.x
  ``save_pretrained`` writes by default (its "original format"): the remote names, except that the
  dense MLP of the first layers is also renamed to ``block_sparse_moe.{gate,up,down}_proj``.
- Kimi K2 / DeepSeek-V3 text (all MLA): ``native`` is transformers' ``deepseek_v3`` (fused
  ``mlp.experts.gate_up_proj``); ``deepseek`` the released K2 names (per-expert
  ``mlp.experts.N.{gate,up,down}_proj``); ``deepseek_prefixed`` the released K2.5's text, under
  ``language_model.``; ``deepseek_blocks`` what transformers' ``Kimi_K25`` ``save_pretrained`` writes
  (``language_model.model.blocks.N``); ``native_k25`` transformers' own ``Kimi_K25`` names
  (``model.language_model.layers.N``, fused experts, ``lm_head`` unprefixed).

PyTorch linears are [out, in]; ours are [in, out], hence the transposes. Rules whose HF tensor is
fused from several of ours (native ``conv1d``, ``experts.gate_up_proj``) have ``to_hf = None``; export
groups them by HF name and calls ``fuse_to_hf``. Remote per-expert rules carry ``to_ours.each`` /
``to_hf.each_hf`` (the map of one expert) so converters can stream expert by expert.
"""
from __future__ import annotations

import numpy as np

T = np.transpose


def _t(a):
    return np.ascontiguousarray(a.T)


def _same(a):
    return a


def _row(a):          # [1, D] <-> [D]
    return a.reshape(-1)


def _unrow(a):
    return a.reshape(1, -1)


def _stack_t(*xs):
    """Per-expert [out, in] tensors -> stacked [E, in, out] (remote layout routed experts)."""
    return np.stack([x.T for x in xs])


def _unstack_t(x):
    return [np.ascontiguousarray(x[i].T) for i in range(x.shape[0])]


# Streaming converters must not build a whole layer's experts at once (K3: 896 x 22 MB per matrix),
# so these rules say how ONE expert maps: ours[e] = each(hf[e]), hf[e] = each_hf(ours[e]).
_stack_t.each = _t
_unstack_t.each_hf = _t


def fuse_to_hf(hf_name: str, parts: list) -> np.ndarray:
    """Rebuild a fused native tensor from our parts, given in rule order (the rules with to_hf None).

    ``...conv1d.weight``: q | k | v convs [P, W] each -> [3P, 1, W].
    ``...experts.gate_up_proj``: w_gate, w_up [E, D, F] each -> [E, 2F, D] (gate rows first).
    """
    if hf_name.endswith("conv1d.weight"):
        return np.concatenate(parts, axis=0)[:, None, :]
    if hf_name.endswith("experts.gate_up_proj"):
        return np.concatenate([p.transpose(0, 2, 1) for p in parts], axis=1)
    raise ValueError(f"{hf_name}: no rule to fuse {len(parts)} parameters into this tensor")


_ROOTS = {"remote_prefixed": ("language_model.model.", "language_model.lm_head"),
          "deepseek_prefixed": ("language_model.model.", "language_model.lm_head"),
          "deepseek_blocks": ("language_model.model.", "language_model.lm_head"),
          "native_k25": ("model.language_model.", "lm_head")}


def _roots(layout: str):
    """(text model root, lm_head name, layer list name) of a layout."""
    root, head = _ROOTS.get(layout, ("model.", "lm_head"))
    return root, head, "blocks" if layout == "deepseek_blocks" else "layers"


def global_rules(m, layout: str = "native"):
    root, head, _ = _roots(layout)
    rules = [("embed_tokens", [root + "embed_tokens.weight"], _same, _same),
             ("norm.weight", [root + "norm.weight"], _same, _same)]
    if not m.tie_word_embeddings:
        rules.append(("lm_head", [head + ".weight"], _t, _t))
    if m.attn_res:
        rules += [("output_attn_res_proj", [root + "output_attn_res_proj.weight"], _row, _unrow),
                  ("output_attn_res_norm", [root + "output_attn_res_norm.weight"], _same, _same)]
    return rules


def layer_rules(m, l: int, layout: str = "native"):
    """Rules for decoder layer ``l``: (our dotted name, [hf names], to_ours, to_hf)."""
    root, _, layers = _roots(layout)
    pre = f"{root}{layers}.{l}."
    remote = layout.startswith(("remote", "deepseek"))   # per-expert tensors
    a = pre + "self_attn."
    r = [("input_layernorm.weight", [pre + "input_layernorm.weight"], _same, _same),
         ("post_attention_layernorm.weight", [pre + "post_attention_layernorm.weight"], _same, _same)]
    if m.attn_res:
        r += [("res.attn_res_proj", [pre + "self_attention_res_proj.weight"], _row, _unrow),
              ("res.attn_res_norm", [pre + "self_attention_res_norm.weight"], _same, _same),
              ("res.mlp_res_proj", [pre + "mlp_res_proj.weight"], _row, _unrow),
              ("res.mlp_res_norm", [pre + "mlp_res_norm.weight"], _same, _same)]
    lin = lambda ours, hf: (f"self_attn.{ours}", [a + hf], _t, _t)  # noqa: E731
    if m.mixer(l) == "kda":
        h, p = m.kda_num_heads, m.kda_num_heads * m.kda_head_dim
        r += [lin("q_proj", "q_proj.weight"), lin("k_proj", "k_proj.weight"), lin("v_proj", "v_proj.weight"),
              lin("b_proj", "b_proj.weight"), lin("o_proj", "o_proj.weight"),
              ("self_attn.o_norm", [a + "o_norm.weight"], _same, _same)]
        fg = "" if remote else "forget_gate."
        r += [lin("f_a_proj", fg + "f_a_proj.weight"), lin("f_b_proj", fg + "f_b_proj.weight"),
              ("self_attn.dt_bias", [a + fg + "dt_bias"], lambda x: x.reshape(-1), lambda x: x)]
        if remote and m.kda_gate == "bounded":
            # K3 stores A_log [128] with the first H real; zero-pad on export (NeMo convention).
            r.append(("self_attn.A_log", [a + "A_log"], lambda x: x.reshape(-1)[:h],
                      lambda x: np.pad(x, (0, max(0, 128 - h)))))
        else:
            r.append(("self_attn.A_log", [a + fg + "A_log"], lambda x: x.reshape(-1)[:h],
                      lambda x: x.reshape(1, 1, h, 1)))
        if m.kda_output_gate == "full":
            r.append(lin("g_proj", "g_proj.weight"))
        else:
            r += [lin("g_a_proj", "g_a_proj.weight"), lin("g_b_proj", "g_b_proj.weight")]
        if remote:
            for n in "qkv":
                r.append((f"self_attn.{n}_conv", [a + f"{n}_conv1d.weight"], lambda x: x[:, 0, :],
                          lambda x: x[:, None, :]))
        else:
            for i, n in enumerate("qkv"):  # fused conv rows q | k | v
                r.append((f"self_attn.{n}_conv", [a + "conv1d.weight"],
                          lambda x, i=i: x[i * p:(i + 1) * p, 0, :], None))
    else:
        if m.q_lora_rank:
            r += [lin("q_a_proj", "q_a_proj.weight"), ("self_attn.q_a_layernorm", [a + "q_a_layernorm.weight"], _same, _same),
                  lin("q_b_proj", "q_b_proj.weight")]
        else:
            r.append(lin("q_proj", "q_proj.weight"))
        r += [lin("kv_a_proj_with_mqa", "kv_a_proj_with_mqa.weight"),
              ("self_attn.kv_a_layernorm", [a + "kv_a_layernorm.weight"], _same, _same),
              lin("kv_b_proj", "kv_b_proj.weight"), lin("o_proj", "o_proj.weight")]
        if m.mla_use_output_gate:
            r.append(lin("g_proj", "g_proj.weight"))
    r += ffn_rules(m, l, pre, remote, dense="block_sparse_moe." if layout == "remote_hf" else "mlp.",
                   deepseek=layout.startswith("deepseek"))
    return r


def ffn_rules(m, l, pre, remote, dense="mlp.", deepseek=False):
    if m.ffn(l) == "dense":
        return [(f"mlp.{n}", [pre + f"{dense}{n}.weight"], _t, _t) for n in ("gate_proj", "up_proj", "down_proj")]
    b = pre + ("block_sparse_moe." if remote and not deepseek else "mlp.")
    e, f = m.num_experts, m.moe_intermediate_size
    r = [("mlp.router", [b + "gate.weight"], _t, _t),
         ("mlp.e_score_correction_bias", [b + "gate.e_score_correction_bias"], _same, _same)]
    if m.num_shared_experts:
        r += [(f"mlp.shared_experts.{n}", [b + f"shared_experts.{n}.weight"], _t, _t)
              for n in ("gate_proj", "up_proj", "down_proj")]
    if m.moe_latent_size:
        r += [("mlp.latent_down", [b + "routed_expert_down_proj.weight"], _t, _t),
              ("mlp.latent_up", [b + "routed_expert_up_proj.weight"], _t, _t)]
        if m.moe_latent_norm:
            r.append(("mlp.latent_norm", [b + "routed_expert_norm.weight"], _same, _same))
    if remote:  # per-expert [out, in] tensors, stacked into [E, in, out]
        names = ("gate_proj", "up_proj", "down_proj") if deepseek else ("w1", "w3", "w2")
        for ours, w in zip(("w_gate", "w_up", "w_down"), names):
            names = [b + f"experts.{i}.{w}.weight" for i in range(e)]
            r.append((f"mlp.{ours}", names, _stack_t, _unstack_t))
    else:
        gu = b + "experts.gate_up_proj"
        r += [("mlp.w_gate", [gu], lambda x: np.ascontiguousarray(x[:, :f, :].transpose(0, 2, 1)), None),
              ("mlp.w_up", [gu], lambda x: np.ascontiguousarray(x[:, f:, :].transpose(0, 2, 1)), None),
              ("mlp.w_down", [b + "experts.down_proj"], lambda x: np.ascontiguousarray(x.transpose(0, 2, 1)),
               lambda x: np.ascontiguousarray(x.transpose(0, 2, 1)))]
    return r


def detect_layout(names) -> str:
    """native (transformers' own names), remote (the released remote-code names), remote_hf (what
    transformers' default ``save_pretrained`` writes: the remote names, but the dense MLP of the
    first layers also under ``block_sparse_moe.``) or remote_prefixed (K3: ``language_model.``);
    for K2 / DeepSeek-V3 text with per-expert ``mlp.experts.N.gate_proj``: deepseek (unprefixed),
    deepseek_prefixed (K2.5), deepseek_blocks (transformers' K2.5 save); native_k25 for
    ``model.language_model.`` (vision tensors do not count)."""
    names = {n for n in names if not n.startswith(("vision_tower.", "mm_projector.", "model.vision_tower.",
                                                    "model.mm_projector."))}
    prefixed = any(n.startswith("language_model.") for n in names)
    remote = any(".block_sparse_moe." in n or "_conv1d.weight" in n for n in names)
    per_expert = any(".mlp.experts.0.gate_proj." in n for n in names)
    if any(n.startswith("model.language_model.") for n in names):
        return "native_k25"
    if any(n.startswith("language_model.model.blocks.") for n in names):
        return "deepseek_blocks"
    if per_expert and not remote:
        return "deepseek_prefixed" if prefixed else "deepseek"
    if prefixed:
        return "remote_prefixed"
    if remote and any(n.endswith(".block_sparse_moe.gate_proj.weight") for n in names):
        return "remote_hf"
    return "remote" if remote else "native"
