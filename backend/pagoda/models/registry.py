"""Model families by Hugging Face architecture name: the one place a model is chosen.

A family is one module of ``pagoda.models`` that gives a config parser
(``parse_config(raw, architecture) -> ModelConfig``) and a model class (a
``LlamaForCausalLM`` subclass: the decoder skeleton with the family's pieces). Adding a
family is one module plus one entry in ``_FAMILIES``; nothing else picks a model class.

Invariants:
- every caller builds configs with ``config_from_dict`` / ``config_from_pretrained`` and
  models with ``build_model`` (the loader, the runner's random-weight model);
- an architecture not listed here is refused with a ``ValueError`` naming it and the
  supported list; a config.json without ``architectures`` is matched by ``model_type``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Union

import torch

from pagoda.models import (deepseek_v3, gemma3, gemma3_vl, gemma4, gemma4_vl, glm4_moe, gpt_oss, llama, mixtral, qwen3,
                           qwen3_5, qwen3_moe, qwen3_5_vl, qwen3_next, qwen3_vl)
from pagoda.models.config import ModelConfig, read_config_json


@dataclass(frozen=True)
class ModelFamily:
    architecture: str  # the name in config.json's "architectures"
    model_type: str  # config.json's "model_type" (used when "architectures" is absent)
    parse_config: Callable[[dict[str, Any], str], ModelConfig]
    model_class: type[llama.LlamaForCausalLM]


_FAMILIES = {f.architecture: f for f in (
    ModelFamily("LlamaForCausalLM", "llama", llama.parse_config, llama.LlamaForCausalLM),
    ModelFamily("MistralForCausalLM", "mistral", llama.parse_config, llama.LlamaForCausalLM),
    ModelFamily("Qwen2ForCausalLM", "qwen2", llama.parse_qwen2_config, llama.LlamaForCausalLM),
    ModelFamily("Qwen3ForCausalLM", "qwen3", qwen3.parse_config, qwen3.Qwen3ForCausalLM),
    ModelFamily("MixtralForCausalLM", "mixtral", mixtral.parse_config, mixtral.MixtralForCausalLM),
    ModelFamily("Qwen3MoeForCausalLM", "qwen3_moe", qwen3_moe.parse_config, qwen3_moe.Qwen3MoeForCausalLM),
    ModelFamily("Gemma3ForCausalLM", "gemma3_text", gemma3.parse_config, gemma3.Gemma3ForCausalLM),
    # Gemma 4 text: per-layer KV shapes, KV-shared layers, per-layer inputs, the MoE block (models/gemma4.py).
    ModelFamily("Gemma4ForCausalLM", "gemma4_text", gemma4.parse_config, gemma4.Gemma4ForCausalLM),
    ModelFamily("GptOssForCausalLM", "gpt_oss", gpt_oss.parse_config, gpt_oss.GptOssForCausalLM),
    ModelFamily("Qwen3NextForCausalLM", "qwen3_next", qwen3_next.parse_config, qwen3_next.Qwen3NextForCausalLM),
    ModelFamily("Qwen3_5ForCausalLM", "qwen3_5_text", qwen3_5.parse_config, qwen3_5.Qwen3_5ForCausalLM),
    ModelFamily("Qwen3_5MoeForCausalLM", "qwen3_5_moe_text", qwen3_5.parse_moe_config,
                qwen3_5.Qwen3_5MoeForCausalLM),
    # Images in (models/multimodal.py): the vision tower, M-RoPE and DeepStack beside Qwen3's decoder.
    ModelFamily("Qwen3VLForConditionalGeneration", "qwen3_vl", qwen3_vl.parse_config,
                qwen3_vl.Qwen3VLForConditionalGeneration),
    ModelFamily("Qwen3VLMoeForConditionalGeneration", "qwen3_vl_moe", qwen3_vl.parse_moe_config,
                qwen3_vl.Qwen3VLMoeForConditionalGeneration),
    ModelFamily("Qwen3_5ForConditionalGeneration", "qwen3_5", qwen3_5_vl.parse_config,
                qwen3_5_vl.Qwen3_5ForConditionalGeneration),
    ModelFamily("Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe", qwen3_5_vl.parse_moe_config,
                qwen3_5_vl.Qwen3_5MoeForConditionalGeneration),
    # Gemma 3 with images: SigLIP, the projector, an image's tokens attending to each other both ways.
    ModelFamily("Gemma3ForConditionalGeneration", "gemma3", gemma3_vl.parse_config,
                gemma3_vl.Gemma3ForConditionalGeneration),
    # Gemma 4 with images: its own tower and embedder, images both ways on sliding layers only; no audio.
    ModelFamily("Gemma4ForConditionalGeneration", "gemma4", gemma4_vl.parse_config,
                gemma4_vl.Gemma4ForConditionalGeneration),
    # Kimi K2's config.json names this architecture too (model_type "kimi_k2").
    ModelFamily("DeepseekV3ForCausalLM", "deepseek_v3", deepseek_v3.parse_config, deepseek_v3.DeepseekV3ForCausalLM),
    # GLM-4.7-Flash: multi-head latent attention and DeepSeek's MoE (the DeepSeek-V3 model).
    ModelFamily("Glm4MoeLiteForCausalLM", "glm4_moe_lite", deepseek_v3.parse_glm_lite_config,
                deepseek_v3.DeepseekV3ForCausalLM),
    # GLM-4.5, GLM-4.5-Air and GLM-4.6 (model_type "glm4_moe").
    ModelFamily("Glm4MoeForCausalLM", "glm4_moe", glm4_moe.parse_config, glm4_moe.Glm4MoeForCausalLM),
)}
SUPPORTED_ARCHITECTURES = tuple(_FAMILIES)


def family(architecture: str) -> ModelFamily:
    """The family registered under ``architecture``.

    Raises:
        ValueError: not a supported architecture (the message lists the supported ones).
    """
    if architecture not in _FAMILIES:
        raise ValueError(
            f"architecture {architecture!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return _FAMILIES[architecture]


def config_from_dict(raw: dict[str, Any]) -> ModelConfig:
    """Build a ``ModelConfig`` from the parsed contents of a config.json.

    Raises:
        ValueError: unsupported architecture, rope type, activation or MoE setting.
    """
    architecture = _pick_architecture(raw)
    return family(architecture).parse_config(raw, architecture)


def config_from_pretrained(path: Union[str, Path]) -> ModelConfig:
    """Read ``<path>/config.json`` (or ``path`` itself when it is a file).

    Raises:
        FileNotFoundError: no config.json there.
        ValueError: as ``config_from_dict``.
    """
    return config_from_dict(read_config_json(path))


def build_model(config: ModelConfig, dtype: torch.dtype = torch.float32,
                device: Union[str, torch.device] = "cpu") -> llama.LlamaForCausalLM:
    """The family's model for ``config``, parameters uninitialised (``load_weights`` fills them)."""
    return family(config.architecture).model_class(config, dtype=dtype, device=device)


def _pick_architecture(raw: dict[str, Any]) -> str:
    architectures = list(raw.get("architectures") or [])
    for name in architectures:
        if name in _FAMILIES:
            return name
    if architectures:
        family(architectures[0])  # raises, naming it
    by_type = {f.model_type: f.architecture for f in _FAMILIES.values()}
    model_type = raw.get("model_type")
    if model_type in by_type:
        return by_type[model_type]
    raise ValueError(f"model_type {model_type!r} is not supported; supported: {', '.join(by_type)}")
