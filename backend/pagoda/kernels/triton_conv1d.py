"""Causal depthwise conv1d + SiLU over a flat step, with per-sequence conv states, in OpenAI Triton.

Same contract as ``reference_gdn.causal_conv1d``: for sequence ``s`` (rows
``query_start_loc[s]:query_start_loc[s+1]`` of ``x``), the input stream is its conv state
(``conv_states[state_indices[s]]``, the ``K - 1`` inputs before this step; zeros when
``has_initial_state[s]`` is false: the slot is not read) followed by its rows, and
``out[t, c] = silu(bias[c] + sum_j w[c, j] stream[t + j, c])``; afterwards the slot holds the
last ``K - 1`` inputs of the stream. A negative slot (padding row) reads and writes nothing.
Products and sums in float32, one rounding to the output dtype.

* ``_conv1d_kernel``: one program per (sequence, block of channels); it walks the
  sequence's tokens in blocks of ``BLOCK_T``, each output row loading its ``K`` taps either
  from ``x`` (position >= 0) or from the old state (position < 0, two masked loads), then
  writes the new state. Programs own disjoint (slot, channel) ranges, so no two programs
  touch one state element; inside a program a barrier separates the last read of the old
  state from the write of the new one (warps run apart).
* ``_conv1d_update_kernel``: the single-token update form, for steps in which every
  sequence brings one token (decode): one program per (sequence, block of channels) reads
  the ``K - 1`` stored inputs, the new one, writes one output and the shifted state.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda.kernels.metadata import AttentionMetadata


@triton.jit
def _conv1d_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, state_ptr, qsl_ptr, idx_ptr, init_ptr,
    num_channels, stride_x, stride_o, stride_s_slot, stride_s_chan,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_T: tl.constexpr, WIDTH_PAD: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    chans = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = chans < num_channels
    first = tl.load(qsl_ptr + seq).to(tl.int64)
    length = tl.load(qsl_ptr + seq + 1).to(tl.int64) - first
    slot = tl.load(idx_ptr + seq).to(tl.int64)
    # How far back the old state is read: K - 1 inputs, or none when the sequence starts from
    # zeros. (A scalar flag and-ed into a block mask is promoted to int32 by the interpreter.)
    stored = tl.where(tl.load(init_ptr + seq) != 0, K - 1, 0)
    if slot >= 0:
        s_base = state_ptr + slot * stride_s_slot + chans[None, :] * stride_s_chan
        bias = tl.zeros([BLOCK_C], dtype=tl.float32)
        if HAS_BIAS:
            bias = tl.load(bias_ptr + chans, mask=c_ok, other=0.0).to(tl.float32)
        rows = tl.arange(0, BLOCK_T)
        for start in range(0, length, BLOCK_T):
            pos = start + rows
            row_ok = pos < length
            acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32) + bias[None, :]
            for j in tl.static_range(K):
                src = pos - (K - 1) + j  # the input tap j reads, relative to the sequence's first row
                ok = row_ok[:, None] & c_ok[None, :]
                xv = tl.load(x_ptr + (first + src)[:, None] * stride_x + chans[None, :], mask=ok & (src >= 0)[:, None],
                             other=0.0).to(tl.float32)
                sv = tl.load(s_base + (K - 1 + src)[:, None], mask=ok & ((src < 0) & (src >= -stored))[:, None],
                             other=0.0).to(tl.float32)
                wj = tl.load(w_ptr + chans * K + j, mask=c_ok, other=0.0).to(tl.float32)
                acc += (xv + sv) * wj[None, :]
            acc = acc / (1.0 + tl.exp(-acc))  # silu
            tl.store(out_ptr + (first + pos)[:, None] * stride_o + chans[None, :], acc.to(out_ptr.dtype.element_ty),
                     mask=row_ok[:, None] & c_ok[None, :])
        # The new state: the stream's last K - 1 inputs, from x or (a short sequence) the old state.
        idx = tl.arange(0, WIDTH_PAD)
        src = length - (K - 1) + idx
        ok = (idx < K - 1)[:, None] & c_ok[None, :]
        xv = tl.load(x_ptr + (first + src)[:, None] * stride_x + chans[None, :], mask=ok & (src >= 0)[:, None],
                     other=0.0)
        sv = tl.load(s_base + (K - 1 + src)[:, None], mask=ok & ((src < 0) & (src >= -stored))[:, None], other=0.0)
        new = tl.where((src >= 0)[:, None], xv.to(state_ptr.dtype.element_ty), sv)
        tl.debug_barrier()  # every warp's reads of the old state come before any write
        tl.store(s_base + idx[:, None], new, mask=ok)


@triton.jit
def _conv1d_update_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, state_ptr, qsl_ptr, idx_ptr, init_ptr,
    num_channels, stride_x, stride_o, stride_s_slot, stride_s_chan,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_C: tl.constexpr, WIDTH_PAD: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    chans = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = chans < num_channels
    row = tl.load(qsl_ptr + seq).to(tl.int64)
    slot = tl.load(idx_ptr + seq).to(tl.int64)
    stored = tl.where(tl.load(init_ptr + seq) != 0, K - 1, 0)  # entries of the old state to read
    if slot >= 0:
        s_base = state_ptr + slot * stride_s_slot + chans[:, None] * stride_s_chan
        idx = tl.arange(0, WIDTH_PAD)
        i_ok = c_ok[:, None] & (idx < K - 1)[None, :]
        old = tl.load(s_base + idx[None, :], mask=c_ok[:, None] & (idx < stored)[None, :], other=0.0)
        x = tl.load(x_ptr + row * stride_x + chans, mask=c_ok, other=0.0)
        w_old = tl.load(w_ptr + chans[:, None] * K + idx[None, :], mask=i_ok, other=0.0).to(tl.float32)
        w_new = tl.load(w_ptr + chans * K + (K - 1), mask=c_ok, other=0.0).to(tl.float32)
        acc = tl.sum(old.to(tl.float32) * w_old, 1) + x.to(tl.float32) * w_new
        if HAS_BIAS:
            acc += tl.load(bias_ptr + chans, mask=c_ok, other=0.0).to(tl.float32)
        acc = acc / (1.0 + tl.exp(-acc))
        tl.store(out_ptr + row * stride_o + chans, acc.to(out_ptr.dtype.element_ty), mask=c_ok)
        # Shift left by one: entry i takes entry i + 1, the last takes the new input.
        shifted = tl.load(s_base + idx[None, :] + 1, mask=c_ok[:, None] & (idx < stored - 1)[None, :], other=0.0)
        new = tl.where((idx == K - 2)[None, :], x[:, None].to(state_ptr.dtype.element_ty), shifted)
        tl.debug_barrier()  # every warp's reads of the old state come before any write
        tl.store(s_base + idx[None, :], new, mask=i_ok)


def causal_conv1d(
    x: torch.Tensor,  # [num_tokens, conv_dim] (rows may be strided)
    weight: torch.Tensor,  # [conv_dim, K]
    bias: torch.Tensor | None,  # [conv_dim]
    conv_states: torch.Tensor,  # [num_slots, conv_dim, K - 1], updated in place
    meta: AttentionMetadata,
) -> torch.Tensor:  # [num_tokens, conv_dim]
    """Causal depthwise conv + SiLU for one step (module docstring).

    Raises:
        ValueError: a state of another shape than ``[slots, conv_dim, K - 1]`` (K >= 2), or no
            state slots in ``meta``.
    """
    num_tokens, num_channels = x.shape
    width = weight.shape[1] - 1
    if width < 1 or tuple(conv_states.shape[1:]) != (num_channels, width) or weight.shape[0] != num_channels:
        raise ValueError(f"conv_states {tuple(conv_states.shape)} / weight {tuple(weight.shape)} do not fit "
                         f"{num_channels} channels with a kernel of at least 2")
    if meta.state_indices is None:
        raise ValueError("linear-attention layers need AttentionMetadata.state_indices (one slot per sequence)")
    x, weight, conv_states = (t if t.stride(-1) == 1 else t.contiguous() for t in (x, weight, conv_states))
    assert conv_states.stride(2) == 1, "a channel's conv state must be contiguous"
    weight = weight.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if num_tokens == 0 or meta.num_seqs == 0:
        return out
    args = (x, weight, bias if bias is not None else weight, out, conv_states, meta.query_start_loc,
            meta.state_indices, meta.has_initial_state, num_channels, x.stride(0), out.stride(0),
            conv_states.stride(0), conv_states.stride(1))
    common = dict(K=width + 1, HAS_BIAS=bias is not None, WIDTH_PAD=max(2, triton.next_power_of_2(width)))
    if meta.decode_count() == meta.num_seqs:
        block_c = min(256, triton.next_power_of_2(num_channels))
        grid = (meta.num_seqs, triton.cdiv(num_channels, block_c))
        _conv1d_update_kernel[grid](*args, **common, BLOCK_C=block_c, num_warps=4)
    else:
        # A [BLOCK_T, BLOCK_C] tile of 1024 float32 accumulators: 8 per thread at 4 warps.
        block_c = min(64, triton.next_power_of_2(num_channels))
        block_t = min(16, max(2, triton.next_power_of_2(meta.max_query_len)))
        grid = (meta.num_seqs, triton.cdiv(num_channels, block_c))
        _conv1d_kernel[grid](*args, **common, BLOCK_C=block_c, BLOCK_T=block_t, num_warps=4)
    return out
