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

* up to ``MAX_PACKED_ROWS`` rows (decode steps): ``aten._weight_int8pack_mm``, which
  reads the int8 weight directly (one byte per weight instead of four). Its CPU kernel is
  only fast for 16-bit activations (fp32 activations take a scalar path ~20x slower than
  sgemm, measured), so fp32 activations are cast to bf16 for the call and the result cast
  back; the kernel also requires scales in the activation dtype, so a bf16 copy of the
  scales is kept. On CUDA the same op has a kernel (present in torch 2.13's dispatch table; not run here);
* more rows (prefill chunks): dequantize the weight to the activation dtype and call
  ``F.linear``; the dequantization is O(N*K) against the matmul's O(M*N*K), so it
  amortises, while the packed kernel is slower than a BLAS sgemm at large M.

If a build has no ``_weight_int8pack_mm`` kernel for the device, every call dequantizes.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

QUANTIZATION_METHODS = ("int8",)
# Rows at or below which the packed int8 kernel beats dequantize + BLAS (measured on CPU
# with SmolLM2 shapes; see docs/quantization.md).
MAX_PACKED_ROWS = 16
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
        self.use_packed = _has_packed_kernel(weight.device)

    @property
    def shape(self) -> torch.Size:
        return self.qweight.shape

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_int8(self.qweight, self.scale, dtype)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, in] -> [num_tokens, out], x.dtype
        """``x @ W.T`` with the dequantized weight ``W`` (see the module docstring for the kernel choice)."""
        if self.use_packed and x.shape[0] <= MAX_PACKED_ROWS:
            packed = torch.ops.aten._weight_int8pack_mm(x.to(self.packed_dtype).contiguous(), self.qweight,
                                                         self.packed_scale)
            return packed.to(x.dtype)
        return F.linear(x, self.dequantize(x.dtype))

    def extra_repr(self) -> str:
        return f"out={self.shape[0]}, in={self.shape[1]}, packed={self.use_packed}"


def linear(x: torch.Tensor, weight, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear`` that also accepts an ``Int8Weight``; the model's projections call this."""
    if isinstance(weight, Int8Weight):
        out = weight.matmul(x)
        return out if bias is None else out + bias
    return F.linear(x, weight, bias)


@torch.no_grad()
def quantize_model(model: nn.Module, method: str = "int8") -> nn.Module:
    """Replace, in place, every weight named in a submodule's ``linear_weights`` by an ``Int8Weight``.

    Call after the weights are loaded; the float weights are released.

    Args:
        model: e.g. a loaded ``LlamaForCausalLM``.
        method: only ``"int8"``.
    Returns:
        ``model``.
    Raises:
        ValueError: unknown ``method``.
    """
    check_quantization(method)
    for module in model.modules():
        for name in getattr(module, "linear_weights", ()):
            weight = getattr(module, name)
            if isinstance(weight, Int8Weight):
                continue
            delattr(module, name)  # a Parameter slot cannot take a Module
            setattr(module, name, Int8Weight(weight))
    return model


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's state (parameters and persistent buffers), tied tensors counted once."""
    tensors = {t.data_ptr(): t for t in model.state_dict(keep_vars=True).values()}
    return sum(t.numel() * t.element_size() for t in tensors.values())
