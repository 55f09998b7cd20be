"""Int8 weight-only quantization of the decoder's linear layers, applied at load time.

Scheme: symmetric, one scale per output channel (per row of a ``[out, in]`` weight)::

    scale[n] = max_k |W[n, k]| / 127        (1 for an all-zero row)
    Q[n, k]  = clamp(round(W[n, k] / scale[n]), -127, 127)      int8
    W ~= Q * scale[:, None]                 |W - Q * scale| <= scale / 2, element-wise

computed in float32 from whatever dtype the weights were loaded in (fp32/fp16/bf16).
Fused weights (``qkv_weight``, ``gate_up_weight``) are quantized as one matrix; since the
scales are per row, that is the same as quantizing q, k, v, gate and up separately.

What is quantized: every weight a module lists in its ``linear_weights`` class attribute
(attention ``qkv``/``o`` and MLP ``gate_up``/``down``: about 80% of SmolLM2's parameters).
What is not: biases, norms, the embedding table and the LM head. SmolLM2 ties the LM head
to the embeddings, so quantizing the head would also quantize the table the first layer
reads; and the head's error lands directly on the logits the sampler sees. Both stay in
the model dtype (decision recorded in docs/quantization.md with its memory cost).

Forward (``linear``): the model's matmuls all go through ``linear(x, weight, bias)``,
which calls ``F.linear`` for a float weight and ``Int8Weight.matmul`` for a quantized one.
Two kernels, picked per call by the number of rows:

* up to ``MAX_PACKED_ROWS`` rows (decode steps), when the packed kernel was proven on this
  machine: ``aten._weight_int8pack_mm``, which reads the int8 weight directly (one byte
  per weight instead of four). Its CPU kernel is only fast for 16-bit activations (fp32
  activations take a scalar path ~20x slower than sgemm, measured), so fp32 activations
  are cast to bf16 for the call and the result cast back; the kernel also requires scales
  in the activation dtype, so a bf16 copy of the scales is kept;
* otherwise (prefill chunks, or no proven packed kernel): dequantize the weight to the
  activation dtype and call ``F.linear``; the dequantization is O(N*K) against the
  matmul's O(M*N*K), so it amortises, while the packed kernel is slower than a BLAS sgemm
  at large M.

Which kernel (``select_int8_kernel``, once per model at ``quantize_model``): the packed
CPU kernel is chosen by torch at run time from the CPU's instruction set, and on some CPUs
it crashes the process or returns garbage (Intel Xeon with AVX-512/AMX, torch 2.13). So on
CPU it is used only after ``int8_probe`` ran it in a subprocess on the model's weight
shapes at every row count from 1 to ``MAX_PACKED_ROWS`` and matched a float64 reference within a
derived bound; otherwise every call dequantizes. The decision and its reason are logged
once. ``PAGODA_INT8_KERNEL=dequantize|packed|auto`` overrides it (``packed`` skips the
probe: for debugging only).

On CUDA the packed kernel is never used (it made batch-1 decode 9x slower than bf16 on an
H100): every call goes through ``pagoda.kernels.w8a16_linear``, the Triton W8A16 kernel
(split-K streaming of the int8 weight for decode, tensor-core tiles above) below
``W8A16_DEQUANT_ROWS`` rows and dequantize + cuBLAS from there. ``quantization="fp8"``
(e4m3 weights) lives in ``pagoda.models.fp8``, ``quantization="w8a8"`` (int8 activations too,
CPU) in ``pagoda.models.w8a8``; ``quantize_model`` and ``linear`` serve all three.
"""

from __future__ import annotations

import logging
import os
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagoda import kernels
from pagoda.kernels import cpu_native
from pagoda.kernels.w8a16 import w8a16_linear_ref
from pagoda.models.cpu_gemm import PackedWeight
from pagoda.models.fp8 import Fp8BlockWeight, Fp8Weight, select_fp8_kernel
from pagoda.models.int4 import Int4Weight
from pagoda.models.int8_probe import ProbeResult, cpu_description, probe_packed_kernel
from pagoda.models.w8a8 import W8A8Weight

logger = logging.getLogger(__name__)

QUANTIZATION_METHODS = ("int8", "fp8", "w8a8")
KERNEL_ENV = "PAGODA_INT8_KERNEL"
# The probe proves the packed kernel at every row count it may be called with
# (1..MAX_PACKED_ROWS): on a CPU where it misbehaves, it does so for some shapes and row
# counts only (an Intel Xeon: fine at 576x576, garbage at 200x136).
# Rows at or below which the packed int8 kernel beats dequantize + BLAS (measured on CPU
# with SmolLM2 shapes; see docs/quantization.md).
MAX_PACKED_ROWS = 16
W8A16_DEQUANT_ROWS = kernels.w8a16.DEQUANT_ROWS
_QMAX = 127


