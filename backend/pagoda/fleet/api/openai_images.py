"""OpenAI chat ``image_url`` content parts -> the images a ``WireRequest`` carries.

A chat message's content may be a list of parts: ``{"type": "text", "text": ...}`` and
``{"type": "image_url", "image_url": {"url": ..., "detail": ...}}`` (OpenAI's and vLLM's
form). Each image part becomes

- its encoded bytes, in the order the parts come over the whole conversation (the engine
  pairs the n-th image with the n-th placeholder of the prompt), and
- ``{"type": "image"}`` in the message the chat template renders (transformers' form: a
  vision model's template, Qwen3-VL's for one, writes the model's image placeholder there).

URLs follow ``serving.dialects.media``'s rules: ``data:image/<subtype>;base64,<payload>`` is
decoded; ``http(s)`` URLs are refused unless the door has a fetcher (``MEDIA.fetcher``, set
from ``--allowed-media-domains``: an allow-list, size and time limits); every other scheme is
refused. Whether the bytes are an image, and the image limits
(count, bytes, pixels, decompression bombs), are the engine's checks (``engine.image_inputs``,
docs/multimodal.md); they come back as 400s naming ``multi_modal_data.image[i]``.

Images are taken in ``user`` messages only (a system or assistant turn with an image has no
meaning a template agrees on).
"""

from __future__ import annotations

import asyncio
import base64
from dataclasses import dataclass
from typing import Any, Callable, Optional, TypeVar

from pagoda.fleet.api.openai_protocol import CHAT_ROLES, ChatMessage, ImageURLPart, OpenAIError
from pagoda.serving.dialects.media import image_url_bytes


@dataclass
class MediaSettings:
    """The door's ``http(s)`` image fetcher (``serving.media_fetch.MediaFetcher``); None: not fetched."""

    fetcher: Optional[Any] = None


T = TypeVar("T")
MEDIA = MediaSettings()  # one per process: set once at the door's start (pagoda router --allowed-media-domains)


def message_for_template(message: ChatMessage, index: int, images: list[bytes]) -> Any:
    """The content a chat template renders for ``message`` (``messages[index]``): its text, or,
    when it holds images, transformers' list of ``text`` / ``image`` parts; the images' bytes are
    appended to ``images``.

    Raises:
        OpenAIError: naming ``messages[i].content[j]...``: an image outside a user message, a URL
            that is not a base64 ``data:`` URL of an image.
    """
    parts = message.content if isinstance(message.content, list) else None
    if parts is None or not any(isinstance(part, ImageURLPart) for part in parts):
        return message.text()
    if CHAT_ROLES[message.role] != "user":
        raise OpenAIError(f"messages[{index}].content: image_url parts are taken in user messages only, "
                          f"not in a {message.role} message", "messages")
    content: list[dict[str, Any]] = []
    for number, part in enumerate(parts):
        if isinstance(part, ImageURLPart):
            images.append(image_bytes(part.image_url.url, f"messages[{index}].content[{number}].image_url.url"))
            content.append({"type": "image"})
        else:
            content.append({"type": "text", "text": part.text})
    return content


def image_url_part(url: str, where: str, param: str = "messages") -> dict[str, Any]:
    """Chat's ``image_url`` part for ``url``, checked here so a bad one is refused naming ``where``
    (another door's field: the Messages and Responses doors translate into chat); an ``http(s)``
    URL is fetched here, once, and handed on as a data: URL. Raises OpenAIError."""
    data = image_bytes(url, where, param)
    if not url.lower().startswith("data:"):
        url = "data:image/*;base64," + base64.b64encode(data).decode("ascii")
    return {"type": "image_url", "image_url": {"url": url}}


async def off_the_loop(build: Callable[..., T], *args: Any) -> T:
    """``build(*args)`` on a worker thread when this door fetches images (a fetch may take up to
    its time limit, which must not stall the event loop), else inline."""
    if MEDIA.fetcher is None:
        return build(*args)
    return await asyncio.to_thread(build, *args)


def image_bytes(url: str, where: str, param: str = "messages") -> bytes:
    """The encoded image ``url`` names (``serving.dialects.media``: data: URLs; http(s) only through
    the door's fetcher). Raises OpenAIError naming ``where`` (its top-level field: ``param``)."""
    try:
        return image_url_bytes(url, where, MEDIA.fetcher)
    except ValueError as exc:
        raise OpenAIError(str(exc), param) from None
