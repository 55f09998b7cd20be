"""SamplingBatch: one step's sampling inputs, built once per step on the host.

The runner builds it from the step's sampling rows (one ``SamplingRow`` per logits row)
right before sampling, after the gate (so every output history already holds the
previous step's tokens), and every stage reads it: the logits processors, the
greedy/random split, the random rows' parameters and seeded positions (stage 4; an
unseeded row's key comes from the sampler's stream, vectorised, when it samples), the
logprobs read-back. All of a step's per-row Python happens in
``SamplingBatch.build``; the stages only copy the small host tensors built here to the
logits' device (``non_blocking``, no sync) and run vectorised ops.

Invariants:

* ``rows[i]`` belongs to logits row ``i``; every index list is ascending.
* A field is ``None`` (or empty) exactly when no row asks for its stage, so that stage
  launches nothing and every row keeps its logits bit for bit.
* Token ids in a ``TokenScatter`` lie in ``[0, vocab_size)`` (checked here, on the host).
* ``token_bitmask`` indexes these rows (``GuidedDecodingManager.prepare_bitmask``); the
  grammar is one more logits processor (``GrammarBitmaskProcessor``), not a separate door.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from pagoda.engine.guided.bitmask import TokenBitmask
from pagoda.engine.sampling.filters import HostRandomRows
from pagoda.engine.sampling.row import SamplingRow


@dataclass
class TokenScatter:
    """``(row, token id)`` pairs to scatter into ``[N, V]``, as host int64 tensors."""

    row_index: torch.Tensor  # [K]
    token_index: torch.Tensor  # [K]

    @classmethod
    def of(cls, token_lists: Sequence[Sequence[int]], row_ids: Sequence[int], vocab_size: int) -> "TokenScatter":
        counts = torch.tensor([len(tokens) for tokens in token_lists], dtype=torch.int64)
        row_index = torch.repeat_interleave(torch.tensor(list(row_ids), dtype=torch.int64), counts)
        token_index = torch.tensor(list(itertools.chain.from_iterable(token_lists)), dtype=torch.int64)
        if token_index.numel():
            low, high = int(token_index.min()), int(token_index.max())
            assert 0 <= low and high < vocab_size, f"token ids must lie in [0, {vocab_size}), got {low}..{high}"
        return cls(row_index, token_index)

    def to(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(row_index, token_index)`` on ``device``, copied without a sync."""
        return (self.row_index.to(device, non_blocking=True), self.token_index.to(device, non_blocking=True))


@dataclass
class RandomInputs:
    """Stage 4's host inputs for the random rows, in ``random_rows`` order. Unseeded rows
    (``is_stream``) get their noise keys from the sampler's stream when they sample."""

    params: HostRandomRows
    seeds: np.ndarray  # [R] uint64, the request's stream seed (0 where is_stream)
    positions: np.ndarray  # [R] uint64, its number of output tokens (0 where is_stream)
    is_stream: np.ndarray  # [R] bool

    @classmethod
    def of(cls, rows: Sequence[SamplingRow], vocab_size: int) -> "RandomInputs":
        is_stream = np.array([row.seed is None for row in rows], dtype=bool)
        seeds = np.array([0 if row.seed is None else row.seed for row in rows], dtype=np.uint64)
        positions = np.array([0 if row.seed is None else len(row.output_token_ids) for row in rows], dtype=np.uint64)
        return cls(HostRandomRows.pack([row.params for row in rows], vocab_size), seeds, positions, is_stream)


