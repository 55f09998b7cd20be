"""Checkpoint weights kept quantized in the model: ``Int4Weight`` (4-bit) and FP8 checkpoints
as ``Fp8Weight``, and the pass that installs them.

A 4-bit checkpoint (AWQ, GPTQ 4-bit, compressed-tensors ``pack-quantized`` int4) is read into
the canonical pieces of ``pagoda.kernels.w4a16`` per Hugging Face module (``Int4Pieces``:
unsigned nibbles, group scales, zero points, the act-order permutation). The loader first
fills the model with the dequantized float weights (every family and fusion works); then,
where 4-bit weights should stay packed (on CUDA, or with ``PAGODA_KEEP_QUANTIZED=1``),
``install_int4_weights`` replaces each fused projection (q/k/v, gate/up, o, down) by an
``Int4Weight`` made by concatenating its shards' pieces along N — exact, since groups run
along K. A projection whose shards disagree (group size, or act-order permutations that
differ between q, k and v) keeps its float weight, and the log says which; so does a
projection its module lists in ``packed_unsupported`` (Qwen3-Next's DeltaNet projection, whose
rows the model reorders at load).

``Int4Weight.matmul``: the Triton W4A16 kernel when the kernels serve the call and ``M <
DEQUANT_ROWS``, else dequantize to the activation dtype + ``F.linear`` (the CPU path).
Memory: half a byte per weight plus 8 bytes per group of scales and zeros (4 bytes without
zero points), against 2 for bf16.

FP8 checkpoints with per-tensor or per-channel scales (``Fp8Pieces``) become
``Fp8Weight.from_quantized`` the same way (the checkpoint's own e4m3 values and row scales,
exact), served by the existing FP8 paths (W8A16 kernel, ``_scaled_mm``); block-scaled FP8
(128x128) has no per-row form and stays dequantized.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from pagoda import kernels
from pagoda.kernels import w4a16

logger = logging.getLogger(__name__)
PACKED_ENV = "PAGODA_KEEP_QUANTIZED"


@dataclass
class Int4Pieces:
    """One Hugging Face module's 4-bit weight in canonical form (``[N, K]`` unsigned nibbles in
    group-contiguous K order; ``W[:, perm] = (q - zeros) * scales`` per group)."""

    q: torch.Tensor  # [N, K] uint8 0..15
    scales: torch.Tensor  # [N, G] float32
    zeros: Optional[torch.Tensor]  # [N, G] float32, None: 8 everywhere
    group_size: int
    perm: Optional[torch.Tensor] = None  # [K] int64: act-order


def pieces_from_group_index(q: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor], group_size: int,
                            g_idx: Optional[torch.Tensor]) -> Int4Pieces:
    """Canonical pieces from ``q [N, K]`` whose column k belongs to group ``g_idx[k]``."""
    k = q.shape[1]
    if zeros is not None and bool((zeros == 8).all()):
        zeros = None
    if g_idx is None or torch.equal(g_idx.long(), torch.arange(k) // max(group_size, 1)):
        return Int4Pieces(q.to(torch.uint8), scales.float(), zeros, group_size if group_size > 0 else k)
    perm = torch.argsort(g_idx.long(), stable=True)
    return Int4Pieces(q[:, perm].to(torch.uint8), scales.float(), zeros, group_size, perm)


class Int4Weight(nn.Module):
    """A packed ``[out, in]`` 4-bit weight in place of a float Parameter (module docstring)."""

    def __init__(self, pieces: Int4Pieces, device: torch.device) -> None:
        super().__init__()
        self.in_features = pieces.q.shape[1]
        self.group_size = pieces.group_size
        self.register_buffer("qweight", w4a16.pack_int4(pieces.q).to(device))
        self.register_buffer("scales", pieces.scales.to(device))
        self.register_buffer("zeros", None if pieces.zeros is None else pieces.zeros.float().to(device))
        self.register_buffer("perm", None if pieces.perm is None else pieces.perm.to(device))

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.qweight.shape[0], self.in_features))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight in the model's K order (the permutation undone)."""
        w = w4a16.dequantize_w4(self.qweight, self.scales, self.zeros, self.in_features, self.group_size, dtype)
        if self.perm is None:
            return w
        out = torch.empty_like(w)
        out[:, self.perm] = w
        return out

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if kernels.use_triton(x) and rows < w4a16.DEQUANT_ROWS:
            from pagoda.kernels.triton_w4a16 import w4a16_linear

            return w4a16_linear(x, self.qweight, self.scales, self.zeros, self.group_size, self.perm)
        return w4a16.w4a16_linear_ref(x, self.qweight, self.scales, self.zeros, self.group_size, self.perm)

    def extra_repr(self) -> str:
        return f"out={self.shape[0]}, in={self.in_features}, group={self.group_size}, act_order={self.perm is not None}"


