"""Golden parity of k3jax's MoonViT3d tower + patchmerger projector with transformers' native
``Kimi_K25ForConditionalGeneration`` (tests/assets/kimi_k25_vision_tiny, made by
scripts/make_vision_goldens.py): two images and a 4-frame video chunk of different grids packed in
one padded sequence; every stage of the tower, the sd2_tpool merge and the projector output.

The weights are read from the asset's model.safetensors, which holds transformers' own names
(``save_original_format=False``): q/k/v split and the q, k rows in rotate-half order. The loader
below maps them to k3jax by docs/vision.md sections 3.1 and 6 on its own, independent of the
converter, so it also checks the spec's inverse permutation against transformers; the converter's
own map (conversion.vision_map) must then give the same parameters bit for bit. Last, the whole
model (tiny DeepSeek-V3 text side + tower) converted from the asset by hf_to_k3jax: its logits on
the golden prompt (image, video chunk, image) against transformers' within 1e-4 relative RMS."""
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from conversion import vision_map
from k3jax import config as C
from k3jax.vision import build_vision, layout_arrays
from k3jax.data.media_layout import media_layout
from k3jax.vision.tower import merge_patches

ASSET = Path(__file__).parent / "assets" / "kimi_k25_vision_tiny"
REL_TOL = 1e-5      # max |k3jax - transformers| / max |transformers|, float32 on both sides
BUCKET = (256, 40)  # patches / merged tokens: above the real 204 / 33, so padding rides along


def vision_overrides(hf: dict) -> list[str]:
    """k3jax's vision_* keys for the asset's Kimi_K25Config (K2.5 switches: LayerNorm 1e-5 with
    biases, bicubic table, patchmerger; transformers hard-codes the tower eps, the projector's is
    projection_layer_norm_eps)."""
    v = hf["vision_config"]
    k = v["merge_kernel_size"]
    assert k[0] == k[1] and v["rope_parameters"]["rope_type"] == "axial"
    return ["vision_enabled=true", f"hidden_size={hf['text_config']['hidden_size']}",
            f"vision_patch_size={v['patch_size']}", f"vision_merge_kernel_size={k[0]}",
            f"vision_hidden_size={v['hidden_size']}", f"vision_num_layers={v['num_hidden_layers']}",
            f"vision_num_heads={v['num_attention_heads']}",
            f"vision_head_dim={v['hidden_size'] // v['num_attention_heads']}",
            f"vision_mlp_dim={v['intermediate_size']}",
            "vision_mlp_activation=" + ("gelu_tanh" if "tanh" in v["hidden_act"] else "gelu"),
            "vision_norm=layernorm", "vision_norm_eps=1e-5", "vision_patch_bias=true", "vision_attn_bias=true",
            "vision_mlp_bias=true", f"vision_pos_emb_height={v['pos_emb_height']}",
            f"vision_pos_emb_width={v['pos_emb_width']}", f"vision_pos_emb_time={v['pos_emb_time']}",
            "vision_pos_interp=bicubic", f"vision_rope_theta={v['rope_parameters']['rope_theta']}",
            "vision_projector=patchmerger", f"vision_projector_eps={hf['projection_layer_norm_eps']}",
            "vision_attention_block=64"]


