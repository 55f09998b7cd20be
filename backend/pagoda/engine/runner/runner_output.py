"""What one executed step hands back: the sampled tokens of every request that sampled.

``ModelRunnerOutput`` is the typed contract between the device side (``ModelRunner.execute``:
forward, then its sampler or speculator) and ``Scheduler.update_from_output``, which takes
nothing else: ``step_id`` echoes ``SchedulerOutput.step_id``, so the scheduler finds the
step it answers. It holds plain Python values (the one device-to-host transfer of a step
has already happened), so the engine core, the scheduler and their CPU tests never import
torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence


@dataclass
class ModelRunnerOutput:
    """One step's sampling results, in batch order.

    Attributes:
        req_ids: the requests that sampled this step (``ScheduledRequest.is_sampling``).
        sampled_token_ids: per request, one token, or (speculative decoding) the accepted
            drafts then one token.
        logprobs: per request, one raw ``TokenLogprobs`` (``pagoda.engine.sampling.sampler``) per
            sampled token, or ``None`` entries where the request did not ask for them.
        step_id: the ``SchedulerOutput.step_id`` of the step these results answer.
        prompt_logprobs: request id -> (prompt position of the first entry, one raw
            ``TokenLogprobs`` per position from there) for the requests that asked for
            prompt log-probabilities and had prompt positions in this step, sampling or not
            (``engine.runner.prompt_logprobs``).
        context_logits: request id -> (prompt position of the first row, float32 rows
            ``[n, vocab]``) for the requests that asked (``engine.logits_output``).
        generation_logits: request id -> float32 rows ``[k, vocab]``, one per token sampled this
            step, for the requests that asked.
    """

    req_ids: list[str] = field(default_factory=list)
    sampled_token_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[Optional[Any]]] = field(default_factory=list)
    step_id: int = 0
    prompt_logprobs: dict[str, tuple[int, list[Any]]] = field(default_factory=dict)
    context_logits: dict[str, tuple[int, Any]] = field(default_factory=dict)
    generation_logits: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_tokens(cls, step_id: int, tokens: Mapping[str, Sequence[int]]) -> "ModelRunnerOutput":
        """Results given as request id -> sampled tokens (fakes in tests and simulators)."""
        return cls(list(tokens), [list(t) for t in tokens.values()], step_id=step_id)

    def __post_init__(self) -> None:
        assert len(self.req_ids) == len(self.sampled_token_ids), "one token list per request"
        if not self.logprobs:
            self.logprobs = [[None] * len(t) for t in self.sampled_token_ids]
        assert len(self.logprobs) == len(self.req_ids), "one logprobs list per request"

    def tokens_by_id(self) -> dict[str, list[int]]:
        return dict(zip(self.req_ids, self.sampled_token_ids))

    def logprobs_by_id(self) -> dict[str, list[Optional[Any]]]:
        return dict(zip(self.req_ids, self.logprobs))
