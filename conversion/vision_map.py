"""The vision tower / projector name map (docs/vision.md §6): a pure, tested table.

k3jax's ``VisionEncoder`` (``k3jax.vision``) holds ``vision_tower.*`` and ``mm_projector.*`` with
[in, out] matrices, the 27 blocks stacked on a leading axis, and ``wqkv`` in the checkpoint's row
order (q, k in interleaved RoPE pairs). Three Hugging Face layouts hold the same weights:

- ``released``: Moonshot's names, shared by the released K3 and K2.5 (remote code):
  ``vision_tower.patch_embed.{proj,pos_emb}``, ``vision_tower.encoder.blocks.N.{norm0,wqkv,wo,
  norm1,mlp.fc0,mlp.fc1}``, ``vision_tower.encoder.final_layernorm``,
  ``mm_projector.{pre_norm,proj.0,proj.2,post_norm}``. Which tensors exist follows the switches
  (K3: no biases, RMSNorm without bias, ``post_norm`` instead of ``pre_norm``).
- ``hf_save``: what transformers 5.25's ``save_pretrained`` writes for ``Kimi_K25``: the released
  names, except the projector pre-norm as ``model.mm_projector.pre_norm`` (docs/vision.md §6) and
  the patch conv as ``vision_tower.encoder.patch_embed.proj`` (seen in a save of a tiny model).
- ``native``: transformers' own names (``save_pretrained(save_original_format=False)``, or a
  ``state_dict``): ``model.vision_tower.layers.N.{norm1,norm2,attn.{q,k,v}_proj,attn.proj,mlp.fc1,
  mlp.fc2}``, ``pos_emb.position_embeddings``, ``model.mm_projector.{in_proj,out_proj}``; q and k
  are split from ``wqkv`` and their rows permuted for rotate-half RoPE (``rope_to_half``).

A rule is ``(our path, index, hf names, to_ours, to_hf)``: ``index`` is () or (block,) into the
stacked leaf, ``to_ours(*hf arrays)`` gives our slice and ``to_hf(ours)`` the HF array (a list when
several HF tensors come from one of ours, as native q/k/v).
"""
from __future__ import annotations

import numpy as np

LAYOUTS = ("released", "hf_save", "native")
VISION_ROOTS = ("vision_tower.", "mm_projector.", "model.vision_tower.", "model.mm_projector.")


def _t(a):
    return np.ascontiguousarray(a.T)


def _same(a):
    return a


def rope_to_half(w: np.ndarray, heads: int) -> np.ndarray:
    """q or k rows (weight [H*Dh, in] or bias [H*Dh]) from interleaved pairs to rotate-half order:
    within each head, checkpoint row 2i+j becomes row j*Dh/2+i (transformers' PermuteForRope)."""
    tail = w.shape[1:]
    return np.ascontiguousarray(w.reshape(heads, -1, 2, *tail).swapaxes(1, 2).reshape(w.shape))


def rope_to_interleaved(w: np.ndarray, heads: int) -> np.ndarray:
    """Inverse of ``rope_to_half`` (docs/vision.md §3.1: reshape(H, 2, Dh/2, in).swap(1, 2))."""
    tail = w.shape[1:]
    return np.ascontiguousarray(w.reshape(heads, 2, -1, *tail).swapaxes(1, 2).reshape(w.shape))


def _names(layout: str) -> dict:
    """HF name pieces of a layout: block prefix (format with the block), and per-part names."""
    if layout == "native":
        tw, blk = "model.vision_tower.", "model.vision_tower.layers.{}."
        return dict(patch=tw + "patch_embed.proj", pos=tw + "patch_embed.pos_emb.position_embeddings",
                    blk=blk, norm0="norm1", norm1="norm2", wo="attn.proj", fc0="mlp.fc1", fc1="mlp.fc2",
                    final=tw + "final_layernorm", pre="model.mm_projector.pre_norm",
                    proj0="model.mm_projector.in_proj", proj2="model.mm_projector.out_proj",
                    post="model.mm_projector.post_norm")
    if layout not in LAYOUTS:
        raise ValueError(f"vision layout {layout!r}: choose one of {LAYOUTS}")
    # transformers' save also moves the patch conv under ``encoder.`` (its reverse rename)
    patch = "vision_tower.encoder.patch_embed.proj" if layout == "hf_save" else "vision_tower.patch_embed.proj"
    return dict(patch=patch, pos="vision_tower.patch_embed.pos_emb.weight",
                blk="vision_tower.encoder.blocks.{}.", norm0="norm0", norm1="norm1", wo="wo", fc0="mlp.fc0",
                fc1="mlp.fc1", final="vision_tower.encoder.final_layernorm",
                pre=("model." if layout == "hf_save" else "") + "mm_projector.pre_norm",
                proj0="mm_projector.proj.0", proj2="mm_projector.proj.2", post="mm_projector.post_norm")


