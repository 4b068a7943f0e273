"""Hugging Face safetensors -> k3jax parameters, streamed.

    python -m conversion.hf_to_k3jax --hf_dir D --out CKPT [--model_name kimi-k3] [--dtype bfloat16]
                                     [--experts_format dense|mxfp4] [--text_only]

Reads ``config.json`` (validated against ``--model_name`` when given, else turned into
``<out>/model.yml``), checks every tensor name, format and dtype from the headers alone, then reads
tensors one at a time through ``CheckpointReader`` (dequantising MXFP4, int4 and FP8 weights), maps
them with ``param_map`` into the scanned layout and writes each one straight into its slice of the
orbax items ``<out>/params`` (``nnx.Param``) and ``<out>/extra`` (router biases); see
``OrbaxStreamWriter``. With ``vision_enabled`` (from ``--model_name``, or derived from config.json's
``vision_config`` unless ``--text_only``) the vision tower and projector go to ``<out>/vision``
(``conversion.vision_map``: the released K3 / K2.5 names, transformers' ``Kimi_K25`` save or its own names). ``load_parameters_path=<out>`` accepts the result. The tokenizer, chat template and
generation config are copied beside them (``conversion.hf_files``), so ``tokenizer_path=<out>`` works
too. No Python file of the model directory is ever imported or executed.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from conversion import hf_files, param_map, quant, vision_map
from conversion.errors import ConversionError


# The text models' ``model_type``s this converter reads (K3 nests a kimi_linear-style text_config).
SUPPORTED_MODEL_TYPES = ("kimi_linear", "kimi_k2", "deepseek_v3")


def check_model_type(hf: dict, where: str) -> None:
    """A config.json of another architecture is refused by name before any tensor is read."""
    c = hf.get("text_config", hf)
    mt = c.get("model_type")
    if mt is not None and mt not in SUPPORTED_MODEL_TYPES:
        raise ConversionError(f"{where}: model_type {mt!r} is not supported; hf_to_k3jax converts "
                              f"{', '.join(SUPPORTED_MODEL_TYPES)} (and K3's kimi_k3 with a kimi_linear text_config)")


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
    elif "full_attn_layers" in lin:
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
         # Kimi Linear and K3 size both low-rank gates (f_a/f_b, g_a/g_b) by the KDA head dim.
         "kda_gate_rank": get("linear_head_dim", default=lin.get("head_dim")),
         "kda_output_gate_rank": get("linear_head_dim", default=lin.get("head_dim")),
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
    o["max_position_embeddings"] = get("max_position_embeddings", "model_max_length", default=4096)
    o.update({k: c[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if isinstance(c.get(k), int)})
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


def hf_to_flat(model, mcfg, get, names) -> dict[tuple, np.ndarray]:
    """All parameters of ``model`` as {state path: array} from HF tensors (``get(name)``)."""
    layout = param_map.detect_layout(names)
    flat: dict[tuple, np.ndarray] = {}
    stacks: dict[tuple, dict[int, np.ndarray]] = {}
    for our, hf, to_ours, _ in param_map.global_rules(mcfg, layout):
        flat[tuple(our.split("."))] = to_ours(*[get(n) for n in hf])
    for l in range(mcfg.num_layers):
        loc, idx = model.layout.where(l)
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


# ---- streaming orbax writer -----------------------------------------------------------------------

_CHUNK_BYTES = 64 * 2**20  # zarr chunks <= 64 MiB: small restore reads, and one chunk = one write


def _key_path(keys) -> tuple:
    """jax key path of a Variable's value -> our state path (("periods", "layers", 0, "mlp", ...))."""
    out = []
    for k in keys:
        out.append(k.key if hasattr(k, "key") else k.idx if hasattr(k, "idx") else k.name)
    return tuple(out[:-1]) if out and out[-1] == "value" else tuple(out)


