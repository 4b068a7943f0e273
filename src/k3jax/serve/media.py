"""Images in chat requests: ``image_url`` content parts -> processed images (``MediaItem``s) and
their prefix-cache digests, each misuse a one-line HTTP 400.

A part is ``{"type": "image_url", "image_url": {"url": URL}}`` (or ``"image_url": URL``). URL is a
base64 ``data:`` URI (always accepted) or an http(s) URL whose host ``serve_image_url_domains``
allows (an exact name, or ``.example.com`` for that domain's subdomains; [] = none). Both are held
to ``serve_image_max_bytes``; a fetch must finish within ``serve_image_fetch_timeout_s`` from the
connection to the last byte (a server that trickles bytes is cut off at the deadline, not only one
that goes silent). Redirects are not followed (a redirect could leave the allowed hosts). The bytes
go through the same processor as ``k3jax.decode``'s ``images=`` (``vision_processor.load_image`` and
``process_image`` with the model's ``ProcessorConfig``), on a worker thread, not the event loop.

``digest`` is what the prefix cache keys on besides the token ids: a hash of an image's patches and
grid, so two requests whose prompts tokenize alike but whose images differ never share state.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import http.client
import time
import urllib.parse

import numpy as np

from k3jax.data.vision_processor import VisionInputError, check_media_limit, load_image, process_image
from k3jax.serve.protocol import ApiError

CHUNK_BYTES = 1 << 16


def _bad(message: str, code: str = "invalid_image") -> ApiError:
    return ApiError(400, message, param="messages", code=code)


def image_urls(messages) -> list[str]:
    """The URL of every image content part, in order (a malformed part is a 400)."""
    out = []
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") in ("image_url", "image")):
                continue
            where = f"messages[{i}].content[{j}]"
            if part.get("type") == "image":
                raise _bad(f"{where}: an image part must be {{\"type\": \"image_url\", \"image_url\": {{\"url\": ...}}}}")
            ref = part.get("image_url")
            url = ref.get("url") if isinstance(ref, dict) else ref
            if not isinstance(url, str) or not url:
                raise _bad(f"{where}.image_url: must be {{\"url\": \"data:image/...;base64,...\" or an http(s) URL}}")
            out.append(url)
    return out


def host_allowed(host: str, domains) -> bool:
    """``host`` is one of ``domains``, or under one written with a leading dot (``.example.com``)."""
    host = host.lower().rstrip(".")
    for d in (d.lower().rstrip(".") for d in domains):
        if host.endswith(d) if d.startswith(".") else host == d:
            return True
    return False


def _data_uri(url: str, max_bytes: int) -> bytes:
    head, sep, payload = url.partition(",")
    if not sep or not head.endswith(";base64"):
        raise _bad("image_url: a data: URI must be data:<mime type>;base64,<data>")
    if len(payload) * 3 // 4 > max_bytes + 3:
        raise _bad(f"image_url: the data: URI holds about {len(payload) * 3 // 4} bytes, over "
                   f"serve_image_max_bytes={max_bytes}", code="image_too_large")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise _bad("image_url: the data: URI is not valid base64") from None
    if len(data) > max_bytes:
        raise _bad(f"image_url: the data: URI holds {len(data)} bytes, over serve_image_max_bytes={max_bytes}",
                   code="image_too_large")
    return data


def _fetch(url: str, domains, max_bytes: int, timeout: float) -> bytes:
    u = urllib.parse.urlsplit(url)
    if u.scheme not in ("http", "https") or not u.hostname:
        raise _bad(f"image_url {url[:100]!r}: must be a data: URI or an http(s) URL", code="invalid_image_url")
    if not host_allowed(u.hostname, domains):
        raise _bad(f"image_url: the host {u.hostname!r} is not in serve_image_url_domains={list(domains)}; "
                   "send the image as a base64 data: URI or have the server's operator allow the host",
                   code="image_url_not_allowed")
    deadline = time.monotonic() + timeout
    cls = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
    conn = cls(u.hostname, u.port, timeout=timeout)
    too_slow = _bad(f"image_url {url[:100]}: not fetched within serve_image_fetch_timeout_s={timeout}",
                    code="image_fetch_timeout")
    try:
        conn.request("GET", (u.path or "/") + (f"?{u.query}" if u.query else ""), headers={"User-Agent": "k3jax"})
        r = conn.getresponse()
        if r.status != 200:
            raise _bad(f"image_url {url[:100]}: the server answered HTTP {r.status}", code="image_fetch_failed")
        length = r.getheader("content-length")
        if length is not None and length.isdigit() and int(length) > max_bytes:
            raise _bad(f"image_url {url[:100]}: {length} bytes, over serve_image_max_bytes={max_bytes}",
                       code="image_too_large")
        data, sock = bytearray(), conn.sock    # (http.client drops conn.sock once the body is read)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise too_slow
            if sock is not None and sock.fileno() >= 0:
                sock.settimeout(left)             # each read waits at most until the deadline
            piece = r.read1(CHUNK_BYTES) if hasattr(r, "read1") else r.read(CHUNK_BYTES)
            if not piece:
                return bytes(data)
            data += piece
            if len(data) > max_bytes:
                raise _bad(f"image_url {url[:100]}: over serve_image_max_bytes={max_bytes} bytes",
                           code="image_too_large")
    except TimeoutError:
        raise too_slow from None
    except OSError as e:      # refused, reset, DNS: one line, not a 500
        raise _bad(f"image_url {url[:100]}: cannot fetch it ({type(e).__name__}: {e})",
                   code="image_fetch_failed") from None
    except http.client.HTTPException as e:
        raise _bad(f"image_url {url[:100]}: bad HTTP response ({type(e).__name__})", code="image_fetch_failed") from None
    finally:
        conn.close()


def load_images(urls: list[str], pcfg, *, domains, max_bytes: int, timeout: float) -> list:
    """Fetch or decode every URL and process it -> MediaItems (blocking: run it on a worker thread)."""
    try:
        check_media_limit(len(urls), pcfg, "request")
    except VisionInputError as e:
        raise _bad(str(e), code="too_many_images") from None
    items = []
    for i, url in enumerate(urls):
        data = _data_uri(url, max_bytes) if url.startswith("data:") else _fetch(url, domains, max_bytes, timeout)
        try:
            items.append(process_image(load_image(data, name=f"image {i + 1}"), pcfg))
        except VisionInputError as e:
            raise _bad(str(e)) from None
    return items


def digest(item) -> bytes:
    """A content hash of a processed image (its grid and patches: what the tower sees)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(np.asarray(item.grid_thw, np.int64).tobytes())
    h.update(np.ascontiguousarray(item.patches).tobytes())
    return h.digest()


def media_keys(ids: list[int], items, pad_id: int) -> tuple:
    """(position of its first pad, digest) per item: the prefix cache's media key."""
    pads = [i for i, t in enumerate(ids) if t == pad_id]
    out, at = [], 0
    for it in items:
        out.append((pads[at], digest(it)))
        at += it.tokens
    return tuple(out)