def vision_rules(v, layout: str):
    """Rules for every parameter slice of the ``VisionEncoder`` of vision config ``v``."""
    n = _names(layout)
    p, d = v.vision_patch_size, v.vision_hidden_size
    ln = v.vision_norm == "layernorm"
    r = [(("vision_tower", "patch_embed", "proj"), (), [n["patch"] + ".weight"],
          lambda x: np.ascontiguousarray(x.reshape(d, -1).T), lambda x: np.ascontiguousarray(x.T.reshape(d, 3, p, p)))]
    if v.vision_patch_bias:
        r.append((("vision_tower", "patch_embed", "proj_bias"), (), [n["patch"] + ".bias"], _same, _same))
    r.append((("vision_tower", "patch_embed", "pos_emb"), (), [n["pos"]], _same, _same))

    def norm(ours, hf, index=()):
        out = [(ours + ("weight",), index, [hf + ".weight"], _same, _same)]
        return out + ([(ours + ("bias",), index, [hf + ".bias"], _same, _same)] if ln else [])

    for l in range(v.vision_num_layers):
        b, i, blk = ("vision_tower", "blocks"), (l,), n["blk"].format(l)
        r += norm(b + ("norm0",), blk + n["norm0"], i) + norm(b + ("norm1",), blk + n["norm1"], i)
        r += _qkv_rules(v, layout, blk, i)
        r.append((b + ("wo",), i, [blk + n["wo"] + ".weight"], _t, _t))
        if v.vision_attn_bias:
            r.append((b + ("wo_bias",), i, [blk + n["wo"] + ".bias"], _same, _same))
        for ours in ("fc0", "fc1"):
            r.append((b + (ours,), i, [blk + n[ours] + ".weight"], _t, _t))
            if v.vision_mlp_bias:
                r.append((b + (ours + "_bias",), i, [blk + n[ours] + ".bias"], _same, _same))
    r += norm(("vision_tower", "final_layernorm"), n["final"])
    mp = ("mm_projector",)
    if v.vision_projector == "patchmerger":
        r += [(mp + ("pre_norm", "weight"), (), [n["pre"] + ".weight"], _same, _same),
              (mp + ("pre_norm", "bias"), (), [n["pre"] + ".bias"], _same, _same)]
    for ours in ("proj0", "proj2"):
        r.append((mp + (ours,), (), [n[ours] + ".weight"], _t, _t))
        if v.vision_projector == "patchmerger":
            r.append((mp + (ours + "_bias",), (), [n[ours] + ".bias"], _same, _same))
    if v.vision_projector == "patchmergerv2":
        r.append((mp + ("post_norm", "weight"), (), [n["post"] + ".weight"], _same, _same))
    return r


def _qkv_rules(v, layout, blk, i):
    """Fused ``wqkv`` (released, hf_save), or q/k/v split with q, k in rotate-half order (native)."""
    b, h = ("vision_tower", "blocks"), v.vision_num_heads
    sfx = [".weight"] + ([".bias"] if v.vision_attn_bias else [])
    out = []
    for s in sfx:
        ours = b + ("wqkv" if s == ".weight" else "wqkv_bias",)
        orient = _t if s == ".weight" else _same          # [3Q, D] <-> ours [D, 3Q]
        if layout != "native":
            out.append((ours, i, [blk + "wqkv" + s], orient, orient))
            continue

        def to_ours(q, k, vv, orient=orient):
            return orient(np.concatenate([rope_to_interleaved(q, h), rope_to_interleaved(k, h), vv], axis=0))

        def to_hf(x, orient=orient):
            q, k, vv = np.split(orient(x), 3, axis=0)
            return [rope_to_half(q, h), rope_to_half(k, h), np.ascontiguousarray(vv)]
        out.append((ours, i, [blk + f"attn.{n}_proj" + s for n in "qkv"], to_ours, to_hf))
    return out


