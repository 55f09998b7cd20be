"""Logits processors: the sampler's per-row edits of the raw logits, run in order.

Each processor takes the step's ``[N, vocab_size]`` float32 logits (a private copy it may
edit in place) and the step's ``SamplingRow``s, and returns the logits to pass on. A
processor whose parameter no row sets returns its input untouched and launches nothing;
a row that does not ask for it keeps its logits bit for bit. Greedy rows take the argmax
of the last processor's output, so a processor constrains greedy and random rows alike
(a grammar bitmask joins this list as one more entry).

Per-row inputs (token ids, penalties) are gathered on the host into small index and
parameter tensors, checked there, and copied to the logits' device with
``non_blocking=True``; nothing here reads a device tensor back.

* ``MinTokensProcessor``: while a row has fewer than ``params.min_tokens`` outputs, the
  ids in ``row.min_tokens_blocked_ids`` (eos and stop token ids) are -inf.
* ``RepetitionPenaltyProcessor`` (HF/vLLM semantics, prompt + output tokens): a seen
  token's positive logit is divided by the penalty, a negative one multiplied.
* ``PresenceFrequencyProcessor`` (OpenAI/vLLM semantics, output tokens):
  ``logit -= frequency_penalty * count + presence_penalty * (count > 0)``.
"""

from __future__ import annotations

import itertools
from typing import Protocol, Sequence

import torch


class LogitsProcessor(Protocol):
    def __call__(self, logits: torch.Tensor, rows: Sequence) -> torch.Tensor:
        """``logits``: ``[N, V]`` float32, owned by the caller's pipeline; ``rows``: one
        ``SamplingRow`` per logits row. Returns the processed ``[N, V]`` logits."""


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list (or CPU tensor) as a tensor on ``device``, copied without a sync."""
    tensor = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    return tensor.to(device=device, dtype=dtype, non_blocking=True)


def _flat_indices(token_lists: Sequence[Sequence[int]], row_ids: Sequence[int], vocab_size: int,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(row_index, token_id)`` pairs on ``device`` for scattering per-row token lists
    into ``[N, V]``; token ids are checked on the host."""
    counts = torch.tensor([len(tokens) for tokens in token_lists], dtype=torch.int64)
    row_index = torch.repeat_interleave(torch.tensor(list(row_ids), dtype=torch.int64), counts)
    token_index = torch.tensor(list(itertools.chain.from_iterable(token_lists)), dtype=torch.int64)
    if token_index.numel():
        low, high = int(token_index.min()), int(token_index.max())
        assert 0 <= low and high < vocab_size, f"token ids must lie in [0, {vocab_size}), got {low}..{high}"
    return to_device(row_index, torch.int64, device), to_device(token_index, torch.int64, device)


class MinTokensProcessor:
    def __call__(self, logits: torch.Tensor, rows: Sequence) -> torch.Tensor:
        vocab_size = logits.shape[1]
        blocked_rows, blocked_lists = [], []
        for i, row in enumerate(rows):
            if row.min_tokens_blocked_ids and len(row.output_token_ids) < row.params.min_tokens:
                blocked_rows.append(i)
                # An id outside the vocabulary can never be sampled anyway.
                blocked_lists.append(sorted(t for t in row.min_tokens_blocked_ids if 0 <= t < vocab_size))
        if blocked_rows:
            row_index, token_index = _flat_indices(blocked_lists, blocked_rows, vocab_size, logits.device)
            logits[row_index, token_index] = float("-inf")
        return logits


class RepetitionPenaltyProcessor:
    def __call__(self, logits: torch.Tensor, rows: Sequence) -> torch.Tensor:
        penalized_rows = [i for i, row in enumerate(rows) if row.params.repetition_penalty != 1.0]
        if not penalized_rows:
            return logits
        device = logits.device
        seen_lists = [list(rows[i].prompt_token_ids) + list(rows[i].output_token_ids) for i in penalized_rows]
        row_index, token_index = _flat_indices(seen_lists, penalized_rows, logits.shape[1], device)
        is_seen = torch.zeros_like(logits, dtype=torch.bool)  # [N, V]
        is_seen[row_index, token_index] = True
        penalty = to_device([row.params.repetition_penalty for row in rows], torch.float32, device)[:, None]
        penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
        return torch.where(is_seen, penalized, logits)


class PresenceFrequencyProcessor:
    def __call__(self, logits: torch.Tensor, rows: Sequence) -> torch.Tensor:
        penalized_rows = [i for i, row in enumerate(rows)
                          if row.params.presence_penalty != 0.0 or row.params.frequency_penalty != 0.0]
        if not penalized_rows:
            return logits
        device = logits.device
        row_index, token_index = _flat_indices([rows[i].output_token_ids for i in penalized_rows], penalized_rows,
                                               logits.shape[1], device)
        counts = torch.zeros_like(logits)  # [N, V]
        counts.index_put_((row_index, token_index), torch.ones_like(token_index, dtype=counts.dtype), accumulate=True)
        penalties = to_device([[row.params.presence_penalty for row in rows],
                               [row.params.frequency_penalty for row in rows]], torch.float32, device)
        presence, frequency = penalties[0][:, None], penalties[1][:, None]
        return logits - frequency * counts - presence * (counts > 0).to(logits.dtype)


def default_logits_processors() -> list[LogitsProcessor]:
    """The sampler's standard stages, in the order they apply."""
    return [MinTokensProcessor(), RepetitionPenaltyProcessor(), PresenceFrequencyProcessor()]
