"""What one ``schedule()`` hands the device side: the step's plan, per request.

The contract between the scheduler (``engine.core``) and the runner (``engine.runner``):
the runner reads it, never the scheduler's state. Token ids travel only where the runner
cannot know them: ``ScheduledRequest.token_ids`` are this step's tokens (a prompt chunk,
a decode's last token, then the drafts), and ``block_ids`` is the request's block table.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagoda.engine.kv.host_tier import BlockPairs
from pagoda.engine.request import Request


@dataclass
class ScheduledRequest:
    request: Request
    num_computed_tokens: int  # start position of this step's tokens
    num_new_tokens: int  # including spec_token_ids
    # all_token_ids[num_computed_tokens : num_computed_tokens + num_new_tokens], then the drafts; shorter by
    # one for a placeholder (async scheduling): the token the previous step samples, filled in by the runner
    token_ids: list[int]
    block_ids: list[int]  # the request's whole block table
    is_sampling: bool  # this step reaches the end of the known tokens: sample one
    spec_token_ids: list[int] = field(default_factory=list)  # drafted tokens verified this step

    @property
    def num_placeholder_tokens(self) -> int:
        """Tokens the runner takes from its previous step's samples (0 or 1)."""
        return self.num_new_tokens - len(self.token_ids)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    total_num_scheduled_tokens: int = 0
    preempted_request_ids: list[str] = field(default_factory=list)
    finished_request_ids: list[str] = field(default_factory=list)  # freed since the last step
    # KV offload copies, (src, dst) block ids, run before the forward pass in this order:
    blocks_to_swap_out: BlockPairs = field(default_factory=list)  # device -> host (swaps, evictions)
    blocks_to_swap_in: BlockPairs = field(default_factory=list)  # host -> device (swapped requests)
    blocks_to_copy_back: BlockPairs = field(default_factory=list)  # host -> device (prefix hits)
    step_id: int = 0  # echoed by the runner in ``ModelRunnerOutput.step_id``

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
