"""The gated delta rule (Gated DeltaNet's token mixer) in OpenAI Triton: chunked and recurrent.

Same contract and math as ``reference_gdn.gated_delta_rule`` (its docstring has the
recurrence and the chunked form): per value head ``h`` a float32 state ``S [Dk, Dv]`` per
sequence, read from ``ssm_states[state_indices[s]]`` when ``has_initial_state[s]`` (else
zeros: the slot is never read, so a NaN-poisoned slot cannot leak in), written back after
the sequence's last token. A negative slot (a padding row) computes and writes nothing.

Grid: one program per (sequence, value head, block of ``BV`` value columns); the program
keeps ``S[:, block]`` (``[BK, BV]`` float32) in registers for the whole sequence, so the
only state traffic is one read and one write per sequence. q and k are L2-normalised in the
kernel (float32), q scaled by ``Dk^-0.5``; key head ``h // (Hv / Hk)`` serves value head ``h``.

* ``_gdn_chunk_kernel`` walks the sequence in chunks of ``BT`` tokens (the chunk size, a
  power of two >= 16: ``tl.dot`` needs 16). Per chunk it builds ``A = tril_-1(beta K K^T * D)``,
  inverts ``I + A`` by forward substitution (row ``i`` of ``T`` is ``e_i - A[i, :] T``, rows
  above ``i`` done; ``BT`` steps of ``BT x BT`` work), then ``U``, ``W``, ``V' = U - W S``,
  the output and the state update as four ``tl.dot``s. Tokens past the end load as zeros
  with ``g = beta = 0``, which leaves the output rows they do not store and the state
  unchanged. Dots run in IEEE float32 (``input_precision=PRECISION``): TF32 would round the
  keys to 10 bits, and the state carries that error along the whole sequence.
* ``_gdn_recurrent_kernel`` takes one token at a time (``S <- exp(g) S``, the delta update,
  ``o = S^T q``): decode steps, where a chunk would be 1/``BT`` full.

A mixed step launches both over all sequences; each program returns at once for the
sequences that are not its kind (``ONLY`` ``1``: single-token sequences; ``2``: longer ones;
``0``: every sequence), so no index lists are built on the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda.kernels.metadata import AttentionMetadata

L2_EPS = 1e-6
DOT_PRECISION = "tf32x3"


@triton.jit
def _load_normed(ptr, rows, row_ok, stride_row, offset, cols, col_ok):
    """Rows of q or k ``[R, BK]`` in float32, L2-normalised over the head dimension."""
    x = tl.load(ptr + rows[:, None] * stride_row + offset + cols[None, :], mask=row_ok[:, None] & col_ok[None, :],
                other=0.0).to(tl.float32)
    return x * tl.rsqrt(tl.sum(x * x, 1) + 1e-6)[:, None]


@triton.jit
def _seq_setup(qsl_ptr, idx_ptr, init_ptr, stride_s_slot, stride_s_head, state_ptr, dim_k, only):
    """(first token, length, state block pointer base, whether to run, state rows to read)."""
    seq = tl.program_id(0)
    hv = tl.program_id(1)
    first = tl.load(qsl_ptr + seq).to(tl.int64)
    length = tl.load(qsl_ptr + seq + 1).to(tl.int64) - first
    slot = tl.load(idx_ptr + seq).to(tl.int64)
    run = slot >= 0
    run = run & ((only == 0) | ((only == 1) & (length == 1)) | ((only == 2) & (length > 1)))
    # Rows of the slot to read: all, or none when the sequence starts from zeros. (A scalar
    # flag and-ed into a block mask is promoted to int32 by the interpreter; a bound is not.)
    read_rows = tl.where(tl.load(init_ptr + seq) != 0, dim_k, 0)
    base = state_ptr + slot * stride_s_slot + hv * stride_s_head
    return first, length, base, run, read_rows


# The head grouping and the kind filter change between steps and models: one compiled variant
# for all their values (no specialisation on 1 or on divisibility by 16).
_RUNTIME_INTS = ["group", "only"]


@triton.jit(do_not_specialize=_RUNTIME_INTS)
def _gdn_chunk_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, state_ptr, qsl_ptr, idx_ptr, init_ptr,
    stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
    stride_g_tok, stride_b_tok, stride_o_tok, stride_o_head, stride_s_slot, stride_s_head, scale,
    group, dim_k, dim_v, only, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    first, length, s_base, run, read_rows = _seq_setup(qsl_ptr, idx_ptr, init_ptr, stride_s_slot, stride_s_head,
                                                       state_ptr, dim_k, only)
    if run:
        hv = tl.program_id(1)
        hk = hv // group
        ks = tl.arange(0, BK)
        vs = tl.program_id(2) * BV + tl.arange(0, BV)
        k_ok, v_ok = ks < dim_k, vs < dim_v
        s_ptrs = s_base + ks[:, None] * dim_v + vs[None, :]
        state = tl.load(s_ptrs, mask=(ks < read_rows)[:, None] & v_ok[None, :], other=0.0).to(tl.float32)
        rows = tl.arange(0, BT)
        causal = rows[:, None] >= rows[None, :]
        for start in range(0, length, BT):
            tok_ok = start + rows < length
            toks = first + start + rows
            q = _load_normed(q_ptr, toks, tok_ok, stride_q_tok, hk * stride_q_head, ks, k_ok) * scale
            k = _load_normed(k_ptr, toks, tok_ok, stride_k_tok, hk * stride_k_head, ks, k_ok)
            v = tl.load(v_ptr + toks[:, None] * stride_v_tok + hv * stride_v_head + vs[None, :],
                        mask=tok_ok[:, None] & v_ok[None, :], other=0.0).to(tl.float32)
            g = tl.load(g_ptr + toks * stride_g_tok + hv, mask=tok_ok, other=0.0).to(tl.float32)
            beta = tl.load(beta_ptr + toks * stride_b_tok + hv, mask=tok_ok, other=0.0).to(tl.float32)
            cum = tl.cumsum(g, 0)
            # Mask before exp: above the diagonal the difference is positive and could overflow.
            decay = tl.exp(tl.where(causal, cum[:, None] - cum[None, :], float("-inf")))
            kk = tl.dot(k, tl.trans(k), input_precision=PRECISION)
            strict = tl.where(rows[:, None] > rows[None, :], beta[:, None] * kk * decay, 0.0)
            inverse = tl.where(rows[:, None] == rows[None, :], 1.0, 0.0)
            for i in range(1, BT):
                a_i = tl.sum(tl.where(rows[:, None] == i, strict, 0.0), 0)  # row i of A, over columns
                update = tl.sum(a_i[:, None] * inverse, 0)  # A[i, :] T (rows >= i of A[i] are 0)
                inverse = tl.where(rows[:, None] == i, inverse - update[None, :], inverse)
            u = tl.dot(inverse, beta[:, None] * v, input_precision=PRECISION)
            w = tl.dot(inverse, (beta * tl.exp(cum))[:, None] * k, input_precision=PRECISION)
            v_new = u - tl.dot(w, state, input_precision=PRECISION)
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * decay
            out = tl.dot(q * tl.exp(cum)[:, None], state, input_precision=PRECISION)
            out += tl.dot(scores, v_new, input_precision=PRECISION)
            tl.store(o_ptr + toks[:, None] * stride_o_tok + hv * stride_o_head + vs[None, :],
                     out.to(o_ptr.dtype.element_ty), mask=tok_ok[:, None] & v_ok[None, :])
            last = tl.sum(tl.where(rows == BT - 1, cum, 0.0), 0)  # padded tokens add 0 to the gate
            k_decayed = k * tl.exp(last - cum)[:, None]
            state = state * tl.exp(last) + tl.dot(tl.trans(k_decayed), v_new, input_precision=PRECISION)
        tl.store(s_ptrs, state, mask=k_ok[:, None] & v_ok[None, :])


@triton.jit(do_not_specialize=_RUNTIME_INTS)
def _gdn_recurrent_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, state_ptr, qsl_ptr, idx_ptr, init_ptr,
    stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
    stride_g_tok, stride_b_tok, stride_o_tok, stride_o_head, stride_s_slot, stride_s_head, scale,
    group, dim_k, dim_v, only, BK: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    first, length, s_base, run, read_rows = _seq_setup(qsl_ptr, idx_ptr, init_ptr, stride_s_slot, stride_s_head,
                                                       state_ptr, dim_k, only)
    if run:
        hv = tl.program_id(1)
        hk = hv // group
        ks = tl.arange(0, BK)
        vs = tl.program_id(2) * BV + tl.arange(0, BV)
        k_ok, v_ok = ks < dim_k, vs < dim_v
        s_ptrs = s_base + ks[:, None] * dim_v + vs[None, :]
        state = tl.load(s_ptrs, mask=(ks < read_rows)[:, None] & v_ok[None, :], other=0.0).to(tl.float32)
        for tok in range(first, first + length):
            q = tl.load(q_ptr + tok * stride_q_tok + hk * stride_q_head + ks, mask=k_ok, other=0.0).to(tl.float32)
            k = tl.load(k_ptr + tok * stride_k_tok + hk * stride_k_head + ks, mask=k_ok, other=0.0).to(tl.float32)
            q = q * tl.rsqrt(tl.sum(q * q, 0) + 1e-6) * scale
            k = k * tl.rsqrt(tl.sum(k * k, 0) + 1e-6)
            v = tl.load(v_ptr + tok * stride_v_tok + hv * stride_v_head + vs, mask=v_ok, other=0.0).to(tl.float32)
            g = tl.load(g_ptr + tok * stride_g_tok + hv).to(tl.float32)
            beta = tl.load(beta_ptr + tok * stride_b_tok + hv).to(tl.float32)
            state = state * tl.exp(g)
            delta = (v - tl.sum(state * k[:, None], 0)) * beta
            state = state + k[:, None] * delta[None, :]
            out = tl.sum(state * q[:, None], 0)
            tl.store(o_ptr + tok * stride_o_tok + hv * stride_o_head + vs, out.to(o_ptr.dtype.element_ty), mask=v_ok)
        tl.store(s_ptrs, state, mask=k_ok[:, None] & v_ok[None, :])


def gated_delta_rule(
    q: torch.Tensor,  # [num_tokens, Hk, Dk]
    k: torch.Tensor,  # [num_tokens, Hk, Dk]
    v: torch.Tensor,  # [num_tokens, Hv, Dv]
    g: torch.Tensor,  # [num_tokens, Hv] float32
    beta: torch.Tensor,  # [num_tokens, Hv]
    ssm_states: torch.Tensor,  # [num_slots, Hv, Dk, Dv] float32, updated in place
    meta: AttentionMetadata,
    chunk_size: int = 64,
) -> torch.Tensor:  # [num_tokens, Hv, Dv] in v's dtype
    """The gated delta rule for one step (module docstring); the reference's contract.

    Raises:
        ValueError: a chunk size that is not a power of two >= 16, a state of another shape or
            dtype than float32, or no state slots in ``meta``.
    """
    num_tokens, num_k_heads, dim_k = k.shape
    num_v_heads, dim_v = v.shape[1:]
    if chunk_size < 16 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two >= 16, got {chunk_size}")
    if ssm_states.dtype != torch.float32 or tuple(ssm_states.shape[1:]) != (num_v_heads, dim_k, dim_v):
        raise ValueError(f"ssm_states {tuple(ssm_states.shape)} {ssm_states.dtype}: expected "
                         f"[slots, {num_v_heads}, {dim_k}, {dim_v}] float32")
    if meta.state_indices is None:
        raise ValueError("linear-attention layers need AttentionMetadata.state_indices (one slot per sequence)")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1 or ssm_states.stride(-1) != 1:
        q, k, v, ssm_states = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v, ssm_states))
    assert ssm_states.stride(2) == dim_v, "each head's state must be a contiguous [Dk, Dv] matrix"
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if num_tokens == 0 or meta.num_seqs == 0:
        return out
    block_k = max(16, triton.next_power_of_2(dim_k))
    block_v = min(32, max(16, triton.next_power_of_2(dim_v)))
    grid = (meta.num_seqs, num_v_heads, triton.cdiv(dim_v, block_v))
    args = (q, k, v, g, beta, out, ssm_states, meta.query_start_loc, meta.state_indices, meta.has_initial_state,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0),
            beta.stride(0), out.stride(0), out.stride(1), ssm_states.stride(0), ssm_states.stride(1), dim_k**-0.5)
    args += (num_v_heads // num_k_heads, dim_k, dim_v)
    num_single = meta.decode_count()
    if num_single:
        _gdn_recurrent_kernel[grid](*args, 1 if num_single < meta.num_seqs else 0, BK=block_k, BV=block_v, num_warps=4)
    if num_single < meta.num_seqs:
        _gdn_chunk_kernel[grid](*args, 2 if num_single else 0, BK=block_k, BV=block_v, BT=chunk_size,
                                PRECISION=DOT_PRECISION, num_warps=4)
    return out