def check_quantization(method: Optional[str]) -> Optional[str]:
    """Validate a quantization name.

    Returns:
        ``method`` unchanged (``None`` means no quantization).
    Raises:
        ValueError: ``method`` is not one of ``QUANTIZATION_METHODS``.
    """
    if method is not None and method not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization: unknown method {method!r}; supported: {', '.join(QUANTIZATION_METHODS)}")
    return method


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8 quantization of a ``[out, in]`` weight.

    Returns:
        ``(qweight [out, in] int8, scale [out] float32)`` with ``weight ~= qweight * scale[:, None]``.
    """
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)  # [out]
    scale = torch.where(amax > 0, amax / _QMAX, torch.ones_like(amax))
    qweight = torch.round(w / scale[:, None]).clamp_(-_QMAX, _QMAX).to(torch.int8)
    return qweight, scale


def dequantize_int8(qweight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``qweight * scale[:, None]`` in ``dtype`` (the product is taken in float32)."""
    return (qweight.float() * scale.float()[:, None]).to(dtype)


def _has_packed_kernel(device: torch.device) -> bool:
    key = {"cpu": "CPU", "cuda": "CUDA"}.get(device.type)
    return key is not None and torch._C._dispatch_has_kernel_for_dispatch_key("aten::_weight_int8pack_mm", key)


def choose_packed_kernel(device: torch.device, dtype: torch.dtype, shapes: set[tuple[int, int]]) -> ProbeResult:
    """Decide whether ``Int8Weight``s of these ``(out, in)`` shapes may use the packed kernel.

    Returns:
        ``ProbeResult(ok, reason)``; ``ok`` False means dequantize + ``F.linear`` on every call.
    Raises:
        ValueError: ``PAGODA_INT8_KERNEL`` holds an unknown value.
    """
    mode = os.environ.get(KERNEL_ENV, "auto")
    if mode not in ("auto", "packed", "dequantize"):
        raise ValueError(f"{KERNEL_ENV}={mode!r}: expected auto, packed or dequantize")
    if device.type != "cpu":
        return ProbeResult(False, f"{device.type}: the Triton W8A16 kernel serves int8 (pagoda.kernels.w8a16_linear)")
    if mode == "dequantize":
        return ProbeResult(False, f"{KERNEL_ENV}=dequantize")
    if not _has_packed_kernel(device):
        return ProbeResult(False, f"no _weight_int8pack_mm kernel for {device.type} in this torch build")
    if mode == "packed":
        return ProbeResult(True, f"{KERNEL_ENV}=packed (not probed)")
    return probe_packed_kernel(dtype, tuple(sorted(shapes)), tuple(range(1, MAX_PACKED_ROWS + 1)))


def select_int8_kernel(weights: list["Int8Weight"]) -> ProbeResult:
    """Set ``use_packed`` on every weight from one decision for their device, dtype and shapes; log it once."""
    if not weights:
        return ProbeResult(False, "no int8 weights")
    device, dtype = weights[0].qweight.device, weights[0].packed_dtype
    result = choose_packed_kernel(device, dtype, {tuple(w.shape) for w in weights})
    for w in weights:
        w.use_packed = result.ok
    where = cpu_description() if device.type == "cpu" else str(device)
    if device.type != "cpu":
        kernel, level = f"Triton W8A16 below {W8A16_DEQUANT_ROWS} rows, dequantize + cuBLAS from there", logging.INFO
    elif result.ok:
        kernel, level = f"packed _weight_int8pack_mm up to {MAX_PACKED_ROWS} rows", logging.INFO
    else:
        kernel, level = "dequantize + F.linear", logging.WARNING
    _log_once(level, f"int8 matmul on {where}: {kernel} ({result.reason})")
    return result


_logged: set[str] = set()


