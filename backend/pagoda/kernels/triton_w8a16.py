"""W8A16 GEMM in OpenAI Triton: 8-bit weights (int8 or fp8 e4m3) dequantized in the kernel.

``out[m, n] = scale[n] * sum_k x[m, k] * Q[n, k]``; ``Q`` is ``[N, K]`` row-major (the
layout of the model's weights), ``scale`` float32 ``[N]``, ``x`` fp16/bf16/fp32.

Main kernel: program ``(tile, ks)`` owns a ``BLOCK_M x BLOCK_N`` output tile and the K
blocks ``ks, ks + split_k, ...``. Per K block it loads the activation tile and the
``BLOCK_K x BLOCK_N`` weight tile (one byte per weight, read once per tile row), converts
the weight to the activation dtype in registers — exact: every int8 value and every e4m3
value is representable in fp16, bf16 and fp32 — and accumulates ``tl.dot`` in fp32
(``ieee`` precision for fp32 activations, so no TF32 rounding). The per-channel scale is
applied once to the fp32 sum. Block scales (``block``: DeepSeek-V3's FP8 checkpoints, 128 x 128
``weight_scale_inv``): ``BLOCK_K`` divides the block, so each K tile lies in one block column and
its partial product is scaled per output column before it is added (the scales are read per
tile, ``[BLOCK_N]`` of them, not per weight). Without a split the scaled tile is stored in the output
dtype; otherwise each split stores its fp32 partial to a ``[split_k, M, N]`` workspace and
``_w8a16_reduce_kernel`` adds the partials in split order (deterministic, no atomics),
scales and casts. The split count is a run-time argument (one compiled variant per
tile shape and dtype, whatever the split). Tiles and split come from ``w8a16.choose_config`` (decode: 16-row tiles,
split-K across the SMs; see that module). Every load and store is masked, so odd ``M``,
``N`` and ``K`` need no padding.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from pagoda.kernels.w8a16 import W8A16Config, choose_config


@triton.jit
def _w8a16_kernel(
    x_ptr,  # [M, K] activations
    w_ptr,  # [N, K] int8 or float8e4nv
    scale_ptr,  # [N] float32; SCALE_BLOCK: [cdiv(N, SCALE_BLOCK), cdiv(K, SCALE_BLOCK)] float32
    out_ptr,  # [M, N] output dtype, or [split_k, M, N] float32 workspace (IS_SPLIT)
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    stride_os,
    stride_sn,  # the block scales' row stride (SCALE_BLOCK only)
    split_k,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IS_SPLIT: tl.constexpr,
    IEEE: tl.constexpr,
    W_FP8: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
    SCALE_BLOCK: tl.constexpr = 0,  # 0: a scale per output channel; else square blocks of this size
):
    tile = tl.program_id(0)
    ks = tl.program_id(1)
    num_n = tl.cdiv(N, BLOCK_N)
    rm = (tile // num_n) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = (tile % num_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
    w_cols = w_ptr + rn.to(tl.int64)[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(ks * BLOCK_K, K, split_k * BLOCK_K):
        kk = k0 + rk
        k_ok = kk < K
        a = tl.load(x_rows + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b_ok = k_ok[:, None] & n_ok[None, :]
        if W_FP8:
            # No ``other`` for fp8 (no integer zero to fill with): masked lanes are zeroed
            # after the conversion, since an unread e4m3 byte may be NaN and 0 * NaN = NaN.
            b = tl.where(b_ok, tl.load(w_cols + kk[:, None], mask=b_ok).to(tl.float32), 0.0)
        else:
            b = tl.load(w_cols + kk[:, None], mask=b_ok, other=0)
        if SCALE_BLOCK > 0:  # BLOCK_K divides SCALE_BLOCK: one k-block per tile, its scale per column
            s = tl.load(scale_ptr + (rn // SCALE_BLOCK).to(tl.int64) * stride_sn + k0 // SCALE_BLOCK, mask=n_ok,
                        other=0.0)
            if DOT_UPCAST:
                acc += tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee") * s[None, :]
            elif IEEE:
                acc += tl.dot(a, b.to(a.dtype), input_precision="ieee") * s[None, :]
            else:
                acc += tl.dot(a, b.to(a.dtype)) * s[None, :]
        elif DOT_UPCAST:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        elif IEEE:
            acc = tl.dot(a, b.to(a.dtype), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b.to(a.dtype), acc)
    mask = m_ok[:, None] & n_ok[None, :]
    offsets = rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
    if not IS_SPLIT:
        out = acc
        if SCALE_BLOCK == 0:
            out = acc * tl.load(scale_ptr + rn, mask=n_ok, other=0.0)[None, :]
        tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptr + ks.to(tl.int64) * stride_os + offsets, acc, mask=mask)


@triton.jit
def _w8a16_reduce_kernel(
    ws_ptr,  # [split_k, M, N] float32
    scale_ptr,  # [N] float32
    out_ptr,  # [M, N]
    N,
    stride_ws,
    stride_wm,
    stride_om,
    split_k,
    BLOCK_N: tl.constexpr,
    SCALED: tl.constexpr = True,  # False: the partials are scaled already (block scales)
):
    row = tl.program_id(0).to(tl.int64)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for s in range(split_k):
        acc += tl.load(ws_ptr + s * stride_ws + row * stride_wm + rn, mask=n_ok, other=0.0)
    if SCALED:
        acc = acc * tl.load(scale_ptr + rn, mask=n_ok, other=0.0)
    tl.store(out_ptr + row * stride_om + rn, acc.to(out_ptr.dtype.element_ty), mask=n_ok)


# The interpreter computes bf16 tl.dot wrongly (as triton_attention notes); under it, and
# only there, bf16 operands are upcast to fp32. Compiled GPU code never takes that branch.
_INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"
_REDUCE_BLOCK_N = 256
_SMS: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # interpreter / compile tests: shape the launch as for an H100
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SMS:
        _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SMS[index]


def w8a16_linear(
    x: torch.Tensor,  # [..., K] fp16 / bf16 / fp32
    qweight: torch.Tensor,  # [N, K] int8 or float8_e4m3fn
    scale: torch.Tensor,  # [N] float32, or [cdiv(N, block), cdiv(K, block)] with ``block``
    config: W8A16Config | None = None,
    block: int = 0,
) -> torch.Tensor:  # [..., N], x.dtype
    """``x @ (Q * scale[:, None]).T`` without materialising the float weight; ``block > 0``:
    square block scales (DeepSeek's 128x128 ``weight_scale_inv``), ``W[n, k] = Q[n, k] *
    scale[n // block, k // block]``."""
    n, k = qweight.shape
    want = (n,) if not block else (-(-n // block), -(-k // block))
    if x.shape[-1] != k or tuple(scale.shape) != want or qweight.stride(1) != 1 or scale.stride(-1) != 1:
        raise ValueError(f"w8a16_linear: x {tuple(x.shape)}, weight {tuple(qweight.shape)} (strides "
                         f"{qweight.stride()}, K must be contiguous), scale {tuple(scale.shape)} (block {block})")
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out.view(*x.shape[:-1], n)
    cfg = config or choose_config(m, n, k, _num_sms(x.device), x.element_size(), max_block_k=block or None)
    assert not block or block % cfg.block_k == 0, f"BLOCK_K {cfg.block_k} must divide the scale block {block}"
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n), cfg.split_k)
    target = out if cfg.split_k == 1 else torch.empty((cfg.split_k, m, n), dtype=torch.float32, device=x.device)
    _w8a16_kernel[grid](
        x2, qweight, scale, target, m, n, k,
        x2.stride(0), qweight.stride(0), target.stride(-2), target.stride(0) if cfg.split_k > 1 else 0,
        scale.stride(0) if block else 0, cfg.split_k,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, IS_SPLIT=cfg.split_k > 1,
        IEEE=x.dtype == torch.float32, W_FP8=qweight.dtype != torch.int8,
        DOT_UPCAST=_INTERPRETING and x.dtype == torch.bfloat16, SCALE_BLOCK=block, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )  # fmt: skip
    if cfg.split_k > 1:
        _w8a16_reduce_kernel[(m, triton.cdiv(n, _REDUCE_BLOCK_N))](
            target, scale, out, n, target.stride(0), target.stride(1), out.stride(0), cfg.split_k,
            BLOCK_N=_REDUCE_BLOCK_N, SCALED=not block, num_warps=4,
        )  # fmt: skip
    return out.view(*x.shape[:-1], n)
