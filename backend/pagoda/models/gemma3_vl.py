"""Gemma 3 with images (``Gemma3ForConditionalGeneration``): Gemma 3's decoder, SigLIP and the projector.

As transformers' ``Gemma3Model``:

- the text model is Gemma 3's (``models/gemma3.py``), the tower and the projector are
  ``models/siglip_vision.py``; each image is resized to the tower's square (Hugging Face's
  ``Gemma3ImageProcessor``, pan-and-scan refused) and becomes ``mm_tokens_per_image`` rows;
- a prompt holds ``<start_of_image>`` (``boi_token_index``) once per image, as Gemma 3's chat
  template writes it; the input processor expands it as Gemma 3's processor does:
  ``"\\n\\n" <start_of_image> <image_soft_token> * mm_tokens_per_image <end_of_image> "\\n\\n"``
  (``engine.image_inputs``), so the image's rows are the soft tokens only;
- a step's image rows take the projector's output instead of the (scaled) token embedding; the
  soft token's id may lie past the vocabulary (262144 in the released models), so such ids
  read row 0 of the table first, as transformers does;
- **an image's soft tokens attend to each other both ways** (transformers' ``token_type_ids``
  mask: full-attention layers OR(causal, same image); sliding layers AND(window, OR(causal,
  same image))): ``VisionSpec.is_bidirectional``, carried to the kernels as per-query key
  limits (``kernels.AttentionMetadata.key_limits``: a query inside an image sees keys up to
  the image's last position, within its layer's window);
- positions are 1-D (no M-RoPE);
- ``text_config`` / ``vision_config`` are completed with transformers' defaults, as transformers
  reads them (the released configs leave most fields to them).

Checkpoint names: transformers 5 writes the text model under ``language_model.model.*`` (the
released checkpoints too; ``model.language_model.*`` is read as well), the tower under
``vision_tower.*`` (released: ``vision_tower.vision_model.*``), the projector under
``multi_modal_projector.*``; the head is tied unless ``tie_word_embeddings`` is false.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Optional

import torch
import torch.nn.functional as F

from pagoda.kernels import AttentionMetadata
from pagoda.models import gemma3
from pagoda.models.config import ModelConfig
from pagoda.models.llama import copy_checked
from pagoda.models.multimodal import ImageEmbedding, MultiModalBatch, VisionSpec, text_and_vision_sections
from pagoda.models.siglip_vision import Gemma3Projector, SiglipVisionTower

if TYPE_CHECKING:
    from pagoda.models.lora import LoRABatch

# Where each part lives in a checkpoint, in the order they are tried (``match_checkpoint``).
_TEXT = ("language_model.model.", "model.language_model.")
_HEAD = ("lm_head.weight", "language_model.lm_head.weight")
_TOWER = ("vision_tower.vision_model.", "vision_tower.", "model.vision_tower.")
_PROJECTOR = ("multi_modal_projector.", "model.multi_modal_projector.")


def parse_config(raw: dict, architecture: str) -> ModelConfig:
    """Gemma 3's text fields from ``text_config``, the image rules from the rest.

    Raises:
        ValueError: no ``text_config`` / ``vision_config``, or what ``gemma3.parse_config`` refuses.
    """
    if not isinstance(raw.get("text_config"), dict) or not isinstance(raw.get("vision_config"), dict):
        raise ValueError(f"{architecture}: config.json needs text_config and vision_config")
    text, vision = text_and_vision_sections(raw, "Gemma3TextConfig", "SiglipVisionConfig")
    config = gemma3.parse_config(text, architecture)
    config.architectures = list(raw.get("architectures") or [architecture])
    size = int(vision.get("image_size", 224))
    config.vision = VisionSpec(
        family="gemma3", image_token_id=int(raw.get("image_token_index", 262144)), spatial_merge_size=1,
        mrope_section=(), image_processor="Gemma3ImageProcessorPil",
        processor_defaults=dict(size={"height": size, "width": size}), vision_config=vision,
        tokens_per_image=int(raw.get("mm_tokens_per_image", 256)),
        begin_token_id=int(raw.get("boi_token_index", 255999)), end_token_id=int(raw.get("eoi_token_index", 256000)),
        is_bidirectional=True)
    return config


class Gemma3ForConditionalGeneration(gemma3.Gemma3ForCausalLM):
    """Gemma 3's decoder, the SigLIP tower (``vision_tower``) and the projector (module docstring)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        super().__init__(config, dtype, device)
        spec = config.vision
        assert spec is not None, f"{config.architecture}: a vision config carries its VisionSpec"
        self.vision_tower = SiglipVisionTower(spec.vision_config, dtype, self.device)
        self.multi_modal_projector = Gemma3Projector(spec.vision_config, config.hidden_size, spec.tokens_per_image,
                                                     self.vision_tower.patches_per_side, dtype, self.device)
        self._soft_token_outside_vocab = spec.image_token_id >= config.vocab_size
        self._prefixes = (_TEXT[0], _HEAD[0], _TOWER[0], _PROJECTOR[0])

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list, meta: AttentionMetadata,
                lora: Optional["LoRABatch"] = None, mm: Optional[MultiModalBatch] = None) -> torch.Tensor:
        """One step; ``mm`` brings this step's image rows (their key limits are on ``meta``)."""
        if self._soft_token_outside_vocab:  # the soft token's own row is replaced below
            input_ids = torch.where(input_ids < self.config.vocab_size, input_ids, 0)
        h = F.embedding(input_ids, self.embed_tokens) * self.embed_scale
        if mm is not None:
            h = h.index_copy(0, mm.rows, mm.embeds.to(h.dtype))
        return self.run_layers(h, positions, kv_caches, meta, lora)

    def encode_image(self, data: dict) -> ImageEmbedding:
        """One image's soft-token rows ``[mm_tokens_per_image, hidden]``: ``data`` is
        ``{"pixel_values": [1, 3, size, size]}`` (the input processor's)."""
        with torch.inference_mode():
            patches = self.vision_tower(data["pixel_values"].to(self.device))
            return ImageEmbedding(self.multi_modal_projector(patches))

    # ---- weights: the checkpoint's names <-> the decoder's --------------------------------

    def match_checkpoint(self, names: set[str]) -> None:
        """Which of the known spellings (module docstring) this checkpoint uses for each part."""
        def pick(options: tuple[str, ...], exact: bool = False) -> str:
            for option in options:
                if option in names if exact else any(n.startswith(option) for n in names):
                    return option
            return options[0]

        tower = [p for p in _TOWER if any(n.startswith(p + "embeddings.") for n in names)]
        self._prefixes = (pick(_TEXT), pick(_HEAD, exact=True), tower[0] if tower else _TOWER[0], pick(_PROJECTOR))

    def _checkpoint_name(self, name: str) -> str:
        text, head, _, _ = self._prefixes
        if name == "lm_head.weight":
            return head
        return text + name[len("model."):] if name.startswith("model.") else name

    def _image_params(self) -> dict[str, torch.Tensor]:
        _, _, tower, projector = self._prefixes
        return {**{tower + n: p for n, p in self.vision_tower.named_parameters()},
                **{projector + n: p for n, p in self.multi_modal_projector.named_parameters()}}

    def expected_weight_names(self) -> set[str]:
        return {self._checkpoint_name(n) for n in super().expected_weight_names()} | set(self._image_params())

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The tower's and projector's tensors as they are; the text model's, renamed to ``model.*``,
        through Gemma 3's ``load_weights`` (its ``1 + w`` norms). Returns the checkpoint names loaded.
        Raises ValueError on a shape."""
        text, head, _, _ = self._prefixes
        image = self._image_params()
        loaded: set[str] = set()

        def text_weights():
            for name, tensor in weights:
                if name in image:
                    copy_checked(name, image[name], tensor)
                    loaded.add(name)
                elif name == head:
                    yield "lm_head.weight", tensor
                elif name.startswith(text):
                    yield "model." + name[len(text):], tensor
                else:
                    yield name, tensor

        text_loaded = super().load_weights(text_weights())  # runs text_weights, which loads the image parts too
        return loaded | {self._checkpoint_name(n) for n in text_loaded}
