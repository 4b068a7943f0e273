"""Vision tower / projector conversion both ways (conversion/vision_map.py, docs/vision.md §6).

Two tiny multimodal models with random weights: a K3-VL (the tiny K3 text cut to 5 layers + a tower
with K3's switches: RMSNorm, no biases, qkv width 48 != 32, patchmergerv2) and a K2.5 (a tiny K2 text
model + a tower with K2.5's: LayerNorm, biases, patchmerger). Their Hugging Face directories are
written here from the name maps in every layout (released, transformers' save, transformers' own
names), converted by hf_to_k3jax and compared bit for bit with the weights they came from; the
released layouts are exported back by k3jax_to_hf and compared bit for bit with the directory they
were converted from.
"""
import json
from collections import Counter

import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from conversion import param_map, vision_map
from conversion.errors import ConversionError
from conversion.hf_to_k3jax import convert
from conversion.k3jax_to_hf import deepseek_config, export, hf_config, open_item
from conversion.safetensors_io import write_tiny_checkpoint
from k3jax import config as C
from k3jax import model as M
from k3jax.vision import build_vision

K3_VISION = ["num_layers=5", "mla_extra_layers=[4]", "attn_res_block_size=2", "vision_enabled=true", "vision_norm=rmsnorm", "vision_norm_eps=1.1920929e-07",
             "vision_patch_bias=false", "vision_attn_bias=false", "vision_mlp_bias=false",
             "vision_projector=patchmergerv2", "vision_pos_interp=bilinear", "vision_num_heads=3"]
K25 = ["model_name=deepseek3-tiny", "vocab_size=256", "vision_enabled=true", "vision_in_patch_limit=16384",
       "vision_transparent_bg=none", "vision_image_prompt_size=false", "vision_video=true"]
CONFIGS = {"k3": K3_VISION, "k25": K25}


def _cfg(name):
    return C.load(C.REPO_CONFIGS / "base.yml", [*CONFIGS[name], "weight_dtype=float32"])


def _shapes(module, kind=None):
    state = nnx.state(module, kind) if kind else nnx.state(module)
    return {tuple(p): tuple(v.shape) for p, v in nnx.to_flat_state(state)}


def _random(shapes, seed):
    rng = np.random.default_rng(seed)
    return {p: rng.standard_normal(s).astype(np.float32) for p, s in sorted(shapes.items())}


def vision_hf(v, layout, ours):
    """HF tensors of ``ours`` (the encoder's {path: array}) in ``layout``, through the map."""
    out = {}
    for path, index, hf, _, to_hf in vision_map.vision_rules(v, layout):
        h = to_hf(ours[path][index] if index else ours[path])
        out.update(zip(hf, h if isinstance(h, list) else [h]))
    return out


def text_hf(model, m, layout, ours):
    """HF tensors of the text model's {path: array} in ``layout`` (the export's plan, here by hand)."""
    out, fused = {}, {}
    rules = [(r, (), None) for r in param_map.global_rules(m, layout)]
    for l in range(m.num_layers):
        loc, idx = model.layout.where(l)
        rules += [(r, loc, idx) for r in param_map.layer_rules(m, l, layout)]
    for (our, hf, _, to_hf), loc, idx in rules:
        x = ours[loc + tuple(our.split("."))]
        x = x if idx is None else x[idx]
        if to_hf is None:
            fused.setdefault(hf[0], []).append(x)
        elif hasattr(to_hf, "each_hf"):
            out.update((n, to_hf.each_hf(x[e])) for e, n in enumerate(hf))
        else:
            out[hf[0]] = to_hf(x)
    out.update((n, param_map.fuse_to_hf(n, parts)) for n, parts in fused.items())
    return out


def k25_transformers_config(cfg):
    """transformers' own Kimi_K25Config keys (what its save_pretrained writes)."""
    v = cfg.vision
    return {"architectures": ["Kimi_K25ForConditionalGeneration"], "model_type": "kimi_k25",
            "text_config": deepseek_config(cfg.model, "float32"), "projection_hidden_size": v.vision_hidden_size,
            "projection_layer_norm_eps": v.vision_projector_eps, "tie_word_embeddings": False,
            "vision_config": {"model_type": "kimi_k25_vision", "hidden_size": v.vision_hidden_size,
                              "num_hidden_layers": v.vision_num_layers, "num_attention_heads": v.vision_num_heads,
                              "intermediate_size": v.vision_mlp_dim, "patch_size": v.vision_patch_size,
                              "pos_emb_height": v.vision_pos_emb_height, "pos_emb_width": v.vision_pos_emb_width,
                              "pos_emb_time": v.vision_pos_emb_time, "hidden_act": "gelu_pytorch_tanh",
                              "merge_kernel_size": [2, 2]}}


