"""Torch kernels of the Gated DeltaNet layer (linear attention): the CPU path and the references.

A step is a flat batch of tokens from many sequences (``AttentionMetadata``); each sequence
``s`` has a state slot ``state_indices[s]`` in a ``StateCache`` and reads it only when
``has_initial_state[s]`` (else it starts from zeros). Three operations:

* ``causal_conv1d``: a depthwise causal convolution of width ``K`` over each sequence's
  channels, continuing the ``K - 1`` inputs kept in its conv state, then SiLU; the state
  becomes the last ``K - 1`` inputs. ``out[t, c] = silu(bias[c] + sum_j w[c, j] x[t - K + 1 + j, c])``.
* ``gated_delta_rule``: per value head ``h`` (reading key head ``h // (Hv / Hk)``), with
  ``q`` and ``k`` L2-normalised (``x / sqrt(|x|^2 + 1e-6)``) and ``q`` scaled by ``Dk^-0.5``
  (transformers' ``use_qk_l2norm_in_kernel``), the state ``S [Dk, Dv]`` runs

      S <- exp(g_t) S;   S <- S + beta_t k_t (v_t - S^T k_t)^T;   o_t = S^T q_t

  in float32. Single-token sequences (decode) take that step in place on their slot; longer ones the
  chunked form (Yang et al., "Gated Delta Networks", 2024): inside a chunk of ``C`` tokens
  with cumulative gates ``G`` and ``D_ij = exp(G_i - G_j)`` (i >= j), the ``C`` updates fold
  into ``T = (I + tril_-1(diag(beta) K K^T * D))^-1``, ``U = T diag(beta) V``,
  ``W = T diag(beta exp(G)) K``; then ``V' = U - W S``, ``O = diag(exp(G)) Q S + tril(Q K^T * D) V'``
  and ``S <- exp(G_C) S + (K * exp(G_C - G))^T V'``. Padding a partial chunk with zeros
  (``beta = g = 0``) leaves both unchanged, so any length works with any chunk size.
* ``gated_rms_norm``: ``rmsnorm(x) * weight * silu(gate)``, rounded as transformers'
  ``Qwen3NextRMSNormGated`` rounds (normalised value in the input dtype, times the weight,
  times ``silu(gate)`` in float32, one final rounding).

The CPU plan (index tensors of the decode rows, spans of the longer sequences) is made once
per step from the metadata's host lists and shared by every layer (``meta.cpu_plans``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagoda.kernels.metadata import AttentionMetadata

L2_EPS = 1e-6  # transformers' and fla's l2norm epsilon


@dataclass
class StatePlan:
    """The step's sequences, split by kind, from host values only."""

    decode_rows: torch.Tensor  # [n] int64: the token row of each single-token sequence
    decode_slots: torch.Tensor  # [n] int64: its slot
    decode_init: torch.Tensor  # [n] bool: whether its slot is read
    decodes: list[tuple[int, int, bool]]  # the same as (row, slot, read slot)
    spans: list[tuple[int, int, int, bool]]  # (first row, end row, slot, read slot) of longer sequences


def state_plan(meta: AttentionMetadata, device: torch.device) -> StatePlan:
    """The step's ``StatePlan`` (made by the first layer that asks, reused by the others).

    Raises:
        ValueError: the metadata has no state slots, or two sequences share one.
    """
    plan = meta.cpu_plans.get("state")
    if plan is not None:
        return plan
    if meta.state_indices_host is None:
        raise ValueError("linear-attention layers need AttentionMetadata.state_indices (one slot per sequence)")
    slots = [s for s in meta.state_indices_host if s >= 0]
    if len(set(slots)) != len(slots):
        raise ValueError(f"state_indices: two sequences share a slot ({meta.state_indices_host})")
    rows, dslots, dinit, spans, start = [], [], [], [], 0
    for q_len, slot, init in zip(meta.query_lens_host, meta.state_indices_host, meta.has_initial_state_host):
        if slot >= 0 and q_len == 1:
            rows.append(start), dslots.append(slot), dinit.append(init)
        elif slot >= 0:
            spans.append((start, start + q_len, slot, init))
        start += q_len

    def tensor(values, dtype):
        return torch.tensor(values, dtype=dtype).to(device)

    plan = StatePlan(tensor(rows, torch.int64), tensor(dslots, torch.int64), tensor(dinit, torch.bool),
                     list(zip(rows, dslots, dinit)), spans)
    meta.cpu_plans["state"] = plan
    return plan


