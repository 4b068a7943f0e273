"""The MoonViT3d tower and both projectors (k3jax.vision) against the independent float64 numpy
reference tests/vision_numpy_ref.py, with K2.5's switches (LayerNorm + biases, bicubic table,
patchmerger, a video chunk) and K3's (RMSNorm at fp32 eps, qkv width != width, no biases,
bilinear, patchmergerv2); media of different grids packed in one padded sequence."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import vision_numpy_ref as ref
from k3jax import config as C
from k3jax.schema import ConfigError
from k3jax.vision import build_vision, encode_media, layout_arrays, media_layout, merge_patches
from k3jax.vision.attention import blocked_segment_attention, splash_segment_attention
from k3jax.vision.layout import resample_taps

BASE = C.REPO_CONFIGS / "base.yml"
TINY = ["vision_enabled=true", "hidden_size=48", "vision_attention_block=32"]
K25 = TINY + ["vision_hidden_size=32", "vision_num_heads=2", "vision_head_dim=16", "vision_mlp_dim=64"]
K3 = TINY + ["vision_hidden_size=32", "vision_num_heads=3", "vision_head_dim=16", "vision_mlp_dim=48",
             "vision_norm=rmsnorm", "vision_norm_eps=1.1920929e-7", "vision_patch_bias=false",
             "vision_attn_bias=false", "vision_mlp_bias=false", "vision_pos_interp=bilinear",
             "vision_projector=patchmergerv2", "vision_pos_emb_height=6", "vision_pos_emb_width=10"]
# Down- and upsampling of the 8x8 (6x10) table, non-square grids, a 3-frame video chunk for K2.5.
GRIDS = {"k25": [(1, 2, 2), (1, 4, 6), (3, 2, 4), (1, 10, 2)], "k3": [(1, 4, 2), (1, 2, 12), (1, 8, 8)]}
SETS = {"k25": K25, "k3": K3}
BUCKET = {"k25": (96, 24), "k3": (112, 32)}       # patches / tokens, both above the real counts


def randomize(enc, seed):
    """Every parameter random (norm weights and biases included) at scales that keep the tower's
    activations O(1); the position table ~N(0, 1) as in vision.md §10."""
    rng = np.random.default_rng(seed)
    state = nnx.state(enc, nnx.Param)
    for path, v in nnx.to_flat_state(state):
        name, shape = ".".join(map(str, path)), v.shape
        if name.endswith("pos_emb"):
            val = rng.standard_normal(shape)
        elif "norm" in name and name.endswith("weight"):
            val = 1 + 0.2 * rng.standard_normal(shape)
        elif v.get_metadata().get("matrix") is not None:
            val = rng.standard_normal(shape) / math.sqrt(shape[-2])
        else:
            val = 0.2 * rng.standard_normal(shape)
        v.set_value(jnp.asarray(val, v.get_value().dtype))
    nnx.update(enc, state)


def flat_params(enc):
    """k3jax name -> float64 array."""
    return {".".join(map(str, p)): np.asarray(v.get_value(), np.float64)
            for p, v in nnx.to_flat_state(nnx.state(enc, nnx.Param))}


def ckpt_params(st, vc):
    """Parameters (``flat_params``) in the released checkpoint's names and layout (vision.md §6)."""
    ps = vc.vision_patch_size
    out = {"vision_tower.patch_embed.proj.weight": st["vision_tower.patch_embed.proj"].T.reshape(-1, 3, ps, ps),
           "vision_tower.patch_embed.pos_emb.weight": st["vision_tower.patch_embed.pos_emb"]}
    names = {"norm0.weight": "norm0.weight", "norm0.bias": "norm0.bias", "norm1.weight": "norm1.weight",
             "norm1.bias": "norm1.bias", "wqkv.weight": "wqkv", "wqkv.bias": "wqkv_bias", "wo.weight": "wo",
             "wo.bias": "wo_bias", "mlp.fc0.weight": "fc0", "mlp.fc0.bias": "fc0_bias",
             "mlp.fc1.weight": "fc1", "mlp.fc1.bias": "fc1_bias"}
    for i in range(vc.vision_num_layers):
        for ck, mine in names.items():
            a = st.get(f"vision_tower.blocks.{mine}")
            if a is not None:
                out[f"vision_tower.encoder.blocks.{i}.{ck}"] = a[i].T if a[i].ndim == 2 else a[i]
    for ck, mine in {"vision_tower.patch_embed.proj.bias": "vision_tower.patch_embed.proj_bias",
                     "vision_tower.encoder.final_layernorm.weight": "vision_tower.final_layernorm.weight",
                     "vision_tower.encoder.final_layernorm.bias": "vision_tower.final_layernorm.bias",
                     "mm_projector.pre_norm.weight": "mm_projector.pre_norm.weight",
                     "mm_projector.pre_norm.bias": "mm_projector.pre_norm.bias",
                     "mm_projector.proj.0.weight": "mm_projector.proj0", "mm_projector.proj.0.bias":
                     "mm_projector.proj0_bias", "mm_projector.proj.2.weight": "mm_projector.proj2",
                     "mm_projector.proj.2.bias": "mm_projector.proj2_bias",
                     "mm_projector.post_norm.weight": "mm_projector.post_norm.weight"}.items():
        if mine in st:
            out[ck] = st[mine].T if st[mine].ndim == 2 else st[mine]
    return out


