"""k3jax parameters -> Hugging Face safetensors, streamed.

    python -m conversion.k3jax_to_hf --ckpt CKPT --out D [--model_name ...] [--dtype bfloat16]
                                     [--experts_format dense|mxfp4|int4] [--tokenizer_dir DIR]

``CKPT`` is anything ``load_parameters_path`` accepts (a converter output, a run or step directory).
The model config is ``--model_name``, a converter output's ``model.yml`` or a training run's
``config.yml``. The tokenizer, chat template and generation config are copied in (``hf_files``). Output: sharded
``model-000NN-of-000MM.safetensors`` + ``model.safetensors.index.json`` + ``config.json``:

- Kimi Linear-shaped configs (plain residuals, SwiGLU, softplus KDA gate, full-width experts, no MLA
  output gate) get the native transformers ``kimi_linear`` layout (fused ``conv1d``,
  ``mlp.experts.gate_up_proj``) and config, which transformers loads without remote code.
- K3-shaped configs get the released K3 remote-code layout: ``language_model.`` prefix,
  ``{q,k,v}_conv1d``, ``block_sparse_moe`` with per-expert ``w1/w2/w3``, ``A_log`` zero-padded to
  [128], and a ``kimi_k3`` config with the text model under ``text_config``. Routed experts are
  written dense by default (about 4x the released size); ``--experts_format mxfp4`` writes them as
  the release stores them (compressed-tensors ``mxfp4-pack-quantized``: ``weight_packed`` E2M1 codes
  + ``weight_scale`` E8M0 bytes per 32 inputs, ``quantization_config`` in config.json), and
  ``--experts_format int4`` as K2-Thinking / K2.5 do (``pack-quantized`` int4, group 32, BF16
  scales). A model fine-tuned with ``experts_qat=mxfp4`` exports to exactly the weights its
  training forward used (``conversion.quant.quant_mxfp4`` is the rounding ``fake_mxfp4`` reproduces).
- Kimi K2 / DeepSeek-V3-shaped configs (RoPE MLA) get the released K2 names (per-expert
  ``mlp.experts.N.{gate,up,down}_proj``) and a ``deepseek_v3`` config, which transformers loads.
- With ``vision_enabled`` the tower and projector (``<ckpt>/vision``, as ``hf_to_k3jax`` writes it)
  go out in the released names (``conversion.vision_map``): K3-shaped text as the released K3
  (``KimiK3ForConditionalGeneration``), K2 text as the released K2.5 (``KimiK25ForConditionalGeneration``,
  text under ``language_model.``), each config.json with its release's ``vision_config``.

Tensors are BF16 (``--dtype bfloat16``, default) except those K3 stores in F32 (short convs,
``A_log``, ``dt_bias``, ``o_norm``, router bias), which keep F32; ``--dtype float32`` writes F32
throughout. Leaves are read slice by slice straight from the orbax zarr arrays with tensorstore
(one layer, or one expert, at a time), so host memory stays at one output shard plus one slice.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import ml_dtypes
import numpy as np

from conversion import hf_files, param_map, quant, vision_map
from conversion.errors import ConversionError

# Tensor-name endings that K3 checkpoints keep in float32 (k3-architecture.md section 8).
F32_SUFFIXES = ("conv1d.weight", "A_log", "dt_bias", "o_norm.weight", "e_score_correction_bias")
# The routed experts' stored layouts (--experts_format) and the quantization_config each declares:
# K3's release (MXFP4) and K2-Thinking / K2.5's (int4, group 32, symmetric).
EXPERT_FORMATS = {"dense": "bf16", "mxfp4": "mxfp4", "int4": "int4_pack"}
_IGNORE = ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*lm_head.*"]
QUANTIZATION_CONFIGS = {
    "mxfp4": {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
              "quantization_status": "compressed",
              "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None,
                                            "weights": {"num_bits": 4, "type": "float", "strategy": "group",
                                                        "group_size": 32, "symmetric": True}}},
              "ignore": _IGNORE},
    "int4": {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
             "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None,
                                           "weights": {"num_bits": 4, "type": "int", "strategy": "group",
                                                       "group_size": 32, "symmetric": True}}},
             "ignore": _IGNORE},
}


def open_item(item_dir) -> dict[tuple, object]:
    """Lazy tensorstore handles {state path: TensorStore} for every leaf of an orbax item.

    Reads only ``_METADATA`` (tree keys, ``use_ocdbt``, ``use_zarr3``) and each array's zarr
    metadata; ``handle[i].read().result()`` then reads one slice. Works for the converter's
    per-leaf zarr directories and for OCDBT checkpoints written by training.
    """
    import tensorstore as ts
    item_dir = Path(item_dir).absolute()
    try:
        meta = json.loads((item_dir / "_METADATA").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConversionError(f"{item_dir}: not an orbax checkpoint item ({e})") from None
    driver = "zarr3" if meta.get("use_zarr3") else "zarr"
    out = {}
    for entry in meta["tree_metadata"].values():
        keys = [k["key"] for k in entry["key_metadata"]]
        name = ".".join(map(str, keys))
        kv = ({"driver": "ocdbt", "base": f"file://{item_dir}", "path": name} if meta.get("use_ocdbt", True)
              else {"driver": "file", "path": str(item_dir / name)})
        # Sequence indices (key_type 1) come back as ints, as in the model state; nnx.List indices
        # are stored as dict keys "0", "1", ... so digit strings are indices too.
        path = tuple(int(k["key"]) if k["key_type"] == 1 or str(k["key"]).isdigit() else k["key"]
                     for k in entry["key_metadata"])
        if path and path[-1] == "value":  # nnx.Variable payloads
            path = path[:-1]
        out[path] = ts.open({"driver": driver, "kvstore": kv}, open=True, read=True).result()
    return out


def is_kimi_linear_shaped(m) -> bool:
    """True when transformers' native ``kimi_linear`` can express the model config ``m``."""
    return (not m.attn_res and m.moe_latent_size is None and m.kda_gate == "softplus"
            and m.ffn_activation == "swiglu" and not m.mla_use_output_gate and m.kda_output_gate == "low_rank"
            and not m.mla_use_rope)


