"""A request's images as the engine keeps them: ``MultiModalFeature`` and the limits on them.

One ``MultiModalFeature`` per image of a prompt, made by the input processor
(``engine/image_inputs.py``) after the model's own image processor ran: its content hash, where
its placeholder tokens lie in the prompt, and the processor's output for the encoder
(``data``: opaque here, the model's ``encode_image`` reads it). Torch-free: the core and the KV
bookkeeping carry features without looking inside ``data``.

Invariants: features of one request are in prompt order and their placeholder ranges
``[offset, offset + length)`` are disjoint and inside the prompt; ``mm_hash`` depends on the
image's pixels, size and mode only (never on the file's encoding or name), so the same picture
sent twice hashes the same and hits the encoder cache and the prefix cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence


@dataclass(frozen=True)
class MultiModalFeature:
    """One image of a request.

    Attributes:
        mm_hash: lowercase hex SHA-256 of the image's content (mode, size, pixels).
        offset: the index of its first placeholder token in the prompt.
        length: its number of placeholder tokens.
        data: what the model's encoder takes (``{"pixel_values": ..., "grid_thw": ...}`` for Qwen3-VL).
        modality: "image" (the only one served).
        is_bidirectional: its placeholders attend to each other both ways (Gemma 3): a query inside
            it sees keys up to ``end - 1``, so a prefill chunk never ends inside it
            (``core.sched.step_plan``) and the runner gives its rows a key limit
            (``kernels.AttentionMetadata.key_limits``).
    """

    mm_hash: str
    offset: int
    length: int
    data: Any = field(default=None, compare=False, repr=False)
    modality: str = "image"
    is_bidirectional: bool = False

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(frozen=True)
class MultiModalConfig:
    """Images: what one request may bring and what the encoder cache keeps (``EngineConfig``'s
    fields of the same names; one of its groups, ``EngineConfig.multimodal``).

    Attributes:
        limit_images_per_prompt: images per prompt.
        max_image_pixels: width x height of one image as sent (checked before decoding it fully;
            a larger one is refused as too big or a decompression bomb).
        max_image_bytes: encoded bytes of one image payload.
        mm_encoder_cache_bytes: the encoder cache's cap (``engine/runner/encoder_cache.py``).
    """

    limit_images_per_prompt: int = 4
    max_image_pixels: int = 4096 * 4096
    max_image_bytes: int = 20 * 2**20
    mm_encoder_cache_bytes: int = 256 * 2**20

    def __post_init__(self) -> None:
        for name in ("limit_images_per_prompt", "max_image_pixels", "max_image_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.mm_encoder_cache_bytes < 0:
            raise ValueError(f"mm_encoder_cache_bytes: must be >= 0, got {self.mm_encoder_cache_bytes}")


def block_mm_keys(features: Sequence[MultiModalFeature], start: int, end: int) -> tuple[tuple[str, int], ...]:
    """(hash, offset) of each feature whose placeholders overlap tokens ``[start, end)`` (a block's
    extra keys, ``contracts.block_hash``)."""
    return tuple((f.mm_hash, f.offset) for f in features if f.offset < end and f.end > start)
