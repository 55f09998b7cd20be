"""The batched sampler: one step's logits for every running row in, one token per row out.

Everything runs on the logits' device. Per-row inputs arrive as one ``SamplingBatch``
(``batch.py``), built once per step on the host before sampling; the sampler copies its
small tensors over without a sync and reads back, once per call, the chosen ids (and the
logprobs of rows that ask for them). Stages, vectorised over the batch; a stage no row
needs is skipped, and a row that does not need a stage keeps its logits bit for bit:

1. Padding columns are cut off: the model's logits may be wider than the tokenizer's
   vocabulary (``vocab_size``); those columns never take part in anything below, so
   they can never be sampled and do not dilute the logprobs.
2. Logits processors, in order (``Sampler.logits_processors``, see ``logits_processors``):
   min_tokens masking, repetition penalty, presence/frequency penalties, then the grammar
   (structured output: rows with a ``TokenBitmask`` entry get every token their grammar
   forbids set to -inf). The list is the only door that edits logits: another per-row
   constraint joins it, reading its inputs from the batch.
3. Greedy rows (``params.is_greedy``) take the argmax of these logits and stop here.
4. Random rows: temperature, then top-k, then top-p (on the top-k renormalised
   distribution; the token that crosses ``top_p`` is kept), then min-p, then the
   exponential race ``argmax(w / E)``, ``E ~ Exp(1)`` per token (``sampling.filters``).
   Rows with top-k or top-p work on their largest logits only (no sort when no row
   asks for top-k/top-p, no full sort when every such row has a top-k).

Randomness (``sampling.noise``) is counter-based: the draw at a vocabulary index is a hash
of (row key, index), and a seeded request's row key is a function of its seed and its
number of output tokens. So a seeded request's samples depend only on its seed and its own
logits, never on which rows share the batch or where it sits, and a draw can be recomputed
for any future position (speculative decoding does). Unseeded rows take keys from the
sampler's own stream (seeded by ``EngineConfig.seed``), one key per row per step.

What reproduces across devices: the noise integers are the same on every device (exact
integer arithmetic); the float32 ``log`` that turns them into Exp(1) draws, the softmax
sums behind top-p and the model's logits themselves may differ by rounding between CPU
and CUDA (and between GPU models or dtypes), so a seeded request gives the same tokens on
the same device and weights, and usually but not always the same tokens on another device
(a near-tie between two tokens can resolve differently). On one device, a seeded row's
output does not depend on the batch as long as its logits do not (see docs/sampling.md).

Logprobs follow vLLM's default "raw" mode: ``log_softmax`` of the model's logits over the
real vocabulary, before processors, temperature and filters. ``rank`` is 1 + the number of
tokens with a strictly larger logprob.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from pagoda.engine.guided.bitmask import TokenBitmask
from pagoda.engine.sampling.batch import RandomInputs, SamplingBatch
from pagoda.engine.sampling.logits_processors import LogitsProcessor, default_logits_processors, to_device
from pagoda.engine.sampling.filters import RandomRows, filter_dense, race_candidates, race_dense
from pagoda.engine.sampling.noise import exponential_noise, row_keys
from pagoda.engine.sampling.row import SamplingRow, TokenLogprobs, make_seed

__all__ = ["Sampler", "SamplerOutput", "SamplingBatch", "SamplingRow", "TokenLogprobs", "make_seed"]

_U64 = (1 << 64) - 1


@dataclass
class SamplerOutput:
    """One step's result: ``token_ids[i]`` and ``logprobs[i]`` belong to ``rows[i]``;
    ``logprobs[i]`` is ``None`` when the row did not ask for logprobs."""

    token_ids: list[int]
    logprobs: list[Optional[TokenLogprobs]]


class Sampler:
    """Samples one token per row from a batch of logits. See the module docstring.

    Args:
        vocab_size: the tokenizer's vocabulary size; logits columns at or past it are
            padding and are never sampled.
        seed: seed of the stream unseeded rows draw from.
        logits_processors: stage 2, in order; ``None`` means the default list.
    """

    def __init__(self, vocab_size: int, seed: int = 0,
                 logits_processors: Optional[list[LogitsProcessor]] = None) -> None:
        if vocab_size <= 0:
            raise ValueError(f"vocab_size: must be > 0, got {vocab_size}")
        self.vocab_size = vocab_size
        self.logits_processors = default_logits_processors() if logits_processors is None else logits_processors
        # Kept apart from any request seed equal to ``seed`` by a fixed offset.
        self._stream_seed = (seed * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) & _U64
        self._num_stream_draws = 0

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """Sample one token for each row.

        Args:
            logits: ``[num_rows, >= vocab_size]`` float logits on any device; not modified.
            batch: the step's ``SamplingBatch``, one row per logits row, in the same order.

        Returns:
            ``SamplerOutput`` with one token id (and optional logprobs) per row.
        """
        raw_logits = self._cut_padding(logits, batch.rows)  # [N, V]
        processed = self.process_logits(raw_logits, batch)  # [N, V]
        if len(batch.random_rows) == len(batch):
            token_ids = self._sample(processed, batch.random)
        else:
            token_ids = processed.argmax(dim=-1)  # [N]; final for greedy rows
            if batch.random_rows:
                index = to_device(list(batch.random_rows), torch.int64, logits.device)
                token_ids[index] = self._sample(processed[index], batch.random)
        removed = None
        if batch.allowed_logprob_rows:  # guided beams: their candidates are the allowed tokens
            removed = torch.zeros(len(batch), dtype=torch.bool)
            removed[list(batch.allowed_logprob_rows)] = True
            removed = removed.to(logits.device, non_blocking=True)[:, None] & torch.isneginf(processed)
        return _to_host(raw_logits, batch.rows, batch.logprob_rows, token_ids, removed)

    def process_logits(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Stage 2 (the logits processors, the grammar last); greedy rows take the argmax
        of the result.

        Args:
            logits: ``[num_rows, >= vocab_size]`` logits; not modified.
            batch: the step's ``SamplingBatch``, one row per logits row.

        Returns:
            A new ``[num_rows, vocab_size]`` float32 tensor.
        """
        logits = logits[:, : self.vocab_size].to(torch.float32, copy=True)
        for processor in self.logits_processors:
            logits = processor(logits, batch)
        return logits

    def make_batch(self, rows: Sequence[SamplingRow], token_bitmask: Optional[TokenBitmask] = None) -> SamplingBatch:
        """``SamplingBatch.build`` for this sampler's vocabulary."""
        return SamplingBatch.build(rows, self.vocab_size, token_bitmask)

    def filter_logits(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """Stage 4's transforms for random rows, dense: temperature-scaled logits with every
        token top-k/top-p/min-p removes at -inf. Draws no noise.

        Args:
            logits: ``[R, vocab_size]`` output of ``process_logits``; not modified.
            rows: one non-greedy ``SamplingRow`` per logits row.
        """
        params = RandomRows.build([row.params for row in rows], row_keys([0] * len(rows), [0] * len(rows)),
                                  self.vocab_size, logits.device)
        return filter_dense(logits / params.temperature[:, None], params)

    def sample_probs(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """The distribution each random row samples from: ``softmax(filter_logits(...))``."""
        return self.filter_logits(logits, rows).softmax(dim=-1)

    def race(self, filtered: torch.Tensor, rows: Sequence[SamplingRow],
             offsets: Optional[Sequence[int]] = None) -> torch.Tensor:
        """The tokens plain sampling picks from ``filter_logits`` output ``[R, V]`` with each
        row's draws (at ``offsets[i]`` outputs past the row's own); ``[R]`` on its device."""
        return race_dense(filtered, self._device_keys(rows, filtered.device, offsets))

    def draw_noise(self, rows: Sequence[SamplingRow], device: torch.device,
                   offsets: Optional[Sequence[int]] = None) -> torch.Tensor:
        """Exp(1) noise ``[R, vocab_size]`` on ``device``: a seeded row's draws for its output
        position ``len(output_token_ids) + offsets[i]``; unseeded rows advance the stream."""
        return exponential_noise(self._device_keys(rows, device, offsets), self.vocab_size)

    def compute_logprobs(
        self, logits: torch.Tensor, rows: Sequence[SamplingRow], token_ids: torch.Tensor
    ) -> list[Optional[TokenLogprobs]]:
        """Raw-mode logprobs of ``token_ids`` (one per row) for rows that ask for them.

        Args:
            logits: ``[R, >= vocab_size]`` model logits (padding columns are cut off).
            rows: one ``SamplingRow`` per logits row.
            token_ids: ``[R]`` the token chosen at each row.
        """
        wanted = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
        return _to_host(self._cut_padding(logits, rows), rows, wanted, token_ids).logprobs

    def _cut_padding(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits: expected shape [{len(rows)}, vocab], got {list(logits.shape)}")
        if logits.shape[1] < self.vocab_size:
            raise ValueError(f"logits: {logits.shape[1]} columns, fewer than vocab_size={self.vocab_size}")
        return logits[:, : self.vocab_size].float()

    def _sample(self, logits: torch.Tensor, random: RandomInputs) -> torch.Tensor:
        """Stage 4 for random rows; ``[R]`` token ids on the logits' device."""
        params = RandomRows.upload(random.params, self._batch_keys(random), logits.device)
        scaled = logits.div_(params.temperature[:, None])  # ``logits`` is this call's own copy
        needs_candidates = params.needs_candidates(self.vocab_size)
        filtered = [i for i, needed in enumerate(needs_candidates) if needed]
        if len(filtered) == len(needs_candidates):
            return race_candidates(scaled, params)
        if not filtered:
            return race_dense(filter_dense(scaled, params), params.keys)
        plain = [i for i, needed in enumerate(needs_candidates) if not needed]
        tokens = torch.empty(len(needs_candidates), dtype=torch.int64, device=logits.device)
        for group, sample in ((filtered, race_candidates), (plain, _race_plain)):
            index = to_device(group, torch.int64, logits.device)
            tokens[index] = sample(scaled[index], params.select(group))
        return tokens

    def _batch_keys(self, random: RandomInputs):
        """``_keys`` for a batch's random rows, vectorised: unseeded rows take the next
        counters of the stream, in row order."""
        seeds, positions = random.seeds.copy(), random.positions.copy()
        num_stream = int(random.is_stream.sum())
        seeds[random.is_stream] = self._stream_seed
        positions[random.is_stream] = np.arange(self._num_stream_draws, self._num_stream_draws + num_stream,
                                                dtype=np.uint64)
        self._num_stream_draws += num_stream
        return row_keys(seeds, positions)

    def _keys(self, rows: Sequence[SamplingRow], offsets: Optional[Sequence[int]] = None):
        """Host row keys: a seeded row's at its output position (+ offset); unseeded rows
        take the next counters of the sampler's stream."""
        offsets = offsets if offsets is not None else [0] * len(rows)
        seeds, positions = [], []
        for row, offset in zip(rows, offsets):
            if row.seed is None:
                seeds.append(self._stream_seed)
                positions.append(self._num_stream_draws)
                self._num_stream_draws += 1
            else:
                seeds.append(row.seed)
                positions.append(len(row.output_token_ids) + offset)
        return row_keys(seeds, positions)

    def _device_keys(self, rows, device, offsets) -> torch.Tensor:
        return to_device(torch.from_numpy(self._keys(rows, offsets)), torch.int64, device)


def _race_plain(scaled: torch.Tensor, params: RandomRows) -> torch.Tensor:
    return race_dense(filter_dense(scaled, params), params.keys)


def _to_host(raw_logits: torch.Tensor, rows: Sequence[SamplingRow], wanted: Sequence[int],
             token_ids: torch.Tensor, removed: Optional[torch.Tensor] = None) -> SamplerOutput:
    """The call's one device-to-host transfer: token ids, plus raw-mode logprobs (see the
    module docstring) for the ``wanted`` rows, packed in one float64 tensor (ids and ranks
    are exact in it); ``removed`` (``[N, V]`` bool): logprobs set to ``-inf`` there."""
    num_rows = len(rows)
    wanted = list(wanted)
    if not wanted:
        return SamplerOutput(token_ids.tolist(), [None] * num_rows)
    index = to_device(wanted, torch.int64, raw_logits.device)
    logprobs = torch.log_softmax(raw_logits[index], dim=-1)  # [M, V]
    if removed is not None:
        logprobs = logprobs.masked_fill(removed[index], float("-inf"))
    chosen = token_ids[index]
    chosen_logprobs = logprobs.gather(1, chosen[:, None])  # [M, 1]
    ranks = (logprobs > chosen_logprobs).sum(dim=-1, keepdim=True) + 1
    num_top = min(max(rows[i].params.logprobs for i in wanted), logprobs.shape[1])
    top_values, top_ids = logprobs.topk(num_top, dim=-1)  # [M, T] each
    payload = torch.cat([chosen_logprobs.double(), ranks.double(), top_ids.double(), top_values.double()], dim=1)
    host = torch.cat([token_ids.double(), payload.flatten()]).tolist()
    result: list[Optional[TokenLogprobs]] = [None] * num_rows
    width = 2 + 2 * num_top
    for j, i in enumerate(wanted):
        entry = host[num_rows + j * width : num_rows + (j + 1) * width]
        num_wanted = rows[i].params.logprobs
        top_ids_j = [int(t) for t in entry[2 : 2 + num_wanted]]
        result[i] = TokenLogprobs(token_id=int(host[i]), logprob=entry[0], rank=int(entry[1]),
                                  top=list(zip(top_ids_j, entry[2 + num_top : 2 + num_top + num_wanted])))
    return SamplerOutput([int(t) for t in host[:num_rows]], result)
