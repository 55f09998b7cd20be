"""Writing pre-quantized checkpoints: round-to-nearest quantizers and the formats' packers.

The write side of ``pagoda.models.quant_checkpoint``, written from the formats' specs (not
from the reader): tests make checkpoints with it, and ``pagoda bench quant`` makes the
folders it compares. The quantizer is plain round-to-nearest with min-max scales per group
(``minmax_int``): the formats' layouts are exact, their calibration is not AWQ's or GPTQ's
(an RTN checkpoint in AWQ's layout is not an AWQ-calibrated one; docs/quantization.md says
so where it reports quality). Every packer returns the tensors a checkpoint stores for one
linear module and the exact float weight they stand for.

- AWQ GEMM: ``qweight [K, N/8]`` int32 with AutoAWQ's nibble order (nibble ``i`` holds
  column ``8c + (0,2,4,6,1,3,5,7)[i]``), ``qzeros`` the same way, ``scales [G, N]`` fp16;
- GPTQ v1: ``qweight [K*b/32, N]`` packed along K, ``qzeros [G, N*b/32]`` storing ``z - 1``,
  ``scales [G, N]``, ``g_idx [K]`` (act-order: columns quantized in a permuted order);
- FP8: 128x128 blocks with ``weight_scale_inv`` (DeepSeek / Qwen3-FP8), or per output channel
  (compressed-tensors ``float-quantized``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file

# The linear modules a checkpoint quantizes: Llama's, and DeepSeek-V3's attention (its experts and
# shared experts are gate/up/down; the router ``mlp.gate`` stays float, as in DeepSeek's FP8 release).
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "q_a_proj", "q_b_proj",
           "kv_a_proj_with_mqa", "kv_b_proj")


def linear_names(state: dict) -> list[str]:
    return sorted(n[:-len(".weight")] for n in state if n.endswith(".weight") and n.split(".")[-2] in LINEARS)


def write_variant(float_dir: Path, out: Path, quant_config: dict,
                  replace: Callable[[str, torch.Tensor], tuple[dict, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Copy ``float_dir`` to ``out`` with every linear ``X.weight`` replaced by ``replace(X, W)``
    (a dict of tensors) and ``quant_config`` in config.json; returns {X: expected float weight}."""
    shutil.copytree(float_dir, out)
    state = load_file(str(out / "model.safetensors"))
    expected = {}
    for prefix in linear_names(state):
        tensors, dequantized = replace(prefix, state.pop(f"{prefix}.weight"))
        state.update({f"{prefix}.{k}": v.contiguous() for k, v in tensors.items()})
        expected[prefix] = dequantized
    save_file(state, str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = quant_config
    (out / "config.json").write_text(json.dumps(config))
    return expected


def minmax_int(weight: torch.Tensor, bits: int, group: int, symmetric: bool):
    """Integer values, scales and zero points per group (any correct quantizer will do)."""
    n, k = weight.shape
    g = weight.reshape(n, k // group, group)
    if symmetric:
        scale = g.abs().amax(-1) / (2 ** (bits - 1) - 1)
        zero = torch.full_like(scale, 2 ** (bits - 1))
    else:
        low, high = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
        scale = (high - low) / (2 ** bits - 1)
        zero = torch.round(-low / scale)
    q = torch.clamp(torch.round(g / scale[..., None]) + zero[..., None], 0, 2 ** bits - 1).reshape(n, k)
    return q.to(torch.int32), scale.to(torch.float16), zero.to(torch.int32)


# ------------------------------------------------------------------ packers from the specs
def pack_along_last(values: torch.Tensor, bits: int, order=None) -> torch.Tensor:
    """Unsigned ``values [R, C]`` -> int32 ``[R, C*bits/32]``, element ``i`` of each word at bit ``bits*i``
    (``order``: the column of the word's 8 that nibble ``i`` holds, AWQ's interleave)."""
    per = 32 // bits
    r, c = values.shape
    v = values.reshape(r, c // per, per).to(torch.int64)
    if order is not None:
        v = v[..., list(order)]
    words = torch.zeros(r, c // per, dtype=torch.int64)
    for i in range(per):
        words |= v[..., i] << (bits * i)
    return (words - (words >= 2**31).to(torch.int64) * 2**32).to(torch.int32)


AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's: nibble i holds column AWQ_PACK_ORDER[i]


def awq_tensors(weight: torch.Tensor, group: int = 128):
    q, scale, zero = minmax_int(weight, 4, group, symmetric=False)  # [N, K], [N, G]
    tensors = {"qweight": pack_along_last(q.t().contiguous(), 4, AWQ_PACK_ORDER),  # [K, N/8]
               "qzeros": pack_along_last(zero.t().contiguous(), 4, AWQ_PACK_ORDER),  # [G, N/8]
               "scales": scale.t().contiguous()}  # [G, N] fp16
    g = torch.arange(weight.shape[1]) // group
    return tensors, ((q - zero[:, g]).float() * scale.float()[:, g])


def gptq_tensors(weight: torch.Tensor, bits: int, group: int, act_order: bool, seed: int):
    n, k = weight.shape
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed)) if act_order else torch.arange(k)
    # act-order: columns are quantized in ``perm`` order, so column perm[j] belongs to group j // group.
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[perm] = (torch.arange(k) // group).to(torch.int32)
    q_perm, scale, zero = minmax_int(weight[:, perm], bits, group, symmetric=True)
    q = torch.empty_like(q_perm)
    q[:, perm] = q_perm
    tensors = {"qweight": pack_along_last(q.contiguous(), bits).t().contiguous(),  # [K*bits/32, N]: along K
               "qzeros": pack_along_last((zero - 1).t().contiguous(), bits),  # v1 stores z - 1
               "scales": scale.t().contiguous(), "g_idx": g_idx}
    g = g_idx.long()
    return tensors, ((q - zero[:, g]).float() * scale.float()[:, g])


def fp8_block_tensors(weight: torch.Tensor):
    n, k = weight.shape
    rows, cols = -(-n // 128), -(-k // 128)
    padded = torch.zeros(rows * 128, cols * 128)
    padded[:n, :k] = weight
    amax = padded.reshape(rows, 128, cols, 128).abs().amax(dim=(1, 3))
    scale_inv = amax / 448.0
    expanded = scale_inv.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    fp8 = (weight / expanded).to(torch.float8_e4m3fn)
    return {"weight": fp8, "weight_scale_inv": scale_inv}, fp8.float() * expanded


def fp8_channel_tensors(weight: torch.Tensor):
    """FP8 e4m3 per output channel (compressed-tensors ``float-quantized``, strategy channel)."""
    scale = (weight.abs().amax(dim=1, keepdim=True) / 448.0).clamp(min=1e-12)
    fp8 = (weight / scale).to(torch.float8_e4m3fn)
    return {"weight": fp8, "weight_scale": scale}, fp8.float() * scale


FP8_CHANNEL_CONFIG = {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {
    "group_0": {"targets": ["Linear"], "format": "float-quantized", "weights": {
        "num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "dynamic": False}}},
    "ignore": ["lm_head"], "quantization_status": "compressed"}
# method -> (quantization_config, packer(prefix, weight)); RTN quantization in each layout.
# Group 64: SmolLM2-135M's hidden size (576) is not a multiple of 128.
GROUP = 64
FORMATS = {
    "awq": ({"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"},
            lambda p, w: awq_tensors(w, GROUP)),
    "gptq": ({"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False, "sym": True},
             lambda p, w: gptq_tensors(w, 4, GROUP, False, 0)),
    "fp8-channel": (FP8_CHANNEL_CONFIG, lambda p, w: fp8_channel_tensors(w)),
    "fp8-block": ({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                   "weight_block_size": [128, 128]}, lambda p, w: fp8_block_tensors(w)),
}


def write_quantized(float_dir: Path, out: Path, method: str) -> Path:
    """``float_dir`` (a float Hugging Face folder, one safetensors file) written as ``method``."""
    config, replace = FORMATS[method]
    write_variant(Path(float_dir), Path(out), config, lambda p, w: replace(p, w.float()))
    return Path(out)
