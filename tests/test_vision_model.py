"""Media spliced into the text model (k3jax.data.media, k3jax.vision.splice, K3Model.embed_media): the chat template's
media expansion, the splice itself, a text-only prompt through the vision model, decode with images
(log-probabilities, no recompiles within a patch bucket, the images= mistakes) and a train step whose
loss reaches the tower. A tiny K3 (one MLA layer) with the tiny tower and 28x28 images; the compiled
programs are shared through the module fixture."""
import dataclasses
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from PIL import Image

from k3jax import config as C
from k3jax import model as M
from k3jax.data.chat_template import chat_ids, render
from k3jax.data.vision_processor import VisionInputError, from_config, process_image
from k3jax.inference.generate import generate
from k3jax.layers.common import REST
from k3jax.data.media import media_inputs, media_loss_mask, media_token_ids
from k3jax.data.media_layout import DROP
from k3jax.optim.muon import make_optimizer
from k3jax.runtime import load_tokenizer
from k3jax.step import make_train_step

REPO = C.REPO_CONFIGS.parent
TOK = REPO / "data" / "demo" / "tokenizer"
# one MLA layer, dense FFN: the splice does not depend on the layer kinds, the compile time does
TEXT = ["model_name=tiny", "vocab_size=1024", f"tokenizer_path={TOK}", "num_layers=1", "mla_extra_layers=[0]",
        "first_k_dense=1", "attn_res=false", "max_target_length=128"]
# one 16-patch bucket: a 28x28 image (4 patches) and a 28x56 one (8) run the same programs
VISION = TEXT + ["vision_enabled=true", "vision_patch_buckets=[16]", "vision_attention_block=16"]
# one optimizer step whose update is nonzero exactly where the gradient is (no decay, no warm-up)
STEP = ["opt_type=adamw", "lr_schedule=constant", "learning_rate=0.01", "warmup_steps_fraction=0",
        "adam_weight_decay=0", "remat_policy=none", "use_qk_clip=false"]


def image(seed, w=28, h=28):
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def mm():
    cfg = C.load(C.REPO_CONFIGS / "base.yml", VISION + STEP)
    model = M.build(cfg, 0)
    tok = load_tokenizer(cfg)
    ids = media_token_ids(tok)
    pcfg = from_config(cfg)

    def prompt(items, text="what is it?"):
        content = [{"type": "image"}] * len(items) + [{"type": "text", "text": text}]
        return chat_ids(tok, [{"role": "user", "content": content}], media=[it.prompt for it in items])

    @jax.jit
    def last_logprobs(model, toks, media):
        logits, _ = model(toks, media=media)
        return jax.nn.log_softmax(logits[:, -1])

    return dataclasses.make_dataclass("MM", "cfg model tok ids pcfg prompt last_logprobs".split())(
        cfg, model, tok, ids, pcfg, prompt, last_logprobs)


def test_chat_template_expands_each_image_in_place(mm):
    """Each image part becomes the processor's prompt (K3's "image WxH" header, N pads) where the
    part sits, through the checkpoint's jinja template and the built-in markup alike; the built-in
    mask is 0 on it; a count mismatch is an error."""
    a, b = process_image(image(0), mm.pcfg), process_image(image(1, 56, 28), mm.pcfg)
    assert (a.tokens, b.tokens) == (1, 2) and "image 56x28" in b.prompt
    content = [{"type": "image"}, {"type": "text", "text": "left"}, {"type": "image"}, {"type": "text", "text": "?"}]
    msgs = [{"role": "user", "content": content}]
    jinja = chat_ids(mm.tok, msgs, media=[a.prompt, b.prompt])
    builtin, mask = render(_without_template(mm.tok), msgs, media=[a.prompt, b.prompt])
    begin, content_id, pad, end = mm.ids
    for ids in (jinja, builtin):
        assert ids.count(pad) == 3 and ids.count(begin) == 2 and ids.count(end) == 2
        i = ids.index(end)   # the first image's run closes before "left", the second follows it
        assert mm.tok.decode(ids[i + 1:ids.index(begin, i)]) == "left"
        assert mm.tok.decode(ids[ids.index(begin):ids.index(content_id) + 1]) == \
            "<|media_begin|>image 28x28<|media_content|>"
    assert all(m == 0 for t, m in zip(builtin, mask) if t in mm.ids)
    with pytest.raises(ValueError, match="2 image parts but 1 images"):
        chat_ids(mm.tok, msgs, media=[a.prompt])


