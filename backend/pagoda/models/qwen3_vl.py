"""Qwen3-VL (``Qwen3VLForConditionalGeneration``): Qwen3's decoder with images in.

As transformers' ``Qwen3VLModel``: the text model is Qwen3 (per-head q/k norm) under
``model.language_model.*``; the vision tower with its merger and DeepStack mergers is
``models/qwen3_vl_vision.py`` under ``model.visual.*``; the image path (placeholder rows,
DeepStack, interleaved M-RoPE) is ``models/vision_language.QwenVisionLanguage``. A prompt holds
one ``image_token_id`` per image, which the input processor expands into ``t * h * w / merge**2``
copies (``VisionSpec.num_image_tokens``).

``Qwen3VLMoeForConditionalGeneration`` is the same with Qwen3-MoE's decoder (its router always
renormalises the top-k weights; its checkpoint stacks each layer's experts, ``experts.gate_up_proj``
/ ``experts.down_proj``, which ``SparseMoE.fused_checkpoint`` reads as they are).

Video inputs are not served (``video_token_id`` is left as a plain token).
"""

from __future__ import annotations

from pagoda.models import qwen3, qwen3_moe
from pagoda.models.config import ModelConfig
from pagoda.models.moe import SparseMoE
from pagoda.models.vision_language import QwenVisionLanguage, attach_vision, split_vision_config


def parse_config(raw: dict, architecture: str) -> ModelConfig:
    """Qwen3's fields from ``text_config`` and the vision rules from the rest.

    Raises:
        ValueError: no ``text_config`` / ``vision_config``, or an M-RoPE split that does not
            cover the rotary half-dimension.
    """
    text, section = split_vision_config(raw, architecture)
    return attach_vision(qwen3.parse_config(text, architecture), raw, section or (24, 20, 20), "qwen3_vl", 151655)


def parse_moe_config(raw: dict, architecture: str) -> ModelConfig:
    """Qwen3-VL-MoE: Qwen3-MoE's fields from ``text_config`` (top-k always renormalised), the vision
    rules from the rest. Raises ValueError as ``parse_config``."""
    text, section = split_vision_config(raw, architecture)
    return attach_vision(qwen3_moe.parse_config({**text, "norm_topk_prob": True}, architecture), raw,
                         section or (24, 20, 20), "qwen3_vl_moe", 151655)


class Qwen3VLForConditionalGeneration(QwenVisionLanguage, qwen3.Qwen3ForCausalLM):
    """Qwen3's decoder, the vision tower (``visual``), M-RoPE and DeepStack."""


class Qwen3VLMoeForConditionalGeneration(QwenVisionLanguage, qwen3_moe.Qwen3MoeForCausalLM):
    """Qwen3-MoE's decoder with Qwen3-VL's image path."""

    def match_checkpoint(self, names: set[str]) -> None:
        """Stacked experts (``mlp.experts.gate_up_proj``, what its checkpoints hold) or per-expert tensors."""
        fused = any(name.endswith(".mlp.experts.gate_up_proj") for name in names)
        for layer in self.layers:
            if isinstance(layer.mlp, SparseMoE):
                layer.mlp.fused_checkpoint = fused
