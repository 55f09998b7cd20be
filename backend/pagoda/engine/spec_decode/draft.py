"""What a proposer is asked for and what it returns, and how each request is verified.

A ``DraftRequest`` asks a proposer for up to ``num_tokens`` tokens continuing
``request.all_token_ids``. The proposer answers with a ``Draft``: the token ids, and, for
requests verified by rejection sampling, the distribution ``probs[j]`` each token was
drawn from (``None`` means deterministic proposals: a one-hot ``q``).

How a request is verified depends only on its sampling parameters (``VerifyMode``):

* ``GREEDY`` (temperature 0): accept drafted tokens while they equal the target's argmax
  after penalties; the first mismatch is replaced by that argmax, and when all match the
  argmax at the next position is a bonus token. The output is the non-speculative greedy
  output, token for token.
* ``COUPLED`` (random, seeded): the target's sample at each position is the one the plain
  sampler would draw there: the draws at output position ``m`` are a function of the
  request's seed and ``m`` (``sampling.noise``), and the sample is the same race over the
  same filtered logits (``Sampler.race``). A drafted token is accepted while it equals
  that sample. The output is therefore the same as
  without speculation for the same seed, whatever the window, the draft or the batch;
  the draft model proposes with the same (peeked) noise so it agrees as often as it can.
* ``REJECTION`` (random, unseeded): modified rejection sampling (see
  ``rejection_sampler``); needs ``q`` from the proposer.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from typing import Optional

import torch

from pagoda.engine.request import Request
from pagoda.engine.sampling.row import SamplingRow


class VerifyMode(enum.Enum):
    GREEDY = "greedy"
    COUPLED = "coupled"
    REJECTION = "rejection"

    @classmethod
    def of(cls, row: SamplingRow) -> "VerifyMode":
        if row.params.is_greedy:
            return cls.GREEDY
        return cls.COUPLED if row.seed is not None else cls.REJECTION


@dataclass
class DraftRequest:
    request: Request
    num_tokens: int  # the window k: propose at most this many (> 0)
    row: SamplingRow  # the request's sampling state (penalties, seed)

    @property
    def mode(self) -> VerifyMode:
        return VerifyMode.of(self.row)


@dataclass
class Draft:
    token_ids: list[int]
    probs: Optional[torch.Tensor] = None  # [len(token_ids), vocab] the q each token came from; None: one-hot

    def truncate(self, num_tokens: int) -> "Draft":
        """The first ``num_tokens`` tokens (the scheduler may cut a draft to fit its budget)."""
        probs = None if self.probs is None else self.probs[:num_tokens]
        return Draft(self.token_ids[:num_tokens], probs)


def with_outputs(row: SamplingRow, extra_token_ids: list[int]) -> SamplingRow:
    """``row`` as if ``extra_token_ids`` had already been generated (for penalties,
    min_tokens and bad words at a drafted position)."""
    if not extra_token_ids:
        return row
    return replace(row, output_token_ids=list(row.output_token_ids) + list(extra_token_ids))
