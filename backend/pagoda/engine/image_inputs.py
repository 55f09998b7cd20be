"""A request's images, from what the user sent to ``MultiModalFeature``s: checked, hashed, preprocessed.

``ImageInputs.process(token_ids, images)`` runs where the request is built (the input
processor, off the step), for a model whose config declares a ``VisionSpec``:

1. each image is a PIL image or its encoded bytes; bytes are opened lazily and the header's
   size is checked against ``MultiModalConfig.max_image_pixels`` *before* decoding, so a
   decompression bomb is refused without being expanded (PIL's own ``MAX_IMAGE_PIXELS``
   guard stays on too); a payload that is not an image, or is truncated, is refused;
2. the image is converted to RGB and hashed: ``SHA-256(b"pagoda-image-v1" || mode || u32le(w)
   || u32le(h) || pixels)`` (``mm_hash``), so the same picture in another file format hashes
   the same;
3. the model's own Hugging Face image processor (its PIL variant, configured from the model
   folder's ``preprocessor_config.json``) makes the encoder's input, and the model's rule
   (``VisionSpec.num_image_tokens``) says how many placeholder tokens the image takes;
4. the prompt's placeholder tokens (one ``image_token_id`` per image, as the model's chat
   template writes them) expand into that many copies; their number must equal the number of
   images.

Every refusal is a ``ValueError`` naming the field (``multi_modal_data.image[i]``, ``prompt``)
and the limit; nothing is kept of a refused request.
"""

from __future__ import annotations

import hashlib
import io
import struct
from pathlib import Path
from typing import Any, Optional, Sequence

from pagoda.engine.multimodal import MultiModalFeature, MultiModalConfig

_IMAGE_TAG = b"pagoda-image-v1"


def image_hash(image: Any) -> str:
    """The content hash of an RGB PIL image (module docstring, step 2)."""
    width, height = image.size
    h = hashlib.sha256(_IMAGE_TAG)
    h.update(image.mode.encode("ascii"))
    h.update(struct.pack("<II", width, height))
    h.update(image.tobytes())
    return h.hexdigest()


