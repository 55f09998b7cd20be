"""W8A8 int8 on the CPU: int8 weights and int8 activations, the products summed in int32 (issue 44).

``quantization="w8a8"`` (``LLM(..., quantization="w8a8")``, ``pagoda serve --quantization
w8a8``): vLLM's CPU backend serves W8A8 int8 checkpoints through oneDNN; pagoda quantizes a
float checkpoint at load and runs its own kernels (``kernels/csrc/cpu_int8.cpp``).

Scheme:

* weights: symmetric per output channel, as ``quantization="int8"`` (``quantize_rows`` on the
  ``[out, in]`` weight gives ``quant.quantize_int8``'s integers and scales: ``W ~= Q * w_scale[:, None]``),
  quantized once at load; what is quantized is the same set
  (every ``linear_weights`` entry: attention and MLP projections; not the embedding, the LM
  head, norms or biases);
* activations: symmetric per row ("dynamic per token"), on every call:
  ``x_scale = max|x| / 127`` (1 for a zero row), ``q = round(x / x_scale)`` clamped to
  ``[-127, 127]`` (round half to even, float32 division, as ``torch.round``);
* ``y = (q @ Q^T) * x_scale[:, None] * w_scale[None, :] + bias``: the integer sum is exact
  (int32), the rest in float32, rounded once to the activation dtype.

So a row's result does not depend on its batch (each row has its own scale, each sum is an
exact integer) and every kernel — AMX-INT8 tiles for calls of 16+ rows, AVX512-VNNI register
tiles below, plain C++ where neither exists — gives the same bits. ``w8a8_linear_ref`` is
the definition (tests compare the kernels with it in float64).

Accuracy: activations lose more than weights do (an outlier in a row sets its scale); the
quality table (perplexity and agreement vs the float model) is ``pagoda bench quant
--methods int8,w8a8`` (docs/quantization.md).

Where: CPU only, with pagoda's C++ kernels built (``kernels.cpu_native``); a CUDA model or a
build without them is refused at load naming why (the GPU int8 path is ``int8``, W8A16).
Activations float32 or bfloat16 (the model dtype); float16 is refused.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from pagoda.kernels import cpu_native

_QMAX = 127
AMX_ROWS = 16  # cpu_int8.cpp's kAmxRows: calls of this many rows go to AMX-INT8 where it serves


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric int8 quantization of ``x [rows, K]`` (the kernel's, exactly).

    Returns:
        ``(q [rows, K] int8, x_scale [rows] float32)`` with ``x ~= q * x_scale[:, None]``.
    """
    xf = x.float()
    amax = xf.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / _QMAX, torch.ones_like(amax))
    q = torch.round(xf / scale[:, None]).clamp_(-_QMAX, _QMAX).to(torch.int8)
    return q, scale


def w8a8_linear_ref(x: torch.Tensor, qweight: torch.Tensor, w_scale: torch.Tensor,
                    bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The definition of the W8A8 matmul, in float64 (exact sums), as ``float64``.

    Args:
        x: ``[rows, K]`` activations (any float dtype).
        qweight: ``[N, K]`` int8; ``w_scale``: ``[N]`` float32.
        bias: optional ``[N]``.
    Returns:
        ``[rows, N]`` float64 (callers round to their dtype).
    """
    q, x_scale = quantize_rows(x)
    sums = q.double() @ qweight.double().T  # exact: integers far below 2^53
    out = sums * (x_scale[:, None] * w_scale[None, :].float()).double()
    return out if bias is None else out + bias.double()


def unavailable_reason(device: torch.device, dtype: torch.dtype) -> Optional[str]:
    """Why W8A8 cannot serve a model on ``device`` in ``dtype`` (``None``: it can)."""
    if device.type != "cpu":
        return f"w8a8 runs on the CPU only ({device.type}: use quantization='int8', W8A16)"
    if dtype not in (torch.float32, torch.bfloat16):
        return f"w8a8 takes float32 or bfloat16 activations, not {dtype}"
    if cpu_native.loaded_ops() is None:
        return f"w8a8 needs pagoda's C++ CPU kernels: {cpu_native.build() or cpu_native.KERNELS_ENV + '=torch'}"
    return None


class W8A8Weight(nn.Module):
    """An int8 ``[out, in]`` weight packed for ``linear_w8a8``, with its per-row scales, in place
    of a float Parameter (module docstring)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        reason = unavailable_reason(weight.device, weight.dtype)
        if reason is not None:
            raise ValueError(f"quantization 'w8a8': {reason}")
        qweight, scale = quantize_rows(weight)  # per output channel: a row of W is a row here
        ops = cpu_native.loaded_ops()
        packed, comp = ops.pack_int8(qweight)
        self.register_buffer("packed", packed)  # [panels, Kp / 4, 16, 4] int8
        self.register_buffer("comp", comp)  # [out] int32: 128 * each row's sum
        self.register_buffer("scale", scale)  # [out] float32
        self.shape = weight.shape
        self.dtype = weight.dtype
        self.kernel = "auto"  # "vector", "plain", "amx": tests and benchmarks pin one
        self._linear = ops.linear_w8a8.default

    def matmul(self, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``x @ W.T (+ bias)`` with both operands int8 (module docstring), in ``x.dtype``."""
        rows = x.reshape(-1, self.shape[1])
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        if rows.dtype != self.dtype:
            rows = rows.to(self.dtype)
        out = self._linear(rows, self.packed, self.comp, self.scale, self.shape[0],
                           None if bias is None else bias.float().contiguous(), self.kernel)
        return out.reshape(*x.shape[:-1], self.shape[0]).to(x.dtype)

    def kernel_for(self, x: torch.Tensor) -> str:
        """Name of the kernel ``matmul`` takes for ``x`` (benchmarks print it)."""
        features = cpu_native.loaded_ops().int8_features()
        rows = x.numel() // x.shape[-1]
        if self.kernel == "plain" or not features:
            return "plain C++ int8"
        if self.kernel == "amx" or (self.kernel == "auto" and rows >= AMX_ROWS and "amx-int8" in features):
            return "AMX-INT8 tiles"
        return "AVX512-VNNI tiles" if "avx512vnni" in features else "plain C++ int8"

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight the matmul uses, ``Q * w_scale``, as ``[out, in]``."""
        panels, quads = self.packed.shape[:2]
        q = self.packed.permute(0, 2, 1, 3).reshape(panels * 16, quads * 4)[: self.shape[0], : self.shape[1]]
        return (q.float() * self.scale[:, None]).to(dtype)

    def extra_repr(self) -> str:
        return f"out={self.shape[0]}, in={self.shape[1]}, activations={self.dtype}"
