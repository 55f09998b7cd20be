"""Logits processors: the only stage that edits logits, a list run in order.

Each processor takes the step's ``[N, vocab_size]`` float32 logits (a private copy it may
edit in place) and the step's ``SamplingBatch`` (``batch.py``), and returns the logits to
pass on. Every per-row input was gathered once into the batch on the host; a processor
only copies those small tensors to the logits' device (``non_blocking=True``) and runs
vectorised ops, and nothing here reads a device tensor back. A processor whose batch field
is ``None`` (no row asks for it) returns its input untouched and launches nothing; a row
that does not ask for it keeps its logits bit for bit. Greedy rows take the argmax of the
last processor's output, so a processor constrains greedy and random rows alike.

* ``AllowedTokensProcessor`` (vLLM's ``allowed_token_ids``, first): in a row that sets
  them, every other id is -inf.
* ``LogitBiasProcessor`` (OpenAI/vLLM ``logit_bias``): the bias is added to its token's logit.
* ``MinTokensProcessor``: while a row has fewer than ``params.min_tokens`` outputs, the
  ids in ``row.min_tokens_blocked_ids`` (eos and stop token ids) are -inf.
* ``BadWordsProcessor`` (vLLM's ``bad_words``): in a row whose output ends with all but
  the last token of a bad word, that last token is -inf.
* ``RepetitionPenaltyProcessor`` (HF/vLLM semantics, prompt + output tokens): a seen
  token's positive logit is divided by the penalty, a negative one multiplied.
* ``PresenceFrequencyProcessor`` (OpenAI/vLLM semantics, output tokens):
  ``logit -= frequency_penalty * count + presence_penalty * (count > 0)``.
* ``GrammarBitmaskProcessor`` (structured output, last): rows with a grammar get every
  token it forbids set to -inf (``pagoda.engine.guided.bitmask``).
"""

from __future__ import annotations

from typing import Protocol

import torch

from pagoda.engine.guided.bitmask import apply_token_bitmask
from pagoda.engine.sampling.batch import SamplingBatch


class LogitsProcessor(Protocol):
    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """``logits``: ``[N, V]`` float32, owned by the caller's pipeline; ``batch``: the
        step's ``SamplingBatch`` (one row per logits row). Returns the processed logits."""


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list (or CPU tensor) as a tensor on ``device``, copied without a sync."""
    tensor = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    return tensor.to(device=device, dtype=dtype, non_blocking=True)


class AllowedTokensProcessor:
    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        if batch.allowed is None:
            return logits
        row_index, token_index = batch.allowed.to(logits.device)
        keep = torch.ones_like(logits, dtype=torch.bool)  # [N, V]
        keep[to_device(list(batch.allowed_rows), torch.int64, logits.device)] = False
        keep[row_index, token_index] = True
        return logits.masked_fill_(~keep, float("-inf"))


class LogitBiasProcessor:
    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        if batch.bias is not None:
            row_index, token_index = batch.bias.to(logits.device)
            logits.index_put_((row_index, token_index), to_device(batch.bias_values, torch.float32, logits.device),
                              accumulate=True)
        return logits


class MinTokensProcessor:
    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        if batch.min_tokens is not None:
            row_index, token_index = batch.min_tokens.to(logits.device)
            logits[row_index, token_index] = float("-inf")
        return logits


class BadWordsProcessor:
    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        if batch.bad_words is not None:
            row_index, token_index = batch.bad_words.to(logits.device)
            logits[row_index, token_index] = float("-inf")
        return logits


class RepetitionPenaltyProcessor:
    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        if batch.repetition is None:
            return logits
        row_index, token_index = batch.repetition.to(logits.device)
        is_seen = torch.zeros_like(logits, dtype=torch.bool)  # [N, V]
        is_seen[row_index, token_index] = True
        penalty = to_device(batch.repetition_penalty, torch.float32, logits.device)[:, None]
        penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
        return torch.where(is_seen, penalized, logits)


class PresenceFrequencyProcessor:
    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        if batch.counted is None:
            return logits
        row_index, token_index = batch.counted.to(logits.device)
        counts = torch.zeros_like(logits)  # [N, V]
        counts.index_put_((row_index, token_index), torch.ones_like(token_index, dtype=counts.dtype), accumulate=True)
        penalties = to_device(batch.presence_frequency, torch.float32, logits.device)
        presence, frequency = penalties[0][:, None], penalties[1][:, None]
        return logits - frequency * counts - presence * (counts > 0).to(logits.dtype)


class GrammarBitmaskProcessor:
    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        if batch.token_bitmask is not None:
            apply_token_bitmask(logits, batch.token_bitmask)
        return logits


def default_logits_processors() -> list[LogitsProcessor]:
    """The sampler's standard stages, in the order they apply (the grammar last)."""
    return [AllowedTokensProcessor(), LogitBiasProcessor(), MinTokensProcessor(), BadWordsProcessor(),
            RepetitionPenaltyProcessor(), PresenceFrequencyProcessor(), GrammarBitmaskProcessor()]
