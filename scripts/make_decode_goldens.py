"""Make tests/assets/decode_golden.npz: greedy tokens and their log-probabilities from the batch
prefill + ``model.decode_step`` path, for text prompts (a mixed-length batch on the tiny K3) and
image prompts (the tiny vision model of tests/test_vision_model.py), which the inference core's
``generate`` must reproduce (tokens identical, log-probabilities within 1e-5).

The asset was first recorded with the left-padded ``while_loop`` generate that the inference core
replaced; this script asserted then that its replay (``prefill`` of the left-padded batch, then one
``decode_step`` per token, the same calls that loop made) gave that generate's tokens. The replay's
prefill is ``k3jax.inference.batch_prefill``.

    JAX_PLATFORMS=cpu .venv/bin/python scripts/make_decode_goldens.py [--out tests/assets/decode_golden.npz]
"""
from __future__ import annotations

import argparse
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from PIL import Image

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from helpers import randomize  # noqa: E402
from k3jax import config as C  # noqa: E402
from k3jax import model as M  # noqa: E402
from k3jax.data.chat_template import chat_ids  # noqa: E402
from k3jax.data.vision_processor import from_config, process_image  # noqa: E402
from k3jax.inference.batch_prefill import left_pad, prefill  # noqa: E402
from k3jax.data.media import media_inputs, media_token_ids  # noqa: E402
from k3jax.runtime import load_tokenizer  # noqa: E402

TEXT_CFG = ["model_name=tiny"]
TEXT_NEW = 6
TOK = REPO / "data" / "demo" / "tokenizer"
VISION_CFG = ["model_name=tiny", "vocab_size=1024", f"tokenizer_path={TOK}", "num_layers=1", "mla_extra_layers=[0]",
              "first_k_dense=1", "attn_res=false", "max_target_length=128", "vision_enabled=true",
              "vision_patch_buckets=[16]", "vision_attention_block=16"]
VISION_NEW = 4
IMAGES = [(0, 28, 28), (2, 56, 28)]   # (seed, width, height)


def text_case():
    """-> (model, prompts) of the text case: three random prompts of 3, 10 and 7 tokens."""
    cfg = C.load(C.REPO_CONFIGS / "base.yml", TEXT_CFG)
    model = randomize(M.build(cfg, 0))
    rng = np.random.default_rng(11)
    return model, [list(map(int, rng.integers(0, cfg.model.vocab_size, n))) for n in (3, 10, 7)]


def image(seed, w, h):
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def vision_case():
    """-> (model, prompt, items, pad id, processor config) for each image of IMAGES."""
    cfg = C.load(C.REPO_CONFIGS / "base.yml", VISION_CFG)
    model = M.build(cfg, 0)
    tok = load_tokenizer(cfg)
    pcfg = from_config(cfg)
    out = []
    for seed, w, h in IMAGES:
        items = [process_image(image(seed, w, h), pcfg)]
        content = [{"type": "image"}, {"type": "text", "text": "what is it?"}]
        ids = chat_ids(tok, [{"role": "user", "content": content}], media=[it.prompt for it in items])
        out.append((ids, items))
    return model, out, media_token_ids(tok)[2], pcfg


def replay(model, prompts, new, media=None):
    """Greedy tokens [B, new] and their log-probabilities [B, new] by the batch prefill and one
    decode step per token (no stop ids: every row runs ``new`` steps)."""
    toks, seg, start = left_pad(prompts)
    p = toks.shape[1]
    logits, cache = nnx.jit(prefill, static_argnums=4)(model, jnp.asarray(toks), jnp.asarray(seg),
                                                       jnp.asarray(start), p + new, media)
    step = nnx.jit(lambda m, t, c, pos, s: m.decode_step(t, c, pos, s))
    out, lps = [], []
    for i in range(new):
        lp = jax.nn.log_softmax(logits, -1)
        t = jnp.argmax(logits, -1).astype(jnp.int32)
        out.append(np.asarray(t))
        lps.append(np.asarray(jnp.take_along_axis(lp, t[:, None], -1)[:, 0]))
        logits, cache = step(model, t, cache, p + i, jnp.asarray(start))
    return np.stack(out, 1), np.stack(lps, 1)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(REPO / "tests" / "assets" / "decode_golden.npz"))
    a = ap.parse_args(argv)
    model, prompts = text_case()
    t_tok, t_lp = replay(model, prompts, TEXT_NEW)
    vmodel, cases, pad, pcfg = vision_case()
    v_tok, v_lp = [], []
    for ids, items in cases:
        toks, _, _ = left_pad([ids])
        mi = media_inputs(vmodel.vision.vision_tower.vcfg, pcfg, items, toks, pad)
        tk, lp = replay(vmodel, [ids], VISION_NEW, mi.arrays())
        v_tok.append(tk[0])
        v_lp.append(lp[0])
    np.savez(a.out, text_tokens=t_tok, text_logprobs=t_lp, vision_tokens=np.stack(v_tok),
             vision_logprobs=np.stack(v_lp))
    print(f"wrote {a.out}: text {t_tok.tolist()}, vision {np.stack(v_tok).tolist()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
