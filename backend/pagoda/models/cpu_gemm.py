"""Prepacked float weights for the CPU's matmuls: pagoda's C++ matmul, or oneDNN (issues 26, 44).

Two packings (``PackedWeight.kind``): ``"pagoda"``, panels for pagoda's C++ matmul
(``kernels/csrc/cpu_gemm.cpp``: AVX-512 float32 tiles, AVX512-BF16 tiles, AMX for bfloat16
calls of 8+ rows; every output element one float32 chain of FMAs in k order, so a row's
result does not depend on its batch), taken where its vector tiles run on this CPU
(``packing_kind``: ``cpu_native.gemm_features()`` at run time); ``"onednn"`` elsewhere (a
CPU without AVX-512, e.g. an AVX2-only EPYC; or the C++ kernels off or not built). Why
pagoda's: at the decode's few rows the matmul is memory-bound and oneDNN's inner product
spends its time outside the FMAs (measured on the Intel Xeon dev VM, one thread, the
default model's shapes, a loaded machine: 1.3-1.5x faster at 1-8 rows in float32 and
bfloat16; docs/benchmarks.md, issue 44). At 64+ rows oneDNN is as fast or faster (bfloat16 at 256 rows: 0.7x,
its AMX blocking is better): the decode-heavy workloads are what this is for.

The oneDNN packing, as it came first (issue 26):

On a CPU, ``F.linear`` on float weights calls the BLAS torch was built with (MKL on x86).
Measured on the 2-core AMD EPYC development VM (Zen 4, AVX-512; torch 2.13, fp32, one
thread, SmolLM2-135M's shapes, best of 120 calls, quiet; docs/benchmarks.md): MKL's sgemm
runs at ~105 GFLOP/s at 32 rows and ~116 at 256, oneDNN's inner product on a weight
reordered once into its blocked layout at 239-254 and ~270 (2.3-2.4x), and the 49,152-row
LM head goes from 24.0 to 9.3 ms at 32 rows; at one row the two are even (memory-bound).
MKL takes its slower code path on non-Intel CPUs, which is why the gap is widest there;
vLLM's CPU backend calls oneDNN with prepacked weights for the same reason. oneDNN's
result for a row also does not depend on how many rows are in the call (checked bit for
bit at 1, 7, 32 and 100 of 256 rows; MKL's one-row path differs from its many-row path in
the last bits), so a request's logits do not depend on its batch.

``pack_model`` (called once by the model runner, after tensor-parallel sharding and
before the first step) replaces every float weight a module lists in ``linear_weights``
with a ``PackedWeight`` (the dense copy is released, as ``Int8Weight`` does), and gives the
model a packed copy of its LM head (``lm_head_packed``; the dense table stays, since the
embedding reads it when the head is tied). ``quant.linear`` calls ``PackedWeight.matmul``.

When: a CPU model whose weights are float32 or bfloat16 (bf16 only where the CPU has
native bf16 dot products, ``avx512_bf16`` or AMX: oneDNN emulates it elsewhere), not
quantized, with oneDNN in the torch build (or pagoda's matmul). ``PAGODA_CPU_GEMM=blas`` keeps
``F.linear`` (``onednn`` forces oneDNN's packing where it is possible, ``pagoda`` pagoda's;
``auto``, the default, is the rule above).
Numerics: oneDNN sums in another order than MKL, so logits differ from ``F.linear``'s in
the last bits (about 1e-6 relative in fp32); fp32 greedy outputs stay equal to Hugging
Face's: the engine-vs-Hugging-Face suites run on packed weights (tests/models/test_cpu_gemm.py
checks that the engine packs, and the matmul against float64 within its fp32 bound).
"""

from __future__ import annotations

import logging
import os
from typing import Optional

import torch
from torch import nn

from pagoda.kernels import cpu_native

logger = logging.getLogger(__name__)

GEMM_ENV = "PAGODA_CPU_GEMM"
_CHOICES = ("auto", "pagoda", "onednn", "blas")


