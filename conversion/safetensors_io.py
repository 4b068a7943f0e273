"""Streaming safetensors I/O for conversion: a lazy validating reader and a sharded writer.

A K3 checkpoint is 96 shards / 1.45 TB / 497k tensors, so nothing here ever holds more than one
tensor (reader) or one output shard (writer) in memory. Byte layout (formats.md §4.1): u64 LE
header length N, N bytes of JSON ``{name: {dtype, shape, data_offsets: [b, e]}, "__metadata__":
{...}}``, then raw little-endian row-major data; offsets are relative to byte 8 + N.

Reading goes through the headers (parsed once, on open) and a positioned ``readinto`` of exactly
one tensor's byte range, viewed as its numpy / ml_dtypes dtype. This is deliberately NOT
``safetensors.safe_open(framework="numpy")``, for three measured reasons (safetensors 0.8.0):

* ``get_tensor`` raises for F8_E4M3 / F8_E8M0 (numpy has no such dtypes), so a raw path is
  needed for those anyway (formats.md §4.3);
* each ``safe_open`` re-parses the shard header: 3.7 ms for a 5,200-entry K3-sized header, i.e.
  ~30 min of pure overhead over K3's 494k U8 expert tensors if opened per tensor;
* a ``safe_open`` handle kept open instead memory-maps the shard, and every page a read touches
  stays in the process RSS until the handle closes (512 MB read -> +512 MB RSS), breaking the
  one-tensor memory bound.

The reader never imports or executes anything from the checkpoint directory (Kimi repos ship
``modeling_*.py`` / ``tokenization_kimi.py`` for ``trust_remote_code``); it only parses JSON.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
from typing import Iterable, Mapping

import ml_dtypes
import numpy as np

from conversion import quant
from conversion.errors import ConversionError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
_MAX_HEADER_BYTES = 100 * 2**20  # the safetensors library's own limit

# safetensors dtype string -> numpy dtype. BF16 and the F8 types come from ml_dtypes.
DTYPES = {
    "BOOL": np.bool_, "U8": np.uint8, "I8": np.int8, "U16": np.uint16, "I16": np.int16,
    "U32": np.uint32, "I32": np.int32, "U64": np.uint64, "I64": np.int64, "F16": np.float16,
    "F32": np.float32, "F64": np.float64, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
    "F8_E8M0": ml_dtypes.float8_e8m0fnu,
}
_DTYPE_NAMES = {np.dtype(t): name for name, t in DTYPES.items()}


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes live: ``path``, absolute byte ``offset``, ``nbytes``; plus
    safetensors ``dtype`` string and ``shape``."""
    path: str
    dtype: str
    shape: tuple
    offset: int
    nbytes: int


