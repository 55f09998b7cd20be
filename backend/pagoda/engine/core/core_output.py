"""What one engine-core step returns per request: ``EngineCoreOutput``, and how the core makes
it from a scheduler update (``core_output``), a done beam group (``beam_outputs``) or requests
that end before the scheduler saw them (``failed_outputs``). Plain data; no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union

from pagoda.engine.core.sched.scheduler import RequestUpdate
from pagoda.engine.logits_output import step_rows
from pagoda.engine.request import Request
from pagoda.engine.request_groups.beam_search import BeamGroup, Hypothesis
from pagoda.engine.sampling.row import TokenLogprobs


@dataclass
class EngineCoreOutput:
    """What one request got from one step.

    Attributes:
        request_id: the scheduler request (a child id for ``n > 1``).
        new_token_ids: tokens appended this step (several with speculative decoding).
        logprobs: one raw ``TokenLogprobs`` per new token, ``None`` where not asked for.
        finish_reason: "stop" | "length" | "abort", or None while running.
        stop_reason: the stop token id that ended it, if any.
        num_cached_tokens: its prefix-cache hit at first admission.
        prompt_logprobs: on the request's first output only, when it asked for them: one
            entry per prompt position (``None`` first), ``Request.prompt_logprobs``.
        first_scheduled_time: when its first step was scheduled (``time.time()``).
        context_logits: on the request's first output, when it asked: float32
            ``[num_prompt_tokens, vocab]`` (``engine.logits_output``).
        generation_logits: on every output with new tokens, when it asked: float32
            ``[len(new_token_ids), vocab]``, the rows these tokens were sampled from.
    """

    request_id: str
    new_token_ids: list[int]
    logprobs: list[Optional[TokenLogprobs]] = field(default_factory=list)
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None
    num_cached_tokens: int = 0
    first_scheduled_time: Optional[float] = None
    prompt_logprobs: Optional[list[Optional[TokenLogprobs]]] = None
    error: Optional[str] = None  # the request failed after it was accepted (a grammar that does not compile)
    cumulative_logprob: Optional[float] = None  # a beam's summed log-probability (beam search only)
    beam_score: Optional[float] = None  # a beam's cumulative_logprob / len ** length_penalty
    context_logits: Optional[Any] = None
    generation_logits: Optional[Any] = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def failed_outputs(requests: list[Request], message: str) -> list[EngineCoreOutput]:
    """The only (final) outputs of requests that end before the scheduler saw them."""
    return [EngineCoreOutput(r.request_id, [], finish_reason="abort", error=message) for r in requests]


def beam_outputs(group: BeamGroup, best: list[Hypothesis]) -> list[EngineCoreOutput]:
    """A done beam group's only outputs: its best beams under the user's output ids, best first."""
    return [EngineCoreOutput(output_id, list(h.token_ids), finish_reason=h.finish_reason,
                             stop_reason=h.stop_string or (h.stop_token if h.stop_token in group.params.stop_token_ids
                                                           else None),
                             cumulative_logprob=h.cumulative_logprob, beam_score=h.score, logprobs=h.logprobs or [],
                             first_scheduled_time=group.first_scheduled_time,
                             num_cached_tokens=group.num_cached_tokens)
            for output_id, h in zip(group.output_ids, best)]


def core_output(update: RequestUpdate, logprobs: list, generation_rows: Optional[Any] = None) -> EngineCoreOutput:
    """A scheduler update as an output; ``generation_rows``: the step's rows of this request's
    kept tokens (``ModelRunnerOutput.generation_logits``), when it asked for them."""
    request = update.request
    is_first = bool(update.new_token_ids) and request.num_output_tokens == len(update.new_token_ids)
    return EngineCoreOutput(
        request_id=request.request_id,
        new_token_ids=update.new_token_ids,
        logprobs=list(logprobs[: len(update.new_token_ids)]),
        finish_reason=request.finish_reason if update.finished else None,
        stop_reason=request.stop_reason if update.finished else None,
        num_cached_tokens=max(request.num_cached_tokens, 0),
        first_scheduled_time=request.metrics.first_scheduled_time,
        prompt_logprobs=list(request.prompt_logprobs) if is_first and request.prompt_logprobs is not None else None,
        # Context logits with the first output (the prompt is done then).
        context_logits=request.kept_logits.take_context() if is_first and request.kept_logits is not None else None,
        generation_logits=step_rows(generation_rows, len(update.new_token_ids)),
    )
