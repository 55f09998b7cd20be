"""What one ``schedule()`` hands the device side: the step's plan, as a delta.

The contract between the scheduler (``engine.core``) and the runner (``engine.runner``):
the runner reads it, never the scheduler's state. It carries only what the runner cannot
know, in the manner of vLLM v1's ``NewRequestData`` / ``CachedRequestData``; the runner
keeps the rest per request (``engine.runner.request_states``), and ``core.sched.runner_view``
decides, on the scheduler's side, what the runner already holds. That is what a
tensor-parallel step must broadcast and what a KV connector must know:

* ``is_new``: the runner has not seen the request since its last (re)admission (first
  schedule, after a preemption or a failed step); it starts a fresh state for it.
* ``new_block_ids``: per KV cache group (``engine.kv.layout``; one group for a model
  whose layers are alike), blocks appended to the request's table since the runner last
  saw it (the whole table when ``is_new``); tables only grow while a request runs. (A
  sliding-window group frees blocks outside the window by nulling their entries on the
  scheduler's side; the runner keeps the old ids there, which its kernels never read:
  they read only the window.) The state group's table is the request's working slot.
* ``token_ids``: the step's input tokens from ``num_computed_tokens`` on, then the drafts,
  less the first one when the runner sampled it (``num_runner_tokens == 1``: a decode of
  a request the runner has sampled for since its admission; the token is a placeholder of
  a step not yet applied, async scheduling, or the runner's last sampled token). Prompt
  chunks, recomputed tokens and drafts always travel.
* ``preempted_request_ids`` / ``finished_request_ids``: states the runner drops, before
  it applies ``scheduled`` (an id may be preempted or finished and scheduled anew in
  the same step).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagoda.engine.kv.host_tier import BlockPairs
from pagoda.engine.request import Request


@dataclass
class ScheduledRequest:
    request: Request  # the live request: the runner reads only its sampling state and adapter
    num_computed_tokens: int  # start position of this step's tokens
    num_new_tokens: int  # including spec_token_ids
    # The step's tokens (all_token_ids[num_computed_tokens : num_computed_tokens + num_new_tokens], then the
    # drafts), less the first when the runner holds it (num_runner_tokens): see the module docstring.
    token_ids: list[int]
    is_new: bool  # the runner starts a fresh state for the request (its tables are new_block_ids)
    # Per KV cache group: blocks appended to the request's table since the runner last saw it
    # (a flat list is taken as the one group's).
    new_block_ids: tuple[list[int], ...]
    is_sampling: bool  # this step reaches the end of the known tokens: sample one
    spec_token_ids: list[int] = field(default_factory=list)  # drafted tokens verified this step

    def __post_init__(self) -> None:
        if not isinstance(self.new_block_ids, tuple):
            self.new_block_ids = (list(self.new_block_ids),)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_runner_tokens(self) -> int:
        """Input tokens the runner supplies from its own samples (0 or 1, the first)."""
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
    blocks_to_copy: BlockPairs = field(default_factory=list)  # device -> device (a beam fork's partial block)
    # File tiers (engine.kv.file_tier), by host block id: after the device -> host copies, the
    # stored blocks' rows are captured for the writer thread, then the loads fill host blocks.
    blocks_to_store: list = field(default_factory=list)  # (host block, FileWrite)
    blocks_to_load: list = field(default_factory=list)  # (host block, verified payload bytes)
    # Recurrent-state slots (engine.kv.state_manager), (src, dst) slot ids:
    states_to_swap_out: BlockPairs = field(default_factory=list)  # device -> host, with blocks_to_swap_out
    states_to_swap_in: BlockPairs = field(default_factory=list)  # host -> device, with blocks_to_swap_in
    states_to_restore: BlockPairs = field(default_factory=list)  # checkpoint -> working slot, before the forward
    states_to_checkpoint: BlockPairs = field(default_factory=list)  # working slot -> checkpoint, after the forward
    step_id: int = 0  # echoed by the runner in ``ModelRunnerOutput.step_id``

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def has_device_work(self) -> bool:
        """Whether the device side must see this step: requests, KV copies, or runner
        states to drop (every plan that changes the runner's states reaches it)."""
        return bool(self.scheduled or self.blocks_to_swap_out or self.blocks_to_swap_in or self.blocks_to_copy_back
                    or self.blocks_to_copy or self.preempted_request_ids or self.finished_request_ids
                    or self.states_to_swap_out or self.states_to_swap_in or self.states_to_restore
                    or self.blocks_to_store or self.blocks_to_load)
