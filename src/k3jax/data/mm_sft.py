"""Image conversations for fine-tuning (``dataset_type=mm_sft``): the MindSpeed-MM / LLaVA layout
through grain, images decoded and processed in grain's read threads (docs/data.md section 9).

A record is ``{"images": ["a.jpg", ...], "messages": [{"role", "content"}, ...]}`` where each
``<image>`` marker in a message's text stands for the next image of ``images`` (docs/vision.md §8;
``{"type": "image"}`` content parts count as markers too). Files hold one JSON list of records
(MindSpeed-MM's ``*.json``) or one record per line (JSONL). Relative image paths are read from
``image_root`` when given, else from the record's file's directory; local or gs://.

    ConversationSource[process_index::process_count]   (record, "path:line") per record
      .shuffle(seed).repeat(num_epochs)
      .map(ParseConversation)        check markers, read + process images, render the template
      .to_iter_dataset(read threads) None (skipped records) dropped here
      .batch(B, batch_fn=collate)    one conversation per row; its media packed to a patch bucket

A batch is the text pipeline's [B, T] contract (``k3jax.data.pipeline``) plus ``"media"``: each
row's media packed on their own (``media.grouped_media_inputs``: arrays [B, ...], patches and
layout padded to the patch bucket of the batch's fullest row, ``slots`` [B, M] the columns of the
row's media pads), so the rows split over the devices like the tokens, each device runs the tower
on its own rows, and the train step compiles one program per bucket. Rows are not packed with
other conversations: a row is one conversation, padded.

Bad records follow the text pipeline's ``bad_data`` rule (logged with path:line, counted, the
same bad fraction stops the run): ``bad_json`` / ``bad_utf8``, ``bad_record`` (wrong shape, marker
count != image count, more than ``vision_max_images``) and ``bad_image`` (missing or unreadable
image). A conversation longer than ``seq_len`` is truncated only where no media run is cut and an
answer token is left (``sft_overlong=truncate``); otherwise it is dropped, counted in
``sft_dropped`` and logged with its place.
"""
from __future__ import annotations

import json
import logging
import posixpath
from typing import Any

import grain
import numpy as np

from k3jax import paths as _paths
from k3jax.data import chat_template
from k3jax.data import pipeline as P
from k3jax.data import sft as sft_lib
from k3jax.data.media import grouped_media_inputs, media_loss_mask, media_token_ids, read_image
from k3jax.data.messages import count_images
from k3jax.data.sources import DataError, JsonlSource, expand_paths
from k3jax.data.vision_processor import (MediaItem, ProcessorConfig, VisionInputError, check_media_limit,
                                         process_image)

logger = logging.getLogger(__name__)

IMAGE_MARKER = "<image>"


class ConversationSource(grain.sources.RandomAccessDataSource):
    """Records of JSON-list files (first non-space byte '[') and JSONL files, in file order.

    Item i is ``((payload, "path:line"), "path:line")``: the payload is a parsed record (JSON
    lists are parsed whole when the source opens, each element's line remembered) or a JSONL
    line's raw bytes (parsed in the read threads like the text pipeline's). A JSON list that does
    not parse is a DataError naming the file and line."""

    def __init__(self, paths: str):
        self.files = expand_paths(paths)
        self._parts: list = []          # per file: a JsonlSource, or a list of (record, where)
        self._ends: list[int] = []
        n = 0
        for path in self.files:
            part = self._json_list(path)
            part = JsonlSource([path]) if part is None else part
            self._parts.append(part)
            n += len(part)
            self._ends.append(n)

    @staticmethod
    def _json_list(path: str) -> list | None:
        with _paths.open_binary(path) as f:
            head = f.read(4096).lstrip()
            if not head.startswith(b"["):
                return None
            data = head + f.read()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"{path}: invalid UTF-8 at byte {e.start} of a JSON list") from None
        dec = json.JSONDecoder()
        out, i = [], text.index("[") + 1
        line, at = 1, 0           # the line of text[at]; advanced incrementally (big files)
        while True:
            while i < len(text) and text[i] in " \t\r\n,":
                i += 1
            if i >= len(text) or text[i] == "]":
                break
            line += text.count("\n", at, i)
            at = i
            try:
                obj, i = dec.raw_decode(text, i)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{e.lineno}: invalid JSON list ({e.msg} at column {e.colno})") from None
            out.append((obj, f"{path}:{line}"))
        return out

    def __len__(self) -> int:
        return self._ends[-1] if self._ends else 0

    def __getitem__(self, index: int):
        index = int(index)
        k = int(np.searchsorted(self._ends, index, side="right"))
        part = self._parts[k]
        item = part[index - (self._ends[k - 1] if k else 0)]
        return item, item[1]

    def __repr__(self) -> str:
        return f"ConversationSource({len(self.files)} files, {len(self)} records)"