def causal_conv1d(
    x: torch.Tensor,  # [num_tokens, conv_dim] (rows may be strided)
    weight: torch.Tensor,  # [conv_dim, K]
    bias: torch.Tensor | None,  # [conv_dim]
    conv_states: torch.Tensor,  # [num_slots, conv_dim, K - 1], updated in place
    meta: AttentionMetadata,
) -> torch.Tensor:  # [num_tokens, conv_dim] in x's dtype: silu(conv(x))
    """Causal depthwise conv + SiLU per sequence, continuing and then updating its conv state.
    Math in float32 (the products and sums), one rounding to ``x.dtype``."""
    plan = state_plan(meta, x.device)
    out = torch.zeros(x.shape, dtype=x.dtype, device=x.device)
    w = weight.float()
    b = bias.float() if bias is not None else None
    width = weight.shape[1] - 1
    if plan.decode_rows.numel():
        # index_select / index_copy_ rather than advanced indexing: ~1.5x faster on these
        # last-dimension-3 rows (measured on this CPU).
        window = torch.cat([conv_states.index_select(0, plan.decode_slots).float(),
                            x.index_select(0, plan.decode_rows).float().unsqueeze(-1)], dim=-1)  # [n, C, K]
        if not all(init for _, _, init in plan.decodes):
            window[~plan.decode_init, :, :-1] = 0.0  # a slot not read is overwritten (it may hold NaN)
        y = torch.einsum("nck,ck->nc", window, w) + (b if b is not None else 0.0)
        out[plan.decode_rows] = F.silu(y).to(x.dtype)
        conv_states.index_copy_(0, plan.decode_slots, window[..., 1:].to(conv_states.dtype))
    for first, end, slot, init in plan.spans:
        old = conv_states[slot].float().T if init else x.new_zeros(width, x.shape[1], dtype=torch.float32)
        stream = torch.cat([old, x[first:end].float()])  # [K - 1 + L, C], token-major as x
        # K multiply-adds of whole [L, C] slices: 2.5x faster than F.conv1d's depthwise path
        # on this CPU (measured), and no transposes of the activations.
        length = end - first
        y = stream[:length] * w[:, 0]
        for j in range(1, width + 1):
            y.addcmul_(stream[j:j + length], w[:, j])
        if b is not None:
            y += b
        out[first:end] = F.silu(y).to(x.dtype)
        conv_states[slot] = stream[length:].T.to(conv_states.dtype)
    return out


