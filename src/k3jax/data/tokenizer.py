"""Kimi tiktoken tokenizer, read from a model directory without running any of its code.

A Kimi model directory ships `tiktoken.model` (one `base64(token_bytes) rank` line per base
token), `tokenizer_config.json` (`added_tokens_decoder`: the names of the reserved special ids)
and a `tokenization_kimi.py` that Hugging Face would import under `trust_remote_code=True`.
This module reads only the two data files: nothing in the directory is imported or executed.

Layout (formats.md §3): base ranks `0 .. n_base-1`, then `num_reserved` special ids
`n_base .. vocab_size-1`; the real K2/K3 file has n_base = 163584, num_reserved = 256,
vocab_size = 163840 (`[BOS]` 163584, `[EOS]` 163585, `<|im_end|>` 163586, `[PAD]` 163839).
Every id is read from the config; the real layout is only validated, never assumed, so the
tiny test tokenizer (`tiny_tokenizer.py`) can put the same names at the top of a small vocab.
"""
from __future__ import annotations

import base64
import binascii
import json
import os
from collections.abc import Iterator, Sequence
from typing import Any

import tiktoken

from k3jax.errors import UserError

# Kimi's exact pre-tokenisation regex (formats.md §3.2). `&&` is character-class intersection:
# Han is removed from the letter classes so "中文English混合" splits as 中文|English|混合.
# tiktoken's Rust fancy_regex accepts it; Python `regex` needs flags=regex.V1.
PAT_STR = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])

# Kimi's encoder cuts text into <= 400k-char pieces, then so that no run of whitespace or of
# non-whitespace exceeds 25k chars: the regex engine backtracks badly on huge runs (§3.3).
MAX_PIECE_CHARS = 400_000
MAX_RUN_CHARS = 25_000

NUM_RESERVED_DEFAULT = 256
# The real Kimi K2/K3 layout, used only to validate a full-size vocabulary.
REAL_N_BASE = 163_584
REAL_VOCAB = 163_840
REAL_IDS = {"[BOS]": 163_584, "[EOS]": 163_585, "[PAD]": 163_839}

# Control tokens the K2-style chat template needs (formats.md §3.5).
CHAT_TOKENS = ("<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>", "<|im_end|>")


class TokenizerError(UserError, ValueError):
    """A model directory whose tokenizer files are missing or inconsistent."""


def _added_token_name(entry: Any) -> str:
    """`added_tokens_decoder` values are `{"content": name, ...}` dicts in HF files, plain
    strings in some hand-written ones; accept both."""
    if isinstance(entry, str):
        return entry
    if isinstance(entry, dict) and isinstance(entry.get("content"), str):
        return entry["content"]
    raise TokenizerError(f"added_tokens_decoder entry {entry!r} has no string 'content'")


def _token_field(config: dict, key: str, default: str) -> str:
    """`bos_token` etc. are strings or `{"content": ...}` dicts in tokenizer_config.json."""
    value = config.get(key)
    if value is None:
        return default
    return _added_token_name(value)


def split_for_encoding(text: str) -> Iterator[str]:
    """Cut `text` like Kimi's encoder: <= 400k-char pieces, then no run of whitespace or of
    non-whitespace longer than 25k chars. Concatenating the pieces gives back `text`."""
    for start in range(0, len(text), MAX_PIECE_CHARS):
        piece = text[start:start + MAX_PIECE_CHARS]
        if len(piece) <= MAX_RUN_CHARS:  # no run can be longer than the piece
            yield piece
            continue
        begin, run, prev_space = 0, 0, None
        for i, ch in enumerate(piece):
            space = ch.isspace()
            run = run + 1 if space == prev_space else 1
            prev_space = space
            if run > MAX_RUN_CHARS:
                yield piece[begin:i]
                begin, run = i, 1
        yield piece[begin:]


