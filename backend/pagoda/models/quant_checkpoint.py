"""Pre-quantized checkpoints: ``quantization_config`` in config.json, read by the same loader.

Formats (``parse_quantization_config`` checks the config; anything else is refused naming
the field and value, never loaded wrong):

For each ``quant_method``: the checkpoint's tensors per linear module ``X``, then the value of ``W[n, k]``.

- ``compressed-tensors``, ``pack-quantized`` (int4 / int8 in int32, sym or asym, group 32..128 or channel,
  optional ``weight_g_idx`` act-order): ``X.weight_packed [N, K*b/32]`` (element ``k`` at bit ``b*k`` of its
  row, stored ``q + 2^(b-1)``), ``X.weight_scale [N, G]``, ``X.weight_zero_point [N*b/32, G]`` (asym, packed
  along N), ``X.weight_shape``; ``W[n, k] = (q - zp[n, g]) * scale[n, g]``.
- ``compressed-tensors``, ``naive-quantized`` (int8): ``X.weight`` int8, ``X.weight_scale``,
  ``X.weight_zero_point`` (asym); ``W = (q - zp) * scale``.
- ``compressed-tensors``, ``float-quantized`` (FP8 e4m3, tensor / channel / 128x128 block): ``X.weight``
  float8, ``X.weight_scale`` (``X.input_scale``: static activation scale); ``W = w * scale`` (block:
  ``scale[n//128, k//128]``).
- ``awq`` (GEMM, 4 bit, zero point): ``X.qweight [K, N/8]`` (nibble ``i`` holds column
  ``8c + (0,2,4,6,1,3,5,7)[i]``), ``X.qzeros [K/G, N/8]`` (same order), ``X.scales [K/G, N]``;
  ``W[n, k] = (q[k, n] - z[k//G, n]) * s[k//G, n]``.
- ``gptq`` (v1 ``checkpoint_format: gptq``, or ``gptq_v2``; 4 or 8 bit; ``desc_act`` with ``g_idx``):
  ``X.qweight [K*b/32, N]`` (packed along K), ``X.qzeros [G, N*b/32]`` (packed along N, v1 stores
  ``z - 1``), ``X.scales [G, N]``, ``X.g_idx [K]``; ``W[n, k] = (q[k, n] - z[g, n]) * s[g, n]``,
  ``g = g_idx[k]``.
- ``fp8`` (DeepSeek / Qwen3-FP8: ``weight_block_size [128, 128]``, or per tensor): ``X.weight`` float8,
  ``X.weight_scale_inv [ceil(N/128), ceil(K/128)]`` (or ``X.weight_scale``);
  ``W = w * scale_inv[n//128, k//128]``.

Loading (``QuantizedTensors``): every group of a module's quantized tensors becomes one
``X.weight`` in float32 (dequantized exactly: integer values times float32 scales) before
the model's own ``load_weights`` fuses it, so every model family and the fused q/k/v and
gate/up layouts work unchanged, and ``ignore`` / ``modules_to_not_convert`` need no list:
a module the checkpoint left in float has a plain ``X.weight``. The model then holds
float weights in its dtype (on CPU this is the torch path: dequantize + matmul, with the
matmul in the model dtype). Where ``keep_quantized`` (on CUDA, or ``PAGODA_KEEP_QUANTIZED=1``)
the 4-bit, row-scaled FP8 and square-block FP8 weights are also kept as pieces
(``pagoda.models.int4``) and replace the float weights after loading, so their bytes stay
quantized (docs/quantization.md says what is measured and what is not).
``model.layers.N.self_attn.k_scale`` / ``v_scale`` (``kv_scales``) become the layers' fp8
KV-cache scales; ``input_scale`` (static FP8 activation scales) is read and not used: pagoda
runs FP8 weights with 16-bit or fp32 activations (or dynamic e4m3 ones in ``_scaled_mm``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch

from pagoda.models.int4 import Fp8BlockPieces, Fp8Pieces, Int4Pieces, pieces_from_group_index

AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # column j of 8 is nibble AWQ_REVERSE_ORDER[j]
# Suffixes of the tensors each format keeps per module (the float weight they replace: X.weight).
_GROUPS = {
    "packed": ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx"),
    "awq_gptq": ("qweight", "qzeros", "scales", "g_idx"),
    "scaled": ("weight", "weight_scale", "weight_scale_inv", "weight_zero_point", "input_scale"),
}
_UNUSED = ("k_scale", "v_scale", "input_scale", "output_scale")


@dataclass(frozen=True)
class CheckpointQuant:
    """What ``quantization_config`` says (``parse_quantization_config``)."""

    method: str  # compressed-tensors | awq | gptq | fp8
    bits: int = 4
    group_size: int = -1  # -1: one group per row (channel)
    symmetric: bool = True
    gptq_v2: bool = False
    block: Optional[tuple[int, int]] = None
    formats: tuple[str, ...] = field(default_factory=tuple)  # compressed-tensors formats in use


def _refuse(name: str, value: Any, supported: str) -> ValueError:
    return ValueError(f"quantization_config.{name}: {value!r} is not supported (supported: {supported})")


def parse_quantization_config(raw: dict[str, Any]) -> Optional[CheckpointQuant]:
    """The checkpoint's quantization, or ``None``; raises ``ValueError`` naming an unsupported field."""
    q = raw.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise ValueError("quantization_config: must be an object")
    method = q.get("quant_method")
    if method == "awq":
        return _parse_awq(q)
    if method == "gptq":
        return _parse_gptq(q)
    if method == "fp8":
        return _parse_fp8(q)
    if method == "compressed-tensors":
        return _parse_compressed_tensors(q)
    if method == "mxfp4":  # gpt-oss experts: pagoda.models.mxfp4 reads their blocks and scales at load
        return None
    raise _refuse("quant_method", method, "compressed-tensors, awq, gptq, fp8, mxfp4 (gpt-oss experts)")