def to_flat(v, layout: str, get) -> dict[tuple, np.ndarray]:
    """Every ``VisionEncoder`` parameter as {state path: array} from HF tensors (``get(name)``),
    blocks stacked on their leading axis."""
    flat: dict[tuple, np.ndarray] = {}
    stacks: dict[tuple, dict] = {}
    for path, index, hf, to_ours, _ in vision_rules(v, layout):
        val = to_ours(*[get(n) for n in hf])
        if index:
            stacks.setdefault(path, {})[index[0]] = val
        else:
            flat[path] = val
    flat.update({p: np.stack([parts[i] for i in range(len(parts))]) for p, parts in stacks.items()})
    return flat


def missing_message(v, layout: str, names, where: str) -> str | None:
    """One line naming the vision tensors a ``vision_enabled`` config needs that ``names`` lacks."""
    have = set(names)
    need = [n for *_, hf, _, _ in vision_rules(v, layout) for n in hf]
    gone = [n for n in need if n not in have]
    if not gone:
        return None
    shown = ", ".join(gone[:6]) + (f", ... ({len(gone) - 6} more)" if len(gone) > 6 else "")
    return (f"{where}: vision_enabled=true but {len(gone)} of the {len(need)} vision tensors ({layout} layout) are "
            f"missing: {shown}; for a text-only conversion pass --text_only (or a model config without the tower)")


# ---- layout detection -----------------------------------------------------------------------------

def is_vision_name(name: str) -> bool:
    return name.startswith(VISION_ROOTS)


def detect_vision_layout(names, hf: dict, where: str = "checkpoint") -> str | None:
    """The vision layout of a checkpoint from its tensor names and config.json's architectures;
    None when it holds no vision tensors. Raises ValueError for vision tensors of no known layout."""
    vis = [n for n in names if is_vision_name(n)]
    if not vis:
        return None
    arch = " ".join(hf.get("architectures") or [])
    if any(n.startswith("model.vision_tower.") for n in vis):
        return "native"
    if any(n.startswith("vision_tower.encoder.blocks.") for n in vis):
        transformers = "Kimi_K25" in arch or any(n.startswith("model.mm_projector.") for n in vis)
        return "hf_save" if transformers else "released"
    raise ValueError(f"{where}: vision tensors of an unknown layout (e.g. {sorted(vis)[0]!r}; architectures "
                     f"{arch or 'not given'}); known: the released K3 / K2.5 names (vision_tower.encoder.blocks.N.*) "
                     "and transformers' Kimi_K25 names (model.vision_tower.layers.N.*)")


# ---- config.json <-> vision_* keys -----------------------------------------------------------------

