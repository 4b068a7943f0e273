"""Random-access record sources for grain: JSONL, Parquet, ArrayRecord and synthetic tokens.

Every source is a `grain.sources.RandomAccessDataSource` (`__len__` + `__getitem__`), so grain
can slice it per host, shuffle it globally and checkpoint a position as a plain index. Text
sources return RAW records, `(payload, location)`, with `location` = "path:line" (JSONL, 1-based
line), "path:row N" (Parquet) or "path:record N" (ArrayRecord): decoding and validation happen in
the pipeline's parse step so a bad record is reported with its place and handled by the
bad-data policy instead of crashing a reader thread.

`SyntheticSource` needs no files: document i is a deterministic function of (seed, i).
"""
from __future__ import annotations

import bisect
import os
import threading
from collections.abc import Sequence

import numpy as np
import pyarrow.parquet as pq
from grain.sources import RandomAccessDataSource

from k3jax import paths as _paths
from k3jax.errors import UserError


class DataError(UserError, ValueError):
    """Bad input data (raised when bad_data="fatal"); the message names file:line."""


def expand_paths(paths: str | Sequence[str]) -> list[str]:
    """Comma-separated globs (or a list of them) -> sorted, de-duplicated file list.

    Sorted so that every host sees the same global record order (per-host sharding slices it).
    A pattern matching nothing is an error, never an empty dataset.
    """
    patterns = paths.split(",") if isinstance(paths, str) else list(paths)
    files: list[str] = []
    for pattern in (p.strip() for p in patterns):
        if not pattern:
            continue
        matched = _paths.glob(pattern, "dataset_path")   # local or gs://
        if not matched:
            raise DataError(f"no file matches {pattern!r}")
        files += matched
    if not files:
        raise DataError(f"no input files in {paths!r}")
    return list(dict.fromkeys(files))


class JsonlSource(RandomAccessDataSource):
    """Random access over the lines of JSONL files (grain ships no JSONL source).

    The constructor scans each file once for newline offsets (numpy over 16 MiB chunks, a few
    hundred MB/s); reads then use `os.pread`, which is thread-safe, so grain's read threads
    share the file descriptors. Item i is `(line_bytes, "path:line")`, line bytes without the
    trailing newline (and without a trailing '\\r').
    """

    _CHUNK = 16 << 20

    def __init__(self, paths: str | Sequence[str]):
        self.files = expand_paths(paths)
        file_ids, starts, ends, line_nos = [], [], [], []
        for fi, path in enumerate(self.files):
            s, e = self._line_spans(path)
            file_ids.append(np.full(len(s), fi, np.int32))
            starts.append(s)
            ends.append(e)
            line_nos.append(np.arange(1, len(s) + 1, dtype=np.int64))
        self._file_ids = np.concatenate(file_ids)
        self._starts = np.concatenate(starts)
        self._ends = np.concatenate(ends)
        self._line_nos = np.concatenate(line_nos)
        self._fds: dict[int, int] = {}
        self._lock = threading.Lock()

    @classmethod
    def _line_spans(cls, path: str) -> tuple[np.ndarray, np.ndarray]:
        """[start, end) byte offsets of every line; a last line without '\\n' counts."""
        newlines = []
        size = 0
        with _paths.open_binary(path) as f:
            while chunk := f.read(cls._CHUNK):
                newlines.append(np.flatnonzero(np.frombuffer(chunk, np.uint8) == 10) + size)
                size += len(chunk)
        nl = np.concatenate(newlines) if newlines else np.zeros(0, np.int64)
        ends = nl.astype(np.int64)
        if size and (len(nl) == 0 or nl[-1] != size - 1):
            ends = np.append(ends, size)
        starts = np.concatenate([[0], ends[:-1] + 1]).astype(np.int64) if len(ends) else ends
        return starts, ends

    def _fd(self, fi: int) -> int:
        fd = self._fds.get(fi)
        if fd is None:
            with self._lock:
                fd = self._fds.get(fi)
                if fd is None:
                    fd = os.open(self.files[fi], os.O_RDONLY)
                    self._fds[fi] = fd
        return fd

    def __len__(self) -> int:
        return len(self._starts)

    def __getitem__(self, index: int) -> tuple[bytes, str]:
        index = int(index)
        fi = int(self._file_ids[index])
        start, end = int(self._starts[index]), int(self._ends[index])
        if _paths.is_remote(self.files[fi]):   # a ranged GET of the object
            data = _paths.read_range(self.files[fi], start, end)
        else:
            data = os.pread(self._fd(fi), end - start, start)
        if data.endswith(b"\r"):
            data = data[:-1]
        return data, f"{self.files[fi]}:{int(self._line_nos[index])}"

    def __getstate__(self):
        # File descriptors do not survive pickling (grain mp_prefetch workers): reopen lazily.
        state = self.__dict__.copy()
        state["_fds"], state["_lock"] = {}, None
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def __del__(self):
        for fd in getattr(self, "_fds", {}).values():
            try:
                os.close(fd)
            except OSError:
                pass

    def __repr__(self) -> str:
        return f"JsonlSource({len(self.files)} files, {len(self)} lines)"