def read_header(path: str) -> tuple[dict[str, TensorInfo], dict]:
    """Parse and validate one safetensors file's header; reads only the header bytes.

    Checks: the header parses; dtypes are known; every byte range matches its shape x itemsize
    and ranges do not overlap; the file holds all the data the header declares (a truncated
    download is reported with the expected and actual byte counts).
    Returns ({name: TensorInfo}, __metadata__ dict).
    """
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise ConversionError(f"{path}: truncated safetensors file: expected at least 8 "
                                  f"bytes (header length), file has {size} bytes")
        n = struct.unpack("<Q", prefix)[0]
        if n > _MAX_HEADER_BYTES:
            raise ConversionError(f"{path}: header length {n} exceeds {_MAX_HEADER_BYTES} bytes; "
                                  "not a safetensors file or corrupt")
        if 8 + n > size:
            raise ConversionError(f"{path}: truncated safetensors file: expected at least "
                                  f"{8 + n} bytes (header), file has {size} bytes")
        try:
            header = json.loads(f.read(n).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ConversionError(f"{path}: safetensors header is not valid JSON: {e}") from None
    if not isinstance(header, dict):
        raise ConversionError(f"{path}: safetensors header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    infos, end = {}, 0
    for name, entry in header.items():
        try:
            dtype, shape, (b, e) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
            ok = all(isinstance(v, int) and v >= 0 for v in (*shape, b, e)) and b <= e
        except (TypeError, KeyError, ValueError):
            ok = False
        if not ok:
            raise ConversionError(f"{path}: malformed header entry for tensor {name!r}: {entry!r}")
        if dtype not in DTYPES:
            raise ConversionError(f"{path}: tensor {name!r} has dtype {dtype!r}; supported: "
                                  f"{sorted(DTYPES)}")
        want = math.prod(shape) * np.dtype(DTYPES[dtype]).itemsize
        if e - b != want:
            raise ConversionError(f"{path}: tensor {name!r} {dtype} {list(shape)} needs {want} "
                                  f"bytes but its data_offsets span {e - b}")
        infos[name] = TensorInfo(path, dtype, shape, 8 + n + b, e - b)
        end = max(end, e)
    spans = sorted((i.offset, i.offset + i.nbytes, k) for k, i in infos.items() if i.nbytes)
    for (_, e0, k0), (b1, _, k1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise ConversionError(f"{path}: byte ranges of tensors {k0!r} and {k1!r} overlap")
    if size < 8 + n + end:
        raise ConversionError(f"{path}: truncated safetensors file: header declares "
                              f"{8 + n + end} bytes (8 + {n}-byte header + {end} bytes of "
                              f"tensor data) but the file has {size} bytes")
    return infos, metadata


def _read_into(info: TensorInfo, name: str) -> np.ndarray:
    """One tensor's bytes as a fresh (private, writable) array; nothing else is read."""
    buf = np.empty(info.nbytes, np.uint8)
    view, done = memoryview(buf), 0
    with open(info.path, "rb", buffering=0) as f:
        f.seek(info.offset)
        while done < info.nbytes:  # readinto may return short counts (e.g. > 2 GiB on Linux)
            got = f.readinto(view[done:])
            if not got:
                raise ConversionError(f"{info.path}: file shrank while reading tensor {name!r}: "
                                      f"got {done} of {info.nbytes} bytes")
            done += got
    # safetensors data is little-endian; '<' makes the view correct on any host.
    return buf.view(np.dtype(DTYPES[info.dtype]).newbyteorder("<")).reshape(info.shape)


def read_config(hf_dir: str) -> dict:
    """The text model's ``config.json`` section, with ``quantization_config`` resolved.

    Multimodal Kimi configs (K3, K2.5) nest the text model under ``text_config``, and K3 puts
    ``quantization_config`` inside it, while re-serialised copies move it to the top level. This
    returns a copy of ``text_config`` (or of the whole file when there is none) whose
    ``quantization_config`` key holds whichever of the two exists (None if neither); two
    different ones raise. Pure JSON parsing: ``auto_map`` code is never imported.
    """
    path = os.path.join(hf_dir, CONFIG_NAME)
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except FileNotFoundError:
        raise ConversionError(f"{path}: no config.json in {hf_dir}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConversionError(f"{path}: not valid JSON: {e}") from None
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    inner = text.get("quantization_config")
    outer = cfg.get("quantization_config") if text is not cfg else None
    if inner is not None and outer is not None and inner != outer:
        raise ConversionError(f"{path}: text_config.quantization_config and the top-level "
                              "quantization_config differ; cannot tell which one applies")
    return {**text, "quantization_config": inner if inner is not None else outer}


class CheckpointReader:
    """Lazy, validating reader of a Hugging Face safetensors checkpoint directory.

    Opening reads ``model.safetensors.index.json`` if present (else ``model.safetensors``, else
    every ``*.safetensors``), parses and validates every shard header (see ``read_header``), and
    checks that each index entry is in the shard the index names. No tensor data is read until
    ``get`` / ``get_dequantized``; shapes and dtypes come from the headers.

    Args:
      hf_dir: checkpoint directory.
      quantization_config: dict overriding the one in config.json; None reads config.json
        (``read_config``) when the file exists. Unsupported methods raise here, on open.
    """

    def __init__(self, hf_dir: str, *, quantization_config: Mapping | None = None):
        self.hf_dir = hf_dir
        index_path = os.path.join(hf_dir, INDEX_NAME)
        if os.path.exists(index_path):
            self._infos = self._open_index(index_path)
        else:
            if os.path.exists(os.path.join(hf_dir, SINGLE_NAME)):
                files = [SINGLE_NAME]
            else:
                files = sorted(f for f in os.listdir(hf_dir) if f.endswith(".safetensors"))
            if not files:
                raise ConversionError(f"{hf_dir}: no {INDEX_NAME}, {SINGLE_NAME} or "
                                      "*.safetensors file")
            self._infos = {}
            for file in files:
                infos, _ = read_header(os.path.join(hf_dir, file))
                for name, info in infos.items():
                    if name in self._infos:
                        raise ConversionError(f"{hf_dir}: tensor {name!r} is in both "
                                              f"{self._infos[name].path} and {info.path}")
                    self._infos[name] = info
        if quantization_config is None and os.path.exists(os.path.join(hf_dir, CONFIG_NAME)):
            quantization_config = read_config(hf_dir)["quantization_config"]
        self.quant_spec = quant.parse_quantization_config(quantization_config)

    def _open_index(self, index_path: str) -> dict[str, TensorInfo]:
        try:
            with open(index_path, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise ConversionError(f"{index_path}: not a valid index (need a JSON object with "
                                  f"'weight_map'): {e!r}") from None
        headers = {}
        for name, shard in weight_map.items():
            if shard not in headers:
                # Index values are bare file names; anything else could escape the directory.
                path = os.path.join(self.hf_dir, str(shard))
                if (not isinstance(shard, str) or os.path.basename(shard) != shard
                        or not os.path.isfile(path)):
                    raise ConversionError(f"{index_path}: tensor {name!r} maps to shard "
                                          f"{shard!r}, which is not a file in {self.hf_dir}")
                headers[shard] = read_header(path)[0]
            if name not in headers[shard]:
                raise ConversionError(f"{index_path}: index entry {name!r} -> {shard}, but "
                                      f"that shard's header has no tensor {name!r}")
        return {name: headers[shard][name] for name, shard in weight_map.items()}

    # --- metadata (headers only) -------------------------------------------------------------

    def keys(self) -> list[str]:
        """All stored tensor names, sorted."""
        return sorted(self._infos)

    def __contains__(self, name: str) -> bool:
        return name in self._infos

    def __len__(self) -> int:
        return len(self._infos)

    def info(self, name: str) -> TensorInfo:
        """File, byte range, safetensors dtype string and shape of a stored tensor."""
        try:
            return self._infos[name]
        except KeyError:
            raise ConversionError(f"{self.hf_dir}: no tensor named {name!r}") from None

    def shape(self, name: str) -> tuple:
        return self.info(name).shape

    def dtype(self, name: str) -> np.dtype:
        """numpy dtype of a stored tensor (ml_dtypes types for BF16 / F8_*)."""
        return np.dtype(DTYPES[self.info(name).dtype])

    @property
    def total_bytes(self) -> int:
        """Sum of all tensors' data bytes (the index's ``metadata.total_size`` convention)."""
        return sum(i.nbytes for i in self._infos.values())

    # --- data ----------------------------------------------------------------------------------

    def get(self, name: str) -> np.ndarray:
        """Read ONE stored tensor, as stored: [shape] of its numpy/ml_dtypes dtype."""
        return _read_into(self.info(name), name)

    def _companions(self, name: str) -> tuple[str, frozenset]:
        """(base, suffixes present) for a weight given as ``X.weight`` or ``X``."""
        suffix = name.rpartition(".")[2]
        if suffix in quant.COMPANION_SUFFIXES and suffix != "weight":
            raise ConversionError(f"{name!r} is one part of a quantized weight; pass the "
                                  f"weight's name ({name.rpartition('.')[0]}.weight)")
        base = name[: -len(".weight")] if suffix == "weight" else name
        found = frozenset(s for s in quant.COMPANION_SUFFIXES if f"{base}.{s}" in self._infos)
        if not found:
            raise ConversionError(f"{self.hf_dir}: no tensor {name!r} and no "
                                  f"{base}.weight / .weight_packed / ... companions")
        return base, found

    def logical_keys(self) -> list[str]:
        """Stored names with each quantized weight's companions collapsed to ``X.weight``.

        These are the names ``get_dequantized`` and ``format_of`` accept; a converter iterates
        over them instead of over ``keys()``.
        """
        out = set()
        for name in self._infos:
            base, _, suffix = name.rpartition(".")
            out.add(f"{base}.weight" if base and suffix in quant.COMPANION_SUFFIXES else name)
        return sorted(out)

    def format_of(self, name: str) -> str:
        """Stored layout of a logical name: "bf16" | "mxfp4" | "int4_pack" | "fp8_block"."""
        if name in self._infos and name.rpartition(".")[2] not in quant.COMPANION_SUFFIXES:
            return "bf16"  # a plain non-Linear tensor (A_log, dt_bias, a bias, ...)
        base, found = self._companions(name)
        return quant.detect_format(found, self.quant_spec)

    def logical_shape(self, name: str) -> tuple:
        """Shape of ``get_dequantized(name)`` without decoding (int4 reads its 8-byte weight_shape)."""
        fmt = self.format_of(name)
        if fmt == "bf16" and name in self._infos:
            return self.shape(name)
        base = self._companions(name)[0]
        if fmt == "mxfp4":
            *lead, cols = self.shape(f"{base}.weight_packed")
            return (*lead, 2 * cols)
        if fmt == "int4_pack":
            return tuple(int(v) for v in self.get(f"{base}.weight_shape"))
        return self.shape(f"{base}.weight")

    def get_dequantized(self, name: str) -> np.ndarray:
        """One weight as dense float32, whatever its stored layout.

        ``name`` is ``X.weight`` (or the bare base ``X``) of a Linear, e.g.
        ``language_model.model.layers.1.block_sparse_moe.experts.7.w1.weight`` for a K3 MXFP4
        expert stored as ``...w1.weight_packed`` + ``...w1.weight_scale``; or any plain tensor
        name. Reads only that weight's companion tensors.
        Returns float32 [out, in] (plain tensors keep their own shape).
        """
        fmt = self.format_of(name)
        if fmt == "bf16" and name in self._infos:
            return self.get(name).astype(np.float32)
        base, found = self._companions(name)
        tensors = {s: self.get(f"{base}.{s}") for s in found}
        return quant.decode_weight(fmt, tensors, self.quant_spec, name=base)


# --- writing ------------------------------------------------------------------------------------

def _check_array(name: str, array) -> np.ndarray:
    arr = np.asarray(array)
    if not arr.flags.c_contiguous:  # (np.ascontiguousarray would also turn 0-d into 1-d)
        arr = np.ascontiguousarray(arr)
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    if arr.dtype.newbyteorder("=") not in _DTYPE_NAMES:
        raise ConversionError(f"tensor {name!r}: dtype {arr.dtype} has no safetensors "
                              f"equivalent; supported: {sorted(DTYPES)}")
    return arr


def write_safetensors(path: str, tensors: Iterable[tuple[str, np.ndarray]],
                      metadata: Mapping[str, str] | None = None) -> int:
    """Write (name, array) pairs as one safetensors file; returns the tensor data bytes.

    Arrays are written straight from their buffers (no concatenated copy). The header is
    space-padded to a multiple of 8 bytes, as the safetensors library does, so data stays aligned.
    """
    tensors = [(name, _check_array(name, arr)) for name, arr in tensors]
    header, offset = {}, 0
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    for name, arr in tensors:
        header[name] = {"dtype": _DTYPE_NAMES[arr.dtype.newbyteorder("=")],
                        "shape": list(arr.shape), "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for _, arr in tensors:
            f.write(arr.reshape(-1).view(np.uint8))
    return offset


def _shard_name(i: int, n: int) -> str:
    width = max(5, len(str(n)))  # HF writes 5 digits; wider only past 99,999 shards
    return f"model-{i:0{width}d}-of-{n:0{width}d}.safetensors"


def _write_index(out_dir: str, weight_map: Mapping[str, str], total_size: int) -> None:
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    tmp = os.path.join(out_dir, INDEX_NAME + ".partial")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(index, f, indent=2)
    os.replace(tmp, os.path.join(out_dir, INDEX_NAME))  # the index appears only when complete


class ShardedWriter:
    """Stream tensors into ``model-000NN-of-000MM.safetensors`` shards plus the index.

    ``add`` buffers arrays until the next one would push the shard past ``max_shard_bytes``,
    then writes that shard, so memory holds at most one shard's tensors (a tensor larger than
    the limit gets a shard of its own). Shards are first written as
    ``model-000NN.safetensors.partial`` because the total count MM is only known at ``close``,
    which renames them and then writes ``model.safetensors.index.json`` (with
    ``metadata.total_size`` = sum of tensor bytes). Arrays are stored in their own dtype
    (cast to ``ml_dtypes.bfloat16`` before ``add`` for BF16); the writer keeps a reference, not
    a copy, until the shard is written, so do not modify an array after adding it.

    Use as a context manager: a clean exit closes, an exception deletes the partial shards.
    """

    def __init__(self, out_dir: str, max_shard_bytes: int = 5 * 2**30, *,
                 metadata: Mapping[str, str] | None = None):
        os.makedirs(out_dir, exist_ok=True)
        clash = sorted(f for f in os.listdir(out_dir)
                       if f.endswith((".safetensors", ".safetensors.partial")) or f == INDEX_NAME)
        if clash:
            raise ConversionError(f"{out_dir}: already holds checkpoint files {clash[:3]}; "
                                  "write into an empty directory")
        self.out_dir, self.max_shard_bytes = out_dir, int(max_shard_bytes)
        self.metadata = dict(metadata or {"format": "pt"})  # "pt": transformers reads it as torch
        self._pending: list[tuple[str, np.ndarray]] = []
        self._pending_bytes = 0
        self._shards: list[tuple[str, list[str]]] = []  # (partial path, tensor names)
        self._names: set[str] = set()
        self.total_size = 0
        self._closed = False

    def add(self, name: str, array: np.ndarray) -> None:
        """Queue one tensor [any shape] for the current shard; flushes a full shard first."""
        if self._closed:
            raise ConversionError(f"{self.out_dir}: add({name!r}) after close()")
        if not name or name == "__metadata__" or name in self._names:
            raise ConversionError(f"{self.out_dir}: invalid or duplicate tensor name {name!r}")
        arr = _check_array(name, array)
        if self._pending and self._pending_bytes + arr.nbytes > self.max_shard_bytes:
            self._flush()
        self._names.add(name)
        self._pending.append((name, arr))
        self._pending_bytes += arr.nbytes

    def _flush(self) -> None:
        path = os.path.join(self.out_dir, f"model-{len(self._shards) + 1:05d}.safetensors.partial")
        self.total_size += write_safetensors(path, self._pending, self.metadata)
        self._shards.append((path, [name for name, _ in self._pending]))
        self._pending, self._pending_bytes = [], 0

    def close(self) -> dict[str, str]:
        """Write the last shard, give shards their final names, write the index.

        Returns the weight_map {tensor name: shard file name}.
        """
        if self._closed:
            raise ConversionError(f"{self.out_dir}: close() called twice")
        if self._pending:
            self._flush()
        if not self._shards:
            raise ConversionError(f"{self.out_dir}: no tensors were added")
        self._closed = True
        weight_map = {}
        for i, (path, names) in enumerate(self._shards, start=1):
            final = _shard_name(i, len(self._shards))
            os.replace(path, os.path.join(self.out_dir, final))
            weight_map.update(dict.fromkeys(names, final))
        _write_index(self.out_dir, weight_map, self.total_size)
        return weight_map

    def abort(self) -> None:
        """Delete the partial shards written so far and drop queued tensors."""
        self._closed = True
        self._pending = []
        for path, _ in self._shards:
            if os.path.exists(path):
                os.remove(path)

    def __enter__(self) -> "ShardedWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def write_tiny_checkpoint(out_dir: str, tensors: Mapping[str, np.ndarray], *, num_shards: int = 1,
                          index: bool | None = None, config: Mapping | None = None) -> dict:
    """Write a small synthetic HF checkpoint for tests (everything in memory; tiny tensors only).

    Tensors are split, in the given order, into ``num_shards`` contiguous groups. With an index
    (default: when num_shards > 1) shards are ``model-0000i-of-0000n.safetensors`` plus
    ``model.safetensors.index.json``; without one a single shard is ``model.safetensors`` and
    several are ``part-i.safetensors`` (the "all *.safetensors" layout). ``config``, if given,
    is written as config.json. Build quantized weights with ``quant.encode_weight``.
    Returns the weight_map {name: file}.
    """
    os.makedirs(out_dir, exist_ok=True)
    index = num_shards > 1 if index is None else index
    names = list(tensors)
    groups = [list(g) for g in np.array_split(np.array(names, dtype=object), num_shards)]
    weight_map, total = {}, 0
    for i, group in enumerate(groups, start=1):
        if index:
            file = _shard_name(i, num_shards)
        else:
            file = SINGLE_NAME if num_shards == 1 else f"part-{i}.safetensors"
        total += write_safetensors(os.path.join(out_dir, file), [(n, tensors[n]) for n in group],
                                   {"format": "pt"})
        weight_map.update(dict.fromkeys(group, file))
    if index:
        _write_index(out_dir, weight_map, total)
    if config is not None:
        with open(os.path.join(out_dir, CONFIG_NAME), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2)
    return weight_map