def vision_overrides_from_hf(hf: dict) -> dict:
    """Our ``vision_*`` keys from a full config.json (released K3 / K2.5 ``vision_config`` with
    ``vt_*`` names, or transformers' ``Kimi_K25Config``); {} when it has no vision_config."""
    vc = hf.get("vision_config")
    if not isinstance(vc, dict):
        return {}
    k3 = hf.get("model_type") == "kimi_k3"
    native = "vt_hidden_size" not in vc
    get = lambda *ks, default=None: next((vc[k] for k in ks if k in vc), default)  # noqa: E731
    d = get("vt_hidden_size", "hidden_size")
    heads = get("vt_num_attention_heads", "num_attention_heads")
    merge = get("merge_kernel_size", default=2)
    norm = "rmsnorm" if str(get("norm_type", default="layernorm")).lower().startswith("rms") else "layernorm"
    act = get("activation_func", "hidden_act", default="gelu_pytorch_tanh")
    proj = get("mm_projector_type", default="patchmerger")
    o = {"vision_enabled": True, "vision_patch_size": get("patch_size", default=14),
         "vision_merge_kernel_size": merge[0] if isinstance(merge, (list, tuple)) else merge,
         "vision_hidden_size": d, "vision_num_layers": get("vt_num_hidden_layers", "num_hidden_layers"),
         "vision_num_heads": heads, "vision_head_dim": get("qkv_hidden_size", default=d) // heads,
         "vision_mlp_dim": get("vt_intermediate_size", "intermediate_size"),
         "vision_mlp_activation": "gelu_tanh" if "tanh" in act else "gelu",
         "vision_norm": norm, "vision_norm_eps": 1.1920929e-07 if norm == "rmsnorm" else 1e-05,
         "vision_patch_bias": bool(get("patch_embed_proj_bias", default=True)),
         "vision_attn_bias": bool(get("attn_bias", default=True)),
         "vision_mlp_bias": bool(get("linear_bias", default=True)),
         "vision_pos_emb_height": get("init_pos_emb_height", "pos_emb_height", default=64),
         "vision_pos_emb_width": get("init_pos_emb_width", "pos_emb_width", default=64),
         "vision_pos_emb_time": get("init_pos_emb_time", "pos_emb_time", default=4),
         "vision_pos_interp": get("pos_emb_interpolation_mode", default="bicubic"),
         "vision_rope_theta": float((get("rope_parameters", default=None) or {}).get("rope_theta", 10000.0)),
         "vision_projector": proj,
         "vision_projector_eps": float(hf.get("projection_layer_norm_eps", 1e-05) if native
                                       else get("projector_ln_eps", default=1e-05))}
    # Processor defaults by release (docs/vision.md §0): base.yml's are K3's.
    if not k3:
        o.update(vision_in_patch_limit=16384, vision_transparent_bg="none", vision_image_prompt_size=False,
                 vision_video=True)
    return o


# The architecture keys that must agree between config.json and a model config.
ARCH_KEYS = ("vision_patch_size", "vision_merge_kernel_size", "vision_hidden_size", "vision_num_layers",
             "vision_num_heads", "vision_head_dim", "vision_mlp_dim", "vision_norm", "vision_patch_bias",
             "vision_attn_bias", "vision_mlp_bias", "vision_pos_emb_height", "vision_pos_emb_width",
             "vision_projector")


def hf_vision_config(v, text_hidden: int, k3: bool) -> dict:
    """The released ``vision_config`` (docs/vision.md §6) of vision config ``v``: K3's keys when
    ``k3``, else K2.5's. Inverse of ``vision_overrides_from_hf`` on the architecture keys."""
    d, k = v.vision_hidden_size, v.vision_merge_kernel_size
    c = {"vt_hidden_size": d, "vt_num_hidden_layers": v.vision_num_layers,
         "vt_num_attention_heads": v.vision_num_heads, "vt_intermediate_size": v.vision_mlp_dim,
         "patch_size": v.vision_patch_size, "init_pos_emb_height": v.vision_pos_emb_height,
         "init_pos_emb_width": v.vision_pos_emb_width, "init_pos_emb_time": v.vision_pos_emb_time,
         "pos_emb_type": "divided_fixed", "merge_kernel_size": [k, k], "merge_type": v.vision_merge,
         "mm_projector_type": v.vision_projector, "mm_hidden_size": d, "projector_hidden_act": "gelu",
         "projector_ln_eps": v.vision_projector_eps, "text_hidden_size": text_hidden}
    if not k3:
        return {**c, "video_attn_type": "spatial_temporal"}
    return {**c, "qkv_hidden_size": v.qkv_width, "norm_type": v.vision_norm, "attn_bias": v.vision_attn_bias,
            "linear_bias": v.vision_mlp_bias, "patch_embed_proj_bias": v.vision_patch_bias, "mlp_type": "mlp2",
            "activation_func": "gelu_pytorch_tanh" if v.vision_mlp_activation == "gelu_tanh" else "gelu",
            "pos_emb_interpolation_mode": v.vision_pos_interp}


def hf_top_level(m, k3: bool) -> dict:
    """The released configs' top-level multimodal keys (docs/vision.md §6)."""
    ids = {k: (val if (val := getattr(m, k)) >= 0 else None) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    extra = ({"image_placeholder": "<|kimi_image_placeholder|>"} if k3 else
             {"use_unified_vision_chunk": True, "video_placeholder": "<|kimi_k25_video_placeholder|>"})
    return {"media_placeholder_token_id": 163605, "ignore_index": -100, **ids, "tie_word_embeddings": False, **extra}