def _log_once(level: int, message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        logger.log(level, message)


class Int8Weight(nn.Module):
    """An int8 ``[out, in]`` weight with per-row float32 scales, in place of a float Parameter."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        qweight, scale = quantize_int8(weight)
        self.register_buffer("qweight", qweight.to(weight.device))  # [out, in] int8
        self.register_buffer("scale", scale.to(weight.device))  # [out] float32
        # The packed kernel wants 16-bit activations and scales of the same dtype: bf16 for
        # a float32 model, the model dtype otherwise.
        self.packed_dtype = torch.bfloat16 if weight.dtype == torch.float32 else weight.dtype
        self.register_buffer("packed_scale", scale.to(self.packed_dtype).to(weight.device))  # [out]
        # Dequantize until select_int8_kernel proves the packed kernel on this machine.
        self.use_packed = False
        self.path = "auto"  # "dequantize": always dequantize + F.linear, on any device (benchmarks)

    @property
    def shape(self) -> torch.Size:
        return self.qweight.shape

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_int8(self.qweight, self.scale, dtype)

    def kernel_for(self, x: torch.Tensor) -> str:
        """Name of the path ``matmul`` takes for ``x`` (benchmarks print it)."""
        rows = x.numel() // x.shape[-1]
        if self.path == "dequantize":
            return "dequantize + F.linear"
        if kernels.use_triton(x):
            return "triton W8A16" if rows < W8A16_DEQUANT_ROWS else "dequantize + F.linear"
        return "packed _weight_int8pack_mm" if self.use_packed and rows <= MAX_PACKED_ROWS else "dequantize + F.linear"

    def matmul(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, in] -> [num_tokens, out], x.dtype
        """``x @ W.T`` with the dequantized weight ``W`` (see the module docstring for the kernel choice)."""
        if self.path == "dequantize":
            return w8a16_linear_ref(x, self.qweight, self.scale)
        if self.use_packed and x.shape[0] <= MAX_PACKED_ROWS and not kernels.use_triton(x):
            packed = torch.ops.aten._weight_int8pack_mm(x.to(self.packed_dtype).contiguous(), self.qweight,
                                                         self.packed_scale)
            return packed.to(x.dtype)
        return kernels.w8a16_linear(x, self.qweight, self.scale)

    def extra_repr(self) -> str:
        return f"out={self.shape[0]}, in={self.shape[1]}, packed={self.use_packed}"


def linear(x: torch.Tensor, weight, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear`` that also accepts an ``Int8Weight``, ``Fp8Weight``, ``Fp8BlockWeight``, ``Int4Weight``,
    a CPU ``W8A8Weight`` or a CPU ``PackedWeight`` (``models.cpu_gemm``); the model's projections call this."""
    if isinstance(weight, (PackedWeight, W8A8Weight)):
        return weight.matmul(x, bias)
    if isinstance(weight, (Int8Weight, Fp8Weight, Int4Weight, Fp8BlockWeight)):
        out = weight.matmul(x)
        return out if bias is None else out + bias
    return F.linear(x, weight, bias)


@torch.no_grad()
def quantize_model(model: nn.Module, method: str = "int8") -> nn.Module:
    """Replace, in place, every weight named in a submodule's ``linear_weights`` by an
    ``Int8Weight`` (``"int8"``), an ``Fp8Weight`` (``"fp8"``, see ``pagoda.models.fp8``) or a
    ``W8A8Weight`` (``"w8a8"``, CPU only, see ``pagoda.models.w8a8``).

    Call after the weights are loaded; the float weights are released.

    Args:
        model: e.g. a loaded ``LlamaForCausalLM``.
        method: ``"int8"``, ``"fp8"`` or ``"w8a8"``.
    Returns:
        ``model``.
    Raises:
        ValueError: unknown ``method``; ``"fp8"`` on a device that cannot run it (CUDA below
            sm_89); ``"w8a8"`` off the CPU or without pagoda's C++ kernels; a model already
            quantized with another method; a module that declares ``quantization_unsupported``
            (MoE experts), checked before anything is converted.
    """
    check_quantization(method)
    cls = {"fp8": Fp8Weight, "w8a8": W8A8Weight}.get(method, Int8Weight)
    weights = []
    for module in model.modules():
        if getattr(module, "quantization_unsupported", None):
            raise ValueError(f"quantization {method!r}: {module.quantization_unsupported}")
    for module in model.modules():
        for name in getattr(module, "linear_weights", ()):
            weight = getattr(module, name)
            if isinstance(weight, (Int8Weight, Fp8Weight, W8A8Weight)) and not isinstance(weight, cls):
                raise ValueError(f"quantize_model: {name} is already {type(weight).__name__}; cannot apply {method!r}")
            if not isinstance(weight, cls):
                if cls is Fp8Weight and not weights:
                    from pagoda.models.fp8 import check_fp8_device

                    check_fp8_device(weight.device)  # refuse before converting anything
                delattr(module, name)  # a Parameter slot cannot take a Module
                weight = cls(weight)
                setattr(module, name, weight)
            weights.append(weight)
    if cls is Int8Weight:
        select_int8_kernel(weights)
    elif cls is W8A8Weight:
        features = cpu_native.loaded_ops().int8_features() or "plain C++ (no AVX512-VNNI or AMX-INT8)"
        _log_once(logging.INFO, f"w8a8 matmul on {cpu_description()}: {features}")
    else:
        dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
        where = cpu_description() if not weights or weights[0].qweight.device.type == "cpu" else \
            str(weights[0].qweight.device)
        _log_once(logging.INFO, f"fp8 matmul on {where}: {select_fp8_kernel(weights, dtype)}")
    return model


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's state (parameters and persistent buffers, and the CPU's prepacked weights,
    ``PackedWeight.packed``, which are neither), tied tensors counted once."""
    tensors = {t.data_ptr(): t for t in model.state_dict(keep_vars=True).values()}
    tensors.update({m.packed.data_ptr(): m.packed for m in model.modules() if isinstance(m, PackedWeight)})
    return sum(t.numel() * t.element_size() for t in tensors.values())
