"""Where and in what the engine runs: the device, the model dtype, the KV cache's dtype, and the
bytes one KV block takes (what ``EngineConfig`` says, resolved against the machine).

Used by the model runner, the executor and the parallel workers (each resolves the same way,
so every rank agrees), and by the benchmarks that size a cache before building an engine.
"""

from __future__ import annotations

from typing import Optional

import torch

from pagoda.engine.config import EngineConfig
from pagoda.models.config import ModelConfig

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

def resolve_device(config: EngineConfig) -> torch.device:
    if config.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if config.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: cuda was requested but no CUDA device is available")
    return torch.device(config.device)


def resolve_dtype(config: EngineConfig, device: torch.device) -> torch.dtype:
    if config.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[config.dtype]


def resolve_kv_cache_dtype(config: EngineConfig, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's storage dtype: the model's, or float8_e4m3fn (per-tensor scale 1.0)."""
    return torch.float8_e4m3fn if config.kv_cache_dtype == "fp8_e4m3" else model_dtype


def kv_bytes_per_block(model_config: ModelConfig, block_size: int, dtype: torch.dtype,
                       kv_heads: Optional[int] = None, num_layers: Optional[int] = None) -> int:
    """Bytes one block takes across the layers (K and V, or multi-head latent attention's one
    latent row per token); ``kv_heads``, ``num_layers``: one rank's (default: all the model's)."""
    elem = torch.tensor([], dtype=dtype).element_size()
    kv_heads = model_config.num_key_value_heads if kv_heads is None else kv_heads
    per_layer = 2 * block_size * kv_heads * model_config.head_dim * elem if model_config.mla is None else \
        block_size * model_config.mla.latent_dim * elem
    return per_layer * (model_config.num_hidden_layers if num_layers is None else num_layers)
