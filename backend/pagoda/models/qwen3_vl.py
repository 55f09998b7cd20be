"""Qwen3-VL (``Qwen3VLForConditionalGeneration``): Qwen3's decoder with images in.

As transformers' ``Qwen3VLModel``:

- the text model is Qwen3 (q/k norm) under ``model.language_model.*``; the vision tower and its
  merger are ``models/qwen3_vl_vision.py`` under ``model.visual.*``;
- a prompt holds one ``image_token_id`` per image, which the input processor expands into
  ``t * h * w / merge**2`` copies (``VisionSpec.num_image_tokens``); the embeddings of those
  rows are the merger's output (``MultiModalBatch.rows`` / ``embeds``);
- DeepStack: the features of the tower's early blocks are added to the outputs of the first
  decoder layers at the image rows (``MultiModalBatch.deepstack``);
- M-RoPE, interleaved: every token has (temporal, height, width) positions; text tokens have
  three equal positions that continue after an image at ``start + max(h, w) / merge``, an
  image's tokens the image's start plus (0, row, column) (``mrope_positions``). Each rotary
  frequency follows one of the three (``models.multimodal.mrope_cos_sin``). A request's
  positions past its prompt are its token index plus ``delta`` (``mrope_positions``' second
  value), so a step without images needs only shifted 1-D positions.

Video inputs are not served (``video_token_id`` is left as a plain token).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch

from pagoda import kernels
from pagoda.kernels import AttentionMetadata
from pagoda.models import qwen3
from pagoda.models.config import ModelConfig
from pagoda.models.llama import KVCache, WeightTargets
from pagoda.models.multimodal import ImageEmbedding, MultiModalBatch, VisionSpec, mrope_cos_sin
from pagoda.models.qwen3_vl_vision import Qwen3VLVisionTower

if TYPE_CHECKING:
    from pagoda.models.lora import LoRABatch

_MROPE_KEYS = ("mrope_section", "mrope_interleaved")


def parse_config(raw: dict, architecture: str) -> ModelConfig:
    """The text model's fields from ``text_config`` (Qwen3's) and the vision rules from the rest.

    Raises:
        ValueError: no ``text_config`` / ``vision_config``, or an M-RoPE split that does not
            cover the rotary half-dimension.
    """
    if not isinstance(raw.get("text_config"), dict) or not isinstance(raw.get("vision_config"), dict):
        raise ValueError(f"{architecture}: config.json needs text_config and vision_config")
    text = dict(raw["text_config"])
    section = (24, 20, 20)
    for key in ("rope_parameters", "rope_scaling"):
        if isinstance(text.get(key), dict):
            params = dict(text[key])
            section = tuple(params.get("mrope_section", section))
            text[key] = {k: v for k, v in params.items() if k not in _MROPE_KEYS}
    for key in ("tie_word_embeddings", "bos_token_id", "eos_token_id"):
        if key in raw and key not in text:
            text[key] = raw[key]
    config = qwen3.parse_config(text, architecture)
    config.architectures = list(raw.get("architectures") or [architecture])
    if len(section) != 3 or sum(section) != config.head_dim // 2:
        raise ValueError(f"{architecture}: mrope_section {list(section)} must be three parts summing to "
                         f"head_dim / 2 = {config.head_dim // 2}")
    vision = raw["vision_config"]
    config.vision = VisionSpec(
        family="qwen3_vl", image_token_id=int(raw.get("image_token_id", 151655)),
        spatial_merge_size=int(vision.get("spatial_merge_size", 2)), mrope_section=section,
        image_processor="Qwen2VLImageProcessorPil",
        processor_defaults=dict(patch_size=vision.get("patch_size", 16), merge_size=vision.get("spatial_merge_size", 2),
                                temporal_patch_size=vision.get("temporal_patch_size", 2)),
        vision_config=dict(vision))
    return config


class Qwen3VLForConditionalGeneration(qwen3.Qwen3ForCausalLM):
    """Qwen3's decoder, the vision tower (``visual``), M-RoPE and DeepStack (module docstring)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        super().__init__(config, dtype, device)
        assert config.vision is not None, "a Qwen3-VL config carries its VisionSpec"
        self.visual = Qwen3VLVisionTower(config.vision.vision_config, dtype, device)
        self.register_buffer("inv_freq", config.inv_freq().to(self.device), persistent=False)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]: rotary positions when ``mm`` brings no M-RoPE ones
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
        lora: Optional["LoRABatch"] = None,
        mm: Optional[MultiModalBatch] = None,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        """One step, with this step's image rows and M-RoPE positions when ``mm`` is given."""
        h = self.embed(input_ids)
        cos_sin, pos = self.cos_sin_cache, positions
        if mm is not None:
            h = h.index_copy(0, mm.rows, mm.embeds.to(h.dtype))
            if mm.mrope_positions is not None:  # a per-token table, read at row i for token i
                cos_sin = mrope_cos_sin(mm.mrope_positions, self.inv_freq, self.config.vision.mrope_section)
                pos = torch.arange(h.shape[0], device=h.device)
        residual = None
        for idx, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            h, residual = layer(h, residual, pos, cos_sin, kv_cache, meta.for_layer(idx), lora)
            if mm is not None and idx < len(mm.deepstack):
                h = h.index_add(0, mm.rows, mm.deepstack[idx].to(h.dtype))
        h, _ = kernels.rms_norm(h, self.norm, self.config.rms_norm_eps, residual)
        return h

    def encode_image(self, data: dict) -> ImageEmbedding:
        """One image's placeholder embeddings: ``data`` is ``{"pixel_values": [patches, dim],
        "grid_thw": (t, h, w)}`` (the input processor's)."""
        return self.visual.encode(data["pixel_values"].to(self.device), tuple(data["grid_thw"]))

    def mrope_positions(self, num_prompt_tokens: int, images: Sequence[Any]) -> tuple[torch.Tensor, int]:
        """A prompt's M-RoPE positions (transformers' ``get_rope_index`` for one sequence).

        Args:
            num_prompt_tokens: the prompt's length.
            images: the prompt's images in order, each with ``offset`` (its first placeholder's
                index) and ``data["grid_thw"]`` (``engine.multimodal.MultiModalFeature``).
        Returns:
            ``[3, num_prompt_tokens]`` int64 positions (CPU) and ``delta``: a later token at index
            ``i`` has position ``i + delta`` on all three axes.
        """
        merge = self.config.vision.spatial_merge_size
        positions = torch.empty(3, num_prompt_tokens, dtype=torch.int64)
        current, text_start = 0, 0
        for offset, (t, h, w) in ((image.offset, image.data["grid_thw"]) for image in images):
            positions[:, text_start:offset] = torch.arange(offset - text_start) + current
            current += offset - text_start
            gh, gw = h // merge, w // merge
            grid = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(gh), torch.arange(gw), indexing="ij"))
            positions[:, offset:offset + t * gh * gw] = grid.reshape(3, -1) + current
            current += max(gh, gw)
            text_start = offset + t * gh * gw
        positions[:, text_start:] = torch.arange(num_prompt_tokens - text_start) + current
        current += num_prompt_tokens - text_start
        return positions, current - num_prompt_tokens

    def _weight_table(self) -> WeightTargets:
        """Qwen3's names under ``model.language_model.`` (the head stays ``lm_head``), the tower's under
        ``model.visual.``."""
        table = {(f"model.language_model.{name[len('model.'):]}" if name.startswith("model.") else name): target
                 for name, target in super()._weight_table().items()}
        table |= {f"model.visual.{name}": target for name, target in self.visual.weight_targets().items()}
        return table
