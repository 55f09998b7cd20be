"""Load a Hugging Face model folder (config.json + safetensors) into its family's model.

The family (and so the model class) comes from ``pagoda.models.registry`` by the
config's architecture name.

Accepts a single ``model.safetensors`` or a sharded checkpoint described by
``model.safetensors.index.json``. Tensors are read one at a time from memory-mapped files
and copied straight into the model's (fused) parameters, so peak memory stays near the
model's own size. Every parameter the config implies must be present, and every tensor in
the checkpoint must be used (apart from a few known leftovers, such as an ``lm_head``
saved next to tied embeddings); anything else is an error naming the tensors, because a
silently half-loaded model produces plausible-looking garbage.

A family whose checkpoints come in two layouts picks one from the checkpoint's names before the
check (``match_checkpoint``: Qwen3.5-MoE's experts per expert or fused).

MXFP4 tensors (gpt-oss experts: ``<name>_blocks`` + ``<name>_scales``) count as ``<name>``
and are dequantized as they are read (``pagoda.models.mxfp4``).

With ``quantization="int8"`` the projection weights are quantized right after loading
(``pagoda.models.quant``), so the float copies are freed once loading returns.

A pre-quantized checkpoint (``quantization_config`` in config.json: compressed-tensors, AWQ,
GPTQ, FP8) is read through ``pagoda.models.quant_checkpoint``: its quantized tensors are
dequantized into the float weights they stand for, and an unsupported format is refused
naming the field. 4-bit and FP8 (row-scaled) weights then stay quantized
(``pagoda.models.int4``: ``Int4Weight`` and the W4A16 kernel, ``Fp8Weight``) where
``keep_packed`` says so: on CUDA, or with ``PAGODA_KEEP_QUANTIZED=1``.

No transformers import: only ``safetensors``.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Iterator, Optional, Union

import torch
from safetensors import safe_open

from pagoda.models import mxfp4
from pagoda.models.config import ModelConfig, read_config_json
from pagoda.models.llama import LlamaForCausalLM
from pagoda.models.int4 import install_quantized_weights, keep_packed
from pagoda.models.quant import check_quantization, quantize_model
from pagoda.models.quant_checkpoint import QuantizedTensors, parse_quantization_config
from pagoda.models.registry import build_model, config_from_pretrained

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def load_model(
    path: Union[str, Path],
    dtype: torch.dtype = torch.float32,
    device: Union[str, torch.device] = "cpu",
    quantization: Optional[str] = None,
) -> LlamaForCausalLM:
    """Build the model from ``<path>/config.json`` and load its safetensors weights.

    Args:
        path: a Hugging Face model folder.
        dtype: parameter dtype (weights are cast on load).
        device: where the parameters live.
        quantization: ``None`` or ``"int8"`` (weight-only, per output channel).
    Returns:
        the model in eval mode (a ``LlamaForCausalLM`` or a family's subclass of it).
    Raises:
        FileNotFoundError: no config.json or no safetensors checkpoint in ``path``.
        ValueError: unsupported config, missing, unexpected or mis-shaped weights, or an
            unknown quantization method.
    """
    check_quantization(quantization)
    path = Path(path)
    config = config_from_pretrained(path)
    checkpoint_quant = parse_quantization_config(read_config_json(path))
    if checkpoint_quant is not None and quantization is not None:
        raise ValueError(f"quantization {quantization!r}: {path} is already quantized ({checkpoint_quant.method}, "
                         "quantization_config in config.json); serve it without --quantization")
    model = build_model(config, dtype=dtype, device=device)
    files = checkpoint_files(path)
    file_of: dict[str, Path] = {}  # stored name -> its file
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            file_of |= dict.fromkeys(f.keys(), file)
    names_in_checkpoint = mxfp4.logical_names(set(file_of))
    model.match_checkpoint(names_in_checkpoint)  # a family with two checkpoint layouts picks one
    expected = model.expected_weight_names()
    with contextlib.ExitStack() as stack:
        quantized = None
        if checkpoint_quant is not None:
            handles = {file: stack.enter_context(safe_open(str(file), framework="pt")) for file in files}
            quantized = QuantizedTensors(checkpoint_quant, names_in_checkpoint,
                                         lambda name: handles[file_of[name]].get_tensor(name),
                                         keep_quantized=keep_packed(torch.device(device)))
            names_in_checkpoint = quantized.names
        ignored = getattr(model, "ignored_checkpoint_prefixes", ())  # parts a family does not serve (audio)
        _check_names(path, config, expected, {n for n in names_in_checkpoint if not n.startswith(ignored)})
        tensors = _read_tensors(files, expected, file_of, dtype)
        loaded = model.load_weights(quantized.tensors(tensors) if quantized else tensors)
        for layer, (k_scale, v_scale) in (quantized.kv_scales() if quantized else {}).items():
            model.layers[layer].attn.k_scale, model.layers[layer].attn.v_scale = k_scale, v_scale
    assert loaded == expected, f"loaded {len(loaded)} of {len(expected)} tensors"
    if quantized is not None and quantized.pieces:
        install_quantized_weights(model, quantized.pieces)
    if quantization is not None:
        quantize_model(model, quantization)
    return model.eval()


def _check_names(path: Path, config: ModelConfig, expected: set[str], names_in_checkpoint: set[str]) -> None:
    unexpected = sorted(n for n in names_in_checkpoint - expected if not _is_ignorable(n, config))
    missing = sorted(expected - names_in_checkpoint)
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {path} does not match its config ({config.architecture}, "
            f"{config.num_hidden_layers} layers): missing {_summarise(missing)}; unexpected {_summarise(unexpected)}"
        )


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a folder, in a stable order."""
    index = path / INDEX_FILE
    if index.exists():
        with open(index, encoding="utf-8") as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        files = [path / name for name in sorted(set(weight_map.values()))]
        absent = [str(f) for f in files if not f.exists()]
        if absent:
            raise FileNotFoundError(f"{index} names shards that are missing: {', '.join(absent)}")
        return files
    if (path / SINGLE_FILE).exists():
        return [path / SINGLE_FILE]
    raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {path}")


def _read_tensors(files: list[Path], wanted: set[str], where: dict[str, Path],
                  dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if name in wanted:
                    yield name, f.get_tensor(name)

    def read(name: str) -> torch.Tensor:  # a pair's halves may sit in different shards
        with safe_open(str(where[name]), framework="pt") as f:
            return f.get_tensor(name)

    wide = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32  # both hold MXFP4 values exactly
    for name in sorted(mxfp4.packed_pairs(set(where)).keys() & wanted):
        yield name, mxfp4.unpacked(name, read, wide)


def _is_ignorable(name: str, config: ModelConfig) -> bool:
    """Tensors some checkpoints carry that the model does not need."""
    if name.endswith("rotary_emb.inv_freq"):  # older transformers saved the rotary buffer
        return True
    if config.num_mtp_layers and is_mtp_tensor(name, config):  # the MTP proposer loads them
        return True
    return name == "lm_head.weight" and config.tie_word_embeddings


def is_mtp_tensor(name: str, config: ModelConfig) -> bool:
    """A multi-token-prediction tensor: ``mtp.*`` (Qwen3-Next) or a layer past the decoder's,
    ``model.layers.{N..N+num_mtp_layers-1}.*`` (DeepSeek-V3)."""
    if name.startswith("mtp."):
        return True
    parts = name.split(".")
    if len(parts) > 3 and parts[:2] == ["model", "layers"] and parts[2].isdigit():
        return config.num_hidden_layers <= int(parts[2]) < config.num_hidden_layers + config.num_mtp_layers
    return False


def _summarise(names: list[str], limit: int = 6) -> str:
    if not names:
        return "none"
    shown = ", ".join(names[:limit])
    return f"{len(names)} tensors ({shown}{', ...' if len(names) > limit else ''})"