def setup(name, seed=0):
    cfg = C.load(BASE, SETS[name])
    enc = build_vision(cfg, 0)
    randomize(enc, seed)
    grid = GRIDS[name]
    n = sum(t * h * w for t, h, w in grid)
    pixels = np.random.default_rng(seed + 1).uniform(-1, 1, (n, 3, 14, 14))
    return cfg, enc, grid, pixels


@nnx.jit
def _parts(enc, patches, arrays):
    hidden, layers = enc.vision_tower(patches, arrays, per_layer=True)
    merged = merge_patches(hidden, arrays)
    return hidden, layers, merged, enc.mm_projector(merged)


def run_parts(name, seed=0):
    """Per part (JAX, reference) arrays, the padding dropped."""
    cfg, enc, grid, pixels = setup(name, seed)
    vc = cfg.vision
    lay = media_layout(vc, grid, *BUCKET[name])
    npad, n, m = len(lay["segment_ids"]), lay["real_patches"], lay["real_tokens"]
    x = np.zeros((npad, pixels[0].size), np.float32)
    x[:n] = pixels.reshape(n, -1)
    arrays = layout_arrays(lay)
    hidden, layers, merged, feats = _parts(enc, jnp.asarray(x), arrays)
    emb = enc.vision_tower.patch_embed(jnp.asarray(x), arrays["pos_index"], arrays["pos_weight"], arrays["frames"])
    p = ckpt_params(flat_params(enc), vc)
    r_out, r_layers = ref.tower(vc, p, pixels, grid, per_layer=True)
    r_merged = ref.merge(vc, r_out, grid)
    parts = {"patch + position embedding": (emb[:n], np.concatenate(r_layers[0]))}
    for i in range(vc.vision_num_layers):
        parts[f"block {i} output"] = (layers[i, :n], np.concatenate(r_layers[i + 1]))
    parts["final norm (hidden)"] = (hidden[:n], np.concatenate(r_out))
    parts["merged (sd2_tpool)"] = (merged[:m], r_merged)
    parts["projector output"] = (feats[:m], ref.projector(vc, p, r_merged))
    return parts


def errors(parts):
    """part -> (max abs error, max abs error / max |reference|)."""
    out = {}
    for k, (got, want) in parts.items():
        d = np.abs(np.asarray(got, np.float64) - want).max()
        out[k] = (d, d / np.abs(want).max())
    return out


