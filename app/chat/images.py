"""Images in chat messages (Qt-free): what may be attached, how an image travels to the server and how it is kept.

An attached image keeps the bytes of its file when the file is PNG, JPEG, WebP or GIF (no quality lost, no size
gained, and the server's image cache keys on the same bytes a resend carries); any other format Pillow opens (BMP,
TIFF, ...) is re-encoded to PNG, the media type every OpenAI-compatible server takes. Pixels are never scaled here:
the server scales an image to its model's limits, and only the thumbnails are scaled copies. A message is sent as
OpenAI content parts, the images first in the order attached and the text after them (the question follows what it
asks about, as in Qwen's own examples).
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import io
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from PIL import Image

MAX_IMAGE_BYTES = 10 * 1024 * 1024  # as the server's max_image_mib default
MAX_IMAGES = 16  # in one message, as the server's max_images default
KEPT_FORMATS = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp", "GIF": "image/gif"}
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".gif", ".bmp", ".tif", ".tiff")
FILE_FILTER = "Images (*.png *.jpg *.jpeg *.webp *.gif *.bmp *.tif *.tiff)"
THUMB_BOX = (160, 120)  # a thumbnail in the transcript fits this box (width, height)
# What a Qwen3.5 / Qwen3.6 VL prompt spends on an image: one token per 32 x 32 pixels after resizing, between the
# processor's 64 and the engine's max_image_pixels default (4,194,304 px), plus the start and end markers.
IMAGE_TOKENS_MIN, IMAGE_TOKENS_MAX, IMAGE_MARKERS = 64, 4096, 2


class ImageRefused(ValueError):
    """An image that cannot be attached or sent; the message says which and what to do."""


@dataclass(frozen=True)
class ChatImage:
    name: str
    media_type: str
    data: bytes = field(repr=False)
    width: int
    height: int

    @cached_property  # (hashing 10 MiB takes milliseconds; the key is asked for at every keystroke and repaint)
    def key(self) -> str:
        """The image's content hash (short): names its thumbnail, so equal images share one."""
        return _key(self.data)

    @property
    def data_uri(self) -> str:
        return _data_uri(self)

    @property
    def tokens(self) -> int:
        """About how many prompt tokens the image costs (an estimate for the context bar)."""
        t = round(self.width * self.height / 1024)
        return min(max(t, IMAGE_TOKENS_MIN), IMAGE_TOKENS_MAX) + IMAGE_MARKERS

    def part(self) -> dict[str, Any]:
        return {"type": "image_url", "image_url": {"url": self.data_uri}}

    def to_dict(self) -> dict[str, Any]:
        """As kept in a saved conversation: by content (base64), with what the transcript shows of it."""
        return {"name": self.name, "media_type": self.media_type, "width": self.width, "height": self.height,
                "data": base64.b64encode(self.data).decode("ascii")}

    @staticmethod
    def from_dict(d: dict[str, Any], check: bool = True) -> "ChatImage":
        """From ``to_dict``'s form; ``check`` decodes it again (a file from elsewhere), else it is trusted (this
        app's own database)."""
        name = str(d.get("name") or "image")
        try:
            data = base64.b64decode(str(d.get("data") or ""), validate=True)
        except (binascii.Error, ValueError):
            raise ImageRefused(f"{name}: its data is not base64. Export the conversation again.") from None
        if check:
            return image_from_bytes(data, name)
        return ChatImage(name, str(d.get("media_type") or "image/png"), data, int(d.get("width") or 0),
                         int(d.get("height") or 0))


_URIS: dict[str, str] = {}  # content hash -> data URI: a message is turned into API parts at every keystroke
URIS_KEPT = 64  # the newest images' URIs are kept (a conversation's images), older ones are rebuilt when needed


