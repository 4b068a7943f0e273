"""Generation: ``python -m k3jax.decode configs/base.yml load_parameters_path=... prompt="..."``
(with images: ``model_name=kimi-k3-vl chat=true images=[a.png,gs://b/c.jpg] prompt="..."``).

A client of the inference core (``k3jax.inference.generate``): the prompt prefills in chunks into
a slot of the core's cache (KDA recurrent + conv state, MLA latent rows), then decodes several
tokens per program call, streamed as they come back; the same programs the server runs.

Images (``images=``, a model with ``vision_enabled``) go through the processor on the host, their
prompts (``<|media_begin|>image WxH<|media_content|>`` + pads + ``<|media_end|>``) into the chat
template, and their packed patches into the tower program, which runs once; its rows are spliced
at the pads as the prompt prefills (``k3jax.inference.media_programs``).
"""
from __future__ import annotations

import codecs

import jax
import numpy as np

from k3jax import config as C
from k3jax.cli import run_tool
from k3jax.data.chat_template import chat_ids
from k3jax.data.media import media_token_ids, read_image
from k3jax.data.vision_processor import check_media_limit, from_config, process_image
from k3jax.inference.generate import generate
from k3jax.runtime import load_tokenizer, tokenizer_dir
from k3jax.sharding import make_mesh
from k3jax.state import load_model


def _run(cfg) -> int:
    d = cfg.decode
    if not d.prompt.strip():
        raise C.ConfigError("prompt is empty; pass prompt=\"some text\"")
    tok = load_tokenizer(cfg)
    items, media_kw = _images(cfg, tok)
    if d.chat:
        content = [{"type": "image"}] * len(items) + [{"type": "text", "text": d.prompt}] if items else d.prompt
        try:
            ids = chat_ids(tok, [{"role": "user", "content": content}],
                           media=[it.prompt for it in items] if items else None)
        except ValueError as e:   # TokenizerError included: no template and no K2 chat tokens
            raise C.ConfigError(f"chat=true: the tokenizer at {tokenizer_dir(cfg)} cannot render a chat ({e}); "
                                f"give it the model's chat_template (tokenizer_config.json or chat_template.jinja) "
                                f"or set chat=false") from None
    else:
        ids = tok.encode(d.prompt, add_bos=True)
        if items:    # the media prompts right after the BOS token, then the text
            ids = ids[:1] + tok.encode_with_special_tokens("".join(it.prompt for it in items)) + ids[1:]
    budget = d.max_prefill_length or cfg.train.max_target_length
    if len(ids) > budget:
        raise C.ConfigError(f"prompt is {len(ids)} tokens but max_prefill_length/max_target_length allows "
                            f"{budget}; shorten the prompt or raise max_target_length")
    mesh = make_mesh(cfg)
    model = load_model(cfg, mesh)
    # Tokens are byte sequences and a character may span tokens: an incremental UTF-8
    # decoder prints each character once it is complete (linear in the output length).
    utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    # An ordered host callback needs a single process; several processes print the text at the end.
    streaming = d.stream and jax.process_count() == 1

    def stream(i, toks):
        if streaming:
            t = int(np.asarray(toks)[0])
            if t >= 0 and t not in (tok.eos_id, tok.im_end_id):
                print(utf8.decode(tok.decode_bytes([t])), end="", flush=True)

    with jax.set_mesh(mesh):
        out, timing = generate(model, [ids], max_new_tokens=d.max_new_tokens,
                               stop_ids=(tok.eos_id, tok.im_end_id), greedy=d.sampling == "greedy",
                               temperature=d.temperature, top_k=d.top_k, top_p=d.top_p, seed=d.decode_seed,
                               on_tokens=stream if streaming else None, **media_kw)
    new = [t for t in out[0].tolist() if t >= 0 and t not in (tok.eos_id, tok.im_end_id)]
    if not streaming:
        print(d.prompt + tok.decode(new))
    else:
        print(utf8.decode(b"", final=True))
    print(f"prefill {timing['prefill_tokens_per_s']:.1f} tokens/s, decode {timing['decode_tokens_per_s']:.1f} "
          f"tokens/s ({timing['new_tokens']} new tokens)")
    return 0


def _images(cfg, tok):
    """(processed images, generate()'s media keywords) of ``images=``; ([], {}) without. The
    config checks (vision_enabled, vision_max_images) ran at load; a missing or unreadable file
    is a one-line VisionInputError."""
    if not cfg.decode.images:
        return [], {}
    pcfg = from_config(cfg)
    check_media_limit(len(cfg.decode.images), pcfg, "prompt")
    pad_id = media_token_ids(tok)[2]
    items = [process_image(read_image(p), pcfg) for p in cfg.decode.images]
    return items, {"media": items, "media_pad_id": pad_id, "processor": pcfg}


def main(argv: list[str] | None = None) -> int:
    return run_tool("decode", _run, argv, __doc__, local_devices=True)


if __name__ == "__main__":
    raise SystemExit(main())