class KimiTokenizer:
    """Byte-level BPE with Kimi's regex and reserved special block.

    `encode` treats special-token strings in the text as ORDINARY text: `"<|im_end|>"` typed by
    a user becomes ~8 byte/BPE tokens, never the control id. Control tokens enter a sequence only
    as ids (see `chat_template.render`). Ids are Python ints; arrays use int32.
    """

    def __init__(self, mergeable_ranks: dict[bytes, int], special_ids: dict[str, int],
                 *, vocab_size: int, name: str = "kimi",
                 bos_token: str = "[BOS]", eos_token: str = "[EOS]", pad_token: str = "[PAD]",
                 chat_template: str | None = None):
        n_base = len(mergeable_ranks)
        if sorted(mergeable_ranks.values()) != list(range(n_base)):
            raise TokenizerError("tiktoken ranks must be exactly 0 .. n_base-1")
        ids = sorted(special_ids.values())
        if ids != list(range(n_base, vocab_size)):
            raise TokenizerError(
                f"special ids must fill {n_base} .. {vocab_size - 1} exactly once; got "
                f"{len(ids)} ids in [{ids[0] if ids else None}, {ids[-1] if ids else None}]")
        for role, tok in (("bos", bos_token), ("eos", eos_token), ("pad", pad_token)):
            if tok not in special_ids:
                raise TokenizerError(f"{role} token {tok!r} is not in added_tokens_decoder")
        self.n_base = n_base
        self._vocab_size = vocab_size
        self._special = dict(special_ids)
        self._id_to_special = {i: s for s, i in special_ids.items()}
        self._bos, self._eos, self._pad = (special_ids[bos_token], special_ids[eos_token],
                                           special_ids[pad_token])
        self.chat_template = chat_template
        self._enc = tiktoken.Encoding(name=name, pat_str=PAT_STR,
                                      mergeable_ranks=mergeable_ranks,
                                      special_tokens=self._special)
        if vocab_size == REAL_VOCAB:
            self._validate_real_layout()

    # ---------------------------------------------------------------- construction
    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> KimiTokenizer:
        """Read `tiktoken.model` + `tokenizer_config.json` from a model directory.

        Never imports or executes anything found there (no trust_remote_code). Unnamed ids in
        the reserved block are named `<|reserved_token_{id}|>` as Kimi's own loader does.
        """
        path = os.fspath(path)
        model_file = os.path.join(path, "tiktoken.model")
        config_file = os.path.join(path, "tokenizer_config.json")
        for f in (model_file, config_file):
            if not os.path.isfile(f):
                raise TokenizerError(f"{f} not found: a Kimi tokenizer directory needs "
                                     "tiktoken.model and tokenizer_config.json")
        try:
            # Not tiktoken's load_tiktoken_bpe: it caches every file it reads in
            # $TMPDIR/data-gym-cache under a hash of the PATH, so a tokenizer rewritten at the same
            # path (a rebuilt checkpoint or test asset) would be read stale in every later process.
            with open(model_file, "rb") as f:
                ranks = {base64.b64decode(tok): int(rank)
                         for tok, rank in (line.split() for line in f.read().splitlines() if line)}
        except (ValueError, UnicodeDecodeError, binascii.Error, IndexError) as e:
            raise TokenizerError(f"{model_file}: not a tiktoken BPE file (lines of '<base64 token> <rank>'): "
                                 f"{type(e).__name__}: {str(e)[:80]}") from None
        try:
            with open(config_file, encoding="utf-8") as f:
                config = json.load(f)
        except (ValueError, UnicodeDecodeError) as e:
            raise TokenizerError(f"{config_file}: not valid JSON ({str(e)[:80]})") from None
        if not isinstance(config, dict):
            raise TokenizerError(f"{config_file}: expected a JSON object")
        if not ranks:
            raise TokenizerError(f"{model_file}: the file has no tokens")
        n_base = len(ranks)
        num_reserved = int(config.get("num_reserved_special_tokens", NUM_RESERVED_DEFAULT))
        named: dict[int, str] = {}
        for key, entry in config.get("added_tokens_decoder", {}).items():
            named[int(key)] = _added_token_name(entry)
        vocab_size = max([n_base + num_reserved] + [i + 1 for i in named])
        special: dict[str, int] = {}
        for i in range(n_base, vocab_size):
            special[named.get(i, f"<|reserved_token_{i}|>")] = i
        if len(special) != vocab_size - n_base:
            raise TokenizerError(f"{config_file}: duplicate special-token names")
        below = sorted(i for i in named if i < n_base)
        if below:
            raise TokenizerError(f"{config_file}: added tokens {below[:5]} overlap the BPE ranks")
        template = config.get("chat_template")
        jinja_file = os.path.join(path, "chat_template.jinja")
        if template is None and os.path.isfile(jinja_file):
            with open(jinja_file, encoding="utf-8") as f:
                template = f.read()
        return cls(ranks, special, vocab_size=vocab_size,
                   name=os.path.basename(os.path.normpath(path)) or "kimi",
                   bos_token=_token_field(config, "bos_token", "[BOS]"),
                   eos_token=_token_field(config, "eos_token", "[EOS]"),
                   pad_token=_token_field(config, "pad_token", "[PAD]"),
                   chat_template=template if isinstance(template, str) else None)

    def _validate_real_layout(self) -> None:
        """A 163840-entry vocabulary must be the real Kimi one: fail loudly otherwise."""
        if self.n_base != REAL_N_BASE:
            raise TokenizerError(f"vocab {REAL_VOCAB} needs n_base {REAL_N_BASE}, "
                                 f"got {self.n_base}")
        for tok, want in REAL_IDS.items():
            if self._special.get(tok) != want:
                raise TokenizerError(f"{tok} must be id {want} in the real Kimi vocabulary, "
                                     f"got {self._special.get(tok)}")

    # ---------------------------------------------------------------- properties
    @property
    def vocab_size(self) -> int:
        """Base ranks + reserved block; equals the model's embedding rows for Kimi."""
        return self._vocab_size

    @property
    def bos_id(self) -> int:
        return self._bos

    @property
    def eos_id(self) -> int:
        return self._eos

    @property
    def pad_id(self) -> int:
        return self._pad

    @property
    def im_end_id(self) -> int:
        """Chat stop token (`<|im_end|>`; K3 renames it `<|end_of_msg|>`)."""
        for name in ("<|im_end|>", "<|end_of_msg|>"):
            if name in self._special:
                return self._special[name]
        raise TokenizerError("neither <|im_end|> nor <|end_of_msg|> is a special token")

    @property
    def special_ids(self) -> dict[str, int]:
        """Name -> id for every id in the reserved block (a copy)."""
        return dict(self._special)

    def token_id(self, name: str) -> int:
        """Id of the special token `name`; KeyError naming the token if absent."""
        try:
            return self._special[name]
        except KeyError:
            raise KeyError(f"{name!r} is not a special token of this tokenizer") from None

    # ---------------------------------------------------------------- encode / decode
    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        """Text -> ids, special-token strings encoded as ordinary text. No EOS is added (Kimi
        adds neither BOS nor EOS by default)."""
        ids = [self._bos] if add_bos else []
        for piece in split_for_encoding(text):
            ids.extend(self._enc.encode_ordinary(piece))
        return ids

    encode_ordinary = encode

    def encode_batch(self, texts: Sequence[str], *, add_bos: bool = False) -> list[list[int]]:
        """`encode` over many texts; short ones go through tiktoken's threaded batch path."""
        short = [i for i, t in enumerate(texts) if len(t) <= MAX_RUN_CHARS]
        out: list[list[int]] = [[] for _ in texts]
        for i, ids in zip(short, self._enc.encode_ordinary_batch([texts[i] for i in short])):
            out[i] = ids
        for i, t in enumerate(texts):
            if len(t) > MAX_RUN_CHARS:
                out[i] = self.encode(t)
        if add_bos:
            out = [[self._bos] + ids for ids in out]
        return out

    def encode_with_special_tokens(self, text: str) -> list[int]:
        """Encode TRUSTED text in which special-token strings are control tokens (e.g. a
        rendered chat template). Never use this on user content: it is the injection path."""
        ids: list[int] = []
        for piece in split_for_encoding(text):
            ids.extend(self._enc.encode(piece, allowed_special="all"))
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        """Ids -> text; special ids become their names. Invalid UTF-8 byte sequences (a cut
        multi-byte character) decode to U+FFFD."""
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self._vocab_size]
        if bad:
            raise ValueError(f"ids {bad[:5]} outside the vocabulary [0, {self._vocab_size})")
        return self._enc.decode(ids)

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        """Ids -> raw bytes, for streaming decoders that must join partial characters."""
        return self._enc.decode_bytes([int(i) for i in ids])

    def is_special(self, token_id: int) -> bool:
        return token_id >= self.n_base

    def __repr__(self) -> str:
        return (f"KimiTokenizer(n_base={self.n_base}, vocab_size={self._vocab_size}, "
                f"bos={self._bos}, eos={self._eos}, pad={self._pad})")
