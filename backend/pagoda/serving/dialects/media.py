"""Image URLs at the doors: a URL a request names -> the image's encoded bytes.

Shared by every door that takes image URLs: the OpenAI door's chat ``image_url`` parts (and
through it the Responses and Messages APIs, ``fleet.api.openai_images``) and TensorRT-LLM's
LLM-API ``image_url`` input (``dialects.llmapi``). Each refusal is a ``ValueError`` whose
message starts with the field it names (``where``); a door turns it into its 400.

- ``data:image/<subtype>;base64,<payload>``: decoded here (strict base64, whitespace
  ignored); a data URL that is not base64 or not ``image/...`` is refused.
- ``http(s)``: fetched only through a ``fetcher`` (``serving.media_fetch.MediaFetcher``: an
  allow-list of hosts, a size and a time limit; off unless the server was started with
  ``--allowed-media-domains``); without one they are refused, naming the flag.
- any other scheme (``file:``, ``ftp:``, ...) is refused.

Whether the bytes are an image, and the image limits (count, bytes, pixels, decompression
bombs), are the engine's checks (``engine.image_inputs``).
"""

from __future__ import annotations

import base64
import binascii
from typing import Any, Optional

NOT_FETCHED = ("http(s) image URLs are not fetched: this server was started without an allow-list of media hosts "
               "(pagoda serve / pagoda router --allowed-media-domains HOST,...); send the image inline as a data: "
               "URL (data:image/png;base64,...)")


def image_url_bytes(url: str, where: str, fetcher: Optional[Any] = None) -> bytes:
    """The encoded image ``url`` names (module docstring).

    Args:
        url: a ``data:`` URL, or ``http(s)`` with a ``fetcher``.
        where: the field, for messages (``messages[0].content[1].image_url.url``, ``image_url[0]``).
        fetcher: fetches ``http(s)`` URLs (``fetch(url, where) -> bytes``); None: they are refused.
    Raises:
        ValueError: naming ``where``: a scheme not taken, a bad data URL, a refused fetch.
    """
    if not isinstance(url, str):
        raise ValueError(f"{where}: must be a URL string, got {type(url).__name__}")
    scheme = url.split(":", 1)[0].strip().lower() if ":" in url else ""
    if scheme in ("http", "https"):
        if fetcher is None:
            raise ValueError(f"{where}: {NOT_FETCHED}")
        return fetcher.fetch(url, where)
    if scheme != "data":
        shown = scheme or url[:16]
        raise ValueError(f"{where}: unsupported image URL scheme {shown!r}; send a data: URL "
                         "(data:image/png;base64,...)")
    return data_url_bytes(url, where)


def data_url_bytes(url: str, where: str) -> bytes:
    """The bytes a base64 ``data:image/...`` URL carries. Raises ValueError naming ``where``."""
    header, comma, payload = url.split(":", 1)[1].partition(",")
    media_type, *params = header.split(";")
    if not comma or "base64" not in (p.strip().lower() for p in params):
        raise ValueError(f"{where}: a data: URL must be base64 (data:image/png;base64,...)")
    if not media_type.strip().lower().startswith("image/"):
        raise ValueError(f"{where}: the data: URL's media type must be image/..., got {media_type!r}")
    try:
        data = base64.b64decode("".join(payload.split()), validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{where}: the data: URL's payload is not valid base64") from None
    if not data:
        raise ValueError(f"{where}: the data: URL holds no image")
    return data