def to_interleaved(w, heads):
    """q or k rows from transformers' rotate-half order back to the checkpoint's interleaved pairs
    (vision.md 3.1: q_ckpt = q_hf.reshape(H, 2, Dh/2, ...).swap(1, 2))."""
    return w.reshape(heads, 2, -1, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def k3jax_params(sd: dict, vc, permute: bool = True) -> dict:
    """k3jax parameter path -> array from transformers' native names (vision.md section 6)."""
    tw, h, p = "model.vision_tower.", vc.vision_num_heads, vc.vision_patch_size
    fix = (lambda w: to_interleaved(w, h)) if permute else (lambda w: w)
    out = {("vision_tower", "patch_embed", "proj"): sd[tw + "patch_embed.proj.weight"].reshape(-1, 3 * p * p).T,
           ("vision_tower", "patch_embed", "proj_bias"): sd[tw + "patch_embed.proj.bias"],
           ("vision_tower", "patch_embed", "pos_emb"): sd[tw + "patch_embed.pos_emb.position_embeddings"]}
    for ours, theirs in (("final_layernorm", "final_layernorm"),):
        for s in ("weight", "bias"):
            out[("vision_tower", ours, s)] = sd[f"{tw}{theirs}.{s}"]
    per_layer = {}
    for i in range(vc.vision_num_layers):
        b = f"{tw}layers.{i}."
        a = b + "attn."
        layer = {("norm0", "weight"): sd[b + "norm1.weight"], ("norm0", "bias"): sd[b + "norm1.bias"],
                 ("norm1", "weight"): sd[b + "norm2.weight"], ("norm1", "bias"): sd[b + "norm2.bias"],
                 ("wqkv",): np.concatenate([fix(sd[a + "q_proj.weight"]), fix(sd[a + "k_proj.weight"]),
                                            sd[a + "v_proj.weight"]]).T,
                 ("wqkv_bias",): np.concatenate([fix(sd[a + "q_proj.bias"]), fix(sd[a + "k_proj.bias"]),
                                                 sd[a + "v_proj.bias"]]),
                 ("wo",): sd[a + "proj.weight"].T, ("wo_bias",): sd[a + "proj.bias"],
                 ("fc0",): sd[b + "mlp.fc1.weight"].T, ("fc0_bias",): sd[b + "mlp.fc1.bias"],
                 ("fc1",): sd[b + "mlp.fc2.weight"].T, ("fc1_bias",): sd[b + "mlp.fc2.bias"]}
        for k, v in layer.items():
            per_layer.setdefault(k, []).append(v)
    for k, vs in per_layer.items():
        out[("vision_tower", "blocks") + k] = np.stack(vs)
    mp = "model.mm_projector."
    out.update({("mm_projector", "pre_norm", "weight"): sd[mp + "pre_norm.weight"],
                ("mm_projector", "pre_norm", "bias"): sd[mp + "pre_norm.bias"],
                ("mm_projector", "proj0"): sd[mp + "in_proj.weight"].T, ("mm_projector", "proj0_bias"): sd[mp + "in_proj.bias"],
                ("mm_projector", "proj2"): sd[mp + "out_proj.weight"].T, ("mm_projector", "proj2_bias"): sd[mp + "out_proj.bias"]})
    return out


def load_params(enc, params: dict):
    """Every k3jax parameter set from ``params`` (shapes checked, nothing left over or missing)."""
    state = nnx.state(enc, nnx.Param)
    flat = dict(nnx.to_flat_state(state))
    assert set(flat) == set(params), (set(flat) ^ set(params))
    for path, var in flat.items():
        val = params[path]
        assert var.get_value().shape == val.shape, (path, var.get_value().shape, val.shape)
        var.set_value(jnp.asarray(val, jnp.float32))
    nnx.update(enc, state)


@nnx.jit
def _parts(enc, patches, arrays):
    tower = enc.vision_tower
    emb = tower.patch_embed(patches, arrays["pos_index"], arrays["pos_weight"], arrays["frames"])
    hidden, layers = tower(patches, arrays, per_layer=True)
    merged = merge_patches(hidden, arrays)
    return {"patch_embeds": emb, "hidden_states": layers, "last_hidden_state": hidden, "pooled": merged,
            "projected": enc.mm_projector(merged)}


@pytest.fixture(scope="module")
def golden():
    hf = json.loads((ASSET / "config.json").read_text())
    cfg = C.load(C.REPO_CONFIGS / "base.yml", vision_overrides(hf))
    sd = load_file(str(ASSET / "model.safetensors"))
    g = dict(np.load(ASSET / "golden.npz"))
    enc = build_vision(cfg, 0)
    vc = cfg.vision
    lay = media_layout(vc, g["grid_thw"], *BUCKET)
    n, m = lay["real_patches"], lay["real_tokens"]
    x = np.zeros((len(lay["segment_ids"]), g["pixel_values"][0].size), np.float32)
    x[:n] = g["pixel_values"].reshape(n, -1)
    x[n:] = 1.0   # padding rows: must not reach any real row

    def run(permute=True):
        load_params(enc, k3jax_params(sd, vc, permute))
        got = _parts(enc, jnp.asarray(x), layout_arrays(lay))
        cut = {"hidden_states": (slice(None), slice(0, n)), "pooled": slice(0, m), "projected": slice(0, m)}
        return {k: np.asarray(v)[cut.get(k, slice(0, n))] for k, v in got.items()}

    return cfg, sd, g, run


def errors(got: dict, g: dict) -> dict:
    """part -> (max abs error, max abs error / max |golden|); the blocks one by one."""
    pairs = {"patch + position embedding": ("patch_embeds", None)}
    pairs |= {f"block {i} output": ("hidden_states", i) for i in range(len(g["hidden_states"]))}
    pairs |= {"final norm": ("last_hidden_state", None), "merged (sd2_tpool)": ("pooled", None),
              "projector output": ("projected", None)}
    out = {}
    for part, (key, i) in pairs.items():
        a, b = got[key], g[key]
        if i is not None:
            a, b = a[i], b[i]
        assert a.shape == b.shape, (part, a.shape, b.shape)
        d = float(np.abs(a.astype(np.float64) - b).max())
        out[part] = (d, d / float(np.abs(b).max()))
    return out


def test_tower_and_projector_match_transformers(golden):
    _, _, g, run = golden
    errs = errors(run(), g)
    for part, (abs_err, rel) in errs.items():
        print(f"{part:28s} max abs {abs_err:.2e}  rel {rel:.2e}")
    bad = {k: e for k, e in errs.items() if not e[1] < REL_TOL}
    assert not bad, bad


def test_rope_row_order_is_visible_in_the_golden(golden):
    """Loading q/k in transformers' rotate-half row order (no inverse permutation) leaves the
    embedding exact but moves block 0's output far past the tolerance: the golden pins the
    checkpoint's interleaved-pair layout."""
    _, _, g, run = golden
    errs = errors(run(permute=False), g)
    assert errs["patch + position embedding"][1] < REL_TOL
    assert errs["block 0 output"][1] > 1e-2, errs["block 0 output"]


def test_converter_reads_the_asset_as_the_spec_does(golden):
    """conversion.vision_map on transformers' own save: the layout is detected as native, the
    vision keys derived from config.json equal this test's, its rules use every vision tensor once
    and give bit for bit the parameters of the loader above (so hf_to_k3jax's vision weights meet
    the same tolerances)."""
    cfg, sd, _, _ = golden
    hf = json.loads((ASSET / "config.json").read_text())
    assert vision_map.detect_vision_layout(list(sd), hf) == "native"
    derived = vision_map.vision_overrides_from_hf(hf)
    for key in (*vision_map.ARCH_KEYS, "vision_mlp_activation", "vision_norm_eps", "vision_pos_emb_time",
                "vision_pos_interp", "vision_projector_eps"):
        assert derived[key] == getattr(cfg.vision, key), key
    got, used = {}, []
    for path, index, names, to_ours, _ in vision_map.vision_rules(cfg.vision, "native"):
        used += names
        val = to_ours(*(sd[n] for n in names))
        if index:
            got.setdefault(path, {})[index[0]] = val
        else:
            got[path] = val
    got = {k: np.stack([v[i] for i in sorted(v)]) if isinstance(v, dict) else v for k, v in got.items()}
    assert sorted(used) == sorted(n for n in sd if vision_map.is_vision_name(n))
    want = k3jax_params(sd, cfg.vision)
    assert set(got) == set(want)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=str(k))


