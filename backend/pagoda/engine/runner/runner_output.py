"""What one executed step hands back: the sampled tokens of every request that sampled.

``ModelRunnerOutput`` is the typed contract between the device side (runner + sampler or
speculator) and ``Scheduler.update_from_output``. It holds plain Python values (the one
device-to-host transfer of a step has already happened), so the scheduler and its CPU
tests never import torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class ModelRunnerOutput:
    """One step's sampling results, in batch order.

    Attributes:
        req_ids: the requests that sampled this step (``ScheduledRequest.is_sampling``).
        sampled_token_ids: per request, one token, or (speculative decoding) the accepted
            drafts then one token.
        logprobs: per request, one raw ``TokenLogprobs`` (``pagoda.engine.sampling.sampler``) per
            sampled token, or ``None`` entries where the request did not ask for them.
    """

    req_ids: list[str] = field(default_factory=list)
    sampled_token_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[Optional[Any]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        assert len(self.req_ids) == len(self.sampled_token_ids), "one token list per request"
        if not self.logprobs:
            self.logprobs = [[None] * len(t) for t in self.sampled_token_ids]
        assert len(self.logprobs) == len(self.req_ids), "one logprobs list per request"

    def tokens_by_id(self) -> dict[str, list[int]]:
        return dict(zip(self.req_ids, self.sampled_token_ids))

    def logprobs_by_id(self) -> dict[str, list[Optional[Any]]]:
        return dict(zip(self.req_ids, self.logprobs))