def _parse_awq(q: dict) -> CheckpointQuant:
    version = str(q.get("version", "gemm")).lower()
    if version != "gemm":
        raise _refuse("version", q.get("version"), "gemm")
    if q.get("bits", q.get("w_bit", 4)) != 4:
        raise _refuse("bits", q.get("bits", q.get("w_bit")), "4")
    if not q.get("zero_point", True):
        raise _refuse("zero_point", q.get("zero_point"), "true")
    return CheckpointQuant("awq", 4, int(q.get("group_size", q.get("q_group_size", 128))), symmetric=False)


def _parse_gptq(q: dict) -> CheckpointQuant:
    fmt = q.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise _refuse("checkpoint_format", fmt, "gptq, gptq_v2")
    if q.get("bits") not in (4, 8):
        raise _refuse("bits", q.get("bits"), "4, 8")
    return CheckpointQuant("gptq", q["bits"], int(q.get("group_size", -1)), bool(q.get("sym", True)),
                           gptq_v2=fmt == "gptq_v2")


def _parse_fp8(q: dict) -> CheckpointQuant:
    if q.get("fmt", "e4m3") != "e4m3":
        raise _refuse("fmt", q.get("fmt"), "e4m3")
    block = q.get("weight_block_size")
    if block is not None and (not isinstance(block, list) or len(block) != 2):
        raise _refuse("weight_block_size", block, "[rows, cols]")
    return CheckpointQuant("fp8", 8, block=tuple(block) if block else None)


