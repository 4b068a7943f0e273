"""Paths that may be local or on Google Cloud Storage (``gs://bucket/...``), in one place.

- ``path(p)``: a ``pathlib.Path`` for a local path, an ``etils.epath.Path`` (gcsfs underneath) for
  ``gs://``; both have ``/``, ``exists``, ``is_dir``, ``iterdir``, ``glob``, ``open``,
  ``read_text``/``write_text``, ``mkdir``, so callers do not branch. orbax checkpoints take such a
  path and write arrays through tensorstore's ``gcs`` kvstore.
- ``glob(pattern)``: the files a (possibly gs://) glob matches, sorted.
- ``local_dir(p)``: a local copy of a gs:// directory (tokenizers, Hugging Face checkpoints read by
  libraries that want files), cached under ``$K3JAX_CACHE`` (default ``~/.cache/k3jax``).
- ``upload(local, remote)``: copy a local file or directory tree to a gs:// location.

Any other scheme (``s3://``, ``hdfs://``, ...) is a ``ConfigError`` naming the key, never a local
folder named ``s3:``. Clients find a GCS emulator through the standard ``STORAGE_EMULATOR_HOST``
(gcsfs) and ``TENSORSTORE_GCS_HTTP_URL`` (tensorstore) variables.
"""
from __future__ import annotations

import glob as _glob
import hashlib
import os
from pathlib import Path

import fsspec
from etils import epath

from k3jax.config import ConfigError, check_path_scheme

SUPPORTED = ("gs",)


def check(p, key: str) -> None:
    """ConfigError unless ``p`` is local or on a supported object store (gs://)."""
    check_path_scheme(p, key)


def is_remote(p) -> bool:
    return str(p).startswith("gs://")


def run_dir(cfg):
    """``<base_output_directory>/<run_name>`` as a path object (local or gs://)."""
    return path(cfg.checkpoint.base_output_directory, "base_output_directory") / cfg.checkpoint.run_name


def path(p, key: str = "path"):
    """The path object for ``p`` (see the module docstring)."""
    check(p, key)
    s = str(p)
    if is_remote(s):
        return epath.Path(s)
    if s.startswith("file://"):
        s = s[len("file://"):]
    return Path(os.path.expanduser(s))


def _fs():
    return fsspec.filesystem("gs")


def glob(pattern: str, key: str = "path") -> list[str]:
    """Files matching ``pattern`` (``**`` recursive), sorted; gs:// results keep their scheme."""
    check(pattern, key)
    if not is_remote(pattern):
        p = os.path.expanduser(pattern[len("file://"):] if pattern.startswith("file://") else pattern)
        return sorted(f for f in _glob.glob(p, recursive=True) if os.path.isfile(f))
    found = _fs().glob(pattern, detail=True)
    return sorted("gs://" + name for name, info in found.items() if info.get("type") == "file")


def read_range(p: str, start: int, end: int) -> bytes:
    """Bytes [start, end) of a gs:// object."""
    return _fs().cat_file(p, start=start, end=end)


def open_binary(p: str):
    """A binary file object for reading (local or gs://)."""
    if is_remote(p):
        return _fs().open(p, "rb")
    return open(p, "rb")


def local_dir(p, key: str = "path") -> Path:
    """``p`` itself when local; for gs:// a local copy of the directory's files (downloaded once per
    process start into a cache folder named by the URL; re-downloaded every call, it is small)."""
    if not is_remote(p):
        return path(p, key)
    base = str(p).rstrip("/")
    fs = _fs()
    files = [f for f in fs.find(base) if f.rstrip("/") != base[len("gs://"):]]
    if not files:
        raise ConfigError(f"{key}={p}: no such directory (no object under it)")
    root = Path(os.environ.get("K3JAX_CACHE", Path.home() / ".cache" / "k3jax"))
    dest = root / "gs" / hashlib.sha256(base.encode()).hexdigest()[:16]
    prefix = base[len("gs://"):] + "/"
    for f in files:
        out = dest / f[len(prefix):]
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + f".part{os.getpid()}")
        tmp.write_bytes(fs.cat_file(f))
        os.replace(tmp, out)
    return dest


def upload(local, remote: str) -> int:
    """Copy a local file or directory tree to ``remote`` (gs://); -> the number of files."""
    local = Path(local)
    dst = path(remote)
    files = [local] if local.is_file() else [f for f in sorted(local.rglob("*")) if f.is_file()]
    for f in files:
        out = dst if local.is_file() else dst / str(f.relative_to(local))
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(f.read_bytes())
    return len(files)
