"""Model configuration read from a Hugging Face ``config.json``.

``ModelConfig`` holds exactly what the Llama-family decoder needs and nothing else. It is
read without importing transformers, and accepts both the transformers 4 layout
(``rope_theta`` and ``rope_scaling`` at top level) and the transformers 5 layout (both
folded into ``rope_parameters``).

Supported architectures: Llama, Mistral and Qwen2. They differ only in small switches:
Qwen2 adds a bias to the q/k/v projections (never to o_proj); Mistral may declare a
sliding window, which we do not implement, so a context longer than the window is refused
(see ``check_max_model_len``) rather than silently computed with full attention.

Rotary frequencies: ``inv_freq()`` reproduces Hugging Face's computation bit for bit
(float32 throughout), for the ``default`` and ``llama3`` rope types; any other type raises
``ValueError`` naming it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import torch

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
# Used when a config.json carries no "architectures" list (e.g. a bare LlamaConfig).
_ARCHITECTURE_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}
SUPPORTED_ROPE_TYPES = ("default", "llama3")
_LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    rope_scaling: Optional[dict[str, Any]] = None  # None means the default rope type
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections
    o_proj_bias: bool = False  # bias on the output projection (Llama's attention_bias sets both)
    bos_token_id: Optional[int] = None
    eos_token_id: Union[int, list[int], None] = None
    sliding_window: Optional[int] = None
    architectures: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architecture {self.architecture!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        self.rope_type  # validates rope_scaling

    # ---- reading -------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path: Union[str, Path]) -> "ModelConfig":
        """Read ``<path>/config.json`` (or ``path`` itself when it is a file).

        Raises:
            FileNotFoundError: no config.json there.
            ValueError: unsupported architecture, rope type or activation.
        """
        path = Path(path)
        file = path / "config.json" if path.is_dir() else path
        with open(file, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        """Build from the parsed contents of a config.json."""
        architectures = list(raw.get("architectures") or [])
        architecture = _pick_architecture(architectures, raw.get("model_type"))
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {raw['hidden_act']!r} is not supported; only 'silu'")
        if raw.get("mlp_bias", False):
            raise ValueError("mlp_bias=true is not supported")
        hidden_size = raw["hidden_size"]
        num_heads = raw["num_attention_heads"]
        rope_theta, rope_scaling = _read_rope(raw)
        llama_bias = bool(raw.get("attention_bias", False))
        is_qwen2 = architecture == "Qwen2ForCausalLM"
        # Qwen2 declares its sliding window even when it is switched off.
        sliding_window = raw.get("sliding_window")
        if is_qwen2 and not raw.get("use_sliding_window", False):
            sliding_window = None
        return cls(
            architecture=architecture,
            vocab_size=raw["vocab_size"],
            hidden_size=hidden_size,
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or hidden_size // num_heads,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=is_qwen2 or llama_bias,
            o_proj_bias=llama_bias and not is_qwen2,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=raw.get("eos_token_id"),
            sliding_window=sliding_window,
            architectures=architectures or [architecture],
        )

    # ---- derived values ------------------------------------------------------------------

    @property
    def rope_type(self) -> str:
        if self.rope_scaling is None:
            return "default"
        rope_type = self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
        if rope_type == "llama3":
            missing = [k for k in _LLAMA3_ROPE_KEYS if k not in self.rope_scaling]
            if missing:
                raise ValueError(f"llama3 rope scaling is missing {', '.join(missing)}")
        return rope_type

    @property
    def eos_token_ids(self) -> list[int]:
        """The eos id(s) as a list (a config may give one int or a list)."""
        if self.eos_token_id is None:
            return []
        if isinstance(self.eos_token_id, int):
            return [self.eos_token_id]
        return list(self.eos_token_id)

    def check_max_model_len(self, max_model_len: Optional[int]) -> int:
        """Resolve and validate a context length for this model.

        Args:
            max_model_len: requested length, or None for the model's maximum.
        Returns:
            the context length to use.
        Raises:
            ValueError: longer than ``max_position_embeddings``, or than a sliding window
                (sliding-window attention is not implemented; within the window it is exact).
        """
        length = self.max_position_embeddings if max_model_len is None else max_model_len
        if self.sliding_window is not None:
            if max_model_len is None:
                length = min(length, self.sliding_window)
            elif length > self.sliding_window:
                raise ValueError(
                    f"max_model_len {length} exceeds the model's sliding_window {self.sliding_window}; "
                    "sliding-window attention is not supported, use max_model_len <= sliding_window"
                )
        if length > self.max_position_embeddings:
            raise ValueError(
                f"max_model_len {length} exceeds max_position_embeddings {self.max_position_embeddings}"
            )
        if length < 1:
            raise ValueError(f"max_model_len must be >= 1, got {length}")
        return length

    def inv_freq(self) -> torch.Tensor:
        """Rotary inverse frequencies [head_dim // 2], float32, computed as Hugging Face does."""
        dim = self.head_dim
        exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim
        inv_freq = 1.0 / (self.rope_theta**exponents)
        if self.rope_type == "llama3":
            inv_freq = _llama3_scale(inv_freq, self.rope_scaling)
        return inv_freq


def _pick_architecture(architectures: list[str], model_type: Optional[str]) -> str:
    for name in architectures:
        if name in SUPPORTED_ARCHITECTURES:
            return name
    if architectures:
        raise ValueError(
            f"architecture {architectures[0]!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    if model_type in _ARCHITECTURE_BY_MODEL_TYPE:
        return _ARCHITECTURE_BY_MODEL_TYPE[model_type]
    raise ValueError(f"model_type {model_type!r} is not supported; supported: {', '.join(_ARCHITECTURE_BY_MODEL_TYPE)}")


def _read_rope(raw: dict[str, Any]) -> tuple[float, Optional[dict[str, Any]]]:
    """(rope_theta, rope_scaling) from either the transformers 4 or 5 layout."""
    params = dict(raw.get("rope_parameters") or {})
    scaling = raw.get("rope_scaling")
    scaling = dict(scaling) if scaling else dict(params)
    theta = raw.get("rope_theta", params.get("rope_theta", scaling.get("rope_theta", 10000.0)))
    scaling.pop("rope_theta", None)
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type in (None, "default") and not set(scaling) - {"rope_type", "type"}:
        return float(theta), None
    return float(theta), scaling


def _llama3_scale(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 frequency scaling: slow down low frequencies, keep high, blend between."""
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)
