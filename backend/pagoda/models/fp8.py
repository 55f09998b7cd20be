"""FP8 (e4m3) weight quantization of the decoder's linear layers, per output channel.

Scheme (``quantization="fp8"``)::

    scale[n] = max_k |W[n, k]| / 448        (448: largest finite e4m3fn; 1 for a zero row)
    Q[n, k]  = e4m3(W[n, k] / scale[n])     round to nearest even, |.| <= 448
    |W - Q * scale| <= max(2^-4 |W|, 2^-10 scale)      element-wise

e4m3 has 3 mantissa bits: in the normal range (``|W / scale| >= 2^-6``) neighbouring values
are ``2^-3`` apart relative to the exponent, so rounding errs by at most half of that, 2^-4
of the value; below it values are subnormal, ``2^-9`` apart (absolute, in scaled units).

Matmul (``Fp8Weight.matmul``), per call:

* CUDA, ``M <= w8a16.DECODE_ROWS`` (decode): the Triton W8A16 kernel with the e4m3
  weight dequantized in the kernel (one byte per weight, activations untouched);
* CUDA, larger ``M`` on 16-bit activations, when ``torch._scaled_mm`` was proven on this
  GPU: activations quantized per token (row-wise, dynamic: ``amax / 448`` per row) to
  e4m3 and ``torch._scaled_mm`` with row-wise scales (``scale_a [M, 1]``, ``scale_b
  [1, N]``, float32; the weight passed as the column-major ``Q.t()``; ``K`` and ``N``
  multiples of 16), output in the activation dtype: FP8 tensor cores;
* otherwise (CPU, fp32 activations, shapes ``_scaled_mm`` does not take): ``pagoda.kernels
  .w8a16_linear`` — on CPU the emulation: dequantize e4m3 to the activation dtype + F.linear.

A DeepSeek-format checkpoint's block-scaled FP8 weights (``Fp8BlockWeight``: 128 x 128 scales)
take the same Triton kernel with the block scales applied per K tile (``kernels.fp8_block_linear``),
dequantize + ``F.linear`` on CPU and from ``w8a16.DEQUANT_ROWS`` rows.

Refused (ValueError at load) on a CUDA device below compute capability 8.9 (no e4m3
support in the tensor cores nor in Triton's conversions there) and on other device types.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import nn

from pagoda import kernels
from pagoda.kernels import w8a16

logger = logging.getLogger(__name__)

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
MIN_CAPABILITY = (8, 9)


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel e4m3 quantization of a ``[out, in]`` weight.

    Returns:
        ``(qweight [out, in] float8_e4m3fn, scale [out] float32)``.
    """
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    qweight = (w / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return qweight, scale


def dequantize_fp8(qweight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``qweight * scale[:, None]`` in ``dtype`` (product in float32)."""
    return (qweight.float() * scale.float()[:, None]).to(dtype)


def check_fp8_device(device: torch.device) -> None:
    """Raise ValueError where neither the GPU path nor the CPU emulation can run."""
    if device.type == "cpu":
        return
    if device.type != "cuda":
        raise ValueError(f"quantization='fp8': unsupported device type {device.type!r} (cuda sm_89+ or cpu)")
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        raise ValueError(f"quantization='fp8' needs an NVIDIA GPU of compute capability 8.9+ (Ada, Hopper or later) "
                         f"for e4m3 weights; {name} is sm_{major}{minor}. Use quantization='int8' on this GPU.")


def scaled_mm_shape_ok(out_features: int, in_features: int) -> bool:
    """``torch._scaled_mm`` needs ``K`` and ``N`` to be multiples of 16."""
    return out_features % 16 == 0 and in_features % 16 == 0


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token e4m3 quantization: ``(x8 [M, K], scale [M, 1] float32)``, ``x ~= x8 * scale``."""
    xf = x.float()
    scale = xf.abs().amax(dim=1, keepdim=True).clamp_(min=1e-12) / FP8_MAX
    return (xf / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def scaled_mm_linear(x: torch.Tensor, qweight: torch.Tensor, scale_row: torch.Tensor) -> torch.Tensor:
    """``x @ (Q * scale).T`` on FP8 tensor cores: ``x`` ``[M, K]`` 16-bit, quantized per token.

    ``torch._scaled_mm`` wants the second operand column-major (``Q.t()`` of the row-major
    ``[N, K]`` weight is), row-wise scales as float32 ``[M, 1]`` and ``[1, N]``, and ``K``,
    ``N`` multiples of 16; the output is produced in ``x.dtype`` (bf16 or fp16).
    """
    x8, x_scale = quantize_activations(x)
    return torch._scaled_mm(x8, qweight.t(), scale_a=x_scale, scale_b=scale_row, out_dtype=x.dtype)


class Fp8Weight(nn.Module):
    """An e4m3 ``[out, in]`` weight with per-row float32 scales, in place of a float Parameter."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        qweight, scale = quantize_fp8(weight)
        self.register_buffer("qweight", qweight.to(weight.device))  # [out, in] float8_e4m3fn
        self.register_buffer("scale", scale.to(weight.device))  # [out] float32
        self.register_buffer("scale_row", self.scale.view(1, -1), persistent=False)  # [1, out] for _scaled_mm
        self.use_scaled_mm = False  # set by select_fp8_kernel once _scaled_mm is proven here
        self.path = "auto"  # "dequantize": always dequantize + F.linear, on any device (benchmarks)

    @classmethod
    def from_quantized(cls, qweight: torch.Tensor, scale: torch.Tensor) -> "Fp8Weight":
        """An ``Fp8Weight`` holding an e4m3 weight and per-row scales as given (an FP8
        checkpoint's own values, ``pagoda.models.int4.install_quantized_weights``)."""
        weight = cls.__new__(cls)
        nn.Module.__init__(weight)
        weight.register_buffer("qweight", qweight.to(torch.float8_e4m3fn))
        weight.register_buffer("scale", scale.float().reshape(-1).to(qweight.device))
        weight.register_buffer("scale_row", weight.scale.view(1, -1), persistent=False)
        weight.use_scaled_mm, weight.path = False, "auto"
        return weight

    @property
    def shape(self) -> torch.Size:
        return self.qweight.shape

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_fp8(self.qweight, self.scale, dtype)

    def kernel_for(self, x: torch.Tensor) -> str:
        """Name of the path ``matmul`` takes for ``x`` (benchmarks print it)."""
        rows = x.numel() // x.shape[-1]
        if self.path == "dequantize":
            return "dequantize + F.linear"
        if (self.use_scaled_mm and rows > w8a16.DECODE_ROWS and x.is_cuda
                and x.dtype in (torch.bfloat16, torch.float16)):
            return "_scaled_mm (e4m3 activations per token)"
        use_triton = kernels.use_triton(x) and rows < w8a16.DEQUANT_ROWS
        return "triton W8A16 (e4m3 weight)" if use_triton else "dequantize + F.linear"

    def matmul(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, in] -> [num_tokens, out], x.dtype
        kernel = self.kernel_for(x)
        if kernel.startswith("_scaled_mm"):
            out = scaled_mm_linear(x.reshape(-1, x.shape[-1]), self.qweight, self.scale_row)
            return out.view(*x.shape[:-1], out.shape[-1])
        if self.path == "dequantize":
            return w8a16.w8a16_linear_ref(x, self.qweight, self.scale)
        return kernels.w8a16_linear(x, self.qweight, self.scale)

    def extra_repr(self) -> str:
        return f"out={self.shape[0]}, in={self.shape[1]}, scaled_mm={self.use_scaled_mm}"


class Fp8BlockWeight(nn.Module):
    """An e4m3 ``[out, in]`` weight with square block scales (a DeepSeek-format FP8 checkpoint's
    ``weight`` and ``weight_scale_inv``, kept as they are): ``W[n, k] = Q[n, k] * scale[n // block,
    k // block]``. ``matmul``: ``kernels.fp8_block_linear`` (the Triton W8A16 kernel with block
    scales on CUDA, dequantize + ``F.linear`` elsewhere). One byte per weight plus 4 bytes per block."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, block: int) -> None:
        super().__init__()
        n, k = qweight.shape
        if tuple(scale.shape) != (-(-n // block), -(-k // block)):
            raise ValueError(f"block scales {tuple(scale.shape)} do not cover a {n} x {k} weight in {block}-blocks")
        self.block = block
        self.register_buffer("qweight", qweight.to(FP8_DTYPE).contiguous())
        self.register_buffer("scale", scale.float().contiguous().to(qweight.device))

    @property
    def shape(self) -> torch.Size:
        return self.qweight.shape

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return w8a16.dequantize_blocks(self.qweight, self.scale, self.block, dtype)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, in] -> [num_tokens, out], x.dtype
        return kernels.fp8_block_linear(x, self.qweight, self.scale, self.block)

    def extra_repr(self) -> str:
        return f"out={self.shape[0]}, in={self.shape[1]}, block={self.block}"


def _scaled_mm_works(weight: Fp8Weight, dtype: torch.dtype) -> Optional[str]:
    """Run ``_scaled_mm`` once on this weight at 32 rows; ``None`` if it matches the emulation."""
    x = torch.randn(32, weight.shape[1], device=weight.qweight.device).to(dtype)
    try:
        out = scaled_mm_linear(x, weight.qweight, weight.scale_row)
    except (RuntimeError, ValueError) as exc:
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    err = (out.double() - scaled_mm_exact(x, weight.qweight, weight.scale)).abs()
    return None if bool(torch.all(err <= scaled_mm_bound(x, weight.qweight, weight.scale))) else "wrong result"


def scaled_mm_exact(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float64 product of the e4m3-quantized activations and weight: what ``_scaled_mm`` computes."""
    x8, x_scale = quantize_activations(x)
    return (x8.double() * x_scale.double()) @ dequantize_fp8(qweight, scale, torch.float64).T


def scaled_mm_bound(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Twice (fp32 accumulation over K terms + the 16-bit output rounding, bf16's 2^-8) of the magnitude."""
    x8, x_scale = quantize_activations(x)
    magnitude = (x8.double() * x_scale.double()).abs() @ dequantize_fp8(qweight, scale, torch.float64).abs().T
    return 2 * (qweight.shape[1] * 2.0**-24 + 2.0**-8) * magnitude + 1e-30


def select_fp8_kernel(weights: list[Fp8Weight], dtype: torch.dtype) -> str:
    """Enable ``_scaled_mm`` on every weight it takes (CUDA sm_89+, 16-bit model); returns the decision."""
    if not weights:
        return "no fp8 weights"
    device = weights[0].qweight.device
    check_fp8_device(device)
    if device.type != "cuda":
        return "fp8 emulation: dequantize e4m3 + F.linear"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"triton W8A16 for every batch size ({dtype} activations: no _scaled_mm path)"
    eligible = [w for w in weights if scaled_mm_shape_ok(*w.shape)]
    failure = _scaled_mm_works(eligible[0], dtype) if eligible else "no weight shape is a multiple of 16"
    for w in eligible:
        w.use_scaled_mm = failure is None
    if failure is not None:
        return f"triton W8A16 for every batch size (_scaled_mm unusable: {failure})"
    return (f"triton W8A16 up to {w8a16.DECODE_ROWS} rows, _scaled_mm row-wise above "
            f"({len(eligible)}/{len(weights)} weights; others triton W8A16)")