@dataclass
class SamplingBatch:
    """Attributes:
    rows: one ``SamplingRow`` per logits row.
    vocab_size: the sampler's vocabulary (logits columns past it are padding).
    token_bitmask: allowed tokens of the rows that follow a grammar, or ``None``.
    random_rows: rows that sample (not greedy).
    random: their stage-4 inputs (``None`` when every row is greedy).
    logprob_rows: rows that ask for logprobs.
    allowed_logprob_rows: those of them whose logprobs exclude removed tokens
        (``SamplingRow.logprobs_allowed_only``).
    min_tokens: ids blocked in rows still short of ``min_tokens``, or ``None``.
    repetition: prompt + output tokens of rows with a repetition penalty, or ``None``.
    repetition_penalty: ``[N]`` float32, 1.0 where unset (``None`` with ``repetition``).
    counted: output tokens of rows with a presence/frequency penalty, or ``None``.
    presence_frequency: ``[2, N]`` float32, presence then frequency penalties.
    allowed: the ``allowed_token_ids`` of rows that set them, or ``None``.
    allowed_rows: those rows.
    bias: the ``logit_bias`` token ids of rows that set one, or ``None``.
    bias_values: ``[K]`` float32, the bias of each ``bias`` pair.
    bad_words: each row's bad-word ids that would complete a bad word now, or ``None``.
    """

    rows: list[SamplingRow]
    vocab_size: int
    token_bitmask: Optional[TokenBitmask] = None
    random_rows: tuple[int, ...] = ()
    random: Optional[RandomInputs] = None
    logprob_rows: tuple[int, ...] = ()
    allowed_logprob_rows: tuple[int, ...] = ()
    min_tokens: Optional[TokenScatter] = None
    repetition: Optional[TokenScatter] = None
    repetition_penalty: Optional[torch.Tensor] = None
    counted: Optional[TokenScatter] = None
    presence_frequency: Optional[torch.Tensor] = None
    allowed: Optional[TokenScatter] = None
    allowed_rows: tuple[int, ...] = ()
    bias: Optional[TokenScatter] = None
    bias_values: Optional[torch.Tensor] = None
    bad_words: Optional[TokenScatter] = None

    @classmethod
    def build(cls, rows: Sequence[SamplingRow], vocab_size: int,
              token_bitmask: Optional[TokenBitmask] = None) -> "SamplingBatch":
        """The batch for ``rows`` (read now: call it after the previous step's tokens were applied)."""
        rows = list(rows)
        batch = cls(rows, vocab_size, token_bitmask,
                    random_rows=tuple(i for i, row in enumerate(rows) if not row.params.is_greedy),
                    logprob_rows=tuple(i for i, row in enumerate(rows) if row.params.logprobs is not None),
                    allowed_logprob_rows=tuple(i for i, row in enumerate(rows) if row.logprobs_allowed_only),
                    min_tokens=_min_tokens(rows, vocab_size), bad_words=_bad_words(rows, vocab_size))
        if batch.random_rows:
            batch.random = RandomInputs.of([rows[i] for i in batch.random_rows], vocab_size)
        repeated = [i for i, row in enumerate(rows) if row.params.repetition_penalty != 1.0]
        if repeated:
            seen = [list(rows[i].prompt_token_ids) + list(rows[i].output_token_ids) for i in repeated]
            batch.repetition = TokenScatter.of(seen, repeated, vocab_size)
            batch.repetition_penalty = torch.tensor([row.params.repetition_penalty for row in rows],
                                                    dtype=torch.float32)
        penalized = [i for i, row in enumerate(rows)
                     if row.params.presence_penalty != 0.0 or row.params.frequency_penalty != 0.0]
        if penalized:
            batch.counted = TokenScatter.of([rows[i].output_token_ids for i in penalized], penalized, vocab_size)
            batch.presence_frequency = torch.tensor([[row.params.presence_penalty for row in rows],
                                                     [row.params.frequency_penalty for row in rows]],
                                                    dtype=torch.float32)
        _add_vllm_extras(batch, rows, vocab_size)
        return batch

    def __len__(self) -> int:
        return len(self.rows)


def _min_tokens(rows: Sequence[SamplingRow], vocab_size: int) -> Optional[TokenScatter]:
    blocked_rows, blocked_lists = [], []
    for i, row in enumerate(rows):
        if row.min_tokens_blocked_ids and len(row.output_token_ids) < row.params.min_tokens:
            blocked_rows.append(i)
            # An id outside the vocabulary can never be sampled anyway.
            blocked_lists.append(sorted(t for t in row.min_tokens_blocked_ids if 0 <= t < vocab_size))
    return TokenScatter.of(blocked_lists, blocked_rows, vocab_size) if blocked_rows else None


def _bad_words(rows: Sequence[SamplingRow], vocab_size: int) -> Optional[TokenScatter]:
    """Per row, the last id of every bad word whose other ids end the output so far."""
    banned_rows, banned_lists = [], []
    for i, row in enumerate(rows):
        done = row.output_token_ids
        banned = {seq[-1] for seq in row.bad_words_token_ids
                  if len(done) >= len(seq) - 1 and list(done[len(done) - len(seq) + 1:]) == list(seq[:-1])}
        banned = sorted(t for t in banned if 0 <= t < vocab_size)
        if banned:
            banned_rows.append(i)
            banned_lists.append(banned)
    return TokenScatter.of(banned_lists, banned_rows, vocab_size) if banned_rows else None


def _add_vllm_extras(batch: SamplingBatch, rows: Sequence[SamplingRow], vocab_size: int) -> None:
    """``allowed_token_ids`` and ``logit_bias`` (ids were checked against the vocabulary at admission)."""
    allowed = [i for i, row in enumerate(rows) if row.params.allowed_token_ids]
    if allowed:
        batch.allowed_rows = tuple(allowed)
        batch.allowed = TokenScatter.of([rows[i].params.allowed_token_ids for i in allowed], allowed, vocab_size)
    biased = [i for i, row in enumerate(rows) if row.params.logit_bias]
    if biased:
        batch.bias = TokenScatter.of([list(rows[i].params.logit_bias) for i in biased], biased, vocab_size)
        batch.bias_values = torch.tensor([bias for i in biased for bias in rows[i].params.logit_bias.values()],
                                         dtype=torch.float32)
