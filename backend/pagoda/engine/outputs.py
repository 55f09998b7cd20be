"""What the engine hands back to callers: per-request outputs, streamed step by step.

``LLMEngine.step()`` returns one ``RequestOutput`` for every request that produced new
tokens (or finished) in that step. Each completion carries both the cumulative state
(``text``, ``token_ids``) and this step's delta (``delta_text``, ``delta_token_ids``,
``delta_logprobs``, ``delta_generation_logits``), so a streaming server sends deltas and an
offline caller reads the final cumulative values. ``RequestMetrics`` holds wall-clock timestamps (``time.time()``)
from which servers compute TTFT, inter-token latency and end-to-end latency.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class TokenLogprob:
    """Log-probability of one generated (or prompt) token, and the top alternatives at its step."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"token_id": self.token_id, "logprob": self.logprob, "rank": self.rank,
                "top_logprobs": [{"token_id": t, "logprob": lp} for t, lp in self.top]}


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None
    finished_time: Optional[float] = None
    # Gaps between consecutive output tokens of this request, appended as they happen.
    inter_token_latencies: list[float] = field(default_factory=list)

    @property
    def time_to_first_token(self) -> Optional[float]:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> Optional[float]:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    delta_text: str
    delta_token_ids: list[int]
    cumulative_logprob: Optional[float] = None
    logprobs: Optional[list[TokenLogprob]] = None
    delta_logprobs: Optional[list[TokenLogprob]] = None
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort"
    stop_reason: Optional[int | str] = None  # the stop token id or stop string that ended it
    # Beam search: cumulative_logprob / len(token_ids) ** length_penalty (cumulative_logprob is the beam's sum).
    beam_score: Optional[float] = None
    # SamplingParams.return_generation_logits (engine.logits_output): float32 [len(token_ids), vocab], once
    # finished, with output_kind CUMULATIVE (None with DELTA); the rows of delta_token_ids, on every output.
    generation_logits: Optional[Any] = None
    delta_generation_logits: Optional[Any] = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    # SamplingParams.prompt_logprobs: one entry per prompt position, None for the first (as
    # vLLM's PromptLogprobs): the prompt token's log-probability, rank and top alternatives.
    prompt_logprobs: Optional[list[Optional[TokenLogprob]]] = None
    # Set when the request failed after it was accepted; then this is its only (or last)
    # output, finished, with finish_reason "abort": a grammar that does not compile, or
    # admission control ended it (displaced by a more urgent request, its deadline passed).
    error: Optional[str] = None
    # SamplingParams.return_context_logits: float32 [len(prompt_token_ids), vocab] (engine.logits_output).
    context_logits: Optional[Any] = None
