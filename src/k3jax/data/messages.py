"""Chat messages as both chat formats read them (K2's ``chat_template`` and K3's ``k3_chat``): a
message's content as text pieces and image parts, and the image count checks."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

Message = Mapping[str, Any]
IMAGE_PARTS = ("image", "image_url")


def content_parts(message: Message, images: bool = False) -> list[str | None]:
    """The content as pieces: the text between image parts as one string, None per image part
    (``images``; without it an image part is an error). None content is ""."""
    content = message.get("content")
    if content is None:
        return [""]
    if isinstance(content, str):
        return [content]
    if isinstance(content, Sequence):
        out: list[str | None] = []
        for part in content:
            kind = part.get("type") if isinstance(part, Mapping) else None
            if images and kind in IMAGE_PARTS:
                out.append(None)
            elif kind == "text":    # adjacent text parts are one piece (encoded as one string)
                if out and out[-1] is not None:
                    out[-1] += str(part["text"])
                else:
                    out.append(str(part["text"]))
            else:
                raise ValueError(f"only text{' and image' if images else ''} content parts are supported, "
                                 f"got {part!r}")
        return out or [""]
    raise ValueError(f"message content must be a string or a list of parts, got {content!r}")


def content_text(message: Message) -> str:
    """String content, or the concatenated `text` parts of a list content; None -> ""."""
    return "".join(content_parts(message))


def count_images(messages: Sequence[Message]) -> int:
    """Image content parts in a conversation."""
    return sum(p is None for m in messages if m.get("role") != "tool" for p in content_parts(m, True))


def check_media(messages: Sequence[Message], media: Sequence[str] | None) -> None:
    n = count_images(messages) if media is not None else 0
    if media is not None and n != len(media):
        raise ValueError(f"the messages have {n} image parts but {len(media)} images were given")