class ImageInputs:
    """Args:
    spec: the model's ``VisionSpec`` (``models.multimodal``).
    model_path: the model folder (its ``preprocessor_config.json``, when there is one).
    limits: what one request may bring.
    """

    def __init__(self, spec: Any, model_path: str, limits: MultiModalConfig) -> None:
        self.spec = spec
        self.model_path = model_path
        self.limits = limits
        self._processor: Any = None

    @property
    def processor(self) -> Any:
        """The model's Hugging Face image processor (built on first use)."""
        if self._processor is None:
            try:
                import transformers
            except ImportError as e:  # pragma: no cover - the vision extra installs it
                raise ValueError("multi_modal_data: images need transformers' image processors "
                                 "(pip install 'pagoda[vision]')") from e
            cls = getattr(transformers, self.spec.image_processor)
            if (Path(self.model_path) / "preprocessor_config.json").exists():
                self._processor = cls.from_pretrained(self.model_path)
            else:
                self._processor = cls(**self.spec.processor_defaults)
        return self._processor

    def process(self, token_ids: list[int], images: Any) -> tuple[list[int], tuple[MultiModalFeature, ...]]:
        """The prompt with its placeholders expanded, and one feature per image.

        Args:
            token_ids: the prompt, holding one ``image_token_id`` per image.
            images: one image or a list (PIL images or encoded bytes).
        Returns:
            (expanded token ids, features in prompt order).
        Raises:
            ValueError: too many images, one too large, not an image or truncated, or placeholders
                that do not match the images.
        """
        images = list(images) if isinstance(images, (list, tuple)) else [images]
        slots = self._check_slots(token_ids, images)
        token_id = self.spec.image_token_id
        prepared = [self.prepare(i, image) for i, image in enumerate(images)]
        out: list[int] = []
        features = []
        previous = 0
        for slot, (mm_hash, data, length) in zip(slots, prepared):
            out += token_ids[previous:slot]
            features.append(MultiModalFeature(mm_hash, len(out), length, data))
            out += [token_id] * length
            previous = slot + 1
        return out + token_ids[previous:], tuple(features)

    def spans(self, token_ids: list[int], images: Any) -> tuple[int, list[tuple[str, int, int]]]:
        """What ``process`` would make of the prompt for its block hashes, without the encoder's
        input (the router's view: ``fleet.routing.image_routing``): the expanded prompt's length
        and (content hash, first placeholder index, placeholder tokens) per image, in order.

        The placeholder count comes from the processor's own size rule
        (``get_number_of_image_patches``, the resize ``process`` runs) without resizing pixels.

        Raises:
            ValueError: as ``process``.
        """
        images = list(images) if isinstance(images, (list, tuple)) else [images]
        slots = self._check_slots(token_ids, images)
        counter = getattr(self.processor, "get_number_of_image_patches", None)
        spans, grown = [], 0
        for index, (slot, value) in enumerate(zip(slots, images)):
            if counter is None:
                mm_hash, _, length = self.prepare(index, value)
            else:
                image = self._load(index, value)
                mm_hash = image_hash(image)
                length = counter(image.height, image.width) // self.spec.spatial_merge_size**2
            spans.append((mm_hash, slot + grown, length))
            grown += length - 1
        return len(token_ids) + grown, spans

    def _check_slots(self, token_ids: list[int], images: list) -> list[int]:
        """The placeholders' indices, one per image (raises ValueError: the count or the limit)."""
        if not images:
            raise ValueError("multi_modal_data.image: no image given")
        limit = self.limits.limit_images_per_prompt
        if len(images) > limit:
            raise ValueError(f"multi_modal_data.image: {len(images)} images; at most {limit} per prompt "
                             "(limit_images_per_prompt)")
        token_id = self.spec.image_token_id
        slots = [i for i, t in enumerate(token_ids) if t == token_id]
        if len(slots) != len(images):
            raise ValueError(f"prompt: {len(slots)} image placeholders (token id {token_id}) for {len(images)} "
                             "images; put one placeholder where each image goes, in order")
        return slots

    def prepare(self, index: int, value: Any) -> tuple[str, dict, int]:
        """One image (``value``, the request's ``index``-th) checked, hashed and run through the
        model's processor: (content hash, the encoder's input, placeholder tokens).

        Raises:
            ValueError: as ``process``, naming ``multi_modal_data.image[index]``.
        """
        image = self._load(index, value)
        processed = self.processor(images=[image], return_tensors="pt")
        grid = tuple(int(v) for v in processed["image_grid_thw"][0].tolist())
        return image_hash(image), {"pixel_values": processed["pixel_values"], "grid_thw": grid}, \
            self.spec.num_image_tokens(grid)

    def _load(self, index: int, value: Any) -> Any:
        """An RGB PIL image from ``value``, within the limits (module docstring, step 1)."""
        from PIL import Image, UnidentifiedImageError

        field = f"multi_modal_data.image[{index}]"
        if isinstance(value, (bytes, bytearray, memoryview)):
            most = self.limits.max_image_bytes
            if len(value) > most:
                raise ValueError(f"{field}: {len(value)} bytes; at most {most} (max_image_bytes)")
            try:
                image = Image.open(io.BytesIO(bytes(value)))
            except (UnidentifiedImageError, Image.DecompressionBombError) as e:
                raise ValueError(f"{field}: not an image this server can read, or too large ({e})") from e
            self._check_size(field, image.size)
            try:
                image.load()
            except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
                raise ValueError(f"{field}: the image data is truncated or corrupt ({e})") from e
        elif isinstance(value, Image.Image):
            image = value
            self._check_size(field, image.size)
        else:
            raise ValueError(f"{field}: must be a PIL image or its encoded bytes, got {type(value).__name__}")
        return image if image.mode == "RGB" else image.convert("RGB")

    def _check_size(self, field: str, size: Sequence[int]) -> None:
        width, height = size
        if width < 1 or height < 1:
            raise ValueError(f"{field}: empty image ({width}x{height})")
        if width * height > self.limits.max_image_pixels:
            raise ValueError(f"{field}: {width}x{height} = {width * height} pixels; at most "
                             f"{self.limits.max_image_pixels} (max_image_pixels)")


def make_image_inputs(model_config: Any, model_path: str, limits: MultiModalConfig) -> Optional[ImageInputs]:
    """``ImageInputs`` for a vision-language model, None for a text-only one."""
    spec = getattr(model_config, "vision", None)
    return ImageInputs(spec, model_path, limits) if spec is not None else None
