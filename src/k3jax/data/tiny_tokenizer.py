"""Build a tiny Kimi-compatible tokenizer directory offline (tests, CPU demo, tiny models).

`build(dir, vocab_size=1024)` writes the two files a real Kimi directory has:
- `tiktoken.model`: 256 single-byte ranks, then BPE merges learned here on a small built-in
  corpus (or one you pass) with Kimi's own pre-tokenisation regex, one `base64 rank` per line;
- `tokenizer_config.json`: `added_tokens_decoder` naming EVERY id of the reserved block, the
  bos/eos/pad/unk names, `num_reserved_special_tokens`, and a jinja `chat_template` mirroring
  the Kimi K2-Instruct template (formats.md §3.5).

The reserved block keeps Kimi's relative layout at the top of the small vocabulary: offset k of
the block holds the token that real id 163584 + k holds (`[BOS]` +0, `[EOS]` +1, `<|im_end|>`
+2, ..., `<|im_middle|>` +17), and `[UNK]`/`[PAD]` are the block's last two ids, as 163838/163839
are. So ids are computed from `vocab_size`; readers take them from the config file, never from
constants. `num_reserved=256` is the real block size; a smaller block (>= 26) lets a 512-entry
vocabulary still have merges. Vocabularies larger than the corpus can fill get unreachable
placeholder tokens (see `build`), so `vocab_size=163840` reproduces the real id layout.
"""
from __future__ import annotations

import base64
import collections
import json
import os
import sys

import regex

from k3jax.data.tokenizer import PAT_STR

# Offsets inside the reserved block (real id - 163584), K2/K2.5 names (formats.md §3.4).
KIMI_SPECIAL_OFFSETS = {
    0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>",
    6: "<|start_header_id|>", 7: "<|end_header_id|>", 9: "[EOT]", 10: "<|im_system|>",
    11: "<|tool_calls_section_begin|>", 12: "<|tool_calls_section_end|>",
    13: "<|tool_call_begin|>", 14: "<|tool_call_argument_begin|>", 15: "<|tool_call_end|>",
    17: "<|im_middle|>", 18: "<|media_begin|>", 19: "<|media_content|>", 20: "<|media_end|>",
    21: "<|media_pad|>", 22: "<think>", 23: "</think>",
}
# K3 renames the block (formats.md §3.4): <|end_of_msg|> and the XTML markers <|open|> <|close|> <|sep|>
# where K2 has <|im_end|> <|im_user|> <|im_assistant|>; K2's other chat and tool-call names are not
# K3's (reserved here), the media tokens stay.
K3_SPECIAL_OFFSETS = {
    0: "[BOS]", 1: "[EOS]", 2: "<|end_of_msg|>", 3: "<|open|>", 4: "<|close|>", 5: "<|sep|>",
    18: "<|media_begin|>", 19: "<|media_content|>", 20: "<|media_end|>", 21: "<|media_pad|>",
}
# The last two ids of the block, like 163838 / 163839 in the real vocabulary.
KIMI_SPECIAL_FROM_END = {2: "[UNK]", 1: "[PAD]"}
MIN_RESERVED = max(KIMI_SPECIAL_OFFSETS) + 1 + len(KIMI_SPECIAL_FROM_END)
FAMILIES = ("k2", "k3")

DEFAULT_SYSTEM = "You are Kimi, an AI assistant created by Moonshot AI."

# A jinja template written for k3jax with the K2-Instruct shape (formats.md §3.5). It is data:
# transformers renders it in its sandboxed jinja environment; chat_template.py is the
# independent Python implementation that is tested against it.
KIMI_CHAT_TEMPLATE = (
    "{%- if tools -%}"
    "<|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}<|im_end|>"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if loop.first and message['role'] != 'system' -%}"
    "<|im_system|>system<|im_middle|>" + DEFAULT_SYSTEM + "<|im_end|>"
    "{%- endif -%}"
    "{%- set role = message['role'] -%}"
    "{%- if role == 'tool' -%}"
    "<|im_system|>tool<|im_middle|>## Return of {{ message['tool_call_id'] }}{{ '\\n' }}"
    "{{ message['content'] }}<|im_end|>"
    "{%- else -%}"
    "{%- if role == 'user' -%}<|im_user|>"
    "{%- elif role == 'assistant' -%}<|im_assistant|>"
    "{%- elif role == 'system' -%}<|im_system|>"
    "{%- else -%}{{ raise_exception('unknown role ' ~ role) }}"
    "{%- endif -%}"
    "{{ message.get('name') or role }}<|im_middle|>"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- elif message['content'] is not none -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{ part['text'] }}"
    "{%- else -%}{{ raise_exception('only text content parts are supported') }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{%- if role == 'assistant' and message.get('tool_calls') -%}"
    "<|tool_calls_section_begin|>"
    "{%- for call in message['tool_calls'] -%}"
    "<|tool_call_begin|>"
    "{{ call.get('id') or ('functions.' ~ call['function']['name'] ~ ':' ~ loop.index0) }}"
    "<|tool_call_argument_begin|>"
    "{%- if call['function']['arguments'] is string -%}{{ call['function']['arguments'] }}"
    "{%- else -%}{{ call['function']['arguments'] | tojson }}{%- endif -%}"
    "<|tool_call_end|>"
    "{%- endfor -%}"
    "<|tool_calls_section_end|>"
    "{%- endif -%}"
    "<|im_end|>"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)

