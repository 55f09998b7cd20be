"""``RequestStates``: the runner's per-request cache, kept from the step plan's deltas.

The scheduler sends each request's block table and tokens once (``engine.scheduler_output``,
decided by ``core.sched.runner_view``); the runner keeps them here and builds its inputs from
this cache. ``update(scheduler_output)`` runs first in every device job, in step order:

1. drop the states of ``preempted_request_ids`` and ``finished_request_ids``;
2. per scheduled request: a fresh state for ``is_new`` (its tables, one per KV cache
   group, are ``new_block_ids``), else each table extended by its ``new_block_ids``;
3. one ``StepInput`` per scheduled request, in batch order: positions, the whole block
   table, and the input tokens. A token the runner supplies itself
   (``num_runner_tokens == 1``: the step's first) comes from the device when the
   previous job sampled it and keeps it there (``on_device``: async scheduling, see
   ``StepSampler.keep_last``), else from the host copy kept by ``record``. A request
   that asks for prompt log-probabilities also hands on its prompt (read-only); one with
   images its ``mm_features`` (references, no copy).

``record(output)`` keeps each sampling request's last token (the last of its accepted
drafts plus one) after the job sampled. Both run on the device worker's one thread, so no
lock is needed. A job that fails before ``update`` leaves states of its finished requests
behind until their ids come back; its scheduled requests are new again after
``Scheduler.undo_step``, so nothing stale is ever read. No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Container, Optional, Sequence

from pagoda.engine.runner.runner_output import ModelRunnerOutput
from pagoda.engine.scheduler_output import SchedulerOutput


@dataclass
class RequestState:
    tables: list[list[int]]  # the request's whole block table per KV cache group
    last_token_id: Optional[int] = None  # the last token the runner sampled for it

    @property
    def block_ids(self) -> list[int]:
        """Group 0's table."""
        return self.tables[0]


@dataclass
class StepInput:
    """One request's inputs in one step, resolved from the cache (what the forward reads)."""

    request_id: str
    num_computed_tokens: int  # start position
    num_new_tokens: int  # including spec_token_ids
    token_ids: list[int]  # input tokens on the host; one short when the first is gathered on the device
    block_ids: list[int]  # the whole block table (of KV cache group 0)
    is_sampling: bool
    spec_token_ids: list[int] = field(default_factory=list)
    adapter_id: Optional[str] = None
    prompt_logprobs: Optional[int] = None  # alternatives per prompt position; None: not asked
    prompt_token_ids: Sequence[int] = ()  # the request's prompt, when it asks for prompt logprobs
    group_block_ids: tuple[list[int], ...] = ()  # every group's table, when there are several
    mm_features: tuple = ()  # the request's images (engine.multimodal), read by runner.mm_inputs
    num_prompt_tokens: int = 0
    context_logits: bool = False  # SamplingParams.return_context_logits (runner.raw_logits)

    @property
    def num_device_tokens(self) -> int:
        """Input tokens taken from the device (0 or 1, the first)."""
        return self.num_new_tokens - len(self.token_ids)


class RequestStates:
    def __init__(self) -> None:
        self._states: dict[str, RequestState] = {}

    def __len__(self) -> int:
        return len(self._states)

    def get(self, request_id: str) -> Optional[RequestState]:
        return self._states.get(request_id)

    def update(self, scheduler_output: SchedulerOutput, on_device: Container[str] = ()) -> list[StepInput]:
        """Apply one step's deltas; its inputs in batch order (see the module docstring)."""
        for request_id in scheduler_output.preempted_request_ids + scheduler_output.finished_request_ids:
            self._states.pop(request_id, None)
        inputs = []
        for item in scheduler_output.scheduled:
            request_id = item.request_id
            if item.is_new:
                state = self._states[request_id] = RequestState([list(ids) for ids in item.new_block_ids])
            else:
                state = self._states[request_id]
                for table, ids in zip(state.tables, item.new_block_ids, strict=True):
                    table.extend(ids)
            tokens = item.token_ids
            if item.num_runner_tokens and request_id not in on_device:
                assert state.last_token_id is not None, f"{request_id!r}: no sampled token to continue from"
                tokens = [state.last_token_id] + tokens
            num_prompt_top = item.request.sampling_params.prompt_logprobs
            inputs.append(StepInput(request_id, item.num_computed_tokens, item.num_new_tokens, tokens,
                                    state.block_ids, item.is_sampling, item.spec_token_ids,
                                    item.request.adapter_id, num_prompt_top,
                                    item.request.prompt_token_ids if num_prompt_top is not None else (),
                                    tuple(state.tables) if len(state.tables) > 1 else (),
                                    item.request.mm_features, item.request.num_prompt_tokens,
                                    item.request.sampling_params.return_context_logits))
        return inputs

    def record(self, output: ModelRunnerOutput) -> None:
        """Keep each sampling request's last token (for its next decode)."""
        for request_id, tokens in zip(output.req_ids, output.sampled_token_ids):
            state = self._states.get(request_id)
            if state is not None and tokens:
                state.last_token_id = tokens[-1]