def _chunk_shape(shape: tuple, itemsize: int, index_dims: int) -> list[int]:
    """Zarr chunk: 1 along the ``index_dims`` leading axes written one slice at a time (layers,
    experts), the rest whole unless above _CHUNK_BYTES, then halved along the first axis that can."""
    chunk = [1] * index_dims + list(shape[index_dims:])
    while math.prod(chunk) * itemsize > _CHUNK_BYTES:
        ax = next((i for i in range(index_dims, len(chunk)) if chunk[i] > 1), None)
        if ax is None:
            break
        chunk[ax] = -(-chunk[ax] // 2)
    return [max(1, c) for c in chunk]


class OrbaxStreamWriter:
    """Write an orbax ``StandardCheckpointer`` item one slice at a time, never holding a whole leaf.

    Orbax saves whole arrays, and a K3 scanned leaf (e.g. routed experts [22, 896, 3584, 3072])
    does not fit in host RAM. So orbax itself first saves the tree with tiny placeholder arrays
    (``use_ocdbt=False``: one zarr directory per leaf), which produces the tree metadata, sharding
    and commit files exactly as its restore expects; then each leaf's zarr array is re-created by
    tensorstore with the real shape and dtype, orbax's own compressor, and chunks of one slice along
    the ``index_dims`` leading axes, so every ``write`` fills whole chunks (no read-modify-write).
    ``close`` checks that every slice was written and records the chunk shape as orbax's
    ``write_shape``. The result is restorable by ``ocp.StandardCheckpointer().restore``.

    Args:
      directory: the item directory to create (e.g. ``<out>/params.partial``).
      tree: pytree (e.g. an ``nnx.State``) of ``jax.ShapeDtypeStruct``-like leaves.
      index_dims: {state path: number of leading axes written slice by slice}.
    """

    def __init__(self, directory, tree, index_dims: dict):
        import jax
        import jax.numpy as jnp
        import orbax.checkpoint as ocp
        import tensorstore as ts
        self.dir = Path(directory)
        tiny = jax.tree.map(lambda a: jnp.zeros((1,) * len(a.shape), a.dtype), tree)
        ocp.Checkpointer(ocp.StandardCheckpointHandler(use_ocdbt=False)).save(
            self.dir, args=ocp.args.StandardSave(tiny))
        names = jax.tree.leaves(ocp.tree.get_param_names(tree))
        leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
        self.arrays, self.pending, self.chunks, self.index_dims = {}, {}, {}, {}
        for name, (keys, a) in zip(names, leaves):
            path = _key_path(keys)
            leaf_dir = self.dir / name
            zarray = json.loads((leaf_dir / ".zarray").read_text())
            shutil.rmtree(leaf_dir)
            nd = index_dims.get(path, 0)
            chunks = _chunk_shape(tuple(a.shape), np.dtype(a.dtype).itemsize, nd)
            meta = dict(zarray, shape=list(a.shape), chunks=chunks)
            self.arrays[path] = ts.open({"driver": "zarr", "kvstore": {"driver": "file", "path": str(leaf_dir)},
                                         "metadata": meta}, create=True).result()
            self.pending[path] = math.prod(a.shape[:nd])
            self.index_dims[path] = nd
            self.chunks[name] = chunks
        self.dtypes = {p: np.dtype(arr.dtype.numpy_dtype) for p, arr in self.arrays.items()}

    def write(self, path: tuple, index: tuple, value: np.ndarray, source=()) -> None:
        """Write ``value`` into leaf ``path`` at ``[*index]`` (a full slice of the leading axes);
        ``source`` names the HF tensors it came from, for error messages."""
        arr = self.arrays[path]
        if len(index) != self.index_dims[path]:  # a programming error in the plan, not user input
            raise ConversionError(f"{'.'.join(map(str, path))}: written with index {index}, expected "
                                  f"{self.index_dims[path]} leading indices")
        want = tuple(arr.shape[len(index):])
        if tuple(value.shape) != want:
            raise ConversionError(f"parameter {'.'.join(map(str, path))}{list(index) if index else ''}: "
                                  f"converted shape {tuple(value.shape)} != model shape {want}"
                                  + (f" (from Hugging Face tensor {list(source)})" if source else ""))
        target = arr[tuple(index)] if index else arr
        target.write(np.ascontiguousarray(value, dtype=self.dtypes[path])).result()
        self.pending[path] -= 1

    def close(self) -> None:
        left = sorted(".".join(map(str, p)) for p, n in self.pending.items() if n > 0)
        if left:
            raise ConversionError(f"{self.dir}: {len(left)} parameters were not (fully) written: {left[:8]}")
        for meta_file in (self.dir / "_METADATA", *sorted((self.dir / "array_metadatas").glob("*"))):
            text = meta_file.read_text()
            data = json.loads(text)
            for entry in data.get("array_metadatas", []):
                am = entry["array_metadata"]
                am["write_shape"] = am["chunk_shape"] = self.chunks[am["param_name"]]
            for key, entry in data.get("tree_metadata", {}).items():
                vm = entry["value_metadata"]
                name = ".".join(str(k["key"]) for k in entry["key_metadata"])
                if "write_shape" in vm and name in self.chunks:
                    vm["write_shape"] = self.chunks[name]
            meta_file.write_text(json.dumps(data))


# ---- the streaming conversion ---------------------------------------------------------------------

_IGNORED_PREFIXES = (*vision_map.VISION_ROOTS, "multi_modal_projector.")


def conversion_steps(model, mcfg, layout: str):
    """Conversion plan, in checkpoint order: (layer or None, state path, index, hf names, to_ours)."""
    for our, hf, to_ours, _ in param_map.global_rules(mcfg, layout):
        yield None, tuple(our.split(".")), (), hf, to_ours
    for l in range(mcfg.num_layers):
        loc, idx = model.layout.where(l)
        for our, hf, to_ours, _ in param_map.layer_rules(mcfg, l, layout):
            yield l, loc + tuple(our.split(".")), (() if idx is None else (idx,)), hf, to_ours


def _listing(names, n: int = 12) -> str:
    names = sorted(names)
    return ", ".join(names[:n]) + (f", ... ({len(names) - n} more)" if len(names) > n else "")


def validate_names(reader, steps) -> list[str]:
    """Check tensor names, formats and dtypes from the headers before any data is read.

    Raises ConversionError listing missing tensors (needed by the model, absent from the checkpoint),
    unexpected ones (present, used by no rule; vision / projector tensors of multimodal checkpoints
    are skipped), unsupported quantization layouts, and non-float dense weights. Returns the names
    of the skipped tensors.
    """
    have = set(reader.logical_keys())
    need = {n for *_, hf, _ in steps for n in hf}
    missing = need - have
    if missing:
        raise ConversionError(f"{reader.hf_dir}: {len(missing)} tensors the model needs are missing: "
                              f"{_listing(missing)}")
    skipped = sorted(n for n in have - need if n.startswith(_IGNORED_PREFIXES))
    unexpected = have - need - set(skipped)
    if unexpected:
        raise ConversionError(f"{reader.hf_dir}: {len(unexpected)} unexpected tensors that no rule of this "
                              f"model config maps (wrong config or layout?): {_listing(unexpected)}")
    for n in sorted(need):
        if reader.format_of(n) == "bf16":  # raises for unsupported quantization layouts
            dt = reader.dtype(n)
            if not (dt.kind == "f" or dt.name == "bfloat16"):
                raise ConversionError(f"tensor {n!r} has dtype {reader.info(n).dtype}; expected a "
                                      "floating-point tensor (BF16/F16/F32) or a supported quantized layout")
    return skipped


def _stored_bytes(reader, name: str) -> int:
    if name in reader:
        return reader.info(name).nbytes
    base = name[: -len(".weight")] if name.endswith(".weight") else name
    return sum(reader.info(f"{base}.{s}").nbytes for s in quant.COMPANION_SUFFIXES if f"{base}.{s}" in reader)


class Progress:
    """One-line progress on stderr: tensors and bytes done, rate, ETA (no dependency)."""

    def __init__(self, total_tensors: int, total_bytes: int, enabled: bool = True):
        self.n, self.total_n, self.b, self.total_b = 0, total_tensors, 0, max(1, total_bytes)
        self.t0, self.last, self.enabled = time.perf_counter(), 0.0, enabled

    def update(self, nbytes: int) -> None:
        self.n += 1
        self.b += nbytes
        now = time.perf_counter()
        if self.enabled and (now - self.last > 0.5 or self.n == self.total_n):
            self.last = now
            rate = self.b / max(now - self.t0, 1e-9)
            eta = (self.total_b - self.b) / max(rate, 1e-9)
            frac = self.b / self.total_b
            bar = "#" * int(30 * frac)
            print(f"\r[{bar:<30}] {self.n}/{self.total_n} tensors {self.b / 2**20:,.1f}/{self.total_b / 2**20:,.1f} MiB "
                  f"{rate / 2**20:,.1f} MiB/s ETA {eta:,.0f}s", end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.enabled:
            print(file=sys.stderr)


def checkpoint_dtype(hf: dict) -> str:
    """The parameter dtype a checkpoint was saved in (``dtype`` / ``torch_dtype`` of config.json):
    float32 stays float32; everything else, quantized experts (MXFP4, int4, FP8) included, is
    converted to bfloat16."""
    if hf.get("quantization_config"):
        return "bfloat16"
    return "float32" if str(hf.get("dtype") or hf.get("torch_dtype")) == "float32" else "bfloat16"


def router_weights_from_biased(hf: dict, layout: str) -> bool:
    """Kimi Linear's remote code gathers the top-k weights from the biased scores; native
    transformers (and its default save_pretrained layout, remote_hf) from the unbiased ones. The
    checkpoint's layout says which code it was written for."""
    return hf.get("text_config", hf).get("model_type", "kimi_linear") == "kimi_linear" and layout == "remote"


def resolve_config(hf: dict, out: Path, model_name: str | None, dtype: str, layout: str = "native",
                   full: dict | None = None, text_only: bool = False):
    """The run config: ``model_name``'s, refused when config.json disagrees; else derived from
    config.json and written to ``<out>/model.yml``, with the vision keys of its ``vision_config``
    (``full``: the whole config.json) unless ``text_only``. ``router_weights_from_biased`` comes
    from the checkpoint's layout either way."""
    import yaml

    from k3jax import config as C
    derived = model_overrides_from_hf(hf)
    derived["router_weights_from_biased"] = router_weights_from_biased(hf, layout)
    vision = {} if text_only else vision_map.vision_overrides_from_hf(full or {})
    if not model_name:
        (out / "model.yml").write_text(yaml.safe_dump({**derived, **vision}, sort_keys=False))
        return C.load(C.REPO_CONFIGS / "base.yml", [f"model_name={out / 'model.yml'}", f"weight_dtype={dtype}"])
    cfg = C.load(C.REPO_CONFIGS / "base.yml", [f"model_name={model_name}", f"weight_dtype={dtype}"])
    if text_only and cfg.vision.vision_enabled:
        raise ConversionError(f"--text_only with model_name={model_name}, whose vision_enabled is true; "
                              "name a text-only model config (or drop --model_name)")
    if cfg.model.router_weights_from_biased != derived["router_weights_from_biased"]:
        print(f"note: router_weights_from_biased={derived['router_weights_from_biased']} for this {layout}-layout "
              f"checkpoint (model_name={model_name} says {cfg.model.router_weights_from_biased}); pass it to the "
              f"tools that load {out}", file=sys.stderr)
    bad = {k: (v, getattr(cfg.model, k)) for k, v in derived.items()
           if k not in ("mla_every", "mla_extra_layers", "router_weights_from_biased") and getattr(cfg.model, k) != v}
    p, n = derived["mla_every"], derived["num_layers"]
    mla = sorted({l for l in range(n) if p and l % p == p - 1} | set(derived["mla_extra_layers"]))
    if mla != sorted(cfg.model.mla_layer_set):
        bad["MLA layers"] = (mla, sorted(cfg.model.mla_layer_set))
    if cfg.vision.vision_enabled and vision:
        bad.update({k: (vision[k], getattr(cfg.vision, k)) for k in vision_map.ARCH_KEYS
                    if getattr(cfg.vision, k) != vision[k]})
    if bad:
        lines = "; ".join(f"{k}: checkpoint {hv!r} vs config {ov!r}" for k, (hv, ov) in list(bad.items())[:8])
        raise ConversionError(f"config.json disagrees with model_name={model_name} in {len(bad)} keys: {lines}; "
                              f"omit --model_name to derive the config from config.json")
    return cfg


def convert(hf_dir, out, model_name=None, dtype=None, experts_format="dense", progress=True,
            text_only=False) -> dict:
    """Stream a Hugging Face checkpoint into ``<out>/{params,extra}`` (+ ``model.yml``); see module doc.

    ``experts_format="mxfp4"`` keeps MXFP4 routed experts packed: they go to ``<out>/experts_mxfp4``
    (per expert matrix ``{codes: uint8 [..., E, out, in/2], scales: uint8 [..., E, out, in/32]}`` in
    the checkpoint's [out, in] orientation) instead of ``params``, which then lacks them.
    Peak host memory: the largest few source tensors (as float32), independent of model size.
    Returns a summary dict (tensors, bytes, seconds, skipped tensor names).
    """
    from k3jax import paths
    if paths.is_remote(out):   # converted locally, then uploaded (orbax files and model.yml)
        import tempfile
        with tempfile.TemporaryDirectory(prefix="k3jax-convert-") as tmp:
            summary = convert(hf_dir, tmp, model_name, dtype, experts_format, progress, text_only)
            summary["uploaded_files"] = paths.upload(tmp, str(out))
        return summary
    if paths.is_remote(hf_dir):   # safetensors are memory-mapped: a local copy of the directory
        hf_dir = paths.local_dir(hf_dir, "--hf_dir")
    paths.check(hf_dir, "--hf_dir")
    paths.check(out, "--out")
    from flax import nnx

    from conversion.safetensors_io import CheckpointReader, read_config
    from k3jax import model as M
    from k3jax.layers.common import RouterBias
    if experts_format not in ("dense", "mxfp4"):
        raise ConversionError(f"experts_format={experts_format!r}: choose dense or mxfp4")
    t0 = time.perf_counter()
    hf = read_config(hf_dir)
    check_model_type(hf, os.path.join(hf_dir, "config.json"))
    reader = CheckpointReader(hf_dir)  # validates headers, index and quantization_config
    out = Path(out).absolute()
    out.mkdir(parents=True, exist_ok=True)
    layout = param_map.detect_layout(reader.keys())
    if dtype is None:
        dtype = checkpoint_dtype(hf)
        if progress:
            print(f"parameters in {dtype} (the checkpoint's dtype; --dtype changes it)", file=sys.stderr)
    full = json.loads((Path(hf_dir) / "config.json").read_text())
    cfg = resolve_config(hf, out, model_name, dtype, layout, full, text_only)
    mcfg = cfg.model
    model = nnx.eval_shape(lambda: M.build(M.text_only(cfg), 0))   # the tower is the 'vision' item
    _, params, extra = nnx.split(model, nnx.Param, RouterBias)
    steps = list(conversion_steps(model, mcfg, layout))
    vlayout = _vision_steps(cfg, reader, full, hf_dir, steps) if cfg.vision.vision_enabled else None
    skipped = validate_names(reader, steps)
    packed = {}
    if experts_format == "mxfp4":
        packed = {path: hf[0] for _, path, _, hf, fn in steps if hasattr(fn, "each")}
        if not packed:
            raise ConversionError(f"{hf_dir}: --experts_format mxfp4 needs per-expert routed expert tensors "
                                  f"(remote layout); this checkpoint has layout {layout}")
        for n in (n for _, path, _, hf_names, _ in steps if path in packed for n in hf_names):
            if reader.format_of(n) != "mxfp4":
                raise ConversionError(f"tensor {n!r} is stored as {reader.format_of(n)}, not mxfp4; "
                                      "--experts_format mxfp4 keeps MXFP4 experts packed, it does not quantize")
        flat = {tuple(p): v for p, v in nnx.to_flat_state(params)}
        params = nnx.from_flat_state([(p, v) for p, v in flat.items() if p not in packed])
    index_dims = {path: len(index) + hasattr(fn, "each") for _, path, index, _, fn in steps}
    parts = {"params": params, "extra": extra}
    if vlayout:
        from k3jax.vision import build_vision
        parts["vision"] = nnx.state(nnx.eval_shape(lambda: build_vision(cfg, 0)), nnx.Param)
    if packed:
        parts["experts_mxfp4"], packed_dims = _packed_tree(reader, packed, flat)
        index_dims.update(packed_dims)
    writers = {}
    try:
        for item, tree in parts.items():
            shutil.rmtree(out / f"{item}.partial", ignore_errors=True)  # left by an interrupted run
            writers[item] = OrbaxStreamWriter(out / f"{item}.partial", tree, index_dims)
        owner = {p: w for w in writers.values() for p in w.arrays}
        need = list(dict.fromkeys(n for *_, hf_names, _ in steps for n in hf_names))
        bar = Progress(len(need), sum(_stored_bytes(reader, n) for n in need), progress)
        _stream(reader, steps, owner, packed, bar)
        bar.close()
        for w in writers.values():
            w.close()
    except BaseException:
        for item in parts:
            shutil.rmtree(out / f"{item}.partial", ignore_errors=True)
        raise
    for item in ("params", "extra", "experts_mxfp4", "vision"):
        shutil.rmtree(out / item, ignore_errors=True)
        if item in parts:
            os.replace(out / f"{item}.partial", out / item)
    side = hf_files.copy_side_files(hf_dir, out)   # tokenizer, chat template, generation config
    n = M.count_params(params)
    secs = time.perf_counter() - t0
    if progress:
        print(f"wrote {out / 'params'} ({n:,} parameters, {len(need)} tensors, {bar.b / 2**20:,.1f} MiB read "
              f"in {secs:.1f}s){'; skipped ' + str(len(skipped)) + ' non-text tensors' if skipped else ''}"
              f"{'; the vision tower and projector (' + vlayout + ' layout) in ' + str(out / 'vision') if vlayout else ''}")
        print(f"copied {', '.join(side)} (tokenizer_path={out} reads them)" if side else
              f"note: {hf_dir} has no tokenizer, chat template or generation config to copy")
    return {"tensors": len(need), "bytes": bar.b, "seconds": secs, "skipped": skipped, "parameters": n,
            "side_files": side, "vision_layout": vlayout}


def _vision_steps(cfg, reader, full, hf_dir, steps) -> str:
    """Append the tower's steps to ``steps``; returns the vision layout (refused: tensors missing)."""
    names = reader.logical_keys()
    try:
        vlayout = vision_map.detect_vision_layout(names, full, os.path.join(str(hf_dir), "config.json"))
    except ValueError as e:
        raise ConversionError(str(e)) from None
    msg = vision_map.missing_message(cfg.vision, vlayout or "released", names, str(hf_dir))
    if msg:
        raise ConversionError(msg)
    steps += [(None, path, index, hf, to_ours) for path, index, hf, to_ours, _ in
              vision_map.vision_rules(cfg.vision, vlayout)]
    return vlayout


def _stream(reader, steps, owner, packed, bar) -> None:
    """Read, convert and write every step; a tensor used by several rules (fused native ``conv1d``,
    ``gate_up_proj``) is read once and kept only until its last user in the same layer."""
    uses: dict[str, int] = {}
    for *_, hf, _ in steps:
        for n in hf:
            uses[n] = uses.get(n, 0) + 1
    cache: dict[str, np.ndarray] = {}

    def get(name):
        if name in cache:
            val = cache[name]
        else:
            val = reader.get_dequantized(name)
            bar.update(_stored_bytes(reader, name))
        uses[name] -= 1
        if uses[name]:
            cache[name] = val
        else:
            cache.pop(name, None)
        return val

    for _, path, index, hf, to_ours in steps:
        if path in packed:  # stored bytes as they are: codes [out, in/2], E8M0 scales [out, in/32]
            codes, scales = (_dotted(path), "codes"), (_dotted(path), "scales")
            for e, name in enumerate(hf):
                base = name[: -len(".weight")]
                owner[codes].write(codes, (*index, e), reader.get(base + ".weight_packed"), (name,))
                owner[scales].write(scales, (*index, e), reader.get(base + ".weight_scale").view(np.uint8), (name,))
                bar.update(_stored_bytes(reader, name))
        elif hasattr(to_ours, "each"):  # per-expert tensors, one expert at a time
            for e, name in enumerate(hf):
                owner[path].write(path, (*index, e), to_ours.each(get(name)), (name,))
        else:
            owner[path].write(path, index, to_ours(*[get(n) for n in hf]), hf)


def _dotted(path) -> str:
    return ".".join(map(str, path))


def _packed_tree(reader, packed, flat):
    """Abstract tree of packed experts {dotted path: {codes, scales}} (uint8, leading axes as the
    dense leaf's [..., E]) and its {leaf path: index dims}."""
    import jax
    tree, dims = {}, {}
    for path, first in packed.items():
        lead, base = tuple(flat[path].shape[:-2]), first[: -len(".weight")]
        tree[_dotted(path)] = {
            "codes": jax.ShapeDtypeStruct(lead + reader.shape(base + ".weight_packed"), np.uint8),
            "scales": jax.ShapeDtypeStruct(lead + reader.shape(base + ".weight_scale"), np.uint8)}
        dims.update({(_dotted(path), leaf): len(lead) for leaf in ("codes", "scales")})
    return tree, dims


def main(argv=None) -> int:
    from k3jax.errors import ArgumentParser, guard
    ap = ArgumentParser(prog="python -m conversion.hf_to_k3jax", description=__doc__.split("\n\n")[0])
    ap.add_argument("--hf_dir", required=True, help="Hugging Face checkpoint directory (config.json + safetensors), local or gs://")
    ap.add_argument("--out", required=True, help="output directory, local or gs://: params/, extra/ (+ model.yml)")
    ap.add_argument("--model_name", default=None, help="check config.json against this model config")
    ap.add_argument("--dtype", default=None, choices=["bfloat16", "float32"],
                    help="parameter dtype (default: the checkpoint's own, dtype/torch_dtype in config.json: float32 "
                         "stays float32, anything else and quantized experts become bfloat16)")
    ap.add_argument("--experts_format", default="dense", choices=["dense", "mxfp4"],
                    help="mxfp4: keep MXFP4 routed experts packed in <out>/experts_mxfp4 (load with experts_format=mxfp4)")
    ap.add_argument("--text_only", action="store_true",
                    help="derive a text-only config: leave the vision tower of a multimodal checkpoint out (skipped, counted)")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")

    def run():
        a = ap.parse_args(argv)
        convert(a.hf_dir, a.out, a.model_name, a.dtype, a.experts_format, progress=not a.quiet, text_only=a.text_only)
    return guard(run)


if __name__ == "__main__":
    raise SystemExit(main())