class PackedWeight(nn.Module):
    """A float ``[out, in]`` weight packed once for a CPU matmul, in place of a Parameter:
    pagoda's panels (``kind="pagoda"``, ``kernels/csrc/cpu_gemm.cpp``) or oneDNN's layout
    (``kind="onednn"``)."""

    def __init__(self, weight: torch.Tensor, kind: str = "onednn") -> None:
        super().__init__()
        self.shape = weight.shape
        self.dtype = weight.dtype
        self.device = weight.device
        self.kind = kind
        dense = weight.detach().contiguous()
        if kind == "pagoda":
            ops = cpu_native.loaded_ops()
            assert ops is not None, "PackedWeight(kind='pagoda') without pagoda's C++ kernels"
            self._linear = ops.linear.default
            self.packed = ops.pack_linear(dense)
        else:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(dense)

    def matmul(self, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``x @ W.T (+ bias)`` for ``x`` of shape ``[..., in]``."""
        rows = x.reshape(-1, self.shape[1])
        if self.kind == "pagoda":
            if rows.stride(-1) != 1:
                rows = rows.contiguous()
            out = self._linear(rows, self.packed, self.shape[0], None if bias is None else bias.float())
        else:
            out = torch.ops.mkldnn._linear_pointwise(rows.contiguous(), self.packed, bias, "none", [], "")
        return out.reshape(*x.shape[:-1], self.shape[0])

    def dense(self) -> torch.Tensor:
        """The ``[out, in]`` weight as a plain tensor again (a copy)."""
        if self.kind != "pagoda":
            return self.packed.to_dense()
        out_features, in_features = self.shape
        if self.packed.dim() == 3:  # float32 panels [P, K, 16]
            return self.packed.transpose(1, 2).reshape(-1, in_features)[:out_features].clone()
        rows = self.packed.permute(0, 2, 1, 3).reshape(self.packed.shape[0] * 16, -1)  # bfloat16 [P, Kp/2, 16, 2]
        return rows[:out_features, :in_features].clone()

    def extra_repr(self) -> str:
        return f"out={self.shape[0]}, in={self.shape[1]}, dtype={self.dtype}, {self.kind}"


def native_bf16() -> bool:
    """Whether this CPU has bf16 dot-product instructions (``avx512_bf16`` or AMX)."""
    try:
        with open("/proc/cpuinfo") as info:
            flags = next((line for line in info if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def packing_reason(device: torch.device, dtype: torch.dtype) -> Optional[str]:
    """Why the model's weights stay as they are (``None``: pack them); reads ``PAGODA_CPU_GEMM``."""
    choice = os.environ.get(GEMM_ENV, "auto")
    if choice not in _CHOICES:
        raise ValueError(f"{GEMM_ENV}={choice!r}: must be one of {', '.join(_CHOICES)}")
    if choice == "blas":
        return f"{GEMM_ENV}=blas"
    if device.type != "cpu":
        return "not a CPU model"
    if dtype not in (torch.float32, torch.bfloat16):
        return f"{dtype} weights"
    if dtype == torch.bfloat16 and choice == "auto" and not native_bf16():
        return "bf16 without native bf16 instructions on this CPU"
    if packing_kind(dtype) == "onednn" and not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN"
    return None


def packing_kind(dtype: torch.dtype) -> str:
    """``"pagoda"`` (pagoda's C++ matmul) where its vector tiles run on this CPU for ``dtype``
    (AVX-512 for float32, AVX512-BF16 for bfloat16: ``cpu_native.gemm_features``), else
    ``"onednn"`` (a CPU without them, e.g. an AVX2-only EPYC, or the C++ kernels off or not
    built). ``PAGODA_CPU_GEMM=onednn`` or ``=pagoda`` forces one (``pagoda`` runs the plain C++
    tiles where the vector ones do not build; a ``ValueError`` without the C++ kernels)."""
    choice = os.environ.get(GEMM_ENV, "auto")
    if choice == "onednn":
        return "onednn"
    if cpu_native.loaded_ops() is None:
        if choice == "pagoda":
            raise ValueError(f"{GEMM_ENV}=pagoda: pagoda's C++ kernels are off "
                             f"({cpu_native.build() or cpu_native.KERNELS_ENV + '=torch'})")
        return "onednn"
    needs = "avx512f" if dtype == torch.float32 else "avx512bf16"
    return "pagoda" if choice == "pagoda" or needs in cpu_native.gemm_features() else "onednn"


@torch.no_grad()
def pack_model(model: nn.Module, device: torch.device, dtype: torch.dtype) -> int:
    """Replace the model's float linear weights by ``PackedWeight`` (module docstring); returns
    how many were packed (0 when ``packing_reason`` says not to, logged once)."""
    reason = packing_reason(device, dtype)
    if reason is not None:
        if device.type == "cpu":
            logger.info("CPU matmuls: BLAS (F.linear): %s", reason)
        return 0
    kind, count = packing_kind(dtype), 0
    for module in model.modules():
        for name in getattr(module, "linear_weights", ()):
            weight = getattr(module, name)
            if isinstance(weight, nn.Parameter) and weight.dtype == dtype:
                delattr(module, name)  # a Parameter slot cannot take a Module
                setattr(module, name, PackedWeight(weight, kind))
                count += 1
    head = getattr(model, "lm_head", None)
    if isinstance(head, torch.Tensor) and head.dtype == dtype:
        model.lm_head_packed = PackedWeight(head, kind)
        count += 1
    logger.info("CPU matmuls: %s, %d weights prepacked (%s)", kind, count, dtype)
    return count
