"""Gemma 4 with images (``Gemma4ForConditionalGeneration``): Gemma 4's decoder, its vision tower and embedder.

As transformers 5.24's ``Gemma4Model``:

- the text model is Gemma 4's (``models/gemma4.py``), the tower and the embedder are
  ``models/gemma4_vision.py``; each image is resized by Hugging Face's ``Gemma4ImageProcessor``
  (aspect ratio kept, within ``max_soft_tokens`` soft tokens), so the number of soft tokens
  varies per image (the processor's ``num_soft_tokens_per_image``);
- a prompt holds ``<|image|>`` (``image_token_id``) once per image, as Gemma 4's chat template
  writes it; the input processor expands it as Gemma 4's processor does:
  ``<|image>`` (``boi_token_id``) ``<|image|> * n`` ``<image|>`` (``eoi_token_id``), no newlines;
- a step's media tokens (image, video, audio ids) read the pad token's row
  (``text_config.pad_token_id``), as transformers does, both for the scaled embedding and for
  the per-layer inputs' token part; the image rows of the embedding are then the embedder's
  output (not scaled), and the per-layer inputs' projected part is computed from that merged
  embedding (transformers' ``project_per_layer_inputs(inputs_embeds, ...)``);
- with ``text_config.use_bidirectional_attention == "vision"``, **an image's soft tokens attend to
  each other both ways on the sliding layers only** (transformers' ``create_masks_for_vision_model``:
  sliding layers AND(window, OR(causal, same image)), full layers causal):
  ``VisionSpec.is_bidirectional``; the runner puts key limits on every layer's metadata and this
  model hands its full-attention layers a copy without them. Without it (the small Gemma 4s),
  plain causal attention;
- audio is not served: the audio tower's tensors (``audio_tower`` / ``embed_audio``) are left in
  the checkpoint unread, and an audio input is refused by the input processor (only ``image``).

Checkpoint names: ``model.language_model.*`` (the text model), ``model.vision_tower.*``,
``model.embed_vision.*``; the head is tied unless ``tie_word_embeddings`` is false.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Iterable, Optional

import torch
import torch.nn.functional as F

from pagoda.kernels import AttentionMetadata
from pagoda.models import gemma4
from pagoda.models.config import ModelConfig
from pagoda.models.gemma4_vision import Gemma4VisionEmbedder, Gemma4VisionTower
from pagoda.models.llama import copy_checked
from pagoda.models.multimodal import ImageEmbedding, MultiModalBatch, VisionSpec, text_and_vision_sections

if TYPE_CHECKING:
    from pagoda.models.lora import LoRABatch

_TEXT, _TOWER, _EMBEDDER = "model.language_model.", "model.vision_tower.", "model.embed_vision."
IGNORED_PREFIXES = ("model.audio_tower.", "model.embed_audio.")  # audio is not served (module docstring)


def parse_config(raw: dict, architecture: str) -> ModelConfig:
    """Gemma 4's text fields from ``text_config``, the image rules from the rest.

    Raises:
        ValueError: no ``text_config`` / ``vision_config``, or what ``gemma4.parse_config`` refuses.
    """
    if not isinstance(raw.get("text_config"), dict) or not isinstance(raw.get("vision_config"), dict):
        raise ValueError(f"{architecture}: config.json needs text_config and vision_config (images are served; "
                         "a Gemma 4 without a vision tower is Gemma4ForCausalLM)")
    text, vision = text_and_vision_sections(raw, "Gemma4TextConfig", "Gemma4VisionConfig")
    config = gemma4.parse_config(text, architecture)
    config.architectures = list(raw.get("architectures") or [architecture])
    image = int(raw.get("image_token_id", 258_880))
    config.vision = VisionSpec(
        family="gemma4", image_token_id=image, spatial_merge_size=1, mrope_section=(),
        image_processor="Gemma4ImageProcessorPil",
        processor_defaults=dict(patch_size=int(vision.get("patch_size", 16)),
                                pooling_kernel_size=int(vision.get("pooling_kernel_size", 3))),
        vision_config=vision, begin_token_id=int(raw.get("boi_token_id", 255_999)),
        end_token_id=int(raw.get("eoi_token_id", 258_882)),
        is_bidirectional=text.get("use_bidirectional_attention") == "vision", prompt_token=image,
        wrap_newlines=False, counted_by_processor=True)
    others = (raw.get(key, default) for key, default in (("video_token_id", 258_884), ("audio_token_id", 258_881)))
    media = (image, *(int(token) for token in others if token is not None))  # Gemma4Config's defaults
    config.gemma4 = dataclasses.replace(config.gemma4, media_token_ids=media, pad_token_id=int(text.get("pad_token_id")
                                                                                               or 0))
    return config


class Gemma4ForConditionalGeneration(gemma4.Gemma4ForCausalLM):
    """Gemma 4's decoder, the vision tower (``vision_tower``) and the embedder (module docstring)."""

    ignored_checkpoint_prefixes = IGNORED_PREFIXES

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        super().__init__(config, dtype, device)
        spec = config.vision
        assert spec is not None, f"{config.architecture}: a vision config carries its VisionSpec"
        self.vision_tower = Gemma4VisionTower(spec.vision_config, dtype, self.device)
        self.embed_vision = Gemma4VisionEmbedder(spec.vision_config, config.hidden_size, dtype, self.device)
        self.pad_token_id = config.gemma4.pad_token_id
        self.register_buffer("media_ids", torch.tensor(config.gemma4.media_token_ids, dtype=torch.int64,
                                                       device=self.device), persistent=False)
        self.full_layers = [i for i, t in enumerate(config.layer_types) if t == "full_attention"]

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list, meta: AttentionMetadata,
                lora: Optional["LoRABatch"] = None, mm: Optional[MultiModalBatch] = None) -> torch.Tensor:
        """One step; ``mm`` brings this step's image rows (their key limits are on ``meta``)."""
        ids = torch.where(torch.isin(input_ids, self.media_ids), self.pad_token_id, input_ids)
        h = F.embedding(ids, self.embed_tokens) * self.embed_scale
        if mm is not None:
            h = h.index_copy(0, mm.rows, mm.embeds.to(h.dtype))
        metas = [meta.for_layer(idx) for idx in range(len(self.layers))]
        if meta.key_limits is not None:  # bidirectional images on sliding layers only: full layers stay causal
            causal: dict[int, AttentionMetadata] = {}
            for idx in self.full_layers:
                layer_meta = metas[idx]
                if id(layer_meta) not in causal:
                    causal[id(layer_meta)] = dataclasses.replace(layer_meta, key_limits=None, key_limits_host=None,
                                                                 cpu_plans={})
                metas[idx] = causal[id(layer_meta)]
        return self.run_layers(h, self.per_layer_inputs(ids, h), positions, kv_caches, metas, lora)

    def encode_image(self, data: dict) -> ImageEmbedding:
        """One image's soft-token rows ``[n, hidden]``: ``data`` is the input processor's
        ``{"pixel_values": [1, max_patches, 3 p p], "image_position_ids": [1, max_patches, 2]}``."""
        with torch.inference_mode():
            soft = self.vision_tower(data["pixel_values"], data["image_position_ids"])  # positions stay on the host
            return ImageEmbedding(self.embed_vision(soft.to(self.dtype)))

    # ---- weights: the checkpoint's names <-> the decoder's --------------------------------

    def _image_params(self) -> dict[str, torch.Tensor]:
        return {**{_TOWER + n: p for n, p in self.vision_tower.named_parameters()},
                **{_EMBEDDER + n: p for n, p in self.embed_vision.named_parameters()}}

    def expected_weight_names(self) -> set[str]:
        return {_checkpoint_name(n) for n in super().expected_weight_names()} | set(self._image_params())

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The tower's and embedder's tensors as they are; the text model's, renamed to ``model.*``,
        through Gemma 4's loader. Returns the checkpoint names loaded. Raises ValueError on a shape."""
        image = self._image_params()
        loaded: set[str] = set()

        def text_weights():
            for name, tensor in weights:
                if name in image:
                    copy_checked(name, image[name], tensor)
                    loaded.add(name)
                elif name.startswith(_TEXT):
                    yield "model." + name[len(_TEXT):], tensor
                else:
                    yield name, tensor

        text_loaded = super().load_weights(text_weights())  # runs text_weights, which loads the image parts too
        return loaded | {_checkpoint_name(n) for n in text_loaded}


def _checkpoint_name(name: str) -> str:
    """A text-model name (``model.*``, ``lm_head.weight``) as the checkpoint spells it."""
    return _TEXT + name[len("model."):] if name.startswith("model.") else name