def _key(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def _data_uri(image: ChatImage) -> str:
    key = image.key
    uri = _URIS.get(key)
    if uri is None:
        if len(_URIS) >= URIS_KEPT:
            _TOKENS.pop(_URIS.pop(next(iter(_URIS))), None)
        uri = _URIS[key] = f"data:{image.media_type};base64," + base64.b64encode(image.data).decode("ascii")
        _TOKENS[uri] = image.tokens
    return uri


_TOKENS: dict[str, int] = {}  # data URI -> estimated tokens (str hashes are cached, so a lookup is cheap)


def mib_text(n: int) -> str:
    return f"{n / (1024 * 1024):.1f} MiB"


def image_from_bytes(data: bytes, name: str) -> ChatImage:
    """An image to attach from a file's (or the clipboard's) bytes; ImageRefused says why it cannot be."""
    if len(data) > MAX_IMAGE_BYTES:
        raise ImageRefused(f"{name} is {mib_text(len(data))}; attach an image of at most {mib_text(MAX_IMAGE_BYTES)} "
                           f"(save it smaller, or as JPEG).")
    try:
        with Image.open(io.BytesIO(data)) as im:
            im.load()  # decodes every pixel: a truncated file is refused here, not by the server
            fmt, (width, height) = im.format, im.size
            if fmt not in KEPT_FORMATS:
                out = io.BytesIO()
                im.save(out, "PNG")
                data, fmt = out.getvalue(), "PNG"
    except Image.UnidentifiedImageError:
        raise ImageRefused(f"{name} is not an image Pillow can open (no image format it knows). Attach a PNG, "
                           f"JPEG, WebP or GIF file.") from None
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        raise ImageRefused(f"{name} is not an image Pillow can open ({e}). Attach a PNG, JPEG, WebP or GIF "
                           f"file.") from None
    if len(data) > MAX_IMAGE_BYTES:
        raise ImageRefused(f"{name} is {mib_text(len(data))} as PNG; attach an image of at most "
                           f"{mib_text(MAX_IMAGE_BYTES)} (save it as JPEG).")
    return ChatImage(name, KEPT_FORMATS[fmt], data, width, height)


def read_image_file(path: Path) -> ChatImage:
    """An image file to attach; ImageRefused says why it cannot be (too big: refused before it is read)."""
    try:
        size = path.stat().st_size
        if size > MAX_IMAGE_BYTES:  # refused before it is read
            raise ImageRefused(f"{path.name} is {mib_text(size)}; attach an image of at most "
                               f"{mib_text(MAX_IMAGE_BYTES)} (save it smaller, or as JPEG).")
        data = path.read_bytes()
    except OSError as e:
        raise ImageRefused(f"cannot read {path.name} ({e.strerror or e}).") from None
    return image_from_bytes(data, path.name)


def png_bytes(data: bytes) -> bytes:
    """An image's bytes (one Pillow opens) as PNG."""
    out = io.BytesIO()
    with Image.open(io.BytesIO(data)) as im:
        im.save(out, "PNG")
    return out.getvalue()


def check_count(already: int, adding: int) -> None:
    if already + adding > MAX_IMAGES:
        have = f" (it holds {already} already)" if already else ""
        raise ImageRefused(f"A message holds at most {MAX_IMAGES} images; {adding} more would make "
                           f"{already + adding}{have}. Send these, then the rest in the next message.")


def thumb_size(width: int, height: int, box: tuple[int, int] = THUMB_BOX) -> tuple[int, int]:
    """``width`` x ``height`` scaled down (never up) to fit ``box``, the aspect ratio kept."""
    if width <= 0 or height <= 0:
        return box
    scale = min(box[0] / width, box[1] / height, 1.0)
    return max(1, round(width * scale)), max(1, round(height * scale))


def content(text: str, images: list[ChatImage]) -> str | list[dict[str, Any]]:
    """A user message's ``content``: the text alone, or the images' parts followed by the text's."""
    if not images:
        return text
    return [im.part() for im in images] + ([{"type": "text", "text": text}] if text else [])


def text_of(content: Any) -> str:
    """The text of a message's ``content`` (a string, or OpenAI parts)."""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content or [] if isinstance(p, dict) and p.get("type") == "text")


def content_tokens(content: Any) -> int:
    """The estimated tokens of the images among a message's content parts."""
    if isinstance(content, str) or not content:
        return 0
    total = 0
    for p in content:
        if isinstance(p, dict) and p.get("type") == "image_url":
            url = (p.get("image_url") or {}).get("url", "")
            total += _TOKENS.get(url, IMAGE_TOKENS_MAX + IMAGE_MARKERS)  # an image from elsewhere: at most
    return total


def image_from_part(part: dict[str, Any], index: int) -> ChatImage:
    """An OpenAI ``image_url`` part carrying a data URI (an imported conversation) as an image."""
    url = str((part.get("image_url") or {}).get("url") or "")
    name = f"image {index + 1}"
    head, sep, payload = url.partition(",")
    if not (url.startswith("data:") and sep and head.endswith(";base64")):
        raise ImageRefused(f"{name} is not inline (its url starts {url[:40]!r}); only data: URIs with base64 "
                           f"data are kept in a conversation. Save the image and attach it.")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageRefused(f"{name}: its data: URI is not valid base64.") from None
    return image_from_bytes(data, name)