def _parse_compressed_tensors(q: dict) -> CheckpointQuant:
    groups = q.get("config_groups") or {}
    if not isinstance(groups, dict) or not groups:
        raise ValueError("quantization_config.config_groups: required (an object of quantization schemes)")
    formats = []
    bits, group_size, symmetric = 4, -1, True
    for name, scheme in groups.items():
        where = f"config_groups.{name}"
        fmt = scheme.get("format") or q.get("format")
        if fmt not in ("pack-quantized", "naive-quantized", "float-quantized"):
            raise _refuse(f"{where}.format", fmt, "pack-quantized, naive-quantized, float-quantized")
        weights = scheme.get("weights") or {}
        kind, num_bits, strategy = weights.get("type"), weights.get("num_bits"), weights.get("strategy")
        allowed = {"pack-quantized": ("int", (4, 8), ("group", "channel")),
                   "naive-quantized": ("int", (8,), ("group", "channel", "tensor")),
                   "float-quantized": ("float", (8,), ("tensor", "channel", "block"))}[fmt]
        if kind != allowed[0]:
            raise _refuse(f"{where}.weights.type", kind, allowed[0])
        if num_bits not in allowed[1]:
            raise _refuse(f"{where}.weights.num_bits", num_bits, ", ".join(map(str, allowed[1])))
        if strategy not in allowed[2]:
            raise _refuse(f"{where}.weights.strategy", strategy, ", ".join(allowed[2]))
        if strategy == "block" and weights.get("block_structure") not in ([128, 128], None):
            raise _refuse(f"{where}.weights.block_structure", weights.get("block_structure"), "[128, 128]")
        if weights.get("dynamic"):
            raise _refuse(f"{where}.weights.dynamic", True, "false (weights have stored scales)")
        formats.append(fmt)
        bits, symmetric = num_bits, bool(weights.get("symmetric", True))
        group_size = int(weights.get("group_size") or -1) if strategy == "group" else -1
    return CheckpointQuant("compressed-tensors", bits, group_size, symmetric, formats=tuple(sorted(set(formats))))


