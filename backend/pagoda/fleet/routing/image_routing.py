"""The router's view of a prompt's images: the block hashes a replica will give an image prompt.

A replica expands each image placeholder of a prompt into as many tokens as the model's
image processor gives the image, and every full block that overlaps an image's placeholders
carries ``[content hash, first placeholder index]`` in its extra keys
(``contracts.block_hash``). The router must hash an image prompt the same way, or an image
request is routed by its text alone: the prefix index would send two requests with the same
text and different images to the same replica as if they shared blocks, and would not find
the replica that really holds an image's blocks.

``RouterImages.expand`` runs the engine's own rules (``engine.image_inputs.ImageInputs.expanded``:
the same content hash, the processor's own size rule for the placeholder count, the same
limits, the same expansion: Gemma's wrap tokens included) on the model folder the router serves,
without the encoder's input (no pixels are resized where the processor has a size rule), and
gives the expanded token ids and each image's (hash, offset, length) for ``hash_prompt_blocks``.
An image the router cannot read (not an image, over a limit, a placeholder count that does not
match) is not the router's to refuse: the replica answers it with its 400; the router hashes
only the blocks before the first placeholder (they do not depend on any image; for Gemma 3 the
token before it too, which its newline wrap may merge with) and routes by those.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, Sequence

from pagoda.engine.image_inputs import ImageInputs
from pagoda.engine.multimodal import MultiModalConfig

Span = tuple[str, int, int]  # (content hash, first placeholder index, placeholder tokens)


class RouterImages:
    """Args:
    inputs: the engine's image rules for the served model (``ImageInputs``).
    """

    def __init__(self, inputs: ImageInputs) -> None:
        self.inputs = inputs

    @classmethod
    def from_model_dir(cls, model_dir: str, limits: Optional[MultiModalConfig] = None) -> Optional["RouterImages"]:
        """The image rules of the model in ``model_dir``; None for a text-only model (torch and the
        model registry are imported only for a vision model's folder)."""
        path = Path(model_dir)
        if not (path / "config.json").exists():
            return None
        if "vision_config" not in json.loads((path / "config.json").read_text(encoding="utf-8")):
            return None
        from pagoda.engine.image_inputs import make_image_inputs
        from pagoda.models.registry import config_from_pretrained

        inputs = make_image_inputs(config_from_pretrained(path), str(path), limits or MultiModalConfig())
        return cls(inputs) if inputs is not None else None

    def count(self, token_ids: list[int], images: Sequence[Any]) -> int:
        """The prompt's length once the replica expands its placeholders (Messages ``count_tokens``).

        Raises:
            ValueError: an image the replica would refuse, naming it (``ImageInputs.spans``).
        """
        length, _ = self.inputs.spans(token_ids, list(images))
        return length

    def expand(self, token_ids: list[int], images: Sequence[Any]) -> tuple[list[int], list[Span]]:
        """The prompt as the replica will hash it.

        Args:
            token_ids: the prompt, one placeholder token per image.
            images: the images' encoded bytes (or PIL images), in prompt order.
        Returns:
            (expanded token ids, spans); for images the engine would refuse, the ids before the
            first placeholder and no spans (module docstring).
        """
        try:
            return self.inputs.expanded(token_ids, list(images))
        except ValueError:
            spec = self.inputs.spec
            token_id = spec.prompt_token_id
            first = token_ids.index(token_id) if token_id in token_ids else len(token_ids)
            if spec.begin_token_id is not None and spec.wrap_newlines:  # a newline there may merge with the wrap's
                first = max(first - 1, 0)
            return token_ids[:first], []