def _without_template(tok):
    import copy
    t = copy.copy(tok)
    t.chat_template = None
    return t


def test_media_loss_mask_covers_the_markup(mm):
    begin, content, pad, end = mm.ids
    toks = np.array([[5, begin, 7, 8, content, pad, pad, end, 9, 10]])
    got = media_loss_mask(toks, np.ones_like(toks), mm.ids)
    # target t is token t+1: positions 0..6 predict the span begin..end, 7 predicts 9
    assert got.tolist() == [[0, 0, 0, 0, 0, 0, 0, 1, 1, 1]]


def test_splice_puts_projector_rows_at_the_pads(mm):
    items = [process_image(image(0), mm.pcfg), process_image(image(1, 56, 28), mm.pcfg)]
    toks = np.array([mm.prompt(items)], np.int32)
    mi = media_inputs(mm.model.vision.vision_tower.vcfg, mm.pcfg, items, toks, mm.ids[2])
    assert mi.patches.shape[0] == 16 and len(mi.slots) == 4 and mi.slots[3] == DROP
    spliced = nnx.jit(lambda m, t, media: m.embed_media(t, media))(mm.model, jnp.asarray(toks), mi.arrays())
    feats = nnx.jit(lambda m, media: m.vision(media["patches"], media))(mm.model, mi.arrays())
    text = np.asarray(mm.model.embed(jnp.asarray(toks)))[0]
    spliced, feats = np.asarray(spliced)[0], np.asarray(feats)
    pads = np.flatnonzero(toks[0] == mm.ids[2])
    assert len(pads) == 3
    np.testing.assert_array_equal(spliced[pads], feats[:3])
    rest = np.setdiff1d(np.arange(toks.shape[1]), pads)
    np.testing.assert_array_equal(spliced[rest], text[rest])
    assert not np.allclose(feats[:3], text[pads])


def test_text_only_prompt_equals_the_text_model(mm):
    """Without media the vision-enabled model is the text model: same logits as a model built with
    vision_enabled=false carrying the same text parameters, whose tree has no vision part."""
    text_cfg = C.load(C.REPO_CONFIGS / "base.yml", TEXT)
    text_model = M.build(text_cfg, 1)
    vstate = nnx.state(mm.model)
    tstate = nnx.state(text_model)
    assert "vision" in vstate and "vision" not in tstate
    assert set(vstate) - {"vision"} == set(tstate)
    nnx.update(text_model, nnx.State({k: v for k, v in vstate.items() if k != "vision"}))
    toks = jnp.asarray([mm.tok.encode("a prompt with no image", add_bos=True)], jnp.int32)
    np.testing.assert_array_equal(np.asarray(mm.last_logprobs(mm.model, toks, None)),
                                  np.asarray(mm.last_logprobs(text_model, toks, None)))


def test_image_changes_the_first_token_and_decode_recompiles_nothing_in_the_bucket(mm):
    """Two images of one size give different next-token log-probabilities; generate() with an
    image of another size in the same patch bucket compiles and traces nothing."""
    lp = []
    for seed in (0, 1):
        items = [process_image(image(seed), mm.pcfg)]
        toks = np.array([mm.prompt(items)], np.int32)
        mi = media_inputs(mm.model.vision.vision_tower.vcfg, mm.pcfg, items, toks, mm.ids[2])
        lp.append(np.asarray(mm.last_logprobs(mm.model, jnp.asarray(toks), mi.arrays()))[0])
    assert np.abs(lp[0] - lp[1]).max() > 1e-4
    kw = dict(max_new_tokens=3, media_pad_id=mm.ids[2], processor=mm.pcfg)
    first = [process_image(image(0), mm.pcfg)]
    out0, timing = generate(mm.model, [mm.prompt(first)], media=first, **kw)
    assert timing["compile_s"] > 0 and (out0 >= 0).all()
    other = [process_image(image(2, 56, 28), mm.pcfg)]
    events = []
    listener = lambda name, *a, **k: events.append(name) if ("compile" in name or "trace" in name) else None  # noqa: E731
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        out1, timing = generate(mm.model, [mm.prompt(other)], media=other, **kw)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert not events, events
    assert timing["compile_s"] == 0 and out1.shape == out0.shape