# ------------------------------------------------------------------ unpacking
def unpack_rows(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """int32 words packed along the last dim, element ``i`` at bit ``bits*i`` -> ``[..., count]`` int32 (unsigned)."""
    per_word = 32 // bits
    shifts = torch.arange(per_word, dtype=torch.int32, device=packed.device) * bits
    values = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return values.reshape(*packed.shape[:-1], packed.shape[-1] * per_word)[..., :count]


def _groups(group_index: Optional[torch.Tensor], num_in: int, group_size: int, num_groups: int) -> torch.Tensor:
    if group_index is not None:
        return group_index.long()
    if group_size <= 0:
        return torch.zeros(num_in, dtype=torch.long, device="cpu")
    return torch.arange(num_in) // group_size


def awq_ints(qweight: torch.Tensor, qzeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """AWQ GEMM tensors -> unsigned ``(q [K, N], z [G, N])`` (AutoAWQ's column order undone)."""
    k, n = qweight.shape[0], qweight.shape[1] * 8
    order = torch.tensor(AWQ_REVERSE_ORDER)
    q = unpack_rows(qweight, 4, n).reshape(k, n // 8, 8)[..., order].reshape(k, n)
    z = unpack_rows(qzeros, 4, n).reshape(-1, n // 8, 8)[..., order].reshape(-1, n)
    return q, z


def gptq_ints(qweight: torch.Tensor, qzeros: torch.Tensor, bits: int, v2: bool = False) -> tuple[torch.Tensor,
                                                                                                 torch.Tensor]:
    """GPTQ tensors (packed along K, zeros along N; v1 stores ``z - 1``) -> ``(q [K, N], z [G, N])``."""
    n, k = qweight.shape[1], qweight.shape[0] * (32 // bits)
    return unpack_rows(qweight.t(), bits, k).t(), unpack_rows(qzeros, bits, n) + (0 if v2 else 1)


def dequantize_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """AWQ GEMM tensors -> ``[N, K]`` float32."""
    q, z = awq_ints(qweight, qzeros)
    g = _groups(None, q.shape[0], group_size, scales.shape[0])
    return ((q - z[g]).float() * scales.float()[g]).t().contiguous()


def dequantize_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: Optional[torch.Tensor],
                    bits: int, group_size: int, v2: bool = False) -> torch.Tensor:
    """GPTQ tensors -> ``[N, K]`` float32 (``g_idx``: each k's group, act-order)."""
    q, z = gptq_ints(qweight, qzeros, bits, v2)
    g = _groups(g_idx, q.shape[0], group_size, scales.shape[0])
    return ((q - z[g]).float() * scales.float()[g]).t().contiguous()


def dequantize_packed(packed: torch.Tensor, scale: torch.Tensor, zero_point: Optional[torch.Tensor],
                      shape: torch.Tensor, g_idx: Optional[torch.Tensor], bits: int, group_size: int) -> torch.Tensor:
    """compressed-tensors ``pack-quantized`` -> ``[N, K]`` float32."""
    n, k = (int(v) for v in shape.tolist())
    offset = 1 << (bits - 1)
    q = unpack_rows(packed, bits, k) - offset  # signed
    g = _groups(g_idx, k, group_size, scale.shape[-1])
    zp = (unpack_rows(zero_point.t(), bits, n).t() - offset) if zero_point is not None else 0
    if isinstance(zp, torch.Tensor):
        zp = zp[:, g]
    return ((q - zp).float() * scale.float()[:, g]).contiguous()


def dequantize_scaled(weight: torch.Tensor, scale: torch.Tensor, zero_point: Optional[torch.Tensor] = None,
                      block: Optional[tuple[int, int]] = None) -> torch.Tensor:
    """int8 / fp8 ``weight`` times a per-tensor, per-channel, per-group or block scale -> float32."""
    w = weight.float()
    if zero_point is not None:
        w = w - _expand(zero_point, w.shape, block)
    return w * _expand(scale, w.shape, block)


def _expand(t: torch.Tensor, shape: torch.Size, block: Optional[tuple[int, int]]) -> torch.Tensor:
    """A scale (or zero point) broadcast to ``shape``: scalar, ``[N]``/``[N, 1]``, ``[N, G]`` or blocks."""
    t = t.float()
    if t.numel() == 1:
        return t.reshape(())
    if t.dim() == 1:
        t = t[:, None]
    if block is not None:
        return t.repeat_interleave(block[0], 0)[:shape[0]].repeat_interleave(block[1], 1)[:, :shape[1]]
    if t.shape[1] not in (1, shape[1]):
        t = t.repeat_interleave(shape[1] // t.shape[1], dim=1)
    return t


# ------------------------------------------------------------------ the checkpoint view
class QuantizedTensors:
    """The loader's view of a quantized checkpoint: each module's quantized tensors appear
    as one float ``X.weight`` (module docstring).

    Args:
        quant: the parsed config.
        names: every tensor name in the checkpoint.
        read: ``read(name) -> tensor``.
    """

    def __init__(self, quant: CheckpointQuant, names: set[str], read: Callable[[str], torch.Tensor],
                 keep_quantized: bool = False) -> None:
        self.quant = quant
        self.read = read
        self.keep_quantized = keep_quantized
        self.pieces: dict[str, Any] = {}  # modules kept quantized: Int4Pieces / Fp8Pieces (keep_quantized)
        self.modules: dict[str, str] = {}  # module prefix -> kind (packed | awq_gptq | scaled)
        for name in names:
            prefix, _, suffix = name.rpartition(".")
            if suffix in ("weight_packed",):
                self.modules[prefix] = "packed"
            elif suffix == "qweight":
                self.modules[prefix] = "awq_gptq"
            elif suffix in ("weight_scale", "weight_scale_inv") and f"{prefix}.weight" in names:
                self.modules[prefix] = "scaled"
        consumed = {f"{p}.{s}" for p, kind in self.modules.items() for s in _GROUPS[kind]}
        self.unused = {n for n in names if n.rpartition(".")[2] in _UNUSED} - consumed
        self.names = (names - consumed - self.unused) | {f"{p}.weight" for p in self.modules}
        if not self.modules:
            raise ValueError(f"quantization_config says {quant.method}, but no tensor of the checkpoint is quantized "
                             "(no weight_packed, qweight or weight_scale tensors)")

    def tensors(self, passthrough: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """``passthrough`` (the checkpoint's plain tensors) then every module's dequantized weight."""
        for name, tensor in passthrough:
            if name in self.names and name.rpartition(".")[0] not in self.modules:
                yield name, tensor
        for prefix in sorted(self.modules):
            yield f"{prefix}.weight", self.dequantize(prefix)

    def _maybe(self, name: str) -> Optional[torch.Tensor]:
        try:
            return self.read(name)
        except KeyError:
            return None

    def dequantize(self, prefix: str) -> torch.Tensor:
        q, kind = self.quant, self.modules[prefix]
        get, maybe = (lambda s: self.read(f"{prefix}.{s}")), (lambda s: self._maybe(f"{prefix}.{s}"))
        if self.keep_quantized and q.bits == 4 and kind in ("packed", "awq_gptq"):
            pieces = self._int4_pieces(kind, get, maybe)
            if pieces is not None:
                self.pieces[prefix] = pieces
        if kind == "packed":
            return dequantize_packed(get("weight_packed"), get("weight_scale"), maybe("weight_zero_point"),
                                     get("weight_shape"), maybe("weight_g_idx"), q.bits, q.group_size)
        if kind == "awq_gptq":
            if q.method == "awq":
                return dequantize_awq(get("qweight"), get("qzeros"), get("scales"), q.group_size)
            return dequantize_gptq(get("qweight"), get("qzeros"), get("scales"), maybe("g_idx"), q.bits,
                                   q.group_size, q.gptq_v2)
        weight, scale = get("weight"), maybe("weight_scale_inv")
        if scale is None:
            scale = get("weight_scale")
        # A 2-D scale with fewer rows than the weight is per block (128 x 128 unless the config says).
        block = None if scale.numel() == 1 or scale.dim() < 2 or scale.shape[0] == weight.shape[0] \
            else (q.block or (128, 128))
        if self.keep_quantized and weight.dtype == torch.float8_e4m3fn and block is not None \
                and block[0] == block[1] and maybe("weight_zero_point") is None:
            self.pieces[prefix] = Fp8BlockPieces(weight, scale.float(), block[0])
        if self.keep_quantized and weight.dtype == torch.float8_e4m3fn and block is None \
                and maybe("weight_zero_point") is None and (scale.numel() == 1 or scale.shape[-1] == 1
                                                            or scale.dim() == 1):
            self.pieces[prefix] = Fp8Pieces(weight, scale.float().reshape(-1).expand(weight.shape[0]).contiguous())
        return dequantize_scaled(weight, scale, maybe("weight_zero_point"), block)

    def _int4_pieces(self, kind: str, get: Callable, maybe: Callable) -> Optional[Int4Pieces]:
        """The module's canonical 4-bit pieces (``pagoda.models.int4``), or ``None`` when its
        act-order groups are not all of the group size (it then stays float)."""
        q = self.quant
        if kind == "packed":
            shape = get("weight_shape")
            n, k = (int(v) for v in shape.tolist())
            zp = maybe("weight_zero_point")
            zeros = None if zp is None else unpack_rows(zp.t(), 4, n).t().float()  # stored zp + 8 = the unsigned zero
            ints, scales, g_idx = unpack_rows(get("weight_packed"), 4, k), get("weight_scale"), maybe("weight_g_idx")
        else:
            awq = q.method == "awq"
            ints, zeros = awq_ints(get("qweight"), get("qzeros")) if awq else \
                gptq_ints(get("qweight"), get("qzeros"), 4, q.gptq_v2)  # [K, N], [G, N]
            k = ints.shape[0]
            ints, zeros = ints.t(), zeros.t().float()
            scales, g_idx = get("scales").t(), None if awq else maybe("g_idx")
        group = q.group_size if q.group_size > 0 else k
        if g_idx is not None and bool((torch.bincount(g_idx.long()) != group).any()):
            return None
        return pieces_from_group_index(ints, scales.float().contiguous(), zeros, group, g_idx)

    def kv_scales(self) -> dict[int, tuple[float, float]]:
        """``{layer: (k_scale, v_scale)}`` from ``model.layers.N.self_attn.k_scale`` / ``v_scale``
        (vLLM's names; a missing one is 1.0). Raises ``ValueError`` naming a non-finite or
        non-positive scale."""
        found: dict[int, list[float]] = {}
        for name in sorted(self.unused):
            parts = name.split(".")
            if parts[-1] not in ("k_scale", "v_scale") or "layers" not in parts:
                continue
            value = float(self.read(name).float().max())
            if not value > 0 or value == float("inf"):
                raise ValueError(f"{name}: a KV-cache scale must be a finite number > 0, got {value}")
            layer = int(parts[parts.index("layers") + 1])
            found.setdefault(layer, [1.0, 1.0])[parts[-1] == "v_scale"] = value
        return {layer: (k, v) for layer, (k, v) in found.items()}