# Invented text for learning merges: common English, chat words, digits, punctuation, a little
# Chinese. Enough distinct pairs for ~1000 merges.
BUILTIN_CORPUS = """\
hello world. Hello, world! The quick brown fox jumps over the lazy dog while the cat sleeps.
The user asks a question and the assistant gives a helpful answer. The system sets the rules.
A tool returns a result, and the model reads the result before it writes the final answer.
We train a small model on simple text so that the loss falls quickly on a laptop computer.
Each document is cut into tokens; tokens are packed into sequences of a fixed length.
In the morning she walked to the market, bought bread, apples and tea, then went back home.
He was reading a book about the history of mathematics, numbers, and the people who made them.
They were playing football in the park when it started to rain, so everyone ran for shelter.
The weather today is sunny with a light wind from the west and a high of twenty-one degrees.
Please write a short story about a robot who learns to paint pictures of the sea at night.
What is the capital of France? The capital of France is Paris, a city on the river Seine.
How many legs does a spider have? A spider has eight legs, while an insect has six legs.
Choose the most plausible ending for the context below and answer with its letter.
A man is standing in a kitchen. He picks up a knife and starts cutting the vegetables.
A woman is sitting on a horse. She pulls the reins and the horse begins to walk forward.
A child is holding a kite on the beach. The wind lifts the kite high into the blue sky.
People are gathered around a table, talking and laughing while they share a large meal.
The teacher explains the lesson, and the students take notes in their small notebooks.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 42 100 128 256 512 1024 2048 4096 2025 3.14 1,000.
Dates such as 2024-01-15 and times like 12:30 appear often, as do prices like $9.99 or 20%.
def main(): return sum(x * x for x in range(10))  # code also appears in training data
for i in range(n): print(i, value[i]) if value[i] > 0 else None; {"key": "value", "id": 7}
Questions, answers, instructions, explanations, summaries, translations and conversations.
important interesting information international understanding development environment
something everything nothing anything sometimes everywhere together another between under
because before after during without within through across against around behind beyond
would could should might must shall will can may do does did done doing have has had having
think thought know knew known make made take took taken give gave given find found work
time year people way day man woman child world life hand part place case week company
system program question government number night point home water room mother area money
story fact month lot right study book eye job word business issue side kind head house
service friend father power hour game line end member law car city community name
president team minute idea kid body information back parent face others level office door
health person art war history party result change morning reason research girl guy moment
air teacher force education good new first last long great little own other old right big
high different small large next early young important few public bad same able
你好世界。我们今天学习语言模型，模型会读文字并写出回答。中文和English混合的句子也很常见。
"""


def _learn_merges(corpus: str, num_merges: int, *, exact: bool = True) -> list[bytes]:
    """Byte-level BPE on `corpus` pre-split by Kimi's regex.

    Returns `num_merges` new tokens (fewer if `exact` is False and the corpus runs out of
    pairs), each the concatenation of two tokens that exist before it (what tiktoken's
    rank-ordered merging needs). Ties go to the lexicographically smallest pair so the result
    is deterministic. Pair counts are updated incrementally: only words that contain the merged
    pair are re-counted.
    """
    splitter = regex.compile(PAT_STR, flags=regex.V1)  # V0 silently mis-splits (§3.2)
    word_freq = collections.Counter(m.encode("utf-8") for m in splitter.findall(corpus))
    words = [[bytes([b]) for b in w] for w in word_freq]
    freqs = list(word_freq.values())
    pair_count: collections.Counter = collections.Counter()
    pair_words: dict[tuple[bytes, bytes], set[int]] = collections.defaultdict(set)
    for wi, w in enumerate(words):
        for a, b in zip(w, w[1:]):
            pair_count[(a, b)] += freqs[wi]
            pair_words[(a, b)].add(wi)
    merges: list[bytes] = []
    seen = {bytes([i]) for i in range(256)}
    while len(merges) < num_merges:
        live = [(c, p) for p, c in pair_count.items() if c > 0 and p[0] + p[1] not in seen]
        if not live and not exact:
            break
        if not live:
            raise ValueError(f"corpus supports only {len(merges)} merges, {num_merges} asked: "
                             "pass a larger corpus or a smaller vocab_size / larger num_reserved")
        best = min(live, key=lambda cp: (-cp[0], cp[1]))[1]
        new = best[0] + best[1]
        merges.append(new)
        seen.add(new)
        for wi in list(pair_words[best]):
            w = words[wi]
            for a, b in zip(w, w[1:]):
                pair_count[(a, b)] -= freqs[wi]
            merged, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == best:
                    merged.append(new)
                    i += 2
                else:
                    merged.append(w[i])
                    i += 1
            words[wi] = merged
            for a, b in zip(merged, merged[1:]):
                pair_count[(a, b)] += freqs[wi]
                pair_words[(a, b)].add(wi)
        pair_count[best] = 0
    return merges


