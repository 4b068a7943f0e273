"""RL prompt sets: JSONL / Parquet records -> rendered prompts, through grain (docs/rl.md).

A record is a JSON object (a JSONL line, a Parquet row) with either

    "prompt":   a string, tokenized as it is (no chat template: a completion-style prompt), or
    "messages": a conversation ([{"role", "content"}, ...]) rendered with the tokenizer's chat
                template and its generation prompt (K3's format for a K3 tokenizer, K2's otherwise),
                with optional "tools" (OpenAI-style function schemas, declared to the model),

plus any fields the rewards read (``answer`` for exact_match, ``tool_call`` for tool_call, a user
reward's ``fields``). Every prompt keeps its place, "path:line" (JSONL, 1-based) or "path:row N"
(Parquet), for error messages. A record that is not such an object, lacks a field a configured reward
reads, cannot be rendered, or leaves no room for ``rl_max_new_tokens`` in ``max_target_length`` is a
``DataError`` naming its place (RL prompt sets are small and curated: nothing is skipped silently).
In Parquet, ``messages`` and ``tools`` are JSON strings (the columns are read with
``data.sources.ParquetSource``, which reads columns of strings and numbers).
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any

import grain
import jax
import jinja2
import pyarrow as pa
import pyarrow.parquet as pq
from grain.sources import RandomAccessDataSource

from k3jax import paths as _paths
from k3jax.config import Config, ConfigError
from k3jax.data import chat_template
from k3jax.data.sources import DataError, JsonlSource, ParquetSource, expand_paths
from k3jax.data.tokenizer import KimiTokenizer, TokenizerError

FORMATS = ("jsonl", "parquet")


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One rendered prompt."""
    record: dict                    # the whole record (the fields rewards read)
    where: str                      # "path:line" / "path:row N"
    ids: tuple[int, ...]            # prompt token ids, ending with the chat's generation prompt
    tools: tuple[str, ...]          # the function names declared (rewards.parse_reply's ``tools``)


class PromptSource(RandomAccessDataSource):
    """Random access over the records of JSONL or Parquet files: item i = (payload, where), the
    payload a JSONL line's bytes or a Parquet row's {column: value}."""

    def __init__(self, paths: str | Sequence[str], fmt: str):
        if fmt not in FORMATS:
            raise ConfigError(f"RL prompts are read from {' or '.join(FORMATS)} files, not {fmt!r}")
        self.fmt = fmt
        if fmt == "jsonl":
            self._jsonl = JsonlSource(paths)
            return
        files = expand_paths(paths)
        try:
            schema = pq.ParquetFile(_paths.open_binary(files[0])).schema_arrow
        except Exception as e:  # noqa: BLE001 - pyarrow raises several kinds for a non-Parquet file
            raise DataError(f"{files[0]}: not a readable Parquet file ({str(e).splitlines()[0]})") from None
        nested = [f.name for f in schema if pa.types.is_nested(f.type)]
        if nested:
            raise DataError(f"{files[0]}: columns {nested} are nested; store messages and tools as JSON strings "
                            "(Parquet prompt columns are strings or numbers)")
        self._columns = {name: ParquetSource(files, column=name) for name in schema.names}

    def __len__(self) -> int:
        return len(self._jsonl) if self.fmt == "jsonl" else len(next(iter(self._columns.values())))

    def __getitem__(self, index: int) -> tuple[Any, str]:
        if self.fmt == "jsonl":
            return self._jsonl[index]
        row, where = {}, ""
        for name, col in self._columns.items():
            row[name], where = col[index]
        return row, where

    def __repr__(self) -> str:
        return f"PromptSource({self.fmt}, {len(self)} records)"


def _json_field(record: dict, key: str, where: str) -> Any:
    """A field that may come as a JSON string (Parquet): parsed."""
    value = record.get(key)
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError as e:
            raise DataError(f"{where}: {key!r} is a string but not JSON ({e})") from None
    return value


def _tool_names(tools: Any, where: str) -> tuple[str, ...]:
    if not isinstance(tools, list):
        raise DataError(f"{where}: 'tools' must be a list of function schemas")
    names = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not (isinstance(fn, dict) and isinstance(fn.get("name"), str) and fn["name"]):
            raise DataError(f"{where}: tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}")
        names.append(fn["name"])
    return tuple(names)