def split_markers(messages: list, n_images: int) -> list[dict]:
    """Messages with each ``<image>`` in string content turned into an ``{"type": "image"}`` part
    (text around it kept as text parts); ValueError when the markers (and image parts already
    there) do not number ``n_images``."""
    out, count = [], 0
    for m in messages:
        c = m.get("content")
        if isinstance(c, str) and IMAGE_MARKER in c:
            parts = []
            for j, piece in enumerate(c.split(IMAGE_MARKER)):
                if j:
                    parts.append({"type": "image"})
                if piece:
                    parts.append({"type": "text", "text": piece})
            m = dict(m, content=parts)
        count += count_images([m])
        out.append(m)
    if count != n_images:
        raise ValueError(f"{count} {IMAGE_MARKER} markers but {n_images} images")
    return out


def resolve_image(path: str, where: str, image_root: str | None) -> str:
    """An image path of a record: absolute or gs:// as is; else under ``image_root``, or the
    directory of the record's file (``where`` is "path:line")."""
    if path.startswith("/") or "://" in path:
        return path
    base = image_root if image_root else posixpath.dirname(where.rsplit(":", 1)[0])
    return posixpath.join(base, path) if base else path


class ParseConversation(P.ParseDocument):
    """``(record, where)`` -> ``{"tokens", "weights", "patches", "grid", "media_tokens"}`` or None,
    under the text pipeline's bad-data policy (``ParseDocument.__call__`` / ``_skipped``)."""

    def __init__(self, tokenizer, pcfg: ProcessorConfig, *, image_root: str | None, media_ids,
                 **kw):
        super().__init__("mm_sft", tokenizer, text_key="messages", add_eos=False, sft_format="messages", **kw)
        self.pcfg, self.image_root, self.media_ids = pcfg, image_root, media_ids
        self._overlong_logged = 0

    def _document(self, payload: Any) -> dict[str, np.ndarray] | None:
        raw, where = payload
        if isinstance(raw, (bytes, bytearray)):
            text = P._utf8(raw)
            if not text.strip():
                return None               # a blank JSONL line: an empty record
            record = P._json(text)
        else:
            record = raw
        if not isinstance(record, dict):
            raise P._BadRecord("bad_record", "record is not a JSON object")
        images = record.get("images", [])
        if images is None:
            images = []
        if not isinstance(images, list) or not all(isinstance(x, str) and x for x in images):
            raise P._BadRecord("bad_record", "'images' must be a list of image paths")
        try:
            messages = split_markers(list(sft_lib.validate_messages(record.get("messages")) or ()), len(images))
            check_media_limit(len(images), self.pcfg, "record")
        except ValueError as e:     # VisionInputError included
            raise P._BadRecord("bad_record", str(e)) from None
        items = []
        for p in images:
            try:
                items.append(process_image(read_image(resolve_image(p, where, self.image_root)), self.pcfg))
            except VisionInputError as e:
                raise P._BadRecord("bad_image", str(e)) from None
        n_patches = sum(len(it.patches) for it in items)
        if self.pcfg.patch_buckets and n_patches > self.pcfg.patch_buckets[-1]:
            raise P._BadRecord("bad_image", f"its images make {n_patches} patches, over the largest "
                                            f"vision_patch_buckets entry {self.pcfg.patch_buckets[-1]}")
        try:
            ids, mask = chat_template.render(self.tokenizer, messages, add_generation_prompt=False,
                                             default_system=self.sft_default_system,
                                             media=[it.prompt for it in items])
        except ValueError as e:
            raise P._BadRecord("bad_record", str(e)) from None
        tokens, weights = np.asarray(ids, np.int32), np.asarray(mask, np.float32)
        if not weights.any():
            return None                       # no assistant output: an empty record, as for text
        if len(tokens) > self.seq_len:
            fitted = self._fit(tokens, weights)
            if fitted is None:
                self.stats.add(sft_dropped=1)
                self._log_overlong(where, len(tokens))
                return None
            self.stats.add(sft_truncated=1)
            tokens, weights = fitted
        self.stats.add(tokens=len(tokens))
        return {"tokens": tokens, "weights": weights,
                "patches": np.concatenate([it.patches for it in items]) if items else
                np.zeros((0, self.pcfg.patch_dim), np.float32),
                "grid": np.asarray([it.grid_thw for it in items], np.int32).reshape(len(items), 3),
                "media_tokens": np.asarray([it.tokens for it in items], np.int32)}

    def _fit(self, tokens: np.ndarray, weights: np.ndarray):
        """Truncation that never cuts a media run: only when the last ``<|media_end|>`` lies inside
        the row and an answer token is left (``sft.fit_to_length``)."""
        if self.sft_overlong == "drop":
            return None
        ends = np.flatnonzero(tokens == self.media_ids[3])
        if len(ends) and ends[-1] >= self.seq_len:
            return None
        return sft_lib.fit_to_length(tokens, weights, self.seq_len, "truncate")

    def _log_overlong(self, where: str, n: int) -> None:
        if self._overlong_logged < P.MAX_WARNINGS:
            self._overlong_logged += 1
            logger.warning("dropping the conversation at %s: %d tokens with its images, over max_target_length=%d "
                           "(never cut through an image; sft_overlong=%s)", where, n, self.seq_len, self.sft_overlong)