def special_token_names(num_reserved: int, family: str = "k2") -> list[str]:
    """Names of the reserved block, offset 0 .. num_reserved-1, in Kimi's relative layout (K2's
    names, or K3's with ``family="k3"``); None for a reserved id."""
    if num_reserved < MIN_RESERVED:
        raise ValueError(f"num_reserved must be >= {MIN_RESERVED} to hold Kimi's layout")
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    table = K3_SPECIAL_OFFSETS if family == "k3" else KIMI_SPECIAL_OFFSETS
    names = []
    for k in range(num_reserved):
        name = table.get(k) or KIMI_SPECIAL_FROM_END.get(num_reserved - k)
        names.append(name)
    return names


def build(out_dir: str | os.PathLike, *, vocab_size: int = 1024, num_reserved: int = 256,
          corpus: str | None = None, num_merges: int | None = None, family: str = "k2") -> str:
    """Write `tiktoken.model` + `tokenizer_config.json` for a tiny Kimi-style tokenizer.

    Base ranks are the 256 bytes, then learned merges, then (only when the vocabulary is larger
    than the corpus can fill) PLACEHOLDER tokens: `0xFF` + a 3-byte index. Valid UTF-8 never
    contains the byte 0xFF, so no text ever encodes to a placeholder; they exist so that a tiny
    tokenizer can match a big model's embedding (e.g. vocab 163840 puts `[BOS]` at the real
    id 163584). Their count is written to the config as `k3jax_placeholder_tokens`.

    Args:
      out_dir: directory to create or overwrite the two files in.
      vocab_size: total ids = 256 bytes + merges + placeholders + num_reserved (the model's
        embedding rows).
      num_reserved: size of the special block at the top of the vocabulary (Kimi: 256).
      corpus: text to learn merges from; defaults to `BUILTIN_CORPUS` (~1000 merges).
      num_merges: exact number of merges to learn (ValueError if the corpus cannot supply
        them); None learns as many as fit, up to what the corpus supports.
      family: "k2" (K2's special names and a K2-shaped jinja chat template) or "k3" (K3's
        <|end_of_msg|> / <|open|> / <|close|> / <|sep|>, no template: k3jax renders K3's format
        natively, data/k3_chat.py).
    Returns:
      `out_dir` as a string.
    """
    room = vocab_size - 256 - num_reserved
    if room < 0:
        raise ValueError(f"vocab_size {vocab_size} < 256 bytes + {num_reserved} reserved ids")
    if num_merges is not None and not 0 <= num_merges <= room:
        raise ValueError(f"num_merges {num_merges} does not fit in {room} free ids")
    names = special_token_names(num_reserved, family)
    text = BUILTIN_CORPUS if corpus is None else corpus
    if num_merges is None:
        merges = _learn_merges(text, room, exact=False)
    else:
        merges = _learn_merges(text, num_merges)
    placeholders = [b"\xff" + i.to_bytes(3, "big") for i in range(room - len(merges))]
    tokens = [bytes([i]) for i in range(256)] + merges + placeholders
    n_base = len(tokens)
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "tiktoken.model"), "w", encoding="ascii") as f:
        for rank, tok in enumerate(tokens):
            f.write(f"{base64.b64encode(tok).decode('ascii')} {rank}\n")
    decoder = {}
    for k, name in enumerate(names):
        token_id = n_base + k
        decoder[str(token_id)] = {
            "content": name or f"<|reserved_token_{token_id}|>",
            "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
            "special": True,
        }
    config = {
        "added_tokens_decoder": decoder,
        "bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[PAD]", "unk_token": "[UNK]",
        "num_reserved_special_tokens": num_reserved,
        "k3jax_placeholder_tokens": len(placeholders),
        "model_max_length": 1_048_576,
        "tokenizer_class": "TikTokenTokenizer",
    }
    if family == "k2":
        config["chat_template"] = KIMI_CHAT_TEMPLATE
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=1, ensure_ascii=False)
    return out_dir


def main(argv: list[str] | None = None) -> None:
    """`python -m k3jax.data.tiny_tokenizer [--k3] OUT_DIR [VOCAB_SIZE [NUM_RESERVED]]` (--k3: K3's names)."""
    args = sys.argv[1:] if argv is None else argv
    family = "k3" if "--k3" in args else "k2"
    args = [a for a in args if a != "--k3"]
    if not 1 <= len(args) <= 3:
        raise SystemExit(main.__doc__)
    vocab = int(args[1]) if len(args) > 1 else 1024
    reserved = int(args[2]) if len(args) > 2 else 256
    print(build(args[0], vocab_size=vocab, num_reserved=reserved, family=family))


if __name__ == "__main__":
    main()
