"""The bytes of one image a request names by URL: a `data:` URI (base64, decoded here) or, when the server allows it
(--image-url-fetch), an http(s) URL downloaded here. Both are bounded by --max-image-mib before the bytes are held:
a data URI's size is known from its length before it is decoded, a download stops at the limit. Anything else
(`file://`, bare base64, other schemes) is refused with a 400 that says what to send instead."""
from __future__ import annotations

import base64
import binascii
import re
import time
from urllib.parse import urljoin, urlsplit

from engine.server.errors import APIError, clip

MIB = 1024 * 1024
FETCH_SECONDS = 10.0  # the whole download, redirects included (llama-server's limit)
MAX_REDIRECTS = 5
_WHITESPACE = re.compile(r"\s+")
_BASE64 = re.compile(r"[A-Za-z0-9+/]+={0,2}")


def image_bytes(url: object, settings, param: str) -> bytes:
    """The encoded image (PNG, JPEG, ...) `url` stands for; a 400 naming `param` when it cannot be had."""
    if not isinstance(url, str) or not url:
        raise APIError(400, f"{param}: the image URL must be a non-empty string (a data:image/...;base64,... URI"
                            f"{' or an http(s) URL' if settings.image_url_fetch else ''}).", param=param)
    limit = settings.max_image_mib * MIB
    scheme = url.split(":", 1)[0].lower() if ":" in url[:16] else ""
    if scheme == "data":
        return data_uri_bytes(url, limit, param)
    if scheme in ("http", "https"):
        if not settings.image_url_fetch:
            raise APIError(400, f"{param}: the image is given by URL ({clip(url, 80)}), and this server does not "
                                f"download images. Send the image inline as a data:image/...;base64,... URI, or "
                                f"start the server with --image-url-fetch (NINFER_IMAGE_URL_FETCH=1) to let it "
                                f"fetch http(s) URLs.", code="image_url_fetch_off", param=param)
        return fetch_bytes(url, limit, param)
    if scheme == "file":
        raise APIError(400, f"{param}: file:// URLs are not read (the server does not open local files for "
                            f"requests). Send the image inline as a data:image/...;base64,... URI.", param=param)
    if not scheme and _BASE64.fullmatch(url[:4096]):
        raise APIError(400, f"{param}: the image URL looks like bare base64. Prefix it with its media type, as a "
                            f"data URI: data:image/png;base64,... (or image/jpeg, image/webp, image/gif).",
                       param=param)
    raise APIError(400, f"{param}: the image URL {clip(url, 80)!r} is neither a data: URI nor an http(s) URL. Send "
                        f"the image as data:image/png;base64,...", param=param)


def data_uri_bytes(url: str, limit: int, param: str) -> bytes:
    """The decoded payload of data:image/<type>;base64,<payload>, refused before decoding when it would exceed
    `limit` bytes."""
    header, comma, payload = url.partition(",")
    if not comma:
        raise APIError(400, f"{param}: the data URI has no comma before its data (data:image/png;base64,...).",
                       param=param)
    media, *options = header[len("data:"):].split(";")
    if not media.strip().lower().startswith("image/"):
        raise APIError(400, f"{param}: the data URI's media type is {media.strip() or 'missing'!r}, not an image "
                            f"type. Send data:image/png;base64,... (or image/jpeg, image/webp, image/gif).",
                       param=param)
    if "base64" not in (o.strip().lower() for o in options):
        raise APIError(400, f"{param}: the data URI is not base64-encoded; send data:{media.strip()};base64,...",
                       param=param)
    if _WHITESPACE.search(payload[:64]) or _WHITESPACE.search(payload[-64:]) or "\n" in payload:
        payload = _WHITESPACE.sub("", payload)  # line-wrapped base64 (MIME style)
    size = len(payload) * 3 // 4 - payload[-2:].count("=")
    check_size(size, limit, param)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise APIError(400, f"{param}: the data URI's payload is not valid base64.", param=param) from None


def check_size(size: int, limit: int, param: str, known: bool = True) -> None:
    """A 400 for an image of `size` bytes (`known`: its whole size; else what has arrived so far) over `limit`."""
    if size > limit:
        amount = f"{size / MIB:.1f} MiB" if known else f"over {limit // MIB} MiB (still arriving)"
        raise APIError(400, f"{param}: the image is {amount}, over this server's limit of "
                            f"{limit // MIB} MiB per image (--max-image-mib). Send a smaller or more compressed "
                            f"image.", code="image_too_large", param=param)


def fetch_bytes(url: str, limit: int, param: str) -> bytes:
    """An http(s) URL's body: at most `limit` bytes and FETCH_SECONDS in all, redirects followed only to http(s)."""
    import httpx

    deadline = time.monotonic() + FETCH_SECONDS
    try:
        with httpx.Client(follow_redirects=False, timeout=FETCH_SECONDS, trust_env=False) as client:
            for _ in range(MAX_REDIRECTS + 1):
                with client.stream("GET", url, headers={"Accept": "image/*"}) as response:
                    if response.is_redirect:
                        url = _redirect_target(url, response.headers.get("location", ""), param)
                        continue
                    return _body(response, url, limit, deadline, param)
    except httpx.HTTPError as e:
        raise APIError(400, f"{param}: the image at {clip(url, 80)} could not be fetched ({type(e).__name__}: "
                            f"{clip(str(e), 200)}). Check the URL, or send the image inline as a data: URI.",
                       param=param) from None
    raise APIError(400, f"{param}: fetching {clip(url, 80)} was redirected more than {MAX_REDIRECTS} times.",
                   param=param)


def _redirect_target(url: str, location: str, param: str) -> str:
    target = urljoin(url, location)
    if urlsplit(target).scheme.lower() not in ("http", "https"):
        raise APIError(400, f"{param}: fetching the image was redirected to {clip(target, 80)!r}; only http(s) "
                            f"redirects are followed.", param=param)
    return target


def _body(response, url: str, limit: int, deadline: float, param: str) -> bytes:
    if response.status_code != 200:
        raise APIError(400, f"{param}: fetching the image at {clip(url, 80)} gave HTTP {response.status_code}.",
                       param=param)
    declared = response.headers.get("content-length", "")
    if declared.isdigit():
        check_size(int(declared), limit, param)
    chunks, size = [], 0
    for chunk in response.iter_bytes():
        size += len(chunk)
        check_size(size, limit, param, known=False)
        if time.monotonic() > deadline:
            raise APIError(400, f"{param}: fetching the image at {clip(url, 80)} took over {FETCH_SECONDS:.0f} s.",
                           param=param)
        chunks.append(chunk)
    return b"".join(chunks)
