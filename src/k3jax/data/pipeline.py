"""grain input pipelines: records -> documents -> pieces <= seq_len -> first-fit packed batches.

    source[process_index::process_count]      per-host disjoint strided slice of records
      .shuffle(seed).repeat(num_epochs)         global index shuffle, reshuffled every epoch
      .map(parse)                               decode + validate + tokenize; bad -> None (skip)
      .to_iter_dataset(read threads)            None elements are dropped here
      flat_map(split_document)                  over-long docs -> seq_len pieces, targets made
      FirstFitPackIterDataset(seq_len)          pieces never straddle rows; segment ids 1-based
      .batch(batch_size).map(finalize)          -> dict of [B, T] numpy arrays

Every stage is a grain transformation with exact `get_state`/`set_state`, so the iterator resumes
the very same batches and saves with `grain.checkpoint.CheckpointSave` in an orbax Composite.

Batch contract ([B, T] = [batch_size, seq_len]):
  tokens      int32    packed documents, 0 on padding
  targets     int32    next token of the same document piece, 0 where there is none
  segment_ids int32    1, 2, ... per piece within a row; 0 = padding
  positions   int32    0-based position within the piece
  loss_mask   float32  1 where `targets` is a real prediction target: 0 on padding, on the last
                       token of every piece (its next token is in another segment or absent) and,
                       for SFT, wherever the target is not assistant output.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import threading
from typing import Any

import grain
import numpy as np

from k3jax.data import sft as sft_lib
from k3jax.data.sources import (ArrayRecordSource, DataError, JsonlSource, ParquetSource,
                                SyntheticSource)
from k3jax.data.tokenizer import KimiTokenizer

logger = logging.getLogger(__name__)

DATASET_TYPES = ("synthetic", "jsonl", "parquet", "arrayrecord", "sft", "mm_sft")
BAD_DATA_POLICIES = ("skip", "fatal")


@dataclasses.dataclass
class PipelineStats:
    """Counters of one pipeline, updated by grain's read threads (hence the lock).

    Counts cover records READ, which runs ahead of the batches consumed by up to the prefetch
    buffer; they restart at 0 on a new iterator (they are not part of the checkpoint), and with
    `mp_prefetch` each worker process keeps its own copy.
    """
    records: int = 0          # records parsed (good or bad)
    docs: int = 0             # documents emitted
    empty: int = 0            # empty / whitespace-only text, null cells, no assistant turn
    bad_utf8: int = 0         # undecodable UTF-8
    bad_json: int = 0         # invalid JSON
    bad_record: int = 0       # valid JSON of the wrong shape (missing key, bad messages, ...)
    bad_image: int = 0        # mm_sft: a missing or unreadable image, or too many patches
    split_docs: int = 0       # documents longer than seq_len, split into pieces
    pieces: int = 0           # pieces emitted to packing
    dropped_pieces: int = 0   # pieces with no prediction target (e.g. a 1-token tail)
    sft_truncated: int = 0    # SFT conversations longer than seq_len, cut to their first seq_len tokens
    sft_dropped: int = 0      # SFT conversations longer than seq_len, left out (sft_overlong=drop, or no answer fits)
    tokens: int = 0           # tokens in emitted pieces
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

    def add(self, **counts: int) -> None:
        with self._lock:
            for k, v in counts.items():
                setattr(self, k, getattr(self, k) + v)

    @property
    def bad(self) -> int:
        """Malformed records (what ``bad_data_max_fraction`` bounds)."""
        return self.bad_utf8 + self.bad_json + self.bad_record + self.bad_image

    @property
    def skipped(self) -> int:
        """Records dropped for any reason (empty or bad)."""
        return self.empty + self.bad

    def as_dict(self) -> dict[str, int]:
        with self._lock:
            d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                 if not f.name.startswith("_")}
        d["skipped"] = d["empty"] + d["bad_utf8"] + d["bad_json"] + d["bad_record"] + d["bad_image"]
        return d

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_lock"] = None
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()


class _BadRecord(Exception):
    def __init__(self, counter: str, why: str):
        super().__init__(why)
        self.counter = counter


def _utf8(data: bytes) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _BadRecord("bad_utf8", f"invalid UTF-8 at byte {e.start}") from None


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise _BadRecord("bad_json", f"invalid JSON ({e.msg} at column {e.colno})") from None


def _text_field(record: Any, key: str) -> str:
    if not isinstance(record, dict) or not isinstance(record.get(key), str):
        raise _BadRecord("bad_record", f"record is not an object with a string {key!r} field")
    return record[key]


class ParseDocument:
    """Raw record -> `{"tokens": int32 [L], "weights": float32 [L]}`, or None to skip it.

    weights[i] = 1 marks token i as a prediction target (all tokens for pretraining text, the
    assistant output for SFT). Pretraining text gets `eos_id` appended when `add_eos`, so the
    model learns where documents end. Bad records raise `DataError` ("fatal") or are logged
    with their location, counted and skipped ("skip").
    """

    def __init__(self, dataset_type: str, tokenizer: KimiTokenizer | None, *, text_key: str,
                 bad_data: str, stats: PipelineStats, add_eos: bool, sft_format: str,
                 seq_len: int | None = None, sft_overlong: str = "truncate",
                 sft_default_system: str | None = sft_lib.chat_template.DEFAULT_SYSTEM,
                 max_bad_fraction: float = 1.0, min_records: int = 0):
        self.dataset_type, self.tokenizer, self.text_key = dataset_type, tokenizer, text_key
        self.bad_data, self.stats, self.add_eos = bad_data, stats, add_eos
        self.sft_format, self.seq_len, self.sft_overlong = sft_format, seq_len, sft_overlong
        self.sft_default_system = sft_default_system
        self.max_bad_fraction, self.min_records = max_bad_fraction, min_records

    def _sft(self, tokens: np.ndarray, weights: np.ndarray) -> dict[str, np.ndarray] | None:
        """A conversation fitted to one row (see `sft.fit_to_length`), counted when changed."""
        if self.seq_len is not None and len(tokens) > self.seq_len:
            fitted = sft_lib.fit_to_length(tokens, weights, self.seq_len, self.sft_overlong)
            self.stats.add(**{"sft_dropped" if fitted is None else "sft_truncated": 1})
            if fitted is None:
                return None
            tokens, weights = fitted
        return {"tokens": tokens, "weights": weights} if weights.any() else None

    def _text(self, payload: Any) -> str:
        """The document text of a raw record, by source kind."""
        kind = self.dataset_type
        if kind == "jsonl":
            line = _utf8(payload)
            if not line.strip():
                return ""  # a blank line: an empty document, not a JSON error
            return _text_field(_json(line), self.text_key)
        if kind == "parquet":
            if payload is None:
                return ""
            if isinstance(payload, bytes):
                return _utf8(payload)
            if not isinstance(payload, str):
                raise _BadRecord("bad_record", f"cell of type {type(payload).__name__}, "
                                 "expected string")
            return payload
        # arrayrecord: UTF-8 text, or a JSON object when the first non-space char is '{'.
        text = _utf8(payload)
        if text.lstrip().startswith("{"):
            return _text_field(_json(text), self.text_key)
        return text

    def _document(self, payload: Any) -> dict[str, np.ndarray] | None:
        if self.dataset_type == "synthetic":
            tokens = np.asarray(payload, np.int32)
            return {"tokens": tokens, "weights": np.ones(len(tokens), np.float32)}
        if self.dataset_type == "sft":
            line = _utf8(payload)
            if not line.strip():
                return None
            try:
                messages = sft_lib.record_to_messages(_json(line), self.sft_format)
                tokens, weights = sft_lib.conversation_to_example(self.tokenizer, messages,
                                                                  default_system=self.sft_default_system)
            except ValueError as e:
                raise _BadRecord("bad_record", str(e)) from None
            return self._sft(tokens, weights)
        text = self._text(payload)
        if not text.strip():
            return None
        ids = self.tokenizer.encode(text)
        if self.add_eos:
            ids.append(self.tokenizer.eos_id)
        return {"tokens": np.asarray(ids, np.int32), "weights": np.ones(len(ids), np.float32)}

    def __call__(self, item: Any) -> dict[str, np.ndarray] | None:
        payload, where = (item, None) if self.dataset_type == "synthetic" else item
        try:
            doc = self._document(payload)
        except _BadRecord as e:
            self.stats.add(records=1, **{e.counter: 1})
            if self.bad_data == "fatal":
                raise DataError(f"{where}: {e}") from None
            self._skipped(where, e)
            return None
        if doc is None:
            self.stats.add(records=1, empty=1)
            return None
        self.stats.add(records=1, docs=1)
        return doc


    def _skipped(self, where: str, why: Exception) -> None:
        """The skip policy: the first MAX_WARNINGS bad records are logged with file:line, later ones
        only counted (``bad_records`` in the metrics); too large a bad fraction stops the run."""
        st = self.stats
        bad, records = st.bad, st.records
        if bad <= MAX_WARNINGS:
            logger.warning("skipping bad record at %s: %s", where, why)
        if bad == MAX_WARNINGS:
            logger.warning("further bad records are counted (bad_records in the metrics), not logged")
        if records >= max(self.min_records, MIN_RECORDS_FOR_FRACTION) and bad > self.max_bad_fraction * records:
            raise DataError(f"{bad} of the {records} records read are malformed, more than bad_data_max_fraction="
                            f"{self.max_bad_fraction} (the last at {where}: {why}); fix the data, or check "
                            f"text_key={self.text_key!r} and dataset_type={self.dataset_type}")


# Bad records logged one by one before the policy only counts them.
MAX_WARNINGS = 5
# Records read before the bad fraction can stop a run (when bad_data_check_records is smaller).
MIN_RECORDS_FOR_FRACTION = 10


def check_records(ds, parse: ParseDocument, n: int, max_bad_fraction: float, what: str) -> None:
    """Parse the first ``n`` records of ``ds`` (a map dataset of raw records) at once, before a
    model is built: a source of which no record gives a document, or of which more than
    ``max_bad_fraction`` are malformed, is a DataError naming the first bad record's place."""
    k = min(n, len(ds))
    bad = docs = 0
    first = None
    stats = getattr(parse, "stats", None)
    dropped = stats.sft_dropped if stats is not None else 0
    for i in range(k):
        payload, where = ds[i]
        try:
            docs += parse._document(payload) is not None
        except _BadRecord as e:
            if parse.bad_data == "fatal":
                raise DataError(f"{where}: {e}") from None
            bad += 1
            first = first or f"{where}: {e}"
    hint = f"check text_key={parse.text_key!r}" if parse.dataset_type not in ("sft", "mm_sft") else \
        f"check sft_format={parse.sft_format}"
    long = stats.sft_dropped - dropped if stats is not None else 0     # SFT conversations that do not fit a row
    if docs == 0 and long:
        raise DataError(f"none of the first {k} records of {what} gives a document: {long} are longer than "
                        f"max_target_length={parse.seq_len} and cannot be cut to fit (sft_overlong={parse.sft_overlong}"
                        f"{', never through an image' if parse.dataset_type == 'mm_sft' else ''}), {bad} malformed, "
                        f"{k - bad - long} empty; raise max_target_length")
    if docs == 0:
        raise DataError(f"{first + ': ' if first else ''}none of the first {k} records of {what} gives a document "
                        f"({bad} malformed, {k - bad} empty); {hint} and dataset_type={parse.dataset_type}")
    if bad > max_bad_fraction * k:
        raise DataError(f"{first}: {bad} of the first {k} records of {what} are malformed, more than "
                        f"bad_data_max_fraction={max_bad_fraction}; {hint}")


