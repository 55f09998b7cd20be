"""Qwen3.5 with images in (``Qwen3_5ForConditionalGeneration``, ``Qwen3_5MoeForConditionalGeneration``).

Qwen3.5 ships as one early-fusion model for text and images: the hybrid decoder of
``models/qwen3_5.py`` (Gated DeltaNet and gated full attention, on the KV cache groups' recurrent
states) under ``model.language_model.*``, and Qwen3-VL's vision tower without DeepStack under
``model.visual.*`` (``models/qwen3_vl_vision.py``; ``deepstack_visual_indexes`` absent). The image
path is ``models/vision_language.QwenVisionLanguage``: placeholder rows, and interleaved M-RoPE
over the rotated quarter of each full-attention head (``mrope_section`` sums to ``rotary_dim /
2``); the DeltaNet layers have no positions. As transformers' ``Qwen3_5Model``.
"""

from __future__ import annotations

from pagoda.models import qwen3_5
from pagoda.models.config import ModelConfig
from pagoda.models.vision_language import QwenVisionLanguage, attach_vision, split_vision_config

_IMAGE_TOKEN = 248056  # transformers' Qwen3_5Config default


def parse_config(raw: dict, architecture: str) -> ModelConfig:
    """Qwen3.5's hybrid fields from ``text_config``, the vision rules from the rest. Raises ValueError."""
    text, section = split_vision_config(raw, architecture)
    return attach_vision(qwen3_5.parse_config(text, architecture), raw, section or (11, 11, 10), "qwen3_5",
                         _IMAGE_TOKEN)


def parse_moe_config(raw: dict, architecture: str) -> ModelConfig:
    """Qwen3.5-MoE's hybrid fields from ``text_config``, the vision rules from the rest. Raises ValueError."""
    text, section = split_vision_config(raw, architecture)
    return attach_vision(qwen3_5.parse_moe_config(text, architecture), raw, section or (11, 11, 10), "qwen3_5",
                         _IMAGE_TOKEN)


class Qwen3_5ForConditionalGeneration(QwenVisionLanguage, qwen3_5.Qwen3_5ForCausalLM):
    """Qwen3.5's hybrid decoder and the vision tower."""


class Qwen3_5MoeForConditionalGeneration(QwenVisionLanguage, qwen3_5.Qwen3_5MoeForCausalLM):
    """Qwen3.5-MoE's hybrid decoder and the vision tower."""
