"""MXFP4 expert weights (gpt-oss checkpoints), dequantized at load on the CPU.

Format (OCP Microscaling, as gpt-oss stores it): a weight ``W [..., rows, cols]`` is saved as
two tensors beside the name transformers would give the unquantized one:

- ``<name>_blocks`` uint8 ``[..., rows, cols / 32, 16]``: 32 FP4 (E2M1) codes per block, two
  per byte, element ``2i`` in the low nibble and ``2i + 1`` in the high nibble;
- ``<name>_scales`` uint8 ``[..., rows, cols / 32]``: one E8M0 exponent per block, the block's
  values times ``2 ** (scale - 127)``.

E2M1 codes: bit 3 is the sign, bits 0-2 index the magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6.
``dequantize`` gives ``W`` exactly (each value has at most two significant bits and a
power-of-two scale; float32 or bfloat16 hold it unless the exponent leaves their range).

The only MXFP4 tensors in Hugging Face checkpoints are gpt-oss's stacked experts
(``mlp.experts.gate_up_proj`` and ``mlp.experts.down_proj``), whose unquantized form is stored
transposed (``[E, in, out]``); ``unpacked`` returns that form, as transformers'
``convert_moe_packed_tensors`` does, so the family loads both checkpoint kinds the same way.

Invariants: a ``*_blocks`` tensor without its ``*_scales`` (or the reverse) is left as it is
(the loader then names it as unexpected); shapes that do not fit the format raise
``ValueError`` naming the tensor. On a GPU the weights are dequantized all the same: the
4-bit weight path (issue 28) does not exist yet.
"""

from __future__ import annotations

from typing import Callable

import torch

BLOCKS, SCALES = "_blocks", "_scales"
BLOCK_SIZE = 32  # FP4 values per scale
SCALE_BIAS = 127
CHUNK_BLOCKS = 1 << 20  # blocks dequantized at a time
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def packed_pairs(names: set[str]) -> dict[str, tuple[str, str]]:
    """Unquantized name -> (its ``_blocks`` name, its ``_scales`` name), for each complete pair."""
    pairs = {}
    for name in names:
        if name.endswith(BLOCKS):
            base = name[: -len(BLOCKS)]
            if base + SCALES in names:
                pairs[base] = (name, base + SCALES)
    return pairs


def logical_names(names: set[str]) -> set[str]:
    """The checkpoint's names with each complete MXFP4 pair replaced by the unquantized name."""
    pairs = packed_pairs(names)
    parts = {part for pair in pairs.values() for part in pair}
    return (names - parts) | set(pairs)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32,
               name: str = "tensor") -> torch.Tensor:
    """``[..., rows, G, 16]`` codes and ``[..., rows, G]`` exponents -> ``[..., rows, G * 32]`` in ``dtype``.

    Raises:
        ValueError: not uint8, or the shapes do not pair up.
    """
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"{name}: MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[-1] != BLOCK_SIZE // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"{name}: MXFP4 blocks {tuple(blocks.shape)} do not fit scales {tuple(scales.shape)} "
                         f"(want [..., G, {BLOCK_SIZE // 2}] and [..., G])")
    nibbles = torch.tensor(FP4_VALUES, dtype=dtype)
    byte = torch.arange(256)
    pairs = torch.stack((nibbles[byte & 0x0F], nibbles[byte >> 4]), dim=-1)  # [256, 2]: a byte's two values
    out = torch.empty(*scales.shape, BLOCK_SIZE, dtype=dtype)
    flat_blocks, flat_scales = blocks.reshape(-1, blocks.shape[-1]), scales.reshape(-1, 1)
    flat_out = out.view(-1, BLOCK_SIZE)
    for lo in range(0, flat_blocks.shape[0], CHUNK_BLOCKS):  # in chunks: the int32 codes stay small
        rows = slice(lo, lo + CHUNK_BLOCKS)
        values = pairs[flat_blocks[rows].to(torch.int32)].flatten(-2)  # [n, 32]
        torch.mul(values, torch.exp2(flat_scales[rows].to(torch.float32) - SCALE_BIAS).to(dtype), out=flat_out[rows])
    return out.flatten(-2)


def unpacked(name: str, read: Callable[[str], torch.Tensor], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The tensor an unquantized checkpoint stores as ``name`` (``read`` fetches a stored tensor by name):
    the dequantized ``[..., out, in]`` transposed to ``[..., in, out]`` (gpt-oss experts)."""
    return dequantize(read(name + BLOCKS), read(name + SCALES), dtype, name).transpose(-1, -2)  # a view: no copy