# (model, vision layout, text layout): the released K3 and K2.5, transformers' save and own names
CASES = {"k3_released": ("k3", "released", "remote_prefixed"), "k25_released": ("k25", "released", "deepseek_prefixed"),
         "k25_hf_save": ("k25", "hf_save", "deepseek_blocks"), "k25_native": ("k25", "native", "native_k25")}


@pytest.fixture(scope="module")
def models():
    out = {}
    for i, name in enumerate(CONFIGS):
        cfg = _cfg(name)
        model = nnx.eval_shape(lambda: M.build(M.text_only(cfg), 0))
        enc = nnx.eval_shape(lambda: build_vision(cfg, 0))
        out[name] = (cfg, model, _random(_shapes(model), 10 + i), _random(_shapes(enc, nnx.Param), 20 + i))
    return out


def write_case(case, models, d):
    name, vl, tl = CASES[case]
    cfg, model, text, vision = models[name]
    if vl == "released":
        config = hf_config(cfg.model, tl, "float32", cfg.vision)
    else:
        config = k25_transformers_config(cfg)
    tensors = {**text_hf(model, cfg.model, tl, text), **vision_hf(cfg.vision, vl, vision)}
    write_tiny_checkpoint(str(d), tensors, num_shards=2, config=config)
    return tensors


def _item(d):
    return {p: np.asarray(ts.read().result()) for p, ts in open_item(d).items()}


@pytest.fixture(scope="module")
def converted(models, tmp_path_factory):
    out = {}
    for case in CASES:
        d = tmp_path_factory.mktemp(case)
        tensors = write_case(case, models, d / "hf")
        summary = convert(str(d / "hf"), str(d / "ckpt"), progress=False)
        out[case] = (d, tensors, summary)
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_hf_to_k3jax_reads_every_layout_bit_exact(case, models, converted):
    name, vl, tl = CASES[case]
    cfg, _, text, vision = models[name]
    d, _, summary = converted[case]
    assert summary["vision_layout"] == vl and not summary["skipped"]
    got = _item(d / "ckpt" / "vision")
    assert got.keys() == vision.keys()
    for p, x in vision.items():
        assert got[p].dtype == np.float32 and np.array_equal(got[p], x), p
    got = {**_item(d / "ckpt" / "params"), **_item(d / "ckpt" / "extra")}
    assert got.keys() == text.keys()
    assert all(np.array_equal(got[p], x) for p, x in text.items())
    # the derived config is the tower's: its architecture keys and the release's processor keys
    derived = C.load(C.REPO_CONFIGS / "base.yml", [f"model_name={d / 'ckpt' / 'model.yml'}"]).vision
    for k in (*vision_map.ARCH_KEYS, "vision_pos_interp", "vision_norm_eps", "vision_projector_eps",
              "vision_in_patch_limit", "vision_video", "vision_image_prompt_size"):
        assert getattr(derived, k) == getattr(cfg.vision, k), k


@pytest.mark.parametrize("case", ["k3_released", "k25_released"])
def test_k3jax_to_hf_writes_the_released_layout_back_bit_exact(case, converted, tmp_path):
    d, tensors, _ = converted[case]
    export(str(d / "ckpt"), str(tmp_path / "hf"), dtype="float32", progress=False)
    back = {}
    for f in sorted((tmp_path / "hf").glob("*.safetensors")):
        back.update(load_file(str(f)))
    assert back.keys() == tensors.keys()
    for n, x in tensors.items():
        assert back[n].dtype == np.float32 and np.array_equal(back[n], x), n
    mine, theirs = (json.loads((p / "config.json").read_text()) for p in (tmp_path / "hf", d / "hf"))
    assert mine == theirs
    assert mine["architectures"] == (["KimiK3ForConditionalGeneration"] if case == "k3_released"
                                     else ["KimiK25ForConditionalGeneration"])
    assert mine["vision_config"]["vt_hidden_size"] == 32 and mine["media_placeholder_token_id"] == 163605


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("layout", vision_map.LAYOUTS)
def test_vision_map_covers_every_parameter_once_and_inverts(name, layout, models):
    cfg, _, _, vision = models[name]
    slices, names = Counter(), Counter()
    for path, index, hf, to_ours, to_hf in vision_map.vision_rules(cfg.vision, layout):
        slices[(path, index)] += 1
        names.update(hf)
        x = vision[path][index] if index else vision[path]
        h = to_hf(x)
        back = to_ours(*(h if isinstance(h, list) else [h]))
        assert back.dtype == x.dtype and np.array_equal(back, x), path
    assert set(names.values()) == {1} and set(slices.values()) == {1}
    want = {(p, (i,)) for p, x in vision.items() if p[1] == "blocks" for i in range(x.shape[0])}
    want |= {(p, ()) for p in vision if p[1] != "blocks"}
    assert set(slices) == want
    assert all(vision_map.is_vision_name(n) for n in names)
    flat = vision_map.to_flat(cfg.vision, layout, vision_hf(cfg.vision, layout, vision).__getitem__)
    assert flat.keys() == vision.keys() and all(np.array_equal(flat[p], x) for p, x in vision.items())
    assert vision_map.detect_vision_layout(list(names), {"architectures": ["Kimi_K25ForConditionalGeneration"]
                                                         if layout != "released" else []}) == layout


