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
4. the prompt's placeholder tokens (one ``VisionSpec.prompt_token_id`` per image, as the model's
   chat template writes them: Qwen's ``<|image_pad|>``, Gemma 3's ``<start_of_image>``) expand into
   that many ``image_token_id`` copies (Gemma 3 wraps them as its processor does: ``_expand``;
   Gemma 4's prompt holds ``<|image|>`` itself, wrapped in ``<|image>`` / ``<image|>`` alone, and
   its count varies per image: the processor's ``num_soft_tokens_per_image``);
   their number must equal the number of images. An image whose tokens attend to each other both
   ways (Gemma 3, Gemma 4) must fit in one step's prefill (``max_step_tokens``).

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
    max_step_tokens: the most prompt tokens one step prefills (chunked prefill's budget); an image
        whose placeholders attend to each other both ways (``VisionSpec.is_bidirectional``) must fit
        in one step. None: no such limit (prompts run whole).
    """

    def __init__(self, spec: Any, model_path: str, limits: MultiModalConfig,
                 max_step_tokens: Optional[int] = None) -> None:
        self.spec = spec
        self.model_path = model_path
        self.limits = limits
        self.max_step_tokens = max_step_tokens
        self._processor: Any = None
        self._hf_tokenizer: Any = None
        self._newline_runs: Optional[dict[int, int]] = None

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
                processor = cls.from_pretrained(self.model_path)
            else:
                processor = cls(**self.spec.processor_defaults)
            if getattr(processor, "do_pan_and_scan", None):  # crops would add images the prompt does not hold
                raise ValueError(f"{self.spec.family}: preprocessor_config.json sets do_pan_and_scan, which is not "
                                 "supported (each image is one crop); set it to false")
            self._processor = processor
        return self._processor

    def process(self, token_ids: list[int], images: Any) -> tuple[list[int], tuple[MultiModalFeature, ...]]:
        """The prompt with its placeholders expanded, and one feature per image.

        Args:
            token_ids: the prompt, holding one ``VisionSpec.prompt_token_id`` per image.
            images: one image or a list (PIL images or encoded bytes).
        Returns:
            (expanded token ids, features in prompt order).
        Raises:
            ValueError: too many images, one too large, not an image or truncated, or placeholders
                that do not match the images.
        """
        images = list(images) if isinstance(images, (list, tuple)) else [images]
        slots = self._check_slots(token_ids, images)
        prepared = [self.prepare(i, image) for i, image in enumerate(images)]
        out, offsets = self._expand(token_ids, slots, [length for _, _, length in prepared])
        bidirectional = self.spec.is_bidirectional
        return out, tuple(MultiModalFeature(mm_hash, offset, length, data, is_bidirectional=bidirectional)
                          for offset, (mm_hash, data, length) in zip(offsets, prepared))

    def spans(self, token_ids: list[int], images: Any) -> tuple[int, list[tuple[str, int, int]]]:
        """``expanded``'s prompt length and spans (Messages ``count_tokens``). Raises as ``process``."""
        out, spans = self.expanded(token_ids, images)
        return len(out), spans

    def expanded(self, token_ids: list[int], images: Any) -> tuple[list[int], list[tuple[str, int, int]]]:
        """What ``process`` would make of the prompt for its block hashes, without the encoder's
        input (the router's view: ``fleet.routing.image_routing``): the expanded prompt (its wrap
        tokens included) and (content hash, first placeholder index, placeholder tokens) per image,
        in order.

        The placeholder count comes from the processor's own size rule
        (``get_number_of_image_patches``, the resize ``process`` runs) without resizing pixels,
        or is the model's fixed count (``VisionSpec.tokens_per_image``), or (Gemma 4) the
        processor's own output.

        Raises:
            ValueError: as ``process``.
        """
        images = list(images) if isinstance(images, (list, tuple)) else [images]
        slots = self._check_slots(token_ids, images)
        counter = None if self.spec.tokens_per_image or self.spec.counted_by_processor else \
            getattr(self.processor, "get_number_of_image_patches", None)
        hashes, lengths = [], []
        for index, value in enumerate(images):
            if counter is None:
                mm_hash, _, length = self.prepare(index, value)
            else:
                image = self._load(index, value)
                mm_hash = image_hash(image)
                length = counter(image.height, image.width) // self.spec.spatial_merge_size**2
            hashes.append(mm_hash)
            lengths.append(length)
        out, offsets = self._expand(token_ids, slots, lengths)
        return out, list(zip(hashes, offsets, lengths))

    def _expand(self, token_ids: list[int], slots: list[int], lengths: list[int]) -> tuple[list[int], list[int]]:
        """The prompt with the placeholder at each of ``slots`` replaced by its image's tokens, and
        each image's first placeholder index in it.

        Qwen: ``length`` copies of ``image_token_id``. A model that wraps its images (Gemma 3):
        ``"\\n\\n", begin, image * length, end, "\\n\\n"``, as its processor's text; a newline token
        beside the wrap merges with the wrap's newlines into one run (``"\\n" + "\\n\\n"`` is
        ``"\\n\\n\\n"``), as the processor's tokenizer reads the joined text (and vLLM's Gemma 3 does).
        """
        head, tail = self._wrap()
        out: list[int] = []
        offsets = []
        previous = 0
        for slot, length in zip(slots, lengths):
            out += token_ids[previous:slot]
            previous = slot + 1
            lead = head
            if lead and out and (merged := self._merge(out[-1], lead[0])) is not None:
                out[-1], lead = merged, lead[1:]
            out += lead
            offsets.append(len(out))
            out += [self.spec.image_token_id] * length + tail
            if tail and previous < len(token_ids) and (merged := self._merge(out[-1], token_ids[previous])) is not None:
                out[-1] = merged
                previous += 1
        return out + token_ids[previous:], offsets

    def _wrap(self) -> tuple[list[int], list[int]]:
        """The tokens before and after an image's placeholders (none for Qwen)."""
        if self.spec.begin_token_id is None:
            return [], []
        if not self.spec.wrap_newlines:  # Gemma 4: <|image> soft tokens <image|>, nothing around them
            return [self.spec.begin_token_id], [self.spec.end_token_id]
        runs = self.newline_runs
        newlines = [runs[2]] if 2 in runs else self._tokenizer.encode("\n\n", add_special_tokens=False)
        return newlines + [self.spec.begin_token_id], [self.spec.end_token_id] + newlines

    def _merge(self, first: int, second: int) -> Optional[int]:
        """The one token of two newline runs joined, when both are runs and the joined run is a token."""
        if not self.spec.wrap_newlines:
            return None
        counts = {token: count for count, token in self.newline_runs.items()}
        if first in counts and second in counts:
            return self.newline_runs.get(counts[first] + counts[second])
        return None

    @property
    def newline_runs(self) -> dict[int, int]:
        """{n: the token of ``n`` newlines} for the runs the model's tokenizer has as one token."""
        if self._newline_runs is None:
            runs = {}
            for count in range(1, 33):
                ids = self._tokenizer.encode("\n" * count, add_special_tokens=False)
                if len(ids) == 1:
                    runs[count] = ids[0]
            self._newline_runs = runs
        return self._newline_runs

    @property
    def _tokenizer(self) -> Any:
        if self._hf_tokenizer is None:
            import transformers

            try:
                self._hf_tokenizer = transformers.AutoTokenizer.from_pretrained(self.model_path)
            except (OSError, ValueError) as e:
                raise ValueError(f"{self.spec.family}: the model folder's tokenizer is needed to wrap images "
                                 f"in newlines as its processor does ({e})") from e
        return self._hf_tokenizer

    def _check_slots(self, token_ids: list[int], images: list) -> list[int]:
        """The placeholders' indices, one per image (raises ValueError: the count or the limit)."""
        if not images:
            raise ValueError("multi_modal_data.image: no image given")
        limit = self.limits.limit_images_per_prompt
        if len(images) > limit:
            raise ValueError(f"multi_modal_data.image: {len(images)} images; at most {limit} per prompt "
                             "(limit_images_per_prompt)")
        token_id = self.spec.prompt_token_id
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
        data = {"pixel_values": processed["pixel_values"]}
        if "image_grid_thw" in processed:
            data["grid_thw"] = tuple(int(v) for v in processed["image_grid_thw"][0].tolist())
        if "image_position_ids" in processed:  # Gemma 4: each patch's (x, y), -1 for padding
            data["image_position_ids"] = processed["image_position_ids"]
        if self.spec.counted_by_processor:
            length = int(processed["num_soft_tokens_per_image"][0])
        else:
            length = self.spec.num_image_tokens(data.get("grid_thw"))
        if self.spec.is_bidirectional and self.max_step_tokens is not None and length > self.max_step_tokens:
            raise ValueError(f"multi_modal_data.image[{index}]: {length} placeholder tokens that attend to each other "
                             f"both ways must be prefilled in one step; at most {self.max_step_tokens} tokens per step "
                             "(max_num_batched_tokens / long_prefill_token_threshold)")
        return image_hash(image), data, length

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


def make_image_inputs(model_config: Any, model_path: str, limits: MultiModalConfig,
                      max_step_tokens: Optional[int] = None) -> Optional[ImageInputs]:
    """``ImageInputs`` for a vision-language model, None for a text-only one (``max_step_tokens``:
    see ``ImageInputs``)."""
    spec = getattr(model_config, "vision", None)
    return ImageInputs(spec, model_path, limits, max_step_tokens) if spec is not None else None