@pytest.mark.parametrize("name", ["k25", "k3"])
def test_every_part_matches_the_float64_reference(name):
    errs = errors(run_parts(name))
    for part, (abs_err, rel) in errs.items():
        print(f"{name:4s} {part:28s} max abs {abs_err:.2e}  rel {rel:.2e}")
    bad = {k: e for k, e in errs.items() if not e[1] < 1e-5}
    assert not bad, bad


def test_media_do_not_attend_to_each_other_and_padding_is_inert():
    """Changing one media item's pixels leaves the other media's features bit-identical, and a
    media item encoded alone (no padding) equals its slice of the padded packed batch."""
    cfg, enc, grid, pixels = setup("k25")
    vc = cfg.vision
    sizes = [t * h * w for t, h, w in grid]
    toks = [h // 2 * (w // 2) for _, h, w in grid]
    starts, tstarts = np.cumsum([0] + sizes), np.cumsum([0] + toks)
    bucket = dict(num_patches=BUCKET["k25"][0], num_tokens=BUCKET["k25"][1])
    base = np.asarray(encode_media(enc, pixels, grid, **bucket))
    other = pixels.copy()
    other[starts[1]:starts[2]] = np.random.default_rng(7).uniform(-1, 1, other[starts[1]:starts[2]].shape)
    changed = np.asarray(encode_media(enc, other, grid, **bucket))
    same = np.r_[tstarts[0]:tstarts[1], tstarts[2]:tstarts[-1]]
    np.testing.assert_array_equal(changed[same], base[same])
    assert np.abs(changed[tstarts[1]:tstarts[2]] - base[tstarts[1]:tstarts[2]]).max() > 1e-2
    alone = np.asarray(encode_media(enc, pixels[starts[2]:starts[3]], [grid[2]]))
    np.testing.assert_allclose(alone, base[tstarts[2]:tstarts[3]], rtol=0, atol=1e-5 * np.abs(base).max())
    with pytest.raises(ValueError, match="grid_thw .* is impossible"):
        media_layout(vc, [(1, 3, 4)])
    with pytest.raises(ValueError, match="buckets hold"):
        media_layout(vc, grid, 16, 4)


@pytest.mark.parametrize("name", ["k25", "k3"])
def test_gradients_match_finite_differences_of_the_reference(name):
    """<dL/dθ, V> of L = sum(features * R) for the position table, patch projection, every block's
    wqkv and first norm, the MLP input bias (K2.5) and the projector's weights and norm, against a
    central difference of the float64 reference along the same random direction V."""
    cfg, enc, grid, pixels = setup(name)
    vc = cfg.vision
    lay = media_layout(vc, grid)
    arrays = layout_arrays(lay)
    x = jnp.asarray(pixels.reshape(len(pixels), -1), jnp.float32)
    st = flat_params(enc)
    feats_ref = ref.forward(vc, ckpt_params(st, vc), pixels, grid)["features"]
    R = np.random.default_rng(3).standard_normal(feats_ref.shape)
    gdef, params, rest = nnx.split(enc, nnx.Param, ...)

    def loss(params):
        return jnp.sum(nnx.merge(gdef, params, rest)(x, arrays) * jnp.asarray(R, jnp.float32))

    grads = {".".join(map(str, p)): np.asarray(v.get_value(), np.float64)
             for p, v in nnx.to_flat_state(jax.jit(jax.grad(loss))(params))}
    checks = ["vision_tower.patch_embed.pos_emb", "vision_tower.patch_embed.proj", "vision_tower.blocks.wqkv",
              "vision_tower.blocks.norm0.weight", "mm_projector.proj0"]
    checks += (["vision_tower.blocks.fc0_bias", "mm_projector.pre_norm.weight"] if name == "k25"
               else ["mm_projector.post_norm.weight"])
    rng = np.random.default_rng(4)
    for mine in checks:
        direction = rng.standard_normal(grads[mine].shape)
        want_dir = float(np.sum(grads[mine] * direction))
        eps = 1e-4

        def shifted(s, mine=mine, direction=direction):
            return ref.forward(vc, ckpt_params({**st, mine: st[mine] + s * direction}, vc), pixels, grid)["features"]

        fd = float(np.sum((shifted(eps) - shifted(-eps)) * R) / (2 * eps))
        gnorm = float(np.sqrt(np.sum(grads[mine] ** 2)))
        print(f"{name} {mine:34s} <g,V> {want_dir:+.6e}  fd {fd:+.6e}  |g| {gnorm:.3e}  diff {abs(want_dir - fd):.1e}")
        # <error, V> ~ N(0, |error|^2): the bound catches a gradient wrong by 1e-4 of its norm
        assert abs(want_dir - fd) <= 1e-4 * (abs(fd) + gnorm), (mine, want_dir, fd, gnorm)


@pytest.mark.parametrize("mode,n,src", [("bilinear", 3, 8), ("bilinear", 20, 8), ("bicubic", 5, 8),
                                        ("bicubic", 13, 8), ("bicubic", 8, 8), ("bilinear", 64, 64)])
def test_resample_taps_equal_the_reference_matrix(mode, n, src):
    idx, w = resample_taps(n, src, mode)
    A = np.zeros((n, src))
    np.add.at(A, (np.repeat(np.arange(n), idx.shape[1]), idx.ravel()), w.ravel())
    np.testing.assert_allclose(A, ref.resample_matrix(n, src, mode), atol=1e-14)
    if n == src:
        np.testing.assert_allclose(A, np.eye(n), atol=1e-14)


def test_splash_path_equals_blocked_in_the_interpreter():
    """vision_attention_impl=splash (the TPU kernel, run here by the Pallas interpreter) gives the
    blocked path's output on two packed segments and a padding segment, head dim 72 (padded to 128)."""
    rng = np.random.default_rng(0)
    n, h, dh = 200, 2, 72
    q, k, v = (jnp.asarray(rng.standard_normal((n, h, dh)), jnp.float32) for _ in range(3))
    seg = jnp.asarray(np.r_[np.full(70, 1), np.full(110, 2), np.zeros(20)], jnp.int32)
    want = blocked_segment_attention(q, k, v, seg, scale=dh ** -0.5, block=64)
    got = splash_segment_attention(q, k, v, seg, scale=dh ** -0.5, interpret=True)
    np.testing.assert_allclose(np.asarray(got)[:180], np.asarray(want)[:180], rtol=0, atol=2e-5)


@pytest.mark.parametrize("args,fragment", [
    (["vision_head_dim=18"], "multiple of 4"),
    (["vision_hidden_size=33"], "must be even"),
    (["vision_num_layers=0"], "vision_num_layers=0: must be positive"),
    (["vision_norm_eps=0"], "vision_norm_eps=0.0: must be positive"),
])
def test_impossible_vision_configs_are_one_line_errors(args, fragment):
    with pytest.raises(ConfigError, match=fragment):
        C.load(BASE, ["vision_enabled=true"] + args)
    C.load(BASE, args)   # with the tower off the same values are not checked


def test_released_configs_have_the_documented_tower_sizes():
    """kimi-k3-vl's tower + projector is 401.2M + 46.1M parameters, kimi-k25's 416.9M + 54.3M (vision.md §0)."""
    for name, (tower, proj) in {"kimi-k3-vl": (401.2e6, 46.1e6), "kimi-k25": (416.9e6, 54.3e6)}.items():
        cfg = C.load(BASE, [f"model_name={name}"])
        enc = nnx.eval_shape(lambda cfg=cfg: build_vision(cfg, 0))
        sizes = {k: sum(math.prod(v.shape) for v in jax.tree.leaves(nnx.state(getattr(enc, k))))
                 for k in ("vision_tower", "mm_projector")}
        assert abs(sizes["vision_tower"] - tower) < 0.05e6 and abs(sizes["mm_projector"] - proj) < 0.05e6, (name, sizes)
    assert not C.load(BASE, ["model_name=kimi-k3"]).vision.vision_enabled