class RenderPrompt:
    """The map step: (payload, where) -> ``Prompt``, checked as the module docstring says.

    ``fields``: record field -> the reward that reads it (``RewardSet.fields``). A prompt whose ids
    plus ``max_new_tokens`` exceed ``max_target_length`` is an error."""

    def __init__(self, tok: KimiTokenizer, *, fields: Mapping[str, str], max_new_tokens: int,
                 max_target_length: int):
        self.tok, self.fields = tok, dict(fields)
        self.max_new_tokens, self.max_target_length = max_new_tokens, max_target_length

    def record(self, payload: Any, where: str) -> dict:
        if isinstance(payload, bytes):
            try:
                payload = json.loads(payload.decode("utf-8"))
            except UnicodeDecodeError as e:
                raise DataError(f"{where}: invalid UTF-8 at byte {e.start}") from None
            except ValueError as e:
                raise DataError(f"{where}: not a JSON object ({e}); RL prompts are one JSON object per line") from None
        if not isinstance(payload, dict):
            raise DataError(f"{where}: a record must be a JSON object with 'prompt' or 'messages', got "
                            f"{type(payload).__name__}")
        return payload

    def __call__(self, item: tuple[Any, str]) -> Prompt:
        payload, where = item
        rec = self.record(payload, where)
        has = [k for k in ("prompt", "messages") if rec.get(k) is not None]
        if len(has) != 1:
            raise DataError(f"{where}: a record needs exactly one of 'prompt' (text) and 'messages' (a chat), "
                            f"got {has or 'neither'}")
        for field, reward in self.fields.items():
            if rec.get(field) is None:
                raise DataError(f"{where}: no field {field!r}, which the reward {reward!r} reads")
        tools = _json_field(rec, "tools", where)
        names = _tool_names(tools, where) if tools is not None else ()
        if has == ["prompt"]:
            if not isinstance(rec["prompt"], str) or not rec["prompt"]:
                raise DataError(f"{where}: 'prompt' must be a non-empty string")
            if tools is not None:
                raise DataError(f"{where}: 'tools' are declared through the chat template: give 'messages', "
                                "not 'prompt'")
            ids = self.tok.encode(rec["prompt"])
        else:
            messages = _json_field(rec, "messages", where)
            if not isinstance(messages, list) or not messages:
                raise DataError(f"{where}: 'messages' must be a non-empty list of {{role, content}} messages")
            try:
                ids = chat_template.chat_ids(self.tok, messages, tools=tools)
            except (ValueError, KeyError, TypeError, TokenizerError, jinja2.TemplateError) as e:
                # (a checkpoint's jinja template reports a bad conversation with raise_exception)
                raise DataError(f"{where}: messages: {e}") from None
        if len(ids) + self.max_new_tokens > self.max_target_length:
            raise DataError(f"{where}: the prompt's {len(ids)} tokens + rl_max_new_tokens={self.max_new_tokens} "
                            f"exceed max_target_length={self.max_target_length}; raise max_target_length, lower "
                            "rl_max_new_tokens or shorten the prompt")
        return Prompt(rec, where, tuple(ids), names)


def _records(cfg: Config, held_out: bool, process_index: int | None, process_count: int | None
             ) -> grain.MapDataset:
    """This process's strided slice of the raw records of dataset_path (or eval_dataset_path), in file
    order (process k reads records k, k + n, ...: the processes never share a prompt)."""
    process_index = jax.process_index() if process_index is None else process_index
    process_count = jax.process_count() if process_count is None else process_count
    paths = cfg.eval.eval_dataset_path if held_out else cfg.data.dataset_path
    if not paths:
        raise ConfigError("held-out RL prompts need eval_dataset_path" if held_out else
                          "RL prompts need dataset_path (a glob of .jsonl or .parquet files)")
    src = PromptSource(paths, cfg.data.dataset_type)
    ds = grain.MapDataset.source(src)[process_index::process_count]
    if len(ds) == 0:
        raise DataError(f"{paths}: no prompts" + (" (the files are empty)" if len(src) == 0 else
                                                  f" for process {process_index} of {process_count}"))
    return ds


def _render(cfg: Config, tok: KimiTokenizer, fields: Mapping[str, str]) -> RenderPrompt:
    return RenderPrompt(tok, fields=fields, max_new_tokens=cfg.rl.rl_max_new_tokens,
                        max_target_length=cfg.train.max_target_length)


def prompt_dataset(cfg: Config, tok: KimiTokenizer, fields: Mapping[str, str], *, held_out: bool = False,
                   process_index: int | None = None, process_count: int | None = None) -> grain.MapDataset:
    """A grain ``MapDataset`` of ``Prompt``s from ``dataset_path`` (``dataset_type`` jsonl or parquet):
    this process's slice of the records, rendered by ``RenderPrompt`` with ``rl_max_new_tokens`` and
    ``max_target_length``, ``fields`` = ``RewardSet.fields``. Shuffled with ``data_seed`` when
    ``data_shuffle`` (each epoch anew) and repeated ``num_epoch`` times (0 = without end).
    held_out=True: ``eval_dataset_path``, in file order, one pass. Random access: element k is the same
    prompt after a restart, so a step's prompts are ``ds[step * n : (step + 1) * n]``."""
    ds = _records(cfg, held_out, process_index, process_count)
    if not held_out:
        if cfg.data.data_shuffle:
            ds = ds.shuffle(seed=cfg.data.data_seed)
        ds = ds.repeat(cfg.data.num_epoch or None)
    return ds.map(_render(cfg, tok, fields))


def check_prompts(cfg: Config, tok: KimiTokenizer, fields: Mapping[str, str], *, held_out: bool = False,
                  limit: int | None = None, process_index: int | None = None,
                  process_count: int | None = None) -> int:
    """Render every record of this process's prompts (the first ``limit`` when given), in file order,
    before any model is built: a bad record stops the run at once, named by its place, instead of
    steps later. -> records checked."""
    ds = _records(cfg, held_out, process_index, process_count).map(_render(cfg, tok, fields))
    n = len(ds) if limit is None else min(limit, len(ds))
    for i in range(n):
        ds[i]
    return n
