"""Hugging Face safetensors -> k3jax parameters.

    python -m conversion.hf_to_k3jax --hf_dir D --out CKPT [--model_name kimi-k3] [--dtype bfloat16]

Reads ``config.json`` (validated against ``--model_name`` when given, else turned into
``<out>/model.yml``), then every tensor lazily through ``CheckpointReader`` (dequantising MXFP4,
int4 and FP8 weights), maps names with ``param_map`` into the scanned layout and writes the orbax
``params`` item to ``<out>/params``, which ``load_parameters_path=<out>`` accepts. No Python file of
the model directory is ever imported or executed.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from conversion import param_map
from conversion.errors import ConversionError


def model_overrides_from_hf(hf: dict) -> dict:
    """Our model keys from a Hugging Face config (kimi_linear native or remote, K3 text_config)."""
    c = hf.get("text_config", hf)
    lin = c.get("linear_attn_config") or {}
    n = c["num_hidden_layers"]
    deepseek = c.get("model_type") in ("deepseek_v3", "kimi_k2")
    if deepseek:  # Kimi K2 / DeepSeek-V3: every layer is MLA (with RoPE)
        mla = list(range(n))
    elif c.get("layer_types"):
        mla = [i for i, t in enumerate(c["layer_types"]) if t == "full_attention"]
    elif lin.get("full_attn_layers"):
        mla = [i - 1 for i in lin["full_attn_layers"]]
    else:
        raise ConversionError("config.json has neither layer_types nor linear_attn_config.full_attn_layers")
    if c.get("mlp_layer_types"):
        dense = [i for i, t in enumerate(c["mlp_layer_types"]) if t != "sparse"]
        first_k_dense = len(dense)
        if dense != list(range(first_k_dense)):
            raise ConversionError(f"dense FFN layers {dense} are not a prefix; unsupported")
    else:
        first_k_dense = c.get("first_k_dense_replace", 1)
    get = lambda *ks, default=None: next((c[k] for k in ks if k in c), default)  # noqa: E731
    latent = get("routed_expert_hidden_size")
    o = {"vocab_size": c["vocab_size"], "hidden_size": c["hidden_size"], "num_layers": n,
         "rms_norm_eps": c.get("rms_norm_eps", 1e-5), "tie_word_embeddings": c.get("tie_word_embeddings", False),
         **_mla_schedule(n, mla), "first_k_dense": first_k_dense,
         "kda_num_heads": get("linear_num_heads", default=lin.get("num_heads")),
         "kda_head_dim": get("linear_head_dim", default=lin.get("head_dim")),
         "kda_conv_size": get("linear_conv_kernel_dim", default=lin.get("short_conv_kernel_size", 4)),
         "num_attention_heads": c["num_attention_heads"], "q_lora_rank": c.get("q_lora_rank"),
         "kv_lora_rank": c["kv_lora_rank"], "qk_nope_head_dim": c["qk_nope_head_dim"],
         "qk_rope_head_dim": c["qk_rope_head_dim"], "v_head_dim": c["v_head_dim"],
         "mla_use_output_gate": bool(c.get("mla_use_output_gate", False)), "mla_use_rope": False,
         "intermediate_size": c["intermediate_size"],
         "num_experts": get("num_experts", "n_routed_experts", "num_local_experts"),
         "num_experts_per_token": get("num_experts_per_token", "num_experts_per_tok"),
         "num_shared_experts": get("num_shared_experts", "n_shared_experts", default=0),
         "moe_intermediate_size": c["moe_intermediate_size"], "moe_latent_size": latent,
         "moe_latent_norm": bool(c.get("latent_moe_use_norm", False)) and latent is not None,
         "routed_scaling_factor": c.get("routed_scaling_factor", 1.0),
         "moe_renormalize": bool(get("moe_renormalize", "norm_topk_prob", default=True)),
         "n_group": get("num_expert_group", "n_group", default=1) or 1, "topk_group": c.get("topk_group", 1) or 1,
         "ffn_activation": "situ" if c.get("hidden_act") == "situ" else "swiglu",
         "attn_res": bool(c.get("attn_res_block_size")),
         "attn_res_block_size": c.get("attn_res_block_size") or 12}
    o = {k: v for k, v in o.items() if v is not None or k in ("q_lora_rank", "moe_latent_size")}
    if deepseek:
        rp = c.get("rope_parameters") or dict(c.get("rope_scaling") or {}, rope_theta=c.get("rope_theta", 10000.0))
        o.update(mla_use_rope=True, rope_theta=float(rp.get("rope_theta", 10000.0)))
        if rp.get("rope_type", rp.get("type")) == "yarn":
            o.update(rope_scaling_factor=float(rp["factor"]),
                     rope_original_max_position=int(rp["original_max_position_embeddings"]),
                     rope_beta_fast=float(rp.get("beta_fast", 32)), rope_beta_slow=float(rp.get("beta_slow", 1)),
                     rope_mscale=float(rp.get("mscale", 1)), rope_mscale_all_dim=float(rp.get("mscale_all_dim", 0)))
        o["max_position_embeddings"] = c.get("max_position_embeddings", 4096)
    full_gate = bool(get("use_full_rank_gate", default=False))
    o["kda_output_gate"] = "full" if full_gate else "low_rank"
    if c.get("gate_lower_bound") is not None:
        o["kda_gate"], o["kda_gate_lower_bound"] = "bounded", float(c["gate_lower_bound"])
    else:
        o["kda_gate"] = "softplus"
    if "activation_situ_beta" in c:
        o["situ_beta"], o["situ_linear_beta"] = c["activation_situ_beta"], c["activation_situ_linear_beta"]
    return o


def _mla_schedule(n: int, mla: list[int]) -> dict:
    """Express the MLA layer set as a period (K3/Kimi Linear: every 4th) plus extra layers."""
    best = {"mla_every": 0, "mla_extra_layers": sorted(mla)}
    for p in (4, 3, 2, 1):  # the period leaving the fewest extra layers
        per = {l for l in range(n) if l % p == p - 1}
        if per and per <= set(mla) and len(set(mla) - per) < len(best["mla_extra_layers"]):
            best = {"mla_every": p, "mla_extra_layers": sorted(set(mla) - per)}
    return best


def layer_location(model, l: int):
    """(path prefix tuple, stack index or None) of decoder layer ``l`` in the model state."""
    lay = model.layout
    if l in lay.prefix:
        return ("prefix", lay.prefix.index(l)), None
    if l in lay.tail:
        return ("tail", lay.tail.index(l)), None
    i, j = divmod(l - lay.scan_start, lay.period)
    return ("periods", "layers", j), i


def hf_to_flat(model, mcfg, get, names) -> dict[tuple, np.ndarray]:
    """All parameters of ``model`` as {state path: array} from HF tensors (``get(name)``)."""
    layout = param_map.detect_layout(names)
    flat: dict[tuple, np.ndarray] = {}
    stacks: dict[tuple, dict[int, np.ndarray]] = {}
    for our, hf, to_ours, _ in param_map.global_rules(mcfg, layout):
        flat[tuple(our.split("."))] = to_ours(*[get(n) for n in hf])
    for l in range(mcfg.num_layers):
        loc, idx = layer_location(model, l)
        for our, hf, to_ours, _ in param_map.layer_rules(mcfg, l, layout):
            path = loc + tuple(our.split("."))
            val = to_ours(*[get(n) for n in hf])
            if idx is None:
                flat[path] = val
            else:
                stacks.setdefault(path, {})[idx] = val
    for path, parts in stacks.items():
        flat[path] = np.stack([parts[i] for i in range(len(parts))])
    return flat


def load_into_model(model, mcfg, get, names, dtype=None):
    """Overwrite ``model``'s variables from HF tensors; every variable must be covered, with its
    exact shape (a mismatch or gap raises ConversionError naming the parameter)."""
    import jax.numpy as jnp
    from flax import nnx
    flat = hf_to_flat(model, mcfg, get, names)
    state = nnx.state(model)
    updates = []
    for path, var in nnx.to_flat_state(state):
        key = tuple(str(p) if not isinstance(p, int) else p for p in path)
        key = tuple(k for k in key)
        if key not in flat:
            raise ConversionError(f"no Hugging Face tensor maps to parameter {'.'.join(map(str, key))}")
        val = flat.pop(key)
        if tuple(val.shape) != tuple(var.shape):
            raise ConversionError(f"{'.'.join(map(str, key))}: converted shape {val.shape} != model shape {var.shape}")
        updates.append((path, var.replace(jnp.asarray(val, dtype or var.dtype))))
    nnx.update(model, nnx.from_flat_state(updates))
    return model


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hf_dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--model_name", default=None)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    a = ap.parse_args(argv)
    try:
        convert(a.hf_dir, a.out, a.model_name, a.dtype)
    except ConversionError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def convert(hf_dir, out, model_name=None, dtype="bfloat16"):
    import jax.numpy as jnp
    import orbax.checkpoint as ocp
    import yaml
    from flax import nnx

    from conversion.safetensors_io import CheckpointReader, read_config
    from k3jax import config as C
    from k3jax import model as M
    from k3jax.layers.common import RouterBias
    hf = read_config(hf_dir)
    derived = model_overrides_from_hf(hf)
    out = Path(out).absolute()
    out.mkdir(parents=True, exist_ok=True)
    if model_name:
        cfg = C.load(C.REPO_CONFIGS / "base.yml", [f"model_name={model_name}", f"weight_dtype={dtype}"])
        bad = {k: (v, getattr(cfg.model, k)) for k, v in derived.items()
               if k not in ("mla_every", "mla_extra_layers") and getattr(cfg.model, k) != v}
        if set(cfg.model.mla_layer_set) != set(derived["mla_extra_layers"]):
            bad["MLA layers"] = (derived["mla_extra_layers"], sorted(cfg.model.mla_layer_set))
        if bad:
            k, (hv, ov) = next(iter(bad.items()))
            raise ConversionError(f"config.json disagrees with model_name={model_name}: {k} is {hv} in the "
                                  f"checkpoint but {ov} in the config ({len(bad)} mismatches); omit --model_name "
                                  f"to derive the config from config.json")
    else:
        (out / "model.yml").write_text(yaml.safe_dump(derived, sort_keys=False))
        cfg = C.load(C.REPO_CONFIGS / "base.yml", [f"model_name={out / 'model.yml'}", f"weight_dtype={dtype}"])
    reader = CheckpointReader(hf_dir)
    model = nnx.eval_shape(lambda: M.build(cfg, 0))
    model = M.build(cfg, 0)
    load_into_model(model, cfg.model, reader.get_dequantized, reader.keys(), dtype=jnp.dtype(dtype))
    _, params, rest = nnx.split(model, nnx.Param, RouterBias)
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(out / "params", params, force=True)
    ckptr.save(out / "extra", rest, force=True)
    ckptr.wait_until_finished()
    print(f"wrote {out / 'params'} ({M.count_params(params):,} parameters)")


if __name__ == "__main__":
    raise SystemExit(main())
