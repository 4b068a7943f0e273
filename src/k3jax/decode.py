"""Generation: ``python -m k3jax.decode configs/base.yml load_parameters_path=... prompt="..."``
(with images: ``model_name=kimi-k3-vl chat=true images=[a.png,gs://b/c.jpg] prompt="..."``).

Prompts are left-padded to a common length with segment id 0 on the padding, so one prefill gives
every row a correct cache: KDA resets its state at the padding -> prompt boundary and the convolution
sees zeros there, MLA masks the padded keys. Decoding then runs as one jitted ``lax.while_loop``
(no per-token recompilation) over ``model.decode_step`` with the cache (KDA recurrent + conv state,
constant in context length; the MLA latent cache c|k_r). Finished rows stop emitting; tokens are
streamed to the host with an ordered debug callback.

Images (``images=``, a model with ``vision_enabled``) go through the processor on the host, their
prompts (``<|media_begin|>image WxH<|media_content|>`` + pads + ``<|media_end|>``) into the chat
template, and their packed patches into the prefill program, which runs the tower once and splices
the features at the pads (``k3jax.multimodal``); the decode loop never sees them. With media the
padded prompt length rounds up to ``MEDIA_PROMPT_MULTIPLE``, so other image sizes in the same
patch bucket reuse the compiled programs.
"""
from __future__ import annotations

import codecs
import collections
import functools
import math
import time
import weakref

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax import config as C
from k3jax.cli import run_tool
from k3jax.layers.context import context_size
from k3jax.runtime import load_tokenizer, sync_processes, tokenizer_dir
from k3jax.sampling import sample
from k3jax.sharding import make_mesh
from k3jax.state import load_model


