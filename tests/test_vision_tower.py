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
from k3jax import sharding as S
from k3jax.schema import ConfigError
from k3jax.vision import build_vision, encode_media, layout_arrays
from k3jax.data.media_layout import media_layout
from k3jax.vision.tower import merge_patches
from k3jax.vision.attention import blocked_segment_attention, splash_segment_attention
from k3jax.data.media_layout import resample_taps

BASE = C.REPO_CONFIGS / "base.yml"
TINY = ["vision_enabled=true", "hidden_size=48", "vision_attention_block=32"]
K25 = TINY + ["vision_hidden_size=32", "vision_num_heads=2", "vision_head_dim=16", "vision_mlp_dim=64"]
K3 = TINY + ["vision_hidden_size=32", "vision_num_heads=3", "vision_head_dim=16", "vision_mlp_dim=48",
             "vision_norm=rmsnorm", "vision_norm_eps=1.1920929e-7", "vision_patch_bias=false",
             "vision_attn_bias=false", "vision_mlp_bias=false", "vision_pos_interp=bilinear",
             "vision_projector=patchmergerv2", "vision_pos_emb_height=6", "vision_pos_emb_width=10"]
# Down- and upsampling of the 8x8 (6x10) table, non-square grids, 3- and 4-frame video chunks for K2.5.
GRIDS = {"k25": [(1, 2, 2), (1, 4, 6), (3, 2, 4), (1, 10, 2), (4, 2, 2)], "k3": [(1, 4, 2), (1, 2, 12), (1, 8, 8)]}
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
    enc = nnx.eval_shape(lambda: build_vision(cfg, 0))    # shapes only: randomize fills every parameter
    randomize(enc, seed)
    grid = GRIDS[name]
    n = sum(t * h * w for t, h, w in grid)
    pixels = np.random.default_rng(seed + 1).uniform(-1, 1, (n, 3, 14, 14))
    return cfg, enc, grid, pixels


@nnx.jit
def _parts(enc, patches, arrays):
    tower = enc.vision_tower
    emb = tower.patch_embed(patches, arrays["pos_index"], arrays["pos_weight"], arrays["frames"])
    hidden, layers = tower(patches, arrays, per_layer=True)
    merged = merge_patches(hidden, arrays)
    return emb, hidden, layers, merged, enc.mm_projector(merged)


