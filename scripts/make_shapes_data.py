"""A synthetic image-caption set for ``dataset_type=mm_sft``: coloured shapes on plain backgrounds.

    python scripts/make_shapes_data.py OUT_DIR [--train 480] [--test 48] [--size 28] [--seed 0]
    python scripts/make_shapes_data.py --score RUN_DIR OUT_DIR [k3jax key=value ...]

Writes ``OUT_DIR/images/NNNNN.png`` (every image the same size; the numbers are a random order, so
a file name says nothing of its label), ``OUT_DIR/train.json`` and ``OUT_DIR/test.json`` in the
MindSpeed-MM / LLaVA layout that ``dataset_type=mm_sft`` reads (image paths relative to the JSON
file), and ``OUT_DIR/blank/NNNNN.png``: images of the test set's backgrounds with no shape, for the
control. A record:

    {"images": ["images/00017.png"],
     "messages": [{"role": "user", "content": "<image>\\nWhat is in the picture?"},
                  {"role": "assistant", "content": "a red circle"}]}

Labels: 4 colours x 3 shapes = 12 captions, chance is 1/12 for the pair. Shapes vary in size and
position, backgrounds in a pale tone. No downloads; numpy + Pillow only.

``--score`` loads the last checkpoint of a training run (its config.yml, key=value overrides
after), captions the held-out images greedily (``k3jax.inference.generate.generate``) and prints each caption
and the accuracy, then the blank-image control's. ``captions`` and ``accuracy`` are the same
functions tests/test_vision_learns.py uses.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

COLOURS = {"red": (215, 35, 35), "green": (30, 160, 50), "blue": (40, 70, 215), "yellow": (230, 200, 20)}
SHAPES = ("circle", "square", "triangle")
QUESTION = "What is in the picture?"


def draw(colour: str, shape: str, size: int, rng: np.random.Generator, background=None) -> Image.Image:
    """One size x size RGB image: a pale plain background and (shape not None) one filled shape."""
    bg = tuple(int(v) for v in (background if background is not None else rng.integers(185, 256, 3)))
    img = Image.new("RGB", (size, size), bg)
    if shape is None:
        return img
    d = ImageDraw.Draw(img)
    r = size * rng.uniform(0.3, 0.38)                       # half the shape's extent
    cx, cy = size / 2 + rng.uniform(-0.06, 0.06, 2) * size
    fill = COLOURS[colour]
    if shape == "circle":
        d.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
    elif shape == "square":
        d.rectangle([cx - r, cy - r, cx + r, cy + r], fill=fill)
    else:
        d.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fill)
    return img


def make(out: str | Path, n_train: int = 480, n_test: int = 48, size: int = 28, seed: int = 0) -> Path:
    """Write the set (module docstring) into ``out``; -> out. Labels are balanced: every
    (colour, shape) pair appears equally often (up to rounding) in each split."""
    out = Path(out)
    (out / "images").mkdir(parents=True, exist_ok=True)
    (out / "blank").mkdir(exist_ok=True)
    rng = np.random.default_rng(seed)
    pairs = [(c, s) for c in COLOURS for s in SHAPES]
    n = n_train + n_test
    labels = [pairs[i % len(pairs)] for i in range(n_train)] + [pairs[i % len(pairs)] for i in range(n_test)]
    names = rng.permutation(n)                               # file numbers in a random order
    splits = {"train": [], "test": []}
    for i, (colour, shape) in enumerate(labels):
        bg = rng.integers(185, 256, 3)
        name = f"{names[i]:05d}.png"
        draw(colour, shape, size, rng, bg).save(out / "images" / name)
        split = "train" if i < n_train else "test"
        if split == "test":
            draw(colour, None, size, rng, bg).save(out / "blank" / name)
        splits[split].append({"images": [f"images/{name}"], "messages": [
            {"role": "user", "content": f"<image>\n{QUESTION}"},
            {"role": "assistant", "content": f"a {colour} {shape}"}]})
    order = rng.permutation(n_train)
    (out / "train.json").write_text(json.dumps([splits["train"][i] for i in order], indent=1))
    (out / "test.json").write_text(json.dumps(splits["test"], indent=1))
    return out


def label_of(text: str) -> tuple[str | None, str | None]:
    """(colour, shape) named in a caption; None where it names none or several."""
    words = re.findall(r"[a-z]+", text.lower())
    c = [w for w in words if w in COLOURS]
    s = [w for w in words if w in SHAPES]
    return (c[0] if len(set(c)) == 1 else None), (s[0] if len(set(s)) == 1 else None)


def accuracy(captions: list[str], want: list[str]) -> float:
    """Share of captions that name exactly the right colour and the right shape."""
    return float(np.mean([label_of(c) == label_of(w) for c, w in zip(captions, want)]))


def test_records(data_dir: str | Path, blank: bool = False) -> tuple[list[str], list[str]]:
    """(image paths, wanted captions) of the held-out set (``blank``: the shape-less images)."""
    data_dir = Path(data_dir)
    recs = json.loads((data_dir / "test.json").read_text())
    paths = [str(data_dir / ("blank/" + Path(r["images"][0]).name if blank else r["images"][0])) for r in recs]
    return paths, [r["messages"][1]["content"] for r in recs]


def captions(model, tok, pcfg, image_paths: list[str], max_new_tokens: int = 10,
             default_system: str | None = None, batch: int = 16) -> list[str]:
    """Greedy captions of ``image_paths``, one prompt per image (the training question), in
    ``generate`` batches of ``batch`` images (all batches one shape: the last is filled up with
    repeats, so one prefill and one decode loop compile). ``default_system``: as the training data
    was rendered."""
    if len(image_paths) > batch:
        padded = image_paths + image_paths[:(-len(image_paths)) % batch]
        out = []
        for i in range(0, len(padded), batch):
            out += captions(model, tok, pcfg, padded[i:i + batch], max_new_tokens, default_system, batch)
        return out[:len(image_paths)]
    from k3jax.data.chat_template import render
    from k3jax.data.vision_processor import process_image
    from k3jax.inference.generate import generate
    from k3jax.data.media import media_token_ids, read_image
    pad = media_token_ids(tok)[2]
    items = [process_image(read_image(p), pcfg) for p in image_paths]
    prompts = [render(tok, [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "\n" + QUESTION}]}],
                      add_generation_prompt=True, default_system=default_system, media=[it.prompt])[0]
               for it in items]
    out, _ = generate(model, prompts, max_new_tokens=max_new_tokens, stop_ids=(tok.eos_id, tok.im_end_id),
                      media=items, media_pad_id=pad, processor=pcfg)
    return [tok.decode([t for t in row if t >= 0 and t not in (tok.eos_id, tok.im_end_id)]).strip()
            for row in out.tolist()]


def score(run_dir: str, data_dir: str, overrides: list[str]) -> int:
    """--score: caption the held-out and the blank images with the run's last checkpoint."""
    import jax
    import yaml

    from k3jax import config as C
    from k3jax.data.chat_template import DEFAULT_SYSTEM
    from k3jax.data.vision_processor import from_config
    from k3jax.runtime import load_tokenizer
    from k3jax.sharding import make_mesh
    from k3jax.state import load_model
    run = Path(run_dir)
    steps = sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())
    saved = yaml.safe_load((run / "config.yml").read_text())
    keys = {k: saved[k] for k in ("model_name", "vocab_size", "max_target_length") if k in saved}
    model_keys = [k for k in C.KEYS if C.KEYS[k][0] in ("model", "vision")]
    args = [f"{k}={v if isinstance(v, str) else json.dumps(v)}"
            for k, v in {**{k: saved[k] for k in model_keys if k in saved}, **keys}.items()]
    cfg = C.load(C.REPO_CONFIGS / "base.yml", args + [f"load_parameters_path={run / 'checkpoints' / str(steps[-1])}",
                                                      f"tokenizer_path={run / 'tokenizer'}", *overrides])
    tok, pcfg, mesh = load_tokenizer(cfg), from_config(cfg), make_mesh(cfg)
    system = DEFAULT_SYSTEM if saved.get("sft_default_system_prompt", True) else None
    model = load_model(cfg, mesh)
    for blank in (False, True):
        paths, want = test_records(data_dir, blank)
        with jax.set_mesh(mesh):
            got = captions(model, tok, pcfg, paths, default_system=system)
        if not blank:   # every 5th held-out image (the set cycles through the 12 labels), then the misses
            rows = list(zip(paths, got, want))
            for p, g, w in rows[::5] + [r for r in rows if label_of(r[1]) != label_of(r[2])][:5]:
                print(f"{os.path.basename(p)}: {g!r} (truth: {w!r})")
        what = "blank images (no shape; chance 1/12)" if blank else "held-out images"
        print(f"{what}: {accuracy(got, want):.0%} of {len(want)} captions name the right colour and shape")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", nargs="+", help="OUT_DIR; with --score: DATA_DIR [key=value ...]")
    ap.add_argument("--train", type=int, default=480)
    ap.add_argument("--test", type=int, default=48)
    ap.add_argument("--size", type=int, default=28)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--score", metavar="RUN_DIR", help="caption the held-out images with this run's checkpoint")
    a = ap.parse_args(argv)
    if a.score:
        return score(a.score, a.out[0], a.out[1:])
    out = make(a.out[0], a.train, a.test, a.size, a.seed)
    print(f"wrote {a.train} training and {a.test} held-out {a.size}x{a.size} images with captions to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