def left_pad(prompts: list[list[int]], pad_id: int = 0, multiple: int = 1, min_len: int = 1):
    """-> tokens [B,P] int32, segment_ids [B,P] (0 on padding, 1 on the prompt), start [B]; P is the
    longest prompt (at least ``min_len``) rounded up to ``multiple`` (a context axis splits P into
    equal slices)."""
    p = -(-max(min_len, *(len(x) for x in prompts)) // multiple) * multiple
    toks = np.full((len(prompts), p), pad_id, np.int32)
    seg = np.zeros((len(prompts), p), np.int32)
    for i, ids in enumerate(prompts):
        toks[i, p - len(ids):] = ids
        seg[i, p - len(ids):] = 1
    return toks, seg, np.array([p - len(x) for x in prompts], np.int32)


MEDIA_PROMPT_MULTIPLE = 64   # with media, the padded prompt length is a multiple of this


def prefill(model, tokens, segment_ids, start, total_len: int, media=None):
    """Prompt forward -> (last-position logits [B,V] f32, decode cache with room for total_len).

    The prompt's caches cover its P slots; every leaf is zero-padded at the end up to the shape
    ``model.cache_spec(B, total_len)`` gives it, in its dtype (the MLA latent cache grows along
    ``cache_seq``; the KDA states have no length and keep their shape). ``media``:
    ``MediaInputs.arrays()`` of the prompts' images (the tower runs here, once)."""
    positions = jnp.maximum(jnp.arange(tokens.shape[1])[None, :] - start[:, None], 0)
    h, _, caches = model.hidden(tokens, segment_ids, positions, return_cache=True, media=media)
    logits = jnp.einsum("bd,dv->bv", h[:, -1], model.head_weight().astype(h.dtype),
                        preferred_element_type=jnp.float32)
    spec = model.cache_spec(tokens.shape[0], total_len)
    pad = lambda x, s: jnp.pad(x.astype(s[1]), [(0, want - have) for have, want in zip(x.shape, s[0])])  # noqa: E731
    cache = jax.tree.map(pad, caches, spec)
    return logits, cache


# Compiled (prefill, decode loop) pairs per model object, most recent last: a later generate() with
# the same shapes, sampling settings, callback and mesh runs them again instead of compiling (a
# compile is seconds on CPU, minutes for a large model). Weak keys: a dropped model drops its programs.
_PROGRAMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
PROGRAMS_PER_MODEL = 8


def generate(model, prompts: list[list[int]], *, max_new_tokens: int, stop_ids=(), greedy=True,
             temperature=1.0, top_k=0, top_p=1.0, seed=0, on_tokens=None, pad_id=0, media=None,
             media_pad_id=None, processor=None):
    """Returns (new tokens [B, max_new_tokens] with -1 after a row stopped, timing dict). Call it
    under ``jax.set_mesh(mesh)`` for a sharded model.

    The timing dict: prefill and decode-loop seconds and tokens/s (compilation excluded), and
    ``compile_s``, the seconds this call spent compiling: 0 when an earlier call on the same model
    object had the same batch, padded prompt length, ``max_new_tokens``, sampling settings, stop ids,
    ``on_tokens`` and mesh (its programs are kept, the last ``PROGRAMS_PER_MODEL`` per model).

    ``media``: the prompts' processed images (``vision_processor.MediaItem``s, in order over the
    rows), whose ``media_pad_id`` runs the prompts already hold; ``processor`` is the
    ProcessorConfig that bucketed them. Image sets in the same patch bucket share the programs."""
    # Under a context mesh the prompt and the cache split into equal slices, each holding at least
    # the short conv's halo (kda_conv_size - 1 tokens).
    cp = context_size()
    halo = cp * (model.cfg.kda_conv_size - 1) if cp > 1 else 1
    multiple = cp if media is None else math.lcm(cp, MEDIA_PROMPT_MULTIPLE)
    toks, seg, start = left_pad(prompts, pad_id, multiple=multiple, min_len=halo)
    b, p = toks.shape
    mi = None
    if media is not None:
        from k3jax.multimodal import media_inputs
        mi = media_inputs(model.vision.vision_tower.vcfg, processor, list(media), toks, media_pad_id)
    total = -(-(p + max_new_tokens) // cp) * cp
    gdef, state = nnx.split(model)
    stop = jnp.asarray(list(stop_ids) or [-2], jnp.int32)
    samp = functools.partial(sample, greedy=greedy, temperature=temperature, top_k=top_k, top_p=top_p)

    @jax.jit
    def run_prefill(state, toks, seg, start, media):
        return prefill(nnx.merge(gdef, state), toks, seg, start, total, media)

    @jax.jit
    def run_decode(state, logits, cache, start, key):
        m = nnx.merge(gdef, state)

        def cond(c):
            return (c["i"] < max_new_tokens) & ~jnp.all(c["done"])

        def body(c):
            tok = samp(c["logits"], jax.random.fold_in(key, c["i"]))
            tok = jnp.where(c["done"], -1, tok)
            if on_tokens is not None:
                jax.debug.callback(on_tokens, c["i"], tok, ordered=True)
            done = c["done"] | jnp.isin(tok, stop)
            logits, cache = m.decode_step(jnp.maximum(tok, 0), c["cache"], p + c["i"], start)
            return {"i": c["i"] + 1, "done": done, "logits": logits, "cache": cache,
                    "out": c["out"].at[:, c["i"]].set(tok)}

        init = {"i": jnp.zeros((), jnp.int32), "done": jnp.zeros((b,), bool), "logits": logits, "cache": cache,
                "out": jnp.full((b, max_new_tokens), -1, jnp.int32)}
        return jax.lax.while_loop(cond, body, init)["out"]

    args = (state, jnp.asarray(toks), jnp.asarray(seg), jnp.asarray(start), None if mi is None else mi.arrays())
    key = jax.random.key(seed)
    # Everything the two programs depend on besides argument values; the graph definition (not
    # hashable) is compared on a hit, so a model whose structure or config changed recompiles.
    spec = (b, p, total, max_new_tokens, greedy, temperature, top_k, top_p, tuple(stop_ids), on_tokens,
            jax.sharding.get_abstract_mesh(), None if mi is None else mi.key(),
            tuple((jnp.shape(x), jnp.result_type(x), getattr(x, "sharding", None)) for x in jax.tree.leaves(state)))
    try:
        hash(spec)
    except TypeError:   # an unhashable on_tokens callable: compile for this call only
        spec = None
    programs = _PROGRAMS.setdefault(model, collections.OrderedDict())
    hit = programs.get(spec) if spec is not None else None
    t_compile = 0.0
    if hit is not None and hit[0] == gdef:
        programs.move_to_end(spec)
        _, pre, dec = hit
    else:
        t0 = time.perf_counter()
        pre = run_prefill.lower(*args).compile()
        t_compile += time.perf_counter() - t0
        dec = None
    sync_processes("compiled the prefill")
    t0 = time.perf_counter()
    logits, cache = jax.block_until_ready(pre(*args))
    t_prefill = time.perf_counter() - t0
    if dec is None:
        t0 = time.perf_counter()
        dec = run_decode.lower(state, logits, cache, args[3], key).compile()
        t_compile += time.perf_counter() - t0
        if spec is not None:
            programs[spec] = (gdef, pre, dec)
            while len(programs) > PROGRAMS_PER_MODEL:
                programs.popitem(last=False)
    sync_processes("compiled the decode loop")
    t0 = time.perf_counter()
    out = jax.block_until_ready(dec(state, logits, cache, args[3], key))
    if not out.is_fully_addressable:   # several processes: every one gets all the tokens
        from jax.experimental import multihost_utils
        out = multihost_utils.process_allgather(out, tiled=True)
    out = np.asarray(out)
    t_decode = time.perf_counter() - t0
    n_new = int((out >= 0).sum())
    timing = {"prefill_tokens_per_s": int((seg > 0).sum()) / t_prefill, "decode_tokens_per_s": n_new / t_decode,
              "prefill_s": t_prefill, "decode_s": t_decode, "new_tokens": n_new, "compile_s": t_compile}
    return out, timing


def _run(cfg) -> int:
    d = cfg.decode
    if not d.prompt.strip():
        raise C.ConfigError("prompt is empty; pass prompt=\"some text\"")
    tok = load_tokenizer(cfg)
    items, media_kw = _images(cfg, tok)
    if d.chat:
        from k3jax.data.chat_template import chat_ids
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
    from k3jax.data.vision_processor import check_media_limit, from_config, process_image
    from k3jax.multimodal import media_token_ids, read_image
    pcfg = from_config(cfg)
    check_media_limit(len(cfg.decode.images), pcfg, "prompt")
    pad_id = media_token_ids(tok)[2]
    items = [process_image(read_image(p), pcfg) for p in cfg.decode.images]
    return items, {"media": items, "media_pad_id": pad_id, "processor": pcfg}


def main(argv: list[str] | None = None) -> int:
    return run_tool("decode", _run, argv, __doc__, local_devices=True)


if __name__ == "__main__":
    raise SystemExit(main())