def _rotate_interleaved(x, ang):
    x0, x1 = x[0::2], x[1::2]
    out = np.empty_like(x)
    out[0::2], out[1::2] = x0 * np.cos(ang) - x1 * np.sin(ang), x0 * np.sin(ang) + x1 * np.cos(ang)
    return out


def _rotate_half(x, ang):
    a = np.concatenate([ang, ang])
    h = len(x) // 2
    return x * np.cos(a) + np.concatenate([-x[h:], x[:h]]) * np.sin(a)


def test_native_qk_permutation_turns_interleaved_rope_into_rotate_half():
    """transformers rotates halves of the permuted q/k; k3jax rotates interleaved pairs of the
    checkpoint's. Per head, the permuted weight with rotate-half RoPE must give the same vector
    (in permuted order) and the same q.k scores as the original with interleaved RoPE."""
    rng = np.random.default_rng(0)
    heads, dh, d_in = 3, 8, 5
    wq, wk = rng.standard_normal((2, heads * dh, d_in))
    bq = rng.standard_normal(heads * dh)
    x1, x2 = rng.standard_normal((2, d_in))
    ang1, ang2 = rng.uniform(-3, 3, (2, dh // 2))          # per-pair angles of two positions
    to_half = lambda w: vision_map.rope_to_half(w, heads)  # noqa: E731
    assert np.array_equal(vision_map.rope_to_interleaved(to_half(wq), heads), wq)
    for h in range(heads):
        s = slice(h * dh, (h + 1) * dh)
        q = _rotate_interleaved(wq[s] @ x1 + bq[s], ang1)
        k = _rotate_interleaved(wk[s] @ x2, ang2)
        q_hf = _rotate_half(to_half(wq)[s] @ x1 + to_half(bq)[s], ang1)
        k_hf = _rotate_half(to_half(wk)[s] @ x2, ang2)
        np.testing.assert_allclose(q_hf, np.concatenate([q[0::2], q[1::2]]), rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(q_hf @ k_hf, q @ k, rtol=1e-12)
        # without the permutation (or with the inverse one) the scores differ
        for wrong in (lambda w: w, lambda w: vision_map.rope_to_interleaved(w, heads)):
            bad = _rotate_half(wrong(wq)[s] @ x1 + wrong(bq)[s], ang1) @ _rotate_half(wrong(wk)[s] @ x2, ang2)
            assert abs(bad - q @ k) > 1e-6


def test_missing_vision_tensors_and_text_only_conversion(models, converted, tmp_path, capsys):
    d, tensors, _ = converted["k25_released"]
    cut = {n: x for n, x in tensors.items() if n != "vision_tower.encoder.blocks.1.wqkv.weight"}
    config = json.loads((d / "hf" / "config.json").read_text())
    write_tiny_checkpoint(str(tmp_path / "cut"), cut, config=config)
    with pytest.raises(ConversionError) as e:
        convert(str(tmp_path / "cut"), str(tmp_path / "o1"), progress=False)
    msg = str(e.value)
    assert "\n" not in msg and "vision_enabled=true" in msg and "vision_tower.encoder.blocks.1.wqkv.weight" in msg
    assert "1 of the" in msg and "--text_only" in msg
    # a text-only conversion of the multimodal checkpoint skips (and counts) the vision tensors
    summary = convert(str(d / "hf"), str(tmp_path / "o2"), text_only=True)
    assert summary["vision_layout"] is None and not (tmp_path / "o2" / "vision").exists()
    n_vision = sum(vision_map.is_vision_name(n) for n in tensors)
    assert len(summary["skipped"]) == n_vision
    assert f"skipped {n_vision} non-text tensors" in capsys.readouterr().out
    # a vision model config against a text-only checkpoint names what is missing
    text_only = {n: x for n, x in tensors.items() if not vision_map.is_vision_name(n)}
    write_tiny_checkpoint(str(tmp_path / "txt"), text_only, config=config)
    yml = tmp_path / "vl.yml"
    yml.write_text((d / "ckpt" / "model.yml").read_text())
    with pytest.raises(ConversionError, match=r"vision_enabled=true but \d+ of the \d+ vision tensors"):
        convert(str(tmp_path / "txt"), str(tmp_path / "o3"), model_name=str(yml), progress=False)


def test_k2_text_export_without_the_tower_round_trips(models, converted, tmp_path):
    """The K2.5 checkpoint exported with a text-only config: the released K2 names and a
    deepseek_v3 config.json, which convert back to the same text weights."""
    d, tensors, _ = converted["k25_released"]
    yml = tmp_path / "k2.yml"
    yml.write_text((d / "ckpt" / "model.yml").read_text().replace("vision_enabled: true", "vision_enabled: false"))
    summary = export(str(d / "ckpt"), str(tmp_path / "hf"), model_name=str(yml), dtype="float32", progress=False)
    assert summary["layout"] == "deepseek"
    names = set(json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())["weight_map"])
    assert names == {n.removeprefix("language_model.") for n in tensors if not vision_map.is_vision_name(n)}
    assert "model.layers.1.mlp.experts.0.gate_proj.weight" in names
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV3ForCausalLM"] and "vision_config" not in config
    assert convert(str(tmp_path / "hf"), str(tmp_path / "ckpt"), progress=False)["vision_layout"] is None
    text = models["k25"][2]
    got = {**_item(tmp_path / "ckpt" / "params"), **_item(tmp_path / "ckpt" / "extra")}
    assert got.keys() == text.keys() and all(np.array_equal(got[p], x) for p, x in text.items())


def test_model_name_must_agree_with_the_vision_config(converted, tmp_path):
    d, _, _ = converted["k25_native"]
    yml = tmp_path / "wide.yml"
    yml.write_text((d / "ckpt" / "model.yml").read_text().replace("vision_hidden_size: 32", "vision_hidden_size: 48"))
    with pytest.raises(ConversionError, match="vision_hidden_size: checkpoint 32 vs config 48"):
        convert(str(d / "hf"), str(tmp_path / "o1"), model_name=str(yml), progress=False)
    with pytest.raises(ConversionError, match="--text_only with model_name=.*vision_enabled is true"):
        convert(str(d / "hf"), str(tmp_path / "o2"), model_name=str(d / "ckpt" / "model.yml"), text_only=True)


def test_detect_k2_text_layouts_ignoring_vision_tensors():
    e = "mlp.experts.0.gate_proj.weight"
    vis = ["model.vision_tower.layers.0.attn.q_proj.weight", "vision_tower.encoder.blocks.0.wqkv.weight"]
    assert param_map.detect_layout([f"model.layers.1.{e}"]) == "deepseek"
    assert param_map.detect_layout([f"language_model.model.layers.1.{e}_packed", *vis]) == "deepseek_prefixed"
    assert param_map.detect_layout([f"language_model.model.blocks.1.{e}", *vis]) == "deepseek_blocks"
    assert param_map.detect_layout(["model.language_model.layers.1.mlp.experts.gate_up_proj", *vis]) == "native_k25"
    assert param_map.detect_layout(["model.layers.1.mlp.experts.gate_up_proj", *vis]) == "native"
    assert param_map.detect_layout(["language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight",
                                    *vis]) == "remote_prefixed"


def test_unknown_vision_layout_is_one_line():
    with pytest.raises(ValueError) as e:
        vision_map.detect_vision_layout(["vision_tower.blocks.0.attn.qkv.weight"], {"architectures": ["X"]}, "c.json")
    assert "\n" not in str(e.value) and "unknown layout" in str(e.value)


def test_processor_files_and_the_code_they_name_travel_with_the_weights(tmp_path):
    """A multimodal checkpoint's processor settings and the remote-code modules its JSONs name in
    ``auto_map`` are copied byte for byte (as files, never imported); other .py files are not."""
    from conversion.hf_files import copy_side_files

    src = tmp_path / "src"
    src.mkdir()
    (src / "tiktoken.model").write_bytes(b"tok")
    (src / "tokenizer_config.json").write_text(json.dumps(
        {"auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None],
                      "AutoProcessor": "kimi_k25_processor.KimiK25Processor"}}))
    (src / "preprocessor_config.json").write_text(json.dumps(
        {"auto_map": {"AutoImageProcessor": "kimi_k25_vision_processing.KimiK25VisionProcessor",
                      "AutoVideoProcessor": "../escape.Bad"}, "in_patch_limit": 16384}))
    for f in ("tokenization_kimi.py", "kimi_k25_processor.py", "kimi_k25_vision_processing.py", "unrelated.py"):
        (src / f).write_text(f"# {f}\n")
    (tmp_path / "escape.py").write_text("# outside\n")
    names = copy_side_files(src, tmp_path / "dst")
    assert names == ["kimi_k25_processor.py", "kimi_k25_vision_processing.py", "preprocessor_config.json",
                     "tiktoken.model", "tokenization_kimi.py", "tokenizer_config.json"]
    for n in names:
        assert (tmp_path / "dst" / n).read_bytes() == (src / n).read_bytes()
