"""Training the vision side: the `vision` / `projector` freeze groups (the text groups never reach
params["vision"]), the optimizer groups of the tower's weights (Muon for matrices, AdamW for the
rest, as for text), the vision FLOPs of counts.py against the released parameter counts and XLA's
cost analysis, grouped media (one packed sequence per batch row, as the pod compile feeds them)
against the flat packing, and one train step with the tower frozen."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax import compile as K
from k3jax import config as C
from k3jax import counts
from k3jax import model as M
from k3jax.layers.common import REST
from k3jax.data.media import pad_grouped
from k3jax.data.media_layout import DROP
from k3jax.vision.splice import slot_loss_mask, splice
from k3jax.optim.muon import frozen_mask, make_optimizer, param_labels
from k3jax.optim.muon import FREEZE_GROUPS, variables_by_path
from k3jax.state import abstract_state
from k3jax.step import make_train_step
from k3jax.vision import build_vision, layout_arrays
from k3jax.data.media_layout import media_layout

# one MLA layer and a dense FFN (as tests/test_vision_model.py): the vision side is what is tested
TEXT = ["model_name=tiny", "vocab_size=256", "num_layers=1", "mla_extra_layers=[0]", "first_k_dense=1",
        "attn_res=false", "max_target_length=32", "per_device_batch_size=1"]
VISION = TEXT + ["vision_enabled=true", "vision_attention_block=16"]
STEP = ["opt_type=adamw", "lr_schedule=constant", "learning_rate=0.01", "warmup_steps_fraction=0",
        "adam_weight_decay=0", "remat_policy=none", "use_qk_clip=false"]
TEXT_GROUPS = sorted(set(FREEZE_GROUPS) - {"vision", "projector"})


def load(*extra):
    return C.load(C.REPO_CONFIGS / "base.yml", [*VISION, *extra])


def part(path) -> str:
    return "text" if path[0] != "vision" else {"vision_tower": "vision", "mm_projector": "projector"}[path[1]]


def test_freeze_groups_split_tower_projector_and_text():
    cfg = load()
    params = abstract_state(cfg)[1]["params"]
    paths = variables_by_path(params)
    parts = {p: part(p) for p in paths}
    assert {"vision", "projector", "text"} == set(parts.values())
    for group in ("vision", "projector"):
        mask = dict(zip(paths, jax.tree.leaves(frozen_mask(params, [group]))))
        assert {p for p, f in mask.items() if f} == {p for p, w in parts.items() if w == group}, group
    for group in TEXT_GROUPS:   # norms, embed, attention, ...: text leaves only
        mask = dict(zip(paths, jax.tree.leaves(frozen_mask(params, [group]))))
        assert not [p for p, f in mask.items() if f and parts[p] != "text"], group
    norms = dict(zip(paths, jax.tree.leaves(frozen_mask(params, ["norms"]))))
    assert norms[("norm", "weight")] and not norms[("vision", "vision_tower", "final_layernorm", "weight")]


def test_vision_weights_take_the_text_optimizer_rule():
    """Muon for the 2-D matrices (per stacked block), AdamW for the position table, norms and biases;
    frozen groups are labelled frozen; opt_type=adamw sends everything to AdamW."""
    cfg = C.override(load(), {"opt_type": "muon", "freeze": ["projector"]})
    params = abstract_state(cfg)[1]["params"]
    labels = {p: l for p, l in param_labels(params, cfg.train).items() if p[0] == "vision"}
    muon = {p[1:] for p, l in labels.items() if l == "muon"}
    assert muon == {("vision_tower", "patch_embed", "proj")} | {("vision_tower", "blocks", w)
                                                                 for w in ("wqkv", "wo", "fc0", "fc1")}
    assert {p[1] for p, l in labels.items() if l == "frozen"} == {"mm_projector"}
    assert labels[("vision", "vision_tower", "patch_embed", "pos_emb")] == "adam"
    assert labels[("vision", "vision_tower", "blocks", "wqkv_bias")] == "adam"
    cfg = C.override(cfg, {"opt_type": "adamw", "freeze": []})
    assert set(param_labels(params, cfg.train).values()) == {"adam"}


def test_vision_freeze_needs_a_vision_model():
    with pytest.raises(C.ConfigError, match=r"freeze the vision side but vision_enabled=false"):
        C.load(C.REPO_CONFIGS / "base.yml", [*TEXT, "freeze=[vision]"])
    with pytest.raises(C.ConfigError, match=r"compile_images_per_sequence=2 needs a vision model"):
        C.load(C.REPO_CONFIGS / "base.yml", [*TEXT, "compile_images_per_sequence=2"])


@pytest.mark.parametrize("name,tower_m,proj_m", [("kimi-k3-vl", 401.2, 46.1), ("kimi-k25", 416.9, 54.3)])
def test_vision_param_counts_match_the_built_tower(name, tower_m, proj_m):
    """counts.vision_params equals the built (abstract) tower and projector leaf for leaf, and the
    released sizes of docs/vision.md section 0."""
    cfg = C.load(C.REPO_CONFIGS / "base.yml", [f"model_name={name}"])
    enc = nnx.eval_shape(lambda: build_vision(cfg, nnx.Rngs(0)))
    size = lambda m: sum(int(np.prod(v.shape)) for v in jax.tree.leaves(nnx.state(m, nnx.Param)))  # noqa: E731
    tower, proj = counts.vision_params(cfg.vision, cfg.model.hidden_size)
    assert (tower, proj) == (size(enc.vision_tower), size(enc.mm_projector))
    assert (round(tower / 1e6, 1), round(proj / 1e6, 1)) == (tower_m, proj_m)


def test_vision_flops_match_xla_and_count_frozen_parts_once():
    """Forward FLOPs of one 8x8 image within 10% of XLA's count (one block and one attention block,
    so XLA's loop-body-once counting sees all the work), and the train-step weights of a trained,
    a frozen and a half-frozen vision side."""
    cfg = load("vision_hidden_size=128", "vision_num_heads=2", "vision_head_dim=64", "vision_mlp_dim=256",
               "vision_num_layers=1", "vision_attention_block=64", "hidden_size=64")
    grid = [(1, 8, 8)]
    enc = nnx.eval_shape(lambda: build_vision(cfg, nnx.Rngs(0)))
    gdef, st = nnx.split(enc)
    st = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), st)
    lay = layout_arrays(media_layout(cfg.vision, np.asarray(grid), 64, 16, max_frames=1))
    x = jax.ShapeDtypeStruct((64, 3 * 14 * 14), jnp.float32)
    compiled = jax.jit(lambda st, x, lay: nnx.merge(gdef, st)(x, lay)).lower(st, x, lay).compile()
    xla = K.cost_report(compiled)["flops"]
    tower, proj = counts.vision_forward_flops(cfg.vision, cfg.model.hidden_size, grid)
    assert abs(xla / (tower + proj) - 1) < 0.10, (xla, tower, proj)
    v, d = cfg.vision, cfg.model.hidden_size
    assert counts.vision_train_flops(v, d, grid) == pytest.approx(3 * (tower + proj))
    assert counts.vision_train_flops(v, d, grid, ["vision", "projector"]) == pytest.approx(tower + proj)
    assert counts.vision_train_flops(v, d, grid, ["vision"]) == pytest.approx(tower + 3 * proj)
    assert counts.vision_train_flops(v, d, grid, ["projector"]) == pytest.approx(3 * tower + 2 * proj)


def test_compile_media_plan_for_k3_vl():
    """Two 1024x1024 images per 4,096-token row of kimi-k3-vl: 74x74 patches each (1024 px padded to
    1036 = 37 x 28), 2 x 1369 tokens; the abstract batch holds them grouped per row."""
    cfg = C.load(C.REPO_CONFIGS / "base.yml", ["model_name=kimi-k3-vl", "max_target_length=4096",
                                               "compile_images_per_sequence=2", "vision_patch_buckets=[10952]"])
    plan = K.media_plan(cfg)
    assert plan["grids"] == [(1, 74, 74)] * 2 and plan["patches"] == 10952 and plan["tokens"] == 2738
    assert plan["bucket"] == 10952 and plan["arrays"]["merge_index"].shape == (2738, 4, 1)
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1, 1, 1, 1), C.MESH_AXES)
    media = K.abstract_batch(cfg, mesh, 2)["media"]
    assert media["patches"].shape == (2, 10952, 588) and media["slots"].shape == (2, 2738)
    assert "media" not in K.abstract_batch(C.override(cfg, {"compile_images_per_sequence": 0}), mesh, 2)
    with pytest.raises(C.ConfigError, match="not fewer than max_target_length=2048"):
        K.media_plan(C.override(cfg, {"max_target_length": 2048}))


def grouped_media(cfg, rows: int, t: int, bucket: int = 16):
    """Row r holds one 28 x 28 image (2 x 2 patches, one merged token) at position 3 + r: the grouped
    arrays [rows, ...] (slots: columns within the row) and the same media packed flat into one
    sequence (slots: flat positions)."""
    rng = np.random.default_rng(0)
    patches = rng.normal(size=(rows, 4, 3 * 14 * 14)).astype(np.float32)
    m = bucket // 4
    groups = []
    for r in range(rows):
        lay = layout_arrays(media_layout(cfg.vision, np.asarray([(1, 2, 2)]), bucket, m, max_frames=1))
        slots = np.full(m, DROP, np.int32)
        slots[0] = 3 + r
        groups.append(lay | {"patches": jnp.asarray(np.pad(patches[r], ((0, bucket - 4), (0, 0)))),
                             "slots": jnp.asarray(slots)})
    grouped = jax.tree.map(lambda *xs: jnp.stack(xs), *groups)
    flat = layout_arrays(media_layout(cfg.vision, np.asarray([(1, 2, 2)] * rows), bucket * rows, m * rows,
                                      max_frames=1))
    slots = np.full(m * rows, DROP, np.int32)
    slots[:rows] = [r * t + 3 + r for r in range(rows)]
    flat |= {"patches": jnp.asarray(np.pad(patches.reshape(-1, patches.shape[-1]), ((0, (bucket - 4) * rows), (0, 0)))),
             "slots": jnp.asarray(slots)}
    return grouped, flat


def test_grouped_media_equal_the_flat_packing_and_a_frozen_tower_stays_put():
    """Media grouped per row ([G, N, ...], VisionEncoder's pod layout) give the flat packing's
    features and splice; one train step with freeze=[vision] leaves every tower leaf bitwise
    unchanged while the projector and the text model move."""
    cfg = load(*STEP, "freeze=[vision]")
    model = M.build(cfg, 0)
    b, t = 2, cfg.train.max_target_length
    grouped, flat = grouped_media(cfg, b, t)
    enc = jax.jit(lambda v, x, lay: v(x, lay))
    fg, ff = enc(model.vision, grouped["patches"], grouped), enc(model.vision, flat["patches"], flat)
    assert fg.shape[0] == b
    np.testing.assert_allclose(np.asarray(fg)[:, 0], np.asarray(ff)[:b], rtol=1e-5, atol=1e-6)
    from k3jax.sharding import make_mesh
    mesh = make_mesh(C.override(cfg, {"ici_fsdp_parallelism": 2}), devices=jax.devices()[:2])
    with jax.set_mesh(mesh):   # on a mesh the groups are split over the batch axes (shard_map)
        fm = enc(model.vision, grouped["patches"], grouped)
        assert "shard_map" in str(jax.make_jaxpr(lambda v, x, lay: v(x, lay))(model.vision, grouped["patches"], grouped))
    np.testing.assert_allclose(np.asarray(fm), np.asarray(fg), rtol=1e-5, atol=1e-6)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(b, t, cfg.model.hidden_size)), jnp.float32)
    # The splice places the same rows at the same positions: bit for bit when both layouts carry the same
    # feature values (the two tower programs agree to the tolerance above, not to the last bit on every
    # CPU: this host's XLA:CPU differs by up to 7.5e-9 between the grouped and the flat program).
    same = ff.at[:b].set(fg[:, 0])
    np.testing.assert_array_equal(np.asarray(splice(x, fg, grouped["slots"])), np.asarray(splice(x, same, flat["slots"])))
    ones = jnp.ones((b, t), jnp.float32)
    lm = np.asarray(slot_loss_mask(ones, grouped["slots"]))
    np.testing.assert_array_equal(lm, np.asarray(slot_loss_mask(ones, flat["slots"])))
    assert (lm == 0).sum() == b and lm[1, 3] == 0           # the target of position 3 is row 1's pad
    # padded to a larger bucket (what processes agree on): the same rows spliced in
    big = pad_grouped(jax.tree.map(np.asarray, grouped), 2, 64, 1)
    assert big["patches"].shape == (b, 64, 588) and big["slots"].shape == (b, 16) and (big["slots"][:, 4:] == DROP).all()
    fb = enc(model.vision, jnp.asarray(big["patches"]), jax.tree.map(jnp.asarray, big))
    np.testing.assert_allclose(np.asarray(splice(x, fb, big["slots"])), np.asarray(splice(x, fg, grouped["slots"])),
                               rtol=1e-5, atol=1e-6)

    toks = np.random.default_rng(2).integers(3, 200, (b, t)).astype(np.int32)
    batch = {"tokens": toks, "targets": np.roll(toks, -1, 1), "segment_ids": np.ones((b, t), np.int32),
             "positions": np.broadcast_to(np.arange(t), (b, t)).astype(np.int32),
             "loss_mask": np.ones((b, t), np.float32)}
    batch = {k: jnp.asarray(v) for k, v in batch.items()} | {"media": grouped}
    gdef, params, rest = nnx.split(model, nnx.Param, REST)
    tx = make_optimizer(cfg.train, params)
    before = jax.tree.map(np.asarray, nnx.to_pure_dict(params))
    state = {"params": params, "opt_state": jax.jit(tx.init)(params), "rest": rest}
    new, metrics = jax.jit(make_train_step(cfg, gdef, tx))(state, batch)
    assert np.isfinite(float(metrics["loss"]))
    # grouped media split into micro-batches with their rows: the same update as one batch
    acc_cfg = C.override(cfg, {"gradient_accumulation_steps": 2})
    state2 = {"params": params, "opt_state": jax.jit(tx.init)(params), "rest": rest}
    new2, m2 = jax.jit(make_train_step(acc_cfg, gdef, tx))(state2, batch)
    for k in ("loss", "grad_norm"):
        np.testing.assert_allclose(float(m2[k]), float(metrics[k]), rtol=2e-6)
    assert float(m2["loss_tokens"]) == float(metrics["loss_tokens"])
    swapped = batch | {"media": jax.tree.map(lambda a: a[::-1], grouped)}    # each row given the other's image
    _, m3 = jax.jit(make_train_step(cfg, gdef, tx))(state, swapped)
    assert abs(float(m3["loss"]) - float(metrics["loss"])) > 1e-4 * float(metrics["loss"]), (m3["loss"], metrics["loss"])
    after = nnx.to_pure_dict(new["params"])
    moved = jax.tree.map(lambda a, c: bool(np.any(np.asarray(c) != a)), before, after)
    flat_moved = {tuple(getattr(k, "key", k) for k in kp): v for kp, v in jax.tree_util.tree_flatten_with_path(moved)[0]}
    tower = [p for p, v in flat_moved.items() if p[:2] == ("vision", "vision_tower")]
    assert tower and not [p for p in tower if flat_moved[p]]
    assert all(v for p, v in flat_moved.items() if p[:2] == ("vision", "mm_projector"))
    assert any(v for p, v in flat_moved.items() if p[0] != "vision")


def test_replicated_tower_keeps_text_shardings():
    """vision_param_sharding=replicated: every tower and projector leaf whole on each device, the
    text leaves as sharded as before; sharded (the default) splits the tower's matrices."""
    from k3jax.sharding import make_mesh
    cfg = load("ici_fsdp_parallelism=8")
    mesh = make_mesh(cfg)

    def specs(c):
        return {p: v.get_value().sharding.spec for p, v in variables_by_path(abstract_state(c, mesh)[1]["params"]).items()}
    sharded, replicated = specs(cfg), specs(C.override(cfg, {"vision_param_sharding": "replicated"}))
    assert sharded[("vision", "vision_tower", "blocks", "wqkv")] != jax.sharding.PartitionSpec()
    for p, s in replicated.items():
        assert s == (jax.sharding.PartitionSpec() if p[0] == "vision" else sharded[p]), p
