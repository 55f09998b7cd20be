"""What every Qwen vision-language family adds to its text decoder: ``QwenVisionLanguage``.

Qwen3-VL (``models/qwen3_vl.py``, on Qwen3's decoder) and Qwen3.5 (``models/qwen3_5_vl.py``, on
the hybrid decoder) take images the same way, as transformers' ``Qwen3VLModel`` /
``Qwen3_5Model`` do:

- the checkpoint's text model lives under ``model.language_model.*`` (the head stays
  ``lm_head``), the vision tower under ``model.visual.*`` (``models/qwen3_vl_vision.py``);
  loading translates the text names to the decoder's own ``model.*`` names, so the decoder's
  loading rules (fused projections, zero-centred norms, canonical DeltaNet rows) apply unchanged;
- a step's image rows take the merger's output instead of the placeholder token's embedding
  (``MultiModalBatch.rows`` / ``embeds``); DeepStack features (Qwen3-VL) are added to the first
  layers' outputs at those rows;
- M-RoPE, interleaved: every token has (temporal, height, width) positions; text tokens three
  equal ones that continue after an image at ``start + max(h, w) / merge``, an image's tokens
  the image's start plus (0, row, column) (``mrope_positions``); each rotary frequency follows
  one of the three (``models.multimodal.mrope_cos_sin``), over the rotated part of each head.
  A request's positions past its prompt are its token index plus ``delta``.

The mixin goes first in the bases: ``class X(QwenVisionLanguage, TextDecoder)``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Optional, Sequence

import torch

from pagoda import kernels
from pagoda.kernels import AttentionMetadata
from pagoda.models.config import ModelConfig
from pagoda.models.llama import copy_checked
from pagoda.models.multimodal import ImageEmbedding, MultiModalBatch, VisionSpec, mrope_cos_sin
from pagoda.models.qwen3_vl_vision import Qwen3VLVisionTower

if TYPE_CHECKING:
    from pagoda.models.lora import LoRABatch

_MROPE_KEYS = ("mrope_section", "mrope_interleaved")
_TEXT, _VISUAL = "model.language_model.", "model.visual."


def split_vision_config(raw: dict, architecture: str) -> tuple[dict, tuple[int, ...]]:
    """config.json's ``text_config`` (with the top level's tie/bos/eos when it lacks them, the
    M-RoPE keys taken out) and its ``mrope_section``. Raises ValueError without text/vision configs."""
    if not isinstance(raw.get("text_config"), dict) or not isinstance(raw.get("vision_config"), dict):
        raise ValueError(f"{architecture}: config.json needs text_config and vision_config")
    text = dict(raw["text_config"])
    section: tuple[int, ...] = ()
    for key in ("rope_parameters", "rope_scaling"):
        if isinstance(text.get(key), dict):
            params = dict(text[key])
            section = tuple(params.get("mrope_section", section))
            text[key] = {k: v for k, v in params.items() if k not in _MROPE_KEYS}
    for key in ("tie_word_embeddings", "bos_token_id", "eos_token_id"):
        if key in raw and key not in text:
            text[key] = raw[key]
    return text, section


def attach_vision(config: ModelConfig, raw: dict, section: tuple[int, ...], family: str,
                  default_image_token: int) -> ModelConfig:
    """``config`` with its ``VisionSpec`` (Qwen's image processor and placeholder rule).

    Raises:
        ValueError: an M-RoPE split that is not three parts covering the rotary half-dimension.
    """
    config.architectures = list(raw.get("architectures") or [config.architecture])
    if len(section) != 3 or sum(section) != config.rotary_dim // 2:
        raise ValueError(f"{config.architecture}: mrope_section {list(section)} must be three parts summing to "
                         f"the rotary dimension / 2 = {config.rotary_dim // 2}")
    vision = raw["vision_config"]
    merge = int(vision.get("spatial_merge_size", 2))
    config.vision = VisionSpec(
        family=family, image_token_id=int(raw.get("image_token_id", default_image_token)), spatial_merge_size=merge,
        mrope_section=section, image_processor="Qwen2VLImageProcessorPil",
        processor_defaults=dict(patch_size=vision.get("patch_size", 16), merge_size=merge,
                                temporal_patch_size=vision.get("temporal_patch_size", 2)),
        vision_config=dict(vision))
    return config


class QwenVisionLanguage:
    """The image path of a Qwen vision-language model (module docstring); mixed into a text decoder."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        super().__init__(config, dtype, device)
        assert config.vision is not None, f"{config.architecture}: a vision config carries its VisionSpec"
        self.visual = Qwen3VLVisionTower(config.vision.vision_config, dtype, device)
        self.register_buffer("inv_freq", config.inv_freq().to(self.device), persistent=False)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]: rotary positions when ``mm`` brings no M-RoPE ones
        kv_caches: list,
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

    # ---- weights: the checkpoint's names <-> the decoder's --------------------------------

    def expected_weight_names(self) -> set[str]:
        return {_checkpoint_name(n) for n in super().expected_weight_names()} | {
            _VISUAL + n for n in self.visual.weight_targets()}

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The tower's tensors into ``visual``; the text model's, renamed to ``model.*``, through the
        decoder's own ``load_weights``. Returns the checkpoint names loaded. Raises ValueError on a shape."""
        visual = self.visual.weight_targets()
        loaded: set[str] = set()

        def text_weights():
            for name, tensor in weights:
                if name.startswith(_VISUAL) and name[len(_VISUAL):] in visual:
                    target, rows = visual[name[len(_VISUAL):]]
                    copy_checked(name, target[rows], tensor)
                    loaded.add(name)
                elif name.startswith(_TEXT):
                    yield "model." + name[len(_TEXT):], tensor
                else:
                    yield name, tensor

        text_loaded = super().load_weights(text_weights())  # runs text_weights, which loads the tower too
        return loaded | {_checkpoint_name(n) for n in text_loaded}


def _checkpoint_name(name: str) -> str:
    """A decoder name (``model.layers.0...``) as the vision-language checkpoint spells it."""
    return _TEXT + name[len("model."):] if name.startswith("model.") else name