def test_train_step_with_media_reaches_the_tower(mm):
    """One optimizer step (no weight decay, no warm-up: a leaf moves iff its gradient is nonzero)
    on a batch with two images: the loss is finite, every tower and projector leaf moves, and the
    targets that are media pads carry no loss (the step masks them; the host mask does not)."""
    items = [process_image(image(0), mm.pcfg), process_image(image(1, 56, 28), mm.pcfg)]
    ids = mm.prompt(items, "describe") + mm.tok.encode("a cat")
    t = 96
    toks = np.zeros((2, t), np.int32)
    toks[0, :len(ids)] = ids
    row = mm.tok.encode("a second row, text only", add_bos=True)
    toks[1, :len(row)] = row
    seg = (np.arange(t)[None] < np.array([[len(ids)], [len(row)]])).astype(np.int32)
    targets = np.concatenate([toks[:, 1:], np.zeros((2, 1), np.int32)], 1)
    loss_mask = np.concatenate([seg[:, 1:], np.zeros((2, 1), np.int32)], 1).astype(np.float32)
    mi = media_inputs(mm.model.vision.vision_tower.vcfg, mm.pcfg, items, toks, mm.ids[2])
    batch = {"tokens": toks, "targets": targets, "segment_ids": seg,
             "positions": np.broadcast_to(np.arange(t), (2, t)).astype(np.int32), "loss_mask": loss_mask}
    batch = {k: jnp.asarray(v) for k, v in batch.items()} | {"media": mi.arrays()}
    gdef, params, rest = nnx.split(mm.model, nnx.Param, REST)
    tx = make_optimizer(mm.cfg.train, params)
    before = jax.tree.map(np.asarray, nnx.to_pure_dict(params["vision"]))
    state = {"params": params, "opt_state": jax.jit(tx.init)(params), "rest": rest}
    new, metrics = jax.jit(make_train_step(mm.cfg, gdef, tx))(state, batch)
    assert np.isfinite(float(metrics["loss"]))
    pads_as_targets = int((targets == mm.ids[2]).sum())
    assert pads_as_targets == 3
    assert float(metrics["loss_tokens"]) == loss_mask.sum() - pads_as_targets
    after = nnx.to_pure_dict(new["params"]["vision"])
    moved = jax.tree.map(lambda a, b: bool(np.any(np.asarray(b) != a)), before, after)
    still = [jax.tree_util.keystr(p) for p, v in jax.tree_util.tree_flatten_with_path(moved)[0] if not v]
    assert not still, still


@pytest.mark.parametrize("case,extra,fragment", [
    ("missing", ["images=[{tmp}/nope.png]"], "nope.png: image file not found"),
    ("unreadable", ["images=[{tmp}/bad.png]"], "bad.png: unreadable image"),
    ("text-model", ["vision_enabled=false", "images=[{tmp}/ok.png]"], "vision_enabled=false"),
    ("too-many", ["vision_max_images=1", "images=[{tmp}/ok.png,{tmp}/ok.png]"], "vision_max_images=1"),
])
def test_decode_image_mistakes(case, extra, fragment, tmp_path, capsys):
    (tmp_path / "bad.png").write_bytes(b"not a png at all")
    image(0).save(tmp_path / "ok.png")
    argv = [str(C.REPO_CONFIGS / "base.yml"), *VISION, "chat=true", "prompt=hi",
            *[a.replace("{tmp}", str(tmp_path)) for a in extra]]
    rc = importlib.import_module("k3jax.decode").main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err[-2000:]
    assert fragment in lines[0], lines[0]


def test_media_count_mismatch_is_one_line(mm):
    items = [process_image(image(0), mm.pcfg)]
    toks = np.array([mm.tok.encode("no pads here", add_bos=True)], np.int32)
    with pytest.raises(VisionInputError, match="holds 0 <\\|media_pad\\|> tokens but its 1 images make 1"):
        media_inputs(mm.model.vision.vision_tower.vcfg, mm.pcfg, items, toks, mm.ids[2])