class Collate:
    """grain ``batch_fn``: B parsed conversations -> the [B, T] batch plus ``"media"`` (module
    docstring): the j-th ``<|media_pad|>`` of row r takes feature row j of row r's media."""

    def __init__(self, vcfg, pcfg: ProcessorConfig, seq_len: int, media_ids):
        self.vcfg, self.pcfg, self.seq_len, self.media_ids = vcfg, pcfg, seq_len, media_ids

    def __call__(self, docs) -> dict:
        b, t = len(docs), self.seq_len
        tokens = np.zeros((b, t), np.int32)
        targets = np.zeros((b, t), np.int32)
        seg = np.zeros((b, t), np.int32)
        loss = np.zeros((b, t), np.float32)
        rows = []
        for r, d in enumerate(docs):
            n = len(d["tokens"])
            tokens[r, :n] = d["tokens"]
            targets[r, :n - 1] = d["tokens"][1:]
            seg[r, :n] = 1
            loss[r, :n - 1] = d["weights"][1:]
            at, items = 0, []
            for g, k in zip(d["grid"].tolist(), d["media_tokens"].tolist()):
                m = g[0] * g[1] * g[2]
                items.append(MediaItem(d["patches"][at:at + m], tuple(g), k, ""))
                at += m
            rows.append(items)
        loss = media_loss_mask(tokens, loss, self.media_ids)
        items = [it for r in rows for it in r]
        return {"tokens": tokens, "targets": targets, "segment_ids": seg,
                "positions": np.arange(t, dtype=np.int32)[None] * (seg > 0), "loss_mask": loss,
                "media": grouped_media_inputs(self.vcfg, self.pcfg, rows, tokens, self.media_ids[2]),
                # host only (the step's vision FLOPs for MFU): (t, h, w) of each item, in order
                "media_grids": np.asarray([it.grid_thw for it in items], np.int32).reshape(len(items), 3)}


def make_dataset(*, paths: str, tokenizer, vcfg, pcfg: ProcessorConfig, seq_len: int, batch_size: int,
                 seed: int, shuffle: bool = True, process_index: int = 0, process_count: int = 1,
                 bad_data: str = "skip", num_epochs: int | None = None, image_root: str | None = None,
                 sft_overlong: str = "truncate",
                 sft_default_system: str | None = chat_template.DEFAULT_SYSTEM, read_threads: int = 2,
                 prefetch: int = 64, check_records_first: int = 0, max_bad_fraction: float = 1.0,
                 **unused: Any) -> tuple[grain.IterDataset, P.PipelineStats]:
    """The grain IterDataset of mm_sft batches and its stats (arguments as ``pipeline.make_dataset``;
    ``vcfg``: the VisionConfig, ``pcfg``: the processor's, ``image_root``: see the module docstring)."""
    if bad_data not in P.BAD_DATA_POLICIES:
        raise ValueError(f"bad_data must be one of {P.BAD_DATA_POLICIES}, got {bad_data!r}")
    if sft_overlong not in sft_lib.SFT_OVERLONG:
        raise ValueError(f"sft_overlong must be one of {sft_lib.SFT_OVERLONG}, got {sft_overlong!r}")
    if tokenizer is None or not paths:
        raise ValueError("dataset_type='mm_sft' needs a tokenizer and paths")
    media_ids = media_token_ids(tokenizer)
    stats = P.PipelineStats()
    src = ConversationSource(paths)
    ds = grain.MapDataset.source(src)[process_index::process_count]
    if len(ds) == 0:
        raise DataError(f"{paths}: no records" + (" (the files are empty)" if len(src) == 0 else
                                                  f" for process {process_index} of {process_count}"))
    parse = ParseConversation(tokenizer, pcfg, image_root=image_root, media_ids=media_ids, bad_data=bad_data,
                              stats=stats, seq_len=seq_len, sft_overlong=sft_overlong,
                              sft_default_system=sft_default_system, max_bad_fraction=max_bad_fraction,
                              min_records=check_records_first)
    if check_records_first:
        P.check_records(ds, parse, check_records_first, max_bad_fraction, paths)
    if shuffle:
        ds = ds.shuffle(seed=seed)
    ds = ds.repeat(num_epochs).map(parse)
    it_ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=read_threads, prefetch_buffer_size=prefetch))
    it_ds = it_ds.batch(batch_size, drop_remainder=True, batch_fn=Collate(vcfg, pcfg, seq_len, media_ids))
    return it_ds, stats


def make_pipeline(*, process_index: int = 0, process_count: int = 1, **kw) -> P.PipelineIterator:
    """``pipeline.make_pipeline`` for image conversations: the batch iterator of ``make_dataset``
    (its arguments) over data shard ``process_index`` of ``process_count``."""
    ds, stats = make_dataset(process_index=process_index, process_count=process_count, **kw)
    return P.PipelineIterator(iter(ds), stats, (process_index, process_count))