def test_asset_records_its_making():
    meta = json.loads((ASSET / "meta.json").read_text())
    assert meta["model_class"] == "Kimi_K25ForConditionalGeneration"
    assert meta["transformers_version"] == "5.25.0" and meta["reload_vs_forward_max_abs_diff"] == 0.0
    g = np.load(ASSET / "golden.npz")
    assert [list(r) for r in g["grid_thw"]] == meta["grid_thw"]
    assert sorted({int(t) for t, _, _ in g["grid_thw"]}) == [1, 4]   # images and a video chunk


def rel_rms(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.sqrt(np.mean((a - b) ** 2) / np.mean(b ** 2)))


def test_full_logits_of_the_converted_model_match_transformers(tmp_path):
    """hf_to_k3jax on transformers' own save (text and tower), restored with the tower, on the
    golden prompt: image A's 15 pads, the video chunk's 6, image B's 12 (transformers fills image
    pads with the images in order and video pads with the video). Full logits within 1e-4
    relative RMS; the same features spliced with the video's and image B's rows swapped are far off."""
    from conversion.hf_to_k3jax import convert
    from k3jax.sharding import make_mesh
    from k3jax.state import restore_model
    from k3jax.data.media_layout import DROP
    convert(str(ASSET), str(tmp_path / "ckpt"), progress=False)
    cfg = C.load(C.REPO_CONFIGS / "base.yml", [f"model_name={tmp_path / 'ckpt' / 'model.yml'}",
                                               f"load_parameters_path={tmp_path / 'ckpt'}", "weight_dtype=float32",
                                               "dtype=float32", "vision_attention_block=64"])
    mesh = make_mesh(cfg, devices=jax.devices()[:1])
    model = restore_model(cfg, mesh)
    g = dict(np.load(ASSET / "golden.npz"))
    ids = g["input_ids"].astype(np.int32)
    lay = media_layout(cfg.vision, g["grid_thw"], *BUCKET)
    n = lay["real_patches"]
    x = np.zeros((BUCKET[0], g["pixel_values"][0].size), np.float32)
    x[:n] = g["pixel_values"].reshape(n, -1)
    hf = json.loads((ASSET / "config.json").read_text())
    flat = ids.reshape(-1)
    image, video = np.flatnonzero(flat == hf["image_token_id"]), np.flatnonzero(flat == hf["video_token_id"])
    assert (len(image), len(video)) == (15 + 12, 6)

    def logits(order):
        slots = np.full(BUCKET[1], DROP, np.int32)
        slots[:len(order)] = order
        media = layout_arrays(lay) | {"patches": jnp.asarray(x), "slots": jnp.asarray(slots)}
        with jax.set_mesh(mesh):
            return np.asarray(_forward(model, jnp.asarray(ids), media))

    err = rel_rms(logits(np.concatenate([image, video])), g["logits"])
    print(f"full logits: relative RMS {err:.2e}")
    assert err <= 1e-4
    swapped = np.concatenate([image[:15], video, image[15:]])   # packed rows B, video land on each other's pads
    assert rel_rms(logits(swapped), g["logits"]) > 1e-2


_forward = nnx.jit(lambda m, t, media: m(t, media=media)[0])