def split_document(tokens: np.ndarray, weights: np.ndarray,
                   seq_len: int) -> list[dict[str, np.ndarray]]:
    """Cut one document into pieces of <= seq_len tokens and build their targets.

    Args:
      tokens: int32 [L]; weights: float32 [L] (1 = token i is a prediction target).
    Returns:
      pieces `{"tokens": int32 [l], "targets": int32 [l], "loss_mask": float32 [l]}` with
      `targets[t] = tokens[t+1]` and `loss_mask[t] = weights[t+1]` inside the piece; the last
      position of each piece has target 0 and mask 0 because its next token lives in another
      segment. Pieces with no target at all are left out.
    """
    pieces = []
    for start in range(0, len(tokens), seq_len):
        t = tokens[start:start + seq_len]
        w = weights[start:start + seq_len]
        targets = np.zeros_like(t)
        targets[:-1] = t[1:]
        loss = np.zeros(len(t), np.float32)
        loss[:-1] = w[1:]
        if loss.any():
            pieces.append({"tokens": t, "targets": targets, "loss_mask": loss})
    return pieces


class _SplitDocument(grain.experimental.FlatMapTransform):
    """grain FlatMap around `split_document` that also counts splits."""

    def __init__(self, seq_len: int, stats: PipelineStats):
        self.seq_len, self.stats = seq_len, stats
        self.max_fan_out = 1 << 20  # unused by FlatMapIterDataset; documents are not bounded

    def flat_map(self, doc: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
        n = len(doc["tokens"])
        pieces = split_document(doc["tokens"], doc["weights"], self.seq_len)
        expected = -(-n // self.seq_len)
        self.stats.add(split_docs=int(n > self.seq_len), pieces=len(pieces),
                       dropped_pieces=expected - len(pieces),
                       tokens=sum(len(p["tokens"]) for p in pieces))
        return pieces


def finalize_batch(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """grain's packed names -> the batch contract of this module (see module docstring)."""
    return {
        "tokens": batch["tokens"].astype(np.int32),
        "targets": batch["targets"].astype(np.int32),
        "segment_ids": batch["tokens_segment_ids"].astype(np.int32),
        "positions": batch["tokens_positions"].astype(np.int32),
        "loss_mask": batch["loss_mask"].astype(np.float32),
    }


class PipelineIterator(grain.DatasetIterator):
    """The batch iterator: a grain DatasetIterator (exact `get_state`/`set_state`, works with
    `grain.checkpoint.CheckpointSave/Restore`) that also carries the pipeline's `stats` and its
    data shard `(index, count)` (the record slice it reads).

    The state names the shard, since a state only continues the pipeline of its own shard: which
    shard a process reads depends on the mesh as well as the process count (processes of one
    context group share a shard), so a restart with as many processes may still read another."""

    def __init__(self, parent: grain.DatasetIterator, stats: PipelineStats, shard: tuple[int, int]):
        super().__init__(parent)
        self.stats, self.shard = stats, tuple(shard)

    def __next__(self) -> dict[str, np.ndarray]:
        return next(self._parent)

    def get_state(self) -> dict[str, Any]:
        return {"data_shard": list(self.shard), "pipeline": self._parent.get_state()}

    def set_state(self, state: dict[str, Any]) -> None:
        if "pipeline" not in state:   # saved before states named their shard
            self._parent.set_state(state)
            return
        if tuple(state["data_shard"]) != self.shard:
            raise ValueError(f"the data-iterator state is of data shard {tuple(state['data_shard'])}, this pipeline "
                             f"reads shard {self.shard}")
        self._parent.set_state(state["pipeline"])


def pipeline_stats(it: PipelineIterator) -> dict[str, int]:
    """Counters of the pipeline behind `it` (see `PipelineStats`)."""
    return it.stats.as_dict()


def _source(dataset_type: str, paths: str | None, *, text_key: str, vocab_size: int | None,
            seed: int, seq_len: int, synthetic_len: tuple[int, int] | None):
    if dataset_type == "synthetic":
        if vocab_size is None:
            raise ValueError("dataset_type='synthetic' needs vocab_size")
        lo, hi = synthetic_len or (min(8, seq_len), seq_len)
        return SyntheticSource(vocab_size=vocab_size, seed=seed, min_len=lo, max_len=hi)
    if not paths:
        raise ValueError(f"dataset_type={dataset_type!r} needs paths")
    if dataset_type in ("jsonl", "sft"):
        return JsonlSource(paths)
    if dataset_type == "parquet":
        return ParquetSource(paths, column=text_key)
    return ArrayRecordSource(paths)


def make_dataset(*, dataset_type: str, paths: str | None, tokenizer: KimiTokenizer | None,
                 seq_len: int, batch_size: int, seed: int, shuffle: bool = True,
                 process_index: int | None = None, process_count: int | None = None,
                 bad_data: str = "skip", vocab_size: int | None = None, text_key: str = "text",
                 num_epochs: int | None = None, add_eos: bool = True,
                 sft_format: str = "messages", sft_overlong: str = "truncate",
                 sft_default_system: str | None = sft_lib.chat_template.DEFAULT_SYSTEM,
                 num_packing_bins: int = 16,
                 read_threads: int = 2, prefetch: int = 64,
                 synthetic_len: tuple[int, int] | None = None,
                 check_records_first: int = 0, max_bad_fraction: float = 1.0, **mm_options: Any
                 ) -> tuple[grain.IterDataset, PipelineStats]:
    """Build the grain `IterDataset` of packed batches and its stats (see `make_pipeline`)."""
    if dataset_type not in DATASET_TYPES:
        raise ValueError(f"dataset_type must be one of {DATASET_TYPES}, got {dataset_type!r}")
    if bad_data not in BAD_DATA_POLICIES:
        raise ValueError(f"bad_data must be one of {BAD_DATA_POLICIES}, got {bad_data!r}")
    if dataset_type == "sft" and sft_format not in sft_lib.SFT_FORMATS:
        raise ValueError(f"sft_format must be one of {sft_lib.SFT_FORMATS}, got {sft_format!r}")
    if sft_overlong not in sft_lib.SFT_OVERLONG:
        raise ValueError(f"sft_overlong must be one of {sft_lib.SFT_OVERLONG}, got {sft_overlong!r}")
    if dataset_type != "synthetic" and tokenizer is None:
        raise ValueError(f"dataset_type={dataset_type!r} needs a tokenizer")
    if seq_len < 2 or batch_size < 1:
        raise ValueError(f"need seq_len >= 2 and batch_size >= 1, got {seq_len}, {batch_size}")
    if process_index is None or process_count is None:
        import jax  # only for the host's coordinates; the pipeline itself is numpy

        process_index = jax.process_index() if process_index is None else process_index
        process_count = jax.process_count() if process_count is None else process_count
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index {process_index} not in [0, {process_count})")
    if dataset_type == "mm_sft":   # image conversations build on this module, not the reverse
        raise ValueError("dataset_type='mm_sft' batches come from k3jax.data.mm_sft.make_pipeline / make_dataset")

    stats = PipelineStats()
    src = _source(dataset_type, paths, text_key=text_key, vocab_size=vocab_size, seed=seed,
                  seq_len=seq_len, synthetic_len=synthetic_len)
    ds = grain.MapDataset.source(src)[process_index::process_count]
    what = paths if dataset_type != "synthetic" else "the synthetic data"
    if len(ds) == 0:
        raise DataError(f"{what}: no records" + (" (the files are empty)" if len(src) == 0 else
                                                 f" for process {process_index} of {process_count}"))
    parse = ParseDocument(dataset_type, tokenizer, text_key=text_key, bad_data=bad_data,
                          stats=stats, add_eos=add_eos, sft_format=sft_format, seq_len=seq_len,
                          sft_overlong=sft_overlong, sft_default_system=sft_default_system,
                          max_bad_fraction=max_bad_fraction, min_records=check_records_first)
    if dataset_type != "synthetic" and check_records_first:
        check_records(ds, parse, check_records_first, max_bad_fraction, what)
    if shuffle:
        ds = ds.shuffle(seed=seed)
    ds = ds.repeat(num_epochs)
    ds = ds.map(parse)
    it_ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=read_threads,
                                                 prefetch_buffer_size=prefetch))
    it_ds = grain.experimental.FlatMapIterDataset(it_ds, _SplitDocument(seq_len, stats))
    lengths = {"tokens": seq_len, "targets": seq_len, "loss_mask": seq_len}
    it_ds = grain.experimental.FirstFitPackIterDataset(
        it_ds, length_struct=lengths, num_packing_bins=num_packing_bins, seed=seed,
        shuffle_bins=shuffle)
    it_ds = it_ds.batch(batch_size, drop_remainder=True).map(finalize_batch)
    return it_ds, stats


def make_pipeline(*, dataset_type: str, paths: str | None, tokenizer: KimiTokenizer | None,
                  seq_len: int, batch_size: int, seed: int, shuffle: bool = True,
                  process_index: int | None = None, process_count: int | None = None,
                  bad_data: str = "skip", vocab_size: int | None = None,
                  text_key: str = "text", num_epochs: int | None = None,
                  **options: Any) -> PipelineIterator:
    """Packed-batch iterator for training.

    Args:
      dataset_type: "synthetic" | "jsonl" | "parquet" | "arrayrecord" | "sft" (image conversations,
        "mm_sft": `k3jax.data.mm_sft.make_pipeline`).
      paths: comma-separated globs of input files (None for synthetic).
      tokenizer: a `KimiTokenizer` (unused for synthetic).
      seq_len, batch_size: T and the PER-HOST B of every batch.
      seed: shuffle / packing / synthetic-data seed; the same seed gives the same batches.
      shuffle: global index shuffle (reshuffled every epoch) and packed-bin shuffle.
      process_index, process_count: the data shard to read (default: this host's,
        jax.process_index/count()); shard i reads records i, i+n, i+2n, ... so shards never share
        a record (the processes of one context group read one shard: k3jax.feed).
      bad_data: "skip" (log file:line with logging.warning, count, continue) or "fatal" (raise
        `DataError` naming file:line).
      vocab_size: token range of synthetic data.
      text_key: JSON field (JSONL, ArrayRecord JSON records) or Parquet column of the text.
      num_epochs: None repeats forever; n stops after n passes (last partial batch dropped).
      **options: add_eos (True), sft_format ("messages" | "hellaswag"), sft_overlong ("truncate" |
        "drop": SFT conversations longer than seq_len, see `sft.fit_to_length`), sft_default_system
        (the system prompt given to conversations without one; None = none), num_packing_bins (16),
        read_threads (2), prefetch (64), synthetic_len ((min, max) doc length).
    Returns:
      `PipelineIterator` yielding the [B, T] batch dict described in the module docstring.
    """
    if process_index is None or process_count is None:
        import jax  # only for the host's coordinates; the pipeline itself is numpy

        process_index = jax.process_index() if process_index is None else process_index
        process_count = jax.process_count() if process_count is None else process_count
    ds, stats = make_dataset(dataset_type=dataset_type, paths=paths, tokenizer=tokenizer,
                             seq_len=seq_len, batch_size=batch_size, seed=seed, shuffle=shuffle,
                             process_index=process_index, process_count=process_count,
                             bad_data=bad_data, vocab_size=vocab_size, text_key=text_key,
                             num_epochs=num_epochs, **options)
    return PipelineIterator(iter(ds), stats, (process_index, process_count))