def test_converter_layout_loads_with_the_tower(mm, tmp_path):
    """A converter output (docs/conversion.md: the text in CKPT/params, the tower and projector in
    CKPT/vision) restores into the vision model's one parameter tree, params["vision"] from the
    vision item; without that item the vision model's restore names what is missing."""
    import orbax.checkpoint as ocp
    from k3jax.checkpoint import CheckpointError
    from k3jax.sharding import make_mesh
    from k3jax.state import restore_state
    params = nnx.state(mm.model, nnx.Param)
    text = nnx.State({k: v for k, v in params.items() if k != "vision"})
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(tmp_path / "ckpt" / "params", text)
    ckptr.save(tmp_path / "ckpt" / "vision", params["vision"])
    ckptr.wait_until_finished()
    cfg = C.load(C.REPO_CONFIGS / "base.yml", VISION + [f"load_parameters_path={tmp_path / 'ckpt'}"])
    _, state, _ = restore_state(cfg, make_mesh(cfg))
    want = jax.tree.leaves(nnx.to_pure_dict(params))
    got = jax.tree.leaves(nnx.to_pure_dict(state["params"]))
    assert len(got) == len(want) and all(np.array_equal(a, b) for a, b in zip(got, want))
    import shutil
    shutil.rmtree(tmp_path / "ckpt" / "vision")
    with pytest.raises(CheckpointError, match=r"vision_enabled=true\) and the checkpoint none"):
        restore_state(cfg, make_mesh(cfg))


def test_images_read_from_gs(gcs, tmp_path):
    """decode's image reader takes gs:// paths (k3jax.paths): the same patches as the local file;
    a missing object is the same one-line error as a missing local file."""
    from k3jax import paths
    from k3jax.data.media import read_image
    d = tmp_path / "imgs"
    d.mkdir()
    image(3, 42, 28).save(d / "a.png")
    paths.upload(d, f"{gcs.bucket}/vision-model")
    pcfg = from_config(C.load(C.REPO_CONFIGS / "base.yml", VISION))
    remote = process_image(read_image(f"{gcs.bucket}/vision-model/a.png"), pcfg)
    local = process_image(read_image(str(d / "a.png")), pcfg)
    assert remote.prompt == local.prompt and np.array_equal(remote.patches, local.patches)
    with pytest.raises(VisionInputError, match="vision-model/none.png: image file not found"):
        read_image(f"{gcs.bucket}/vision-model/none.png")


def test_export_reads_the_tower_of_a_training_checkpoint(mm, tmp_path):
    """A training checkpoint holds the tower inside params (params["vision"]); k3jax_to_hf writes
    it in the released names beside the text tensors."""
    import orbax.checkpoint as ocp
    import yaml
    from safetensors.numpy import load_file
    from conversion.k3jax_to_hf import export
    keys = yaml.safe_load((C.REPO_CONFIGS / "models" / "tiny.yml").read_text())
    keys.update({k: yaml.safe_load(v) for k, v in (a.split("=", 1) for a in VISION)
                 if k not in ("model_name", "tokenizer_path", "max_target_length")})
    (tmp_path / "model.yml").write_text(yaml.safe_dump(keys))
    params = nnx.state(mm.model, nnx.Param)
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(tmp_path / "ckpt" / "params", params)
    ckptr.wait_until_finished()
    export(str(tmp_path / "ckpt"), str(tmp_path / "hf"), model_name=str(tmp_path / "model.yml"), dtype="float32",
           progress=False)
    hf = {}
    for f in (tmp_path / "hf").glob("*.safetensors"):
        hf.update(load_file(f))
    vision = params["vision"]
    assert np.array_equal(hf["mm_projector.proj.2.weight"], np.asarray(vision["mm_projector"]["proj2"].get_value()).T)
    assert np.array_equal(hf["vision_tower.encoder.blocks.1.mlp.fc0.weight"],
                          np.asarray(vision["vision_tower"]["blocks"]["fc0"].get_value())[1].T)
    assert any(k.endswith("embed_tokens.weight") for k in hf)


def test_text_freeze_groups_leave_the_tower_alone(mm):
    """freeze=[norms, attention, embed] freezes text leaves only: the tower's norms and biases share
    the ("norm",) axis of text norms, but params["vision"] belongs to no text group."""
    from k3jax.optim.muon import frozen_mask
    mask = frozen_mask(nnx.state(mm.model, nnx.Param), ["norms", "attention", "embed", "lm_head"])
    assert not any(jax.tree.leaves(nnx.to_pure_dict(mask["vision"])))
    assert any(jax.tree.leaves(nnx.to_pure_dict(mask["norm"])))