def run_parts(name, seed=0):
    """Per part (JAX, reference) arrays, the padding dropped."""
    cfg, enc, grid, pixels = setup(name, seed)
    vc = cfg.vision
    lay = media_layout(vc, grid, *BUCKET[name], max_frames=1 if name == "k3" else None)   # K3: images only
    npad, n, m = len(lay["segment_ids"]), lay["real_patches"], lay["real_tokens"]
    x = np.zeros((npad, pixels[0].size), np.float32)
    x[:n] = pixels.reshape(n, -1)
    arrays = layout_arrays(lay)
    emb, hidden, layers, merged, feats = _parts(enc, jnp.asarray(x), arrays)
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
    """Changing one media item's pixels leaves the other media's features bit-identical, a media
    item encoded alone (the rest of the bucket padding) equals its slice of the packed batch, and
    other grids fitting the same buckets reuse the compiled program."""
    cfg, enc, grid, pixels = setup("k25")
    vc = cfg.vision
    sizes = [t * h * w for t, h, w in grid]
    toks = [h // 2 * (w // 2) for _, h, w in grid]
    starts, tstarts = np.cumsum([0] + sizes), np.cumsum([0] + toks)
    bucket = dict(num_patches=BUCKET["k25"][0], num_tokens=BUCKET["k25"][1])
    base = np.asarray(encode_media(enc, pixels, grid, **bucket))[:tstarts[-1]]
    other = pixels.copy()
    other[starts[1]:starts[2]] = np.random.default_rng(7).uniform(-1, 1, other[starts[1]:starts[2]].shape)
    changed = np.asarray(encode_media(enc, other, grid, **bucket))[:tstarts[-1]]
    same = np.r_[tstarts[0]:tstarts[1], tstarts[2]:tstarts[-1]]
    np.testing.assert_array_equal(changed[same], base[same])
    assert np.abs(changed[tstarts[1]:tstarts[2]] - base[tstarts[1]:tstarts[2]]).max() > 1e-2
    alone = np.asarray(encode_media(enc, pixels[starts[2]:starts[3]], [grid[2]], **bucket))[:toks[2]]
    np.testing.assert_allclose(alone, base[tstarts[2]:tstarts[3]], rtol=0, atol=1e-5 * np.abs(base).max())
    # other grids in the same buckets run the compiled program again: nothing is traced or compiled
    events = []
    listener = lambda name, *a, **kw: events.append(name) if ("compile" in name or "trace" in name) else None  # noqa: E731
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        other_grid = [(1, 2, 6), (2, 4, 4), (1, 8, 2)]
        n_other = sum(t * h * w for t, h, w in other_grid)
        encode_media(enc, pixels[:n_other], other_grid, **bucket)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert not events, events
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
    if name == "k3":   # the rematerialised blocks (the training path) give the same gradients
        def loss_remat(params):
            out = nnx.merge(gdef, params, rest)(x, arrays, remat=True)
            return jnp.sum(out * jnp.asarray(R, jnp.float32))
        for p, v in nnx.to_flat_state(jax.jit(jax.grad(loss_remat))(params)):
            np.testing.assert_allclose(v.get_value(), grads[".".join(map(str, p))], rtol=1e-5, atol=1e-6)
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
    blocked path's output and q/k/v gradients on two packed segments and a padding segment, head
    dim 72 (padded to 128 inside)."""
    rng = np.random.default_rng(0)
    n, h, dh = 200, 2, 72
    q, k, v = (jnp.asarray(rng.standard_normal((n, h, dh)), jnp.float32) for _ in range(3))
    seg = jnp.asarray(np.r_[np.full(70, 1), np.full(110, 2), np.zeros(20)], jnp.int32)
    cot = jnp.asarray(rng.standard_normal((n, h, dh)), jnp.float32).at[180:].set(0)   # padding rows dropped

    def run(fn):
        o, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, seg, scale=dh ** -0.5), q, k, v)
        return [np.asarray(o)[:180]] + [np.asarray(g) for g in vjp(cot)]

    want = run(lambda *a, **kw: blocked_segment_attention(*a, block=64, **kw))
    got = run(lambda *a, **kw: splash_segment_attention(*a, interpret=True, **kw))
    for name, g, w in zip(("o", "dq", "dk", "dv"), got, want):
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-5, err_msg=name)


def test_position_add_dtype_switch():
    """vision_pos_add_dtype (vision.md §11.6): in float32 both settings are one program; in
    bfloat16, float32 (the sum rounded once) lands closer to the float32 result than compute (the
    position term rounded to bf16 before the bf16 add), and the two differ."""
    x = np.random.default_rng(0).uniform(-1, 1, (64, 588))
    outs = {}
    for dtype in ("float32", "bfloat16"):
        for mode in ("float32", "compute"):
            cfg = C.load(BASE, K3 + [f"vision_pos_add_dtype={mode}", f"dtype={dtype}"])
            enc = nnx.eval_shape(lambda cfg=cfg: build_vision(cfg, 0))
            randomize(enc, 0)
            lay = layout_arrays(media_layout(cfg.vision, [(1, 8, 8)]))
            out = nnx.jit(lambda pe, x, a: pe(x, a["pos_index"], a["pos_weight"], a["frames"]))(
                enc.vision_tower.patch_embed, jnp.asarray(x, jnp.dtype(dtype)), lay)
            outs[dtype, mode] = np.asarray(out, np.float32)
    np.testing.assert_array_equal(outs["float32", "float32"], outs["float32", "compute"])
    err = {m: np.abs(outs["bfloat16", m] - outs["float32", "float32"]).mean() for m in ("float32", "compute")}
    assert err["float32"] < err["compute"] and np.abs(outs["bfloat16", "float32"] - outs["bfloat16", "compute"]).max() > 0, err


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
        mesh = S.make_mesh(C.override(cfg, {"ici_fsdp_parallelism": 4, "ici_tensor_parallelism": 2}))
        for path, v in nnx.to_flat_state(nnx.state(enc)):
            sh = S.param_sharding(mesh, v.shape, v.get_metadata()["axes"])
            if v.get_metadata()["matrix"] is not None or path[-1] == "pos_emb":   # not the vectors
                assert sh.num_devices == 8 and sh.shard_shape(v.shape) != v.shape, (path, sh)
    assert not C.load(BASE, ["model_name=kimi-k3"]).vision.vision_enabled
    tiny = C.load(BASE, K3)
    st = {".".join(map(str, p)): np.asarray(v.get_value())
          for p, v in nnx.to_flat_state(jax.jit(lambda: nnx.state(build_vision(tiny, 0)))())}
    assert np.all(st["vision_tower.blocks.norm0.weight"] == 1) and np.all(st["mm_projector.post_norm.weight"] == 1)
    assert abs(st["vision_tower.blocks.wqkv"].std() / tiny.model.initializer_range - 1) < 0.05