def deepseek_config(m, dtype: str, model_type: str = "deepseek_v3") -> dict:
    """A K2 / DeepSeek-V3 config.json for the all-MLA RoPE model config ``m``."""
    yarn = m.rope_scaling_factor != 1.0
    return {"architectures": ["DeepseekV3ForCausalLM"], "model_type": model_type, "vocab_size": m.vocab_size,
            "hidden_size": m.hidden_size, "intermediate_size": m.intermediate_size,
            "moe_intermediate_size": m.moe_intermediate_size, "num_hidden_layers": m.num_layers,
            "num_attention_heads": m.num_attention_heads, "num_key_value_heads": m.num_attention_heads,
            "n_shared_experts": m.num_shared_experts, "n_routed_experts": m.num_experts,
            "num_experts_per_tok": m.num_experts_per_token, "routed_scaling_factor": m.routed_scaling_factor,
            "q_lora_rank": m.q_lora_rank, "kv_lora_rank": m.kv_lora_rank, "qk_nope_head_dim": m.qk_nope_head_dim,
            "qk_rope_head_dim": m.qk_rope_head_dim, "v_head_dim": m.v_head_dim, "topk_method": "noaux_tc",
            "scoring_func": "sigmoid", "n_group": m.n_group, "topk_group": m.topk_group, "moe_layer_freq": 1,
            "first_k_dense_replace": m.first_k_dense, "norm_topk_prob": m.moe_renormalize, "hidden_act": "silu",
            "max_position_embeddings": m.max_position_embeddings, "rms_norm_eps": m.rms_norm_eps,
            "rope_theta": m.rope_theta, "attention_bias": False, "tie_word_embeddings": m.tie_word_embeddings,
            "rope_scaling": {"type": "yarn", "rope_type": "yarn", "factor": m.rope_scaling_factor,
                             "original_max_position_embeddings": m.rope_original_max_position,
                             "beta_fast": m.rope_beta_fast, "beta_slow": m.rope_beta_slow, "mscale": m.rope_mscale,
                             "mscale_all_dim": m.rope_mscale_all_dim} if yarn else None, "dtype": dtype,
            **{k: (v if (v := getattr(m, k)) >= 0 else None) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}}


