"""Verification of drafted tokens against the target's distributions.

Modified rejection sampling (Leviathan et al. 2023; Chen et al. 2023), for one request
with drafted tokens ``x_1..x_k`` drawn from draft distributions ``q_1..q_k`` and target
distributions ``p_1..p_{k+1}`` at the same positions (``p`` and ``q`` both after the
request's sampling transforms):

1. For ``j = 1..k``: accept ``x_j`` with probability ``min(1, p_j(x_j) / q_j(x_j))``
   (tested as ``u * q_j(x_j) < p_j(x_j)`` with ``u ~ U(0, 1)``, so ``q = 0`` needs no
   division); stop at the first rejection.
2. If ``x_j`` was rejected, the next token is drawn from ``normalize(max(0, p_j - q_j))``;
   if all ``k`` were accepted, a bonus token is drawn from ``p_{k+1}``.

Every emitted token is then distributed exactly as ``p`` at its position, whatever ``q``.
A deterministic proposer (n-gram) has a one-hot ``q``: ``x_j`` is accepted with
probability ``p_j(x_j)`` and the residual is ``p_j`` without ``x_j``, renormalized.
If the residual is all zero (``p == q`` up to rounding, where rejection has probability
~0), ``p_j`` itself is used.

Sampling from a distribution uses the exponential race ``argmax(w / E)`` with ``E ~ Exp(1)``,
which needs no normalization. ``greedy_verify`` and ``coupled_verify`` are the two
deterministic-given-noise modes described in ``draft.py``.
"""

from __future__ import annotations

from typing import Optional

import torch

_TINY = torch.finfo(torch.float32).tiny


def rejection_sample(
    target_probs: torch.Tensor,  # [R, K + 1, V]
    draft_probs: Optional[torch.Tensor],  # [R, K, V]; None: one-hot at draft_token_ids
    draft_token_ids: torch.Tensor,  # [R, K] int64 (entries past num_drafts are ignored)
    num_drafts: torch.Tensor,  # [R] int64, 0 <= num_drafts <= K
    generator: Optional[torch.Generator] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Modified rejection sampling for ``R`` independent requests (see module docstring).

    Returns:
        ``(num_accepted [R], next_token_ids [R])``: request ``r`` emits
        ``draft_token_ids[r, :num_accepted[r]]`` followed by ``next_token_ids[r]``.
    """
    num_rows, k_plus_1, vocab = target_probs.shape
    k = k_plus_1 - 1
    device = target_probs.device
    rows = torch.arange(num_rows, device=device)
    if k > 0:
        x = draft_token_ids[:, :k]
        p_x = target_probs[:, :k].gather(2, x[..., None])[..., 0]  # [R, K]
        q_x = torch.ones_like(p_x) if draft_probs is None else draft_probs.gather(2, x[..., None])[..., 0]
        u = torch.rand(num_rows, k, generator=generator, device=device)
        valid = torch.arange(k, device=device)[None, :] < num_drafts[:, None]
        accepted = (u * q_x < p_x) & valid  # [R, K]
        num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)  # leading accepts
    else:
        num_accepted = torch.zeros(num_rows, dtype=torch.long, device=device)
    final_p = target_probs[rows, num_accepted]  # [R, V]
    weights = final_p
    rejected = num_accepted < num_drafts
    if k > 0 and bool(rejected.any()):
        at = num_accepted.clamp(max=k - 1)
        if draft_probs is None:
            q_at = torch.zeros_like(final_p)
            q_at[rows, draft_token_ids[rows, at]] = 1.0
        else:
            q_at = draft_probs[rows, at]
        residual = (final_p - q_at).clamp_min(0.0)
        use_residual = rejected & (residual.sum(dim=-1) > 0)
        weights = torch.where(use_residual[:, None], residual, final_p)
    noise = torch.empty(num_rows, vocab, device=device).exponential_(generator=generator).clamp_min_(_TINY)
    return num_accepted, (weights / noise).argmax(dim=-1)


def greedy_verify(target_argmax: list[int], draft_token_ids: list[int]) -> list[int]:
    """Tokens emitted when the target picks ``target_argmax[j]`` at drafted position ``j``
    (``len(target_argmax) == len(draft_token_ids) + 1``): the accepted drafts, then the
    target's own token at the first mismatch (or the bonus)."""
    out = []
    for drafted, target in zip(draft_token_ids, target_argmax):
        out.append(target)
        if drafted != target:
            return out
    out.append(target_argmax[len(draft_token_ids)])
    return out


def coupled_verify(target_samples: list[int], draft_token_ids: list[int]) -> list[int]:
    """Seeded verification: ``target_samples[j]`` is what plain sampling draws at drafted
    position ``j`` (the request's own noise for that output position, computed up front:
    the noise is counter-based, so drawing it consumes nothing); drafted tokens are
    accepted while they equal those samples, as in ``greedy_verify``."""
    return greedy_verify(target_samples, draft_token_ids)