def keep_packed(device: torch.device) -> bool:
    """Whether 4-bit weights stay packed on ``device`` (CUDA; or ``PAGODA_KEEP_QUANTIZED=1``)."""
    choice = os.environ.get(PACKED_ENV, "auto")
    if choice not in ("auto", "0", "1"):
        raise ValueError(f"{PACKED_ENV}={choice!r}: expected auto, 0 or 1")
    return choice == "1" or (choice == "auto" and device.type == "cuda")


@dataclass
class Fp8Pieces:
    """One module's FP8 checkpoint weight with a per-row scale (per-tensor scales broadcast)."""

    q: torch.Tensor  # [N, K] float8_e4m3fn
    scale: torch.Tensor  # [N] float32


def _projections(model: nn.Module):
    """(module, attribute, weight, [shard prefixes in row order]) of every linear projection."""
    shards: dict[int, list[tuple[int, str]]] = {}
    for name, (target, rows) in model._weight_table().items():
        start = rows.start if isinstance(rows, slice) and rows.start is not None else 0
        shards.setdefault(id(target), []).append((start, name.removesuffix(".weight")))
    for module in model.modules():
        for attr in getattr(module, "linear_weights", ()):
            if attr in getattr(module, "packed_unsupported", ()):  # rows reordered at load: served as float
                continue
            weight = getattr(module, attr)
            yield module, attr, weight, [prefix for _, prefix in sorted(shards.get(id(weight), []))]


def _merged(parts: list) -> Optional[nn.Module]:
    """One quantized module for a projection's shards (concatenated along N), or None."""
    if isinstance(parts[0], Fp8Pieces):
        from pagoda.models.fp8 import Fp8Weight

        if not all(isinstance(p, Fp8Pieces) for p in parts):
            return None
        return Fp8Weight.from_quantized(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]))
    if not all(isinstance(p, Int4Pieces) for p in parts) or len({p.group_size for p in parts}) > 1 \
            or len({None if p.perm is None else tuple(p.perm.tolist()) for p in parts}) > 1:
        return None
    zeros = None if all(p.zeros is None for p in parts) else \
        torch.cat([p.zeros if p.zeros is not None else torch.full_like(p.scales, 8.0) for p in parts])
    return Int4Pieces(torch.cat([p.q for p in parts]), torch.cat([p.scales for p in parts]), zeros,
                      parts[0].group_size, parts[0].perm)


@torch.no_grad()
def install_quantized_weights(model: nn.Module, pieces: dict[str, Any]) -> int:
    """Replace each projection whose every shard has pieces (4-bit or FP8) by an ``Int4Weight``
    or ``Fp8Weight``; returns how many were replaced (module docstring)."""
    replaced = 0
    fp8_weights = []
    for module, attr, weight, prefixes in _projections(model):
        parts = [pieces.get(prefix) for prefix in prefixes]
        if not parts or any(p is None for p in parts):
            continue
        merged = _merged(parts)
        if merged is None:
            logger.info("%s.%s kept as float: its shards differ in format, group size or act-order", module, attr)
            continue
        if isinstance(merged, Int4Pieces):
            merged = Int4Weight(merged, weight.device)
        else:
            from pagoda.models.fp8 import check_fp8_device

            try:
                check_fp8_device(weight.device)
            except ValueError as exc:  # a GPU below sm_89: the dequantized float weight serves
                logger.info("fp8 checkpoint weights kept as float: %s", exc)
                continue
            merged = merged.to(weight.device)
            fp8_weights.append(merged)
        delattr(module, attr)
        setattr(module, attr, merged)
        replaced += 1
    if fp8_weights:
        from pagoda.models.fp8 import select_fp8_kernel

        logger.info("fp8 checkpoint weights: %s", select_fp8_kernel(fp8_weights, next(
            p.dtype for p in model.parameters() if p.is_floating_point())))
    return replaced