class ParquetSource(RandomAccessDataSource):
    """Random access over one string (or binary) column of Parquet files, row-group cached.

    Item i is `(value, "path:row N")` with value a `str`, `bytes` or None (a null cell). A read
    loads the whole row group holding row i (only the text column) and keeps the last few in an
    LRU cache: sequential and per-host strided reads stay cheap; a global shuffle costs about one
    row-group read per record, so keep row groups small (<= a few MB) or shuffle ArrayRecord.
    """

    _CACHE_GROUPS = 4

    def __init__(self, paths: str | Sequence[str], column: str = "text"):
        self.files = expand_paths(paths)
        self.column = column
        self._groups: list[tuple[int, int]] = []  # (file index, row group) in global order
        self._group_starts: list[int] = []  # first global row of each row group
        self._file_starts: list[int] = []  # first global row of each file
        total = 0
        for fi, path in enumerate(self.files):
            self._file_starts.append(total)
            try:
                meta = pq.ParquetFile(_paths.open_binary(path)).metadata
            except Exception as e:  # noqa: BLE001 - pyarrow raises several kinds for a non-Parquet file
                raise DataError(f"{path}: not a readable Parquet file ({str(e).splitlines()[0]}); "
                                f"check dataset_type") from None
            if column not in meta.schema.names:
                raise DataError(f"{path}: no column {column!r} (has {meta.schema.names})")
            for g in range(meta.num_row_groups):
                self._groups.append((fi, g))
                self._group_starts.append(total)
                total += meta.row_group(g).num_rows
        self._len = total
        self._cache: dict[int, list] = {}
        self._lock = threading.Lock()

    def _group(self, gi: int) -> list:
        with self._lock:
            rows = self._cache.pop(gi, None)
            if rows is not None:
                self._cache[gi] = rows  # re-insert: most recently used last
                return rows
        fi, g = self._groups[gi]
        table = pq.ParquetFile(_paths.open_binary(self.files[fi])).read_row_group(g, columns=[self.column])
        rows = table.column(0).to_pylist()
        with self._lock:
            self._cache[gi] = rows
            while len(self._cache) > self._CACHE_GROUPS:
                self._cache.pop(next(iter(self._cache)))
        return rows

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> tuple[object, str]:
        index = int(index)
        gi = bisect.bisect_right(self._group_starts, index) - 1
        fi, _ = self._groups[gi]
        value = self._group(gi)[index - self._group_starts[gi]]
        return value, f"{self.files[fi]}:row {index - self._file_starts[fi]}"

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_cache"], state["_lock"] = {}, None
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"ParquetSource({len(self.files)} files, {len(self)} rows, column={self.column!r})"