def l2_normalised(x: torch.Tensor) -> torch.Tensor:
    """``x / sqrt(|x|^2 + 1e-6)`` along the last dimension, in float32."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def gated_delta_rule(
    q: torch.Tensor,  # [num_tokens, Hk, Dk]
    k: torch.Tensor,  # [num_tokens, Hk, Dk]
    v: torch.Tensor,  # [num_tokens, Hv, Dv]
    g: torch.Tensor,  # [num_tokens, Hv] float32 log-decay (<= 0)
    beta: torch.Tensor,  # [num_tokens, Hv] in (0, 1)
    ssm_states: torch.Tensor,  # [num_slots, Hv, Dk, Dv] float32, updated in place
    meta: AttentionMetadata,
    chunk_size: int = 64,
) -> torch.Tensor:  # [num_tokens, Hv, Dv] in v's dtype
    """The gated delta rule per sequence (module docstring); states read from and written to slots."""
    plan = state_plan(meta, v.device)
    group = v.shape[1] // k.shape[1]
    qn = l2_normalised(q).repeat_interleave(group, dim=1) * q.shape[-1] ** -0.5  # [T, Hv, Dk]
    kn = l2_normalised(k).repeat_interleave(group, dim=1)
    vf, gf, bf = v.float(), g.float(), beta.float()
    if ssm_states.dtype != torch.float32:
        raise ValueError(f"ssm_states must be float32 (the recurrent state's precision), got {ssm_states.dtype}")
    out = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    for row, slot, init in plan.decodes:
        out[row] = recurrent_step(ssm_states[slot], init, qn[row], kn[row], vf[row], gf[row], bf[row])
    for first, end, slot, init in plan.spans:
        span = slice(first, end)
        state = ssm_states[slot].float() if init else vf.new_zeros(v.shape[1], k.shape[2], v.shape[2])
        out[span], state = chunked_sequence(qn[span], kn[span], vf[span], gf[span], bf[span], state, chunk_size)
        ssm_states[slot] = state.to(ssm_states.dtype)
    return out.to(v.dtype)


def recurrent_step(state: torch.Tensor, has_initial_state: bool, q, k, v, g, beta) -> torch.Tensor:
    """One token on one sequence's slot ``state [H, Dk, Dv]`` (float32), updated in place:
    ``S <- exp(g) S + k (beta (v - exp(g) S^T k))^T``, returns ``o = S^T q`` ``[H, Dv]``.
    In place and with ``S^T k`` taken before the decay, the state is read four times and
    written twice (a gather, the decay, the outer product and a scatter would touch it ~14
    times: decode is bound by that traffic)."""
    if not has_initial_state:
        state.zero_()
    decay = g.exp()  # [H]
    predicted = torch.bmm(k.unsqueeze(1), state).squeeze(1) * decay[:, None]  # [H, Dv]
    delta = (v - predicted) * beta[:, None]
    state.mul_(decay[:, None, None]).baddbmm_(k.unsqueeze(2), delta.unsqueeze(1))
    return torch.bmm(q.unsqueeze(1), state).squeeze(1)


def chunked_sequence(q, k, v, g, beta, state, chunk_size: int):
    """One sequence's chunked gated delta rule.

    Args:
        q, k: ``[L, H, Dk]`` normalised (q scaled); v: ``[L, H, Dv]``; g, beta: ``[L, H]``;
            state: ``[H, Dk, Dv]`` (all float32 or all float64).
    Returns:
        ``(o [L, H, Dv], final state [H, Dk, Dv])``.
    """
    length = q.shape[0]
    pad = -length % chunk_size
    q, k, v = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (q, k, v))
    g, beta = (F.pad(t, (0, 0, 0, pad)) for t in (g, beta))
    num_chunks = (length + pad) // chunk_size

    def chunks(t):  # [L, H, ...] -> [H, N, C, ...]
        return t.reshape(num_chunks, chunk_size, *t.shape[1:]).movedim(2, 0)

    q, k, v, g, beta = map(chunks, (q, k, v, g, beta))
    cum = g.cumsum(-1)  # [H, N, C]
    lower = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    # Mask before exp: above the diagonal the difference is positive and could overflow.
    decay = torch.where(lower, cum.unsqueeze(-1) - cum.unsqueeze(-2), float("-inf")).exp()  # [H, N, C, C]
    strict = (beta.unsqueeze(-1) * (k @ k.transpose(-1, -2)) * decay).tril(-1)
    eye = torch.eye(chunk_size, dtype=q.dtype, device=q.device)
    u = torch.linalg.solve_triangular(eye + strict, beta.unsqueeze(-1) * v, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(eye + strict, (beta * cum.exp()).unsqueeze(-1) * k, upper=False,
                                      unitriangular=True)
    scores = (q @ k.transpose(-1, -2)) * decay  # [H, N, C, C], zero above the diagonal
    q_decayed = q * cum.exp().unsqueeze(-1)
    last = cum[..., -1:]  # [H, N, 1]: a padded tail adds 0 to the cumulative gate
    k_decayed = k * (last - cum).exp().unsqueeze(-1)
    out = torch.empty_like(v)
    for n in range(num_chunks):
        v_new = u[:, n] - w[:, n] @ state  # [H, C, Dv]
        out[:, n] = q_decayed[:, n] @ state + scores[:, n] @ v_new
        state = state * last[:, n].exp().unsqueeze(-1) + k_decayed[:, n].transpose(-1, -2) @ v_new
    heads, dim_v = out.shape[0], out.shape[-1]
    return out.movedim(0, 2).reshape(num_chunks * chunk_size, heads, dim_v)[:length], state


def gated_rms_norm(
    x: torch.Tensor,  # [rows, dim]
    gate: torch.Tensor,  # [rows, dim]
    weight: torch.Tensor,  # [dim]
    eps: float,
) -> torch.Tensor:  # [rows, dim] in x's dtype
    """``rmsnorm(x) * weight * silu(gate)`` with transformers' roundings (module docstring)."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf = x.to(acc)
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return ((weight * normed).to(acc) * F.silu(gate.to(acc))).to(x.dtype)
