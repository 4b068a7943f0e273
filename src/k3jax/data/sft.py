"""Supervised fine-tuning examples: conversations -> token ids + per-token target weights.

An SFT record is a JSON object `{"messages": [{"role", "content"}, ...]}` (sft_format
"messages"; an optional record-level `"tools": [schema, ...]`, OpenAI's field, is declared as the
chat template declares a request's tools) or a HellaSwag row `{"ctx", "endings", "label"}`
(sft_format "hellaswag"), turned into messages by `hellaswag_to_messages`. Both are rendered with
the Kimi chat template (`chat_template.render`, add_generation_prompt=False), so only assistant
output is learned.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from k3jax.data import chat_template
from k3jax.data.tokenizer import KimiTokenizer

LETTERS = "ABCD"
HELLASWAG_INSTRUCTION = ("Choose the most plausible continuation of the context from the four "
                         "endings below. Reply with the ending itself.")
SFT_FORMATS = ("messages", "hellaswag")


def hellaswag_to_messages(row: Mapping[str, Any]) -> list[dict[str, str]]:
    """A HellaSwag row -> a two-turn conversation.

    Args:
      row: `{"ctx": str, "endings": [4 str], "label": int | "0".."3"}` (HellaSwag's layout; other
        fields such as `activity_label` are ignored).
    Returns:
      `[{"role": "user", "content": instruction + context + lettered endings},
        {"role": "assistant", "content": the correct ending}]`.
    Raises:
      ValueError: wrong number of endings, a label outside 0..3, or a missing field.
    """
    try:
        ctx, endings, label = row["ctx"], row["endings"], int(row["label"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"not a HellaSwag row (needs ctx, endings, label): {e}") from None
    if not isinstance(ctx, str) or not isinstance(endings, Sequence) or len(endings) != 4:
        raise ValueError("HellaSwag row needs a string ctx and exactly 4 endings")
    if not 0 <= label < 4:
        raise ValueError(f"HellaSwag label {label} is not in 0..3")
    options = "\n".join(f"{LETTERS[i]}. {str(e).strip()}" for i, e in enumerate(endings))
    prompt = f"{HELLASWAG_INSTRUCTION}\n\nContext: {ctx.strip()}\n\n{options}"
    return [{"role": "user", "content": prompt},
            {"role": "assistant", "content": str(endings[label]).strip()}]


def validate_messages(messages: Any) -> list[Mapping[str, Any]]:
    """Check the `messages` field's shape; ValueError saying what is wrong."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("'messages' must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise ValueError(f"message {i} is not an object with a string 'role'")
        if m["role"] not in ("system", "user", "assistant", "tool"):
            raise ValueError(f"message {i} has unknown role {m['role']!r}")
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise ValueError(f"message {i} content must be a string or a list of parts")
    return messages


class Conversation(list):
    """Validated messages plus the record's `tools` (None when it has none), which
    `conversation_to_example` declares."""
    tools: list[Mapping[str, Any]] | None = None


def record_to_messages(record: Mapping[str, Any], sft_format: str) -> list[Mapping[str, Any]]:
    """A parsed JSON record -> validated messages for `sft_format` ("messages"|"hellaswag"); a
    "messages" record's `tools` ride along as the result's `.tools` (a `Conversation`)."""
    if sft_format == "messages":
        if not isinstance(record, Mapping) or "messages" not in record:
            raise ValueError("SFT record has no 'messages' field")
        conv = Conversation(validate_messages(record["messages"]))
        tools = record.get("tools")
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, Mapping) for t in tools)):
            raise ValueError("SFT record 'tools' must be a list of tool schema objects")
        conv.tools = tools or None
        return conv
    if sft_format == "hellaswag":
        return hellaswag_to_messages(record)
    raise ValueError(f"sft_format must be one of {SFT_FORMATS}, got {sft_format!r}")


def conversation_to_example(tokenizer: KimiTokenizer, messages: Sequence[Mapping[str, Any]],
                            *, default_system: str | None = chat_template.DEFAULT_SYSTEM,
                            tools: Sequence[Mapping[str, Any]] | None = None
                            ) -> tuple[np.ndarray, np.ndarray]:
    """Render a complete conversation for training; `tools` (default: the `.tools` of a
    `Conversation`) are declared in a leading `tool_declare` turn, as at inference.

    Returns:
      `(tokens int32 [L], weights float32 [L])`: weights[i] = 1 iff token i is assistant output
      and so a prediction target (the pipeline turns it into `loss_mask[t] = weights[t + 1]`).
    """
    ids, mask = chat_template.render(tokenizer, messages, add_generation_prompt=False,
                                     default_system=default_system,
                                     tools=tools if tools is not None else getattr(messages, "tools", None))
    return np.asarray(ids, np.int32), np.asarray(mask, np.float32)


SFT_OVERLONG = ("truncate", "drop")


def fit_to_length(tokens: np.ndarray, weights: np.ndarray, seq_len: int,
                  policy: str) -> tuple[np.ndarray, np.ndarray] | None:
    """A rendered conversation that must fit one training row of `seq_len` tokens.

    The pipeline would otherwise cut an over-long conversation into seq_len pieces, and every
    piece after the first would train the model to answer without the question. Here:
      - it fits: returned unchanged;
      - `policy="truncate"`: its first seq_len tokens (the system and user turns and the start of
        the answer; the end of the conversation is cut), or None when no assistant token would be
        left to predict inside them (the prompt alone fills the row);
      - `policy="drop"`: None.
    The caller counts the Nones.
    """
    if len(tokens) <= seq_len:
        return tokens, weights
    if policy not in SFT_OVERLONG:
        raise ValueError(f"sft_overlong must be one of {SFT_OVERLONG}, got {policy!r}")
    # Token i is a target of position i-1 (loss_mask[t] = weights[t+1]), so a row of seq_len
    # tokens predicts weights[1:seq_len].
    if policy == "drop" or not weights[1:seq_len].any():
        return None
    return tokens[:seq_len], weights[:seq_len]


def hellaswag_candidates(tokenizer: KimiTokenizer, row: Mapping[str, Any], *,
                        default_system: str | None = chat_template.DEFAULT_SYSTEM
                        ) -> tuple[list[tuple[np.ndarray, np.ndarray]], int]:
    """The four endings of a HellaSwag row, each rendered as the assistant's answer to the row's
    question (`conversation_to_example`), and the label: the model's HellaSwag choice is the
    ending it gives the highest likelihood (lowest summed loss over the answer tokens)."""
    user = hellaswag_to_messages(row)[:1]   # validates the row
    examples = [conversation_to_example(tokenizer, user + [{"role": "assistant", "content": str(e).strip()}],
                                        default_system=default_system) for e in row["endings"]]
    return examples, int(row["label"])


def hellaswag_prompt(tokenizer: KimiTokenizer, row: Mapping[str, Any]) -> list[int]:
    """Inference prompt for a HellaSwag row: the user turn plus the generation prompt, ready
    for the model to write the ending (used to evaluate an SFT model)."""
    user = hellaswag_to_messages(row)[:1]
    ids, _ = chat_template.render(tokenizer, user, add_generation_prompt=True)
    return ids