class ArrayRecordSource(RandomAccessDataSource):
    """ArrayRecord files through grain's reader; item i is `(record_bytes, "path:record N")`.

    Records are UTF-8 text, or JSON objects (a record whose first non-space byte is '{'); the
    pipeline's parse step applies that rule.
    """

    def __init__(self, paths: str | Sequence[str]):
        # lazy: grain installs array_record on every platform but Windows; only ArrayRecord sources need it
        from array_record.python.array_record_module import ArrayRecordReader
        from grain.sources import ArrayRecordDataSource

        self.files = expand_paths(paths)
        remote = [f for f in self.files if _paths.is_remote(f)]
        if remote:
            raise DataError(f"{remote[0]}: ArrayRecord files are read locally only; copy them to local disk, or use "
                            f"jsonl / parquet files on gs://")
        self._starts = [0]
        for path in self.files:
            try:
                reader = ArrayRecordReader(path)
                self._starts.append(self._starts[-1] + reader.num_records())
                reader.close()
            except Exception as e:  # noqa: BLE001 - the C++ reader raises RuntimeError/ValueError
                raise DataError(f"{path}: not a readable ArrayRecord file ({str(e).splitlines()[0]}); "
                                f"check dataset_type") from None
        self._source = ArrayRecordDataSource(self.files)

    def __len__(self) -> int:
        return self._starts[-1]

    def __getitem__(self, index: int) -> tuple[bytes, str]:
        index = int(index)
        fi = bisect.bisect_right(self._starts, index) - 1
        return self._source[index], f"{self.files[fi]}:record {index - self._starts[fi]}"

    def __repr__(self) -> str:
        return f"ArrayRecordSource({len(self.files)} files, {len(self)} records)"


class SyntheticSource(RandomAccessDataSource):
    """Deterministic, learnable token documents; no files, no tokenizer.

    Document i is drawn from `np.random.default_rng([seed, i])`, so any host, shuffle order or
    restart sees the same document for the same index. Two kinds, chosen per document:
    - counting: `t_j = (a + j*d) mod vocab_size`, d in {1, 2, 3}: after two tokens every next
      token is determined by the previous one and d (a bigram-level pattern);
    - repeated motif: a random motif of 2..8 tokens repeated: the first period is noise, the
      rest is copyable (an induction pattern).
    Starts and motif tokens follow a 1/rank (log-uniform) frequency, like words in text.
    A tiny model's loss falls well below log(vocab_size) within tens of steps.

    Item i: int32 [L] with `min_len <= L <= max_len`.
    """

    def __init__(self, *, vocab_size: int, seed: int = 0, num_docs: int = 1 << 30,
                 min_len: int = 8, max_len: int = 256):
        if vocab_size < 4 or not 2 <= min_len <= max_len:
            raise ValueError(f"bad synthetic source: vocab_size={vocab_size}, "
                             f"min_len={min_len}, max_len={max_len}")
        self.vocab_size, self.seed, self.num_docs = vocab_size, seed, num_docs
        self.min_len, self.max_len = min_len, max_len

    def __len__(self) -> int:
        return self.num_docs

    def _zipf(self, rng, n: int) -> np.ndarray:
        """Token ids with a Zipf-like (1/rank) frequency, as in natural text: even a model that has
        seen a few thousand tokens of a 32k vocabulary can learn the unigram skew."""
        u = rng.random(n)
        return np.minimum((self.vocab_size ** u).astype(np.int64) - 1, self.vocab_size - 1)

    def __getitem__(self, index: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, int(index)])
        length = int(rng.integers(self.min_len, self.max_len + 1))
        j = np.arange(length, dtype=np.int64)
        if rng.random() < 0.5:
            a, d = int(self._zipf(rng, 1)[0]), int(rng.integers(1, 4))
            doc = (a + j * d) % self.vocab_size
        else:
            motif = self._zipf(rng, int(rng.integers(2, 9)))
            doc = motif[j % len(motif)]
        return doc.astype(np.int32)

    def __repr__(self) -> str:
        return (f"SyntheticSource(vocab_size={self.vocab_size}, seed={self.seed}, "
                f"len {self.min_len}..{self.max_len})")