def hf_config(m, layout: str, dtype: str, vision=None) -> dict:
    """config.json for model config ``m`` (inverse of ``hf_to_k3jax.model_overrides_from_hf``);
    ``vision``: the vision config when the tower is exported."""
    if layout.startswith("deepseek"):
        if vision is None:
            return deepseek_config(m, dtype)
        return {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
                "text_config": deepseek_config(m, dtype, "kimi_k2"),
                "vision_config": vision_map.hf_vision_config(vision, m.hidden_size, k3=False),
                **vision_map.hf_top_level(m, k3=False)}
    n = m.num_layers
    mla = sorted(m.mla_layer_set)
    common = {
        "vocab_size": m.vocab_size, "hidden_size": m.hidden_size, "num_hidden_layers": n,
        "rms_norm_eps": m.rms_norm_eps, "tie_word_embeddings": m.tie_word_embeddings,
        "initializer_range": m.initializer_range, "intermediate_size": m.intermediate_size,
        "num_attention_heads": m.num_attention_heads, "num_key_value_heads": m.num_attention_heads,
        "q_lora_rank": m.q_lora_rank, "kv_lora_rank": m.kv_lora_rank, "qk_nope_head_dim": m.qk_nope_head_dim,
        "qk_rope_head_dim": m.qk_rope_head_dim, "v_head_dim": m.v_head_dim,
        "first_k_dense_replace": m.first_k_dense, "num_experts": m.num_experts,
        "num_experts_per_token": m.num_experts_per_token, "num_shared_experts": m.num_shared_experts,
        "moe_intermediate_size": m.moe_intermediate_size, "moe_renormalize": m.moe_renormalize,
        "routed_scaling_factor": m.routed_scaling_factor, "num_expert_group": m.n_group,
        "topk_group": m.topk_group, "dtype": dtype,
        # Explicit nulls: transformers' defaults (e.g. pad 163839) may lie outside a small vocabulary.
        **{k: (v if (v := getattr(m, k)) >= 0 else None) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}}
    if layout == "native":
        return {"architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", **common,
                "hidden_act": "silu", "head_dim": m.qk_rope_head_dim, "qk_head_dim": m.qk_head_dim,
                "layer_types": ["full_attention" if l in mla else "linear_attention" for l in range(n)],
                "mlp_layer_types": [m.ffn(l) if m.ffn(l) == "dense" else "sparse" for l in range(n)],
                "linear_num_heads": m.kda_num_heads, "linear_head_dim": m.kda_head_dim,
                "linear_conv_kernel_dim": m.kda_conv_size, "model_max_length": m.max_position_embeddings}
    text = {"architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", **common,
            "hidden_act": "situ" if m.ffn_activation == "situ" else "silu",
            "linear_attn_config": {"num_heads": m.kda_num_heads, "head_dim": m.kda_head_dim,
                                   "short_conv_kernel_size": m.kda_conv_size,
                                   "full_attn_layers": [l + 1 for l in mla],
                                   "kda_layers": [l + 1 for l in range(n) if l not in mla]},
            "use_full_rank_gate": m.kda_output_gate == "full", "mla_use_nope": not m.mla_use_rope,
            "mla_use_output_gate": m.mla_use_output_gate, "moe_layer_freq": 1,
            "moe_router_activation_func": "sigmoid", "topk_method": "noaux_tc", "use_grouped_topk": True,
            "max_position_embeddings": m.max_position_embeddings}
    if m.ffn_activation == "situ":
        text.update(activation_situ_beta=m.situ_beta, activation_situ_linear_beta=m.situ_linear_beta)
    if m.kda_gate == "bounded":
        text["gate_lower_bound"] = m.kda_gate_lower_bound
    if m.moe_latent_size:
        text.update(routed_expert_hidden_size=m.moe_latent_size, latent_moe_use_norm=m.moe_latent_norm)
    if m.attn_res:
        text["attn_res_block_size"] = m.attn_res_block_size
    k3 = {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3", "text_config": text}
    if vision is not None:
        k3.update(vision_config=vision_map.hf_vision_config(vision, m.hidden_size, k3=True),
                  **vision_map.hf_top_level(m, k3=True))
    return k3


def _plan(model, m, layout):
    """([(hf name, [(state path, index, to_hf)...])] in checkpoint order, the names of the routed
    experts' per-expert matrices); fused HF tensors (rules with to_hf None) collect every rule that
    feeds them, in rule order."""
    groups: dict[str, list] = {}
    order, experts = [], set()

    def add(rules, loc, index):
        for our, hf, _, to_hf in rules:
            path = loc + tuple(our.split("."))
            if to_hf is not None and hasattr(to_hf, "each_hf"):  # per-expert names
                for e, name in enumerate(hf):
                    order.append((name, [(path, (*index, e), to_hf.each_hf)]))
                    experts.add(name)
                continue
            (name,) = hf
            if name not in groups:
                groups[name] = []
                order.append((name, groups[name]))
            groups[name].append((path, index, to_hf))

    add(param_map.global_rules(m, layout), (), ())
    for l in range(m.num_layers):
        loc, idx = model.layout.where(l)
        add(param_map.layer_rules(m, l, layout), loc, () if idx is None else (idx,))
    return order, experts


def _vision_plan(cfg, params_dir: Path, leaves: dict, inner: dict) -> list:
    """Plan entries of the tower and projector in the released names; their leaves (the orbax item
    ``vision`` beside ``params`` of a conversion, or ``inner``: params['vision'] of a training
    checkpoint) are added to ``leaves`` after a shape check."""
    from flax import nnx

    from k3jax.vision import build_vision
    vdir = params_dir if inner else params_dir.parent / "vision"
    if not inner and not (vdir / "_METADATA").is_file():
        raise ConversionError(f"{params_dir.parent}: the config has vision_enabled=true but there is no vision "
                              "item (vision/) beside params; pass a text-only --model_name to export the text model")
    got = inner or open_item(vdir)
    enc = nnx.eval_shape(lambda: build_vision(cfg, 0))
    want = {tuple(p): tuple(x.shape) for p, x in nnx.to_flat_state(nnx.state(enc, nnx.Param))}
    bad = sorted(".".join(map(str, p)) for p in want.keys() ^ got.keys())
    bad += sorted(f"{'.'.join(map(str, p))} {tuple(got[p].shape)} != {s}" for p, s in want.items()
                  if p in got and tuple(got[p].shape) != s)
    if bad:
        raise ConversionError(f"{vdir}: {len(bad)} vision parameters missing, unexpected or of another shape than "
                              f"the config's tower: {bad[:6]}")
    leaves.update(got)
    return [(hf[0], [(path, index, to_hf)]) for path, index, hf, _, to_hf in
            vision_map.vision_rules(cfg.vision, "released")]


def load_config(ckpt, model_name: str | None):
    """``--model_name``; else the converter's ``model.yml`` beside the params; else, for a training
    checkpoint ``<run>/checkpoints/<step>``, the model keys of the run's ``config.yml``."""
    import yaml

    from k3jax import config as C
    from k3jax.checkpoint import resolve_params_dir
    if model_name:
        return C.load(C.REPO_CONFIGS / "base.yml", [f"model_name={model_name}"])
    params = resolve_params_dir(ckpt)
    yml = params.parent / "model.yml"
    if yml.exists():
        return C.load(C.REPO_CONFIGS / "base.yml", [f"model_name={yml}"])
    run_cfg = params.parent.parent.parent / "config.yml"
    if params.parent.parent.name == "checkpoints" and run_cfg.is_file():
        flat = yaml.safe_load(run_cfg.read_text()) or {}
        return C.load(C.REPO_CONFIGS / "base.yml", {k: v for k, v in flat.items() if k in C.KEYS and C.KEYS[k][0] == "model"})
    raise ConversionError(f"{ckpt}: no model.yml beside the params item and no run config.yml; pass --model_name")


def export(ckpt, out, model_name=None, dtype="bfloat16", max_shard_bytes=5 * 2**30, progress=True,
           tokenizer_dir=None, experts_format="dense") -> dict:
    """Write ``ckpt`` as a Hugging Face checkpoint in ``out``; see the module docstring.

    The tokenizer, chat template and generation config are copied from ``tokenizer_dir`` or, when
    it is None, from where ``hf_files.find_source`` finds them (the converter output, or the
    tokenizer a training run used); with none found the export holds weights and config only, and
    a note says so. ``experts_format`` (dense | mxfp4 | int4) is how the routed experts are stored
    (module docstring); mxfp4 and int4 need a model with per-expert matrices (K3 / K2 layouts).

    Raises ConversionError when the checkpoint lacks parameters the config needs (listing them; e.g.
    a ``--experts_format mxfp4`` conversion, whose dense experts are absent), holds unexpected ones,
    or a leaf's shape differs from the config's. Returns {"tensors", "bytes", "seconds", "layout"}.
    """
    from flax import nnx

    from conversion.safetensors_io import CONFIG_NAME, ShardedWriter
    from k3jax import model as M
    from k3jax.checkpoint import resolve_params_dir
    t0 = time.perf_counter()
    if experts_format not in EXPERT_FORMATS:
        raise ConversionError(f"experts_format={experts_format!r}: choose one of {sorted(EXPERT_FORMATS)}")
    cfg = load_config(ckpt, model_name)
    m, vis = cfg.model, cfg.vision.vision_enabled
    if m.mla_use_rope:
        layout = "deepseek_prefixed" if vis else "deepseek"
    else:
        layout = "native" if is_kimi_linear_shaped(m) and not vis else "remote_prefixed"
    if experts_format != "dense" and layout == "native":
        raise ConversionError(f"--experts_format {experts_format}: this Kimi Linear-shaped config exports to "
                              f"transformers' native kimi_linear layout, whose fused expert tensors have no "
                              f"quantized form; export it with --experts_format dense")
    params_dir = resolve_params_dir(ckpt)
    leaves = open_item(params_dir)
    inner = {p[1:]: leaves.pop(p) for p in [p for p in leaves if p[0] == "vision"]}   # a training checkpoint's tower
    if (params_dir.parent / "extra").is_dir():
        leaves.update(open_item(params_dir.parent / "extra"))
    model = nnx.eval_shape(lambda: M.build(M.text_only(cfg), 0))
    want = {tuple(p): tuple(v.shape) for p, v in nnx.to_flat_state(nnx.state(model))}
    missing = sorted(".".join(map(str, p)) for p in want if p not in leaves)
    extra = sorted(".".join(map(str, p)) for p in leaves if p not in want)
    if missing:
        raise ConversionError(f"{params_dir}: {len(missing)} parameters of the model config are missing "
                              f"(a --experts_format mxfp4 conversion has no dense experts): {missing[:8]}")
    if extra:
        raise ConversionError(f"{params_dir}: {len(extra)} unexpected parameters for this model config "
                              f"(wrong --model_name?): {extra[:8]}")
    for p, shape in want.items():
        if tuple(leaves[p].shape) != shape:
            raise ConversionError(f"{params_dir}: {'.'.join(map(str, p))} has shape {tuple(leaves[p].shape)} "
                                  f"but the model config needs {shape} (wrong --model_name?)")
    out = Path(out)
    plan, experts = _plan(model, m, layout)
    odd = [w for w in (m.routed_width, m.moe_intermediate_size) if w % 32]
    if experts_format != "dense" and experts and odd:
        raise ConversionError(f"--experts_format {experts_format}: the routed experts' input widths "
                              f"({m.routed_width}, {m.moe_intermediate_size}) must be multiples of 32 (one scale per "
                              f"32 inputs); export with --experts_format dense")
    if vis:
        plan += _vision_plan(cfg, params_dir, leaves, inner)
    n_bytes = 0
    with ShardedWriter(str(out), max_shard_bytes) as w:
        for i, (name, sources) in enumerate(plan):
            arrays = [np.asarray(leaves[p][index].read().result() if index else leaves[p].read().result())
                      for p, index, _ in sources]
            if len(sources) == 1 and sources[0][2] is not None:
                t = sources[0][2](arrays[0])
            else:
                t = param_map.fuse_to_hf(name, arrays)
            if name in experts and experts_format != "dense":
                for suffix, arr in quant.encode_weight(np.asarray(t, np.float32), EXPERT_FORMATS[experts_format],
                                                       name=name).items():
                    w.add(name[: -len("weight")] + suffix, np.ascontiguousarray(arr))
                    n_bytes += arr.nbytes
                continue
            keep32 = dtype == "float32" or name.endswith(F32_SUFFIXES)
            t = np.ascontiguousarray(t, dtype=np.float32 if keep32 else ml_dtypes.bfloat16)
            w.add(name, t)
            n_bytes += t.nbytes
            if progress and (i % 200 == 0 or i == len(plan) - 1):
                print(f"\r{i + 1}/{len(plan)} tensors, {n_bytes / 2**20:,.1f} MiB", end="", file=sys.stderr)
    config = hf_config(m, layout, dtype, cfg.vision if vis else None)
    if experts_format != "dense":
        config.get("text_config", config)["quantization_config"] = QUANTIZATION_CONFIGS[experts_format]
    (out / CONFIG_NAME).write_text(json.dumps(config, indent=2))
    side_src = Path(tokenizer_dir) if tokenizer_dir else hf_files.find_source(params_dir)
    if tokenizer_dir and not hf_files.has_tokenizer(side_src):
        raise ConversionError(f"--tokenizer_dir {tokenizer_dir}: no tiktoken.model or tokenizer.json there")
    side = hf_files.copy_side_files(side_src, out) if side_src else []
    secs = time.perf_counter() - t0
    if progress:
        print(f"\nwrote {out} ({len(plan)} tensors, {layout} layout, {n_bytes / 2**20:,.1f} MiB in {secs:.1f}s)",
              file=sys.stderr)
    if side:
        print(f"copied {', '.join(side)} from {side_src}", file=sys.stderr)
    else:
        print(f"note: no tokenizer found for {ckpt}; {out} holds weights and config.json only "
              f"(pass --tokenizer_dir, e.g. the original Hugging Face checkpoint)", file=sys.stderr)
    return {"tensors": len(plan), "bytes": n_bytes, "seconds": secs, "layout": layout, "side_files": side}


def main(argv=None) -> int:
    from k3jax.errors import ArgumentParser, guard
    ap = ArgumentParser(prog="python -m conversion.k3jax_to_hf", description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", required=True, help="converter output, run directory or checkpoint step")
    ap.add_argument("--out", required=True, help="empty output directory")
    ap.add_argument("--model_name", default=None, help="model config; default <ckpt>/model.yml")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--max_shard_gb", type=float, default=5.0, help="safetensors shard size limit")
    ap.add_argument("--experts_format", default="dense", choices=sorted(EXPERT_FORMATS),
                    help="routed experts as stored: dense (--dtype), mxfp4 (K3's release layout) or int4 "
                         "(K2-Thinking / K2.5's pack-quantized); a model trained with experts_qat=mxfp4 "
                         "exports with mxfp4 to exactly the weights its training forward used")
    ap.add_argument("--tokenizer_dir", default=None,
                    help="copy the tokenizer, chat template and generation config from here; default: found "
                         "beside a converter output or through the training run's config.yml")
    ap.add_argument("--quiet", action="store_true")

    def run():
        a = ap.parse_args(argv)
        export(a.ckpt, a.out, a.model_name, a.dtype, int(a.max_shard_gb * 2**30), progress=not a.quiet,
               tokenizer_dir=a.tokenizer_dir, experts_format=a.experts_format)
    return guard(run)


if __name__ == "__main__":
    raise SystemExit(main())
