"""Continuous-batching scheduler: one token budget, no prefill or decode phases.

Every request has ``num_computed_tokens`` catching up with ``num_tokens``. Each step,
``schedule()`` hands out at most ``max_num_batched_tokens`` tokens and admits at most
``max_num_seqs`` running requests:

1. Running requests first, in admission order: each gets ``num_tokens -
   num_computed_tokens`` tokens (one for a decode, a chunk for an unfinished prompt),
   capped by the remaining budget. If the KV cache cannot hold them, the scheduler
   preempts by recompute: the victim is the running request with the largest policy key
   (lowest priority, then latest arrival); its blocks are freed, its
   ``num_computed_tokens`` reset to 0 and it returns to the waiting queue (FCFS: at the
   front). A request that is its own victim is preempted and the pass moves on: later
   running requests have smaller keys and may still fit (e.g. in a partly filled block).
2. Then, if nothing was preempted this step, waiting requests in policy order: a
   prefix-cache lookup sets ``num_cached_tokens`` (first admission only) and moves
   ``num_computed_tokens`` to the hit; the rest of the prompt is scheduled (a chunk of it
   with chunked prefill, else all or nothing). The priority policy may preempt a
   strictly lower-priority running request to admit a waiting one. Admission stops at
   the first request that does not fit, so FCFS order is never violated. It also stops
   at a request whose next ``min_shared_prefix_to_wait`` (or more) uncached tokens are
   blocks this step already computes for another request (``_Step.num_shared_computing``):
   admitted together, both would prefill the same prefix; one step later those blocks
   are cached and the second one hits them. A burst of requests sharing a long prompt
   therefore prefills it once, not once per request, for one step of extra wait.
   The one exception to strict order is LoRA (``LoRAConstraint``): a request whose
   adapter cannot get a device slot this step is skipped, so requests behind it that need
   no new slot still run; the active adapter with the fewest running requests takes no
   new requests meanwhile, so a slot frees and the skipped request (kept at the front of
   the queue) is admitted then.

A step whose tokens reach the end of a request's known tokens samples (``is_sampling``).
``schedule()`` itself advances ``num_computed_tokens`` by what it schedules and counts the
token that step will sample as an output *placeholder* (``num_output_placeholders``);
``update_from_output`` replaces the placeholder with the sampled token, applies stop
rules and caches the blocks the step filled. It takes only the runner's
``ModelRunnerOutput``: every ``SchedulerOutput`` with scheduled requests gets a
``step_id`` and is kept until the output with that id is applied (or ``undo_step``).

Overlap (``EngineConfig.async_scheduling``): because ``schedule()`` already counts step
N's tokens, step N+1 can be scheduled before step N's results are applied. A request
that samples in step N is then scheduled in step N+1 for its placeholder: one token
whose id is unknown on the host (``ScheduledRequest.token_ids`` holds only the known
ones); the runner substitutes the token it sampled in step N, which it keeps on the
device. At most one step is unapplied when ``schedule()`` runs, so a request has at most
one placeholder then, and a waiting request none. Results may arrive late for requests
that changed state since their step was scheduled: tokens for a request that finished or
was aborted meanwhile are dropped (its blocks were freed when it finished; the late
step's KV writes land in freed blocks before any later step reuses them, as steps run in
order); a request preempted meanwhile keeps its token (it was sampled from a correct
context) and recomputes or swaps in as usual. A request whose placeholders already reach
``max_tokens`` is not scheduled again: it is sure to finish.

Speculative decoding adds no phase either: ``schedule(spec_token_ids)`` schedules a
decode together with its drafted tokens (``ScheduledRequest.spec_token_ids``), as many
as the budget leaves, and only while free blocks remain for the other running requests
(drafts never cause a preemption). ``update_from_output`` then receives the accepted
drafts plus one token and sets ``num_computed_tokens`` back past the rejected drafts;
their slots are overwritten later. Rejected tokens are never appended to the request, so
no block holding them is ever hashed or cached.

KV offload (``kv_offload``, on when ``num_host_blocks > 0``): a victim may instead be
preempted by *swap* (the cost model or ``preemption_mode`` decides): its computed blocks
are copied to host blocks, it keeps ``num_computed_tokens`` and waits swapped out; when
admitted again it gets fresh blocks filled from the host (``blocks_to_swap_in``), with no
prefix lookup. A victim admitted in the same step always recomputes (its inbound copies
have not run yet). Cached blocks the pool evicts go to the host tier
(``blocks_to_swap_out``), and a waiting request's prefix lookup continues there after the
device hit ends (``blocks_to_copy_back``); those blocks count as computed. The runner
executes every device -> host copy, then every host -> device copy, before the forward.

No deadlock: ``add_request`` rejects requests whose worst case exceeds the whole cache,
so a request running alone always fits, and preemption always frees the request that
would otherwise block the others. Preempted requests are never rescheduled in the step
that preempted them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping, Optional, Sequence, Union

from pagoda.engine.kv.block_pool import BlockPool
from pagoda.engine.config import SCHEDULING_POLICIES, EngineConfig
from pagoda.engine.kv.kv_cache_manager import KVCacheManager
from pagoda.contracts.kv_events import KVEvent, KVEventBuffer
from pagoda.engine.kv.host_tier import PREEMPTION_MODES, BlockPairs, KVOffloadManager, SwapCostModel, blocks_for_tokens
from pagoda.engine.lora.constraint import LoRAConstraint
from pagoda.engine.request import Request, RequestStatus
from pagoda.engine.core.request_queue import FcfsQueue, PriorityQueue, policy_key
from pagoda.engine.runner.runner_output import ModelRunnerOutput


@dataclass
class SchedulerConfig:
    num_blocks: int  # including the reserved null block
    max_model_len: int
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    policy: str = "fcfs"
    model_id: str = ""  # seeds the block-hash root
    max_block_events: int = 100_000
    num_host_blocks: int = 0  # CPU tier of the KV cache (kv_offload); 0: off
    preemption_mode: str = "auto"  # auto | recompute | swap (needs num_host_blocks > 0)
    default_max_tokens: Optional[int] = None  # cap for max_tokens=None (EngineConfig's)
    max_loras: int = 0  # most distinct LoRA adapters running at once (device slots); 0: LoRA off
    # A waiting request whose next this-many (or more) tokens are being prefilled for
    # another request in the same step waits one step to hit them; 0 disables.
    min_shared_prefix_to_wait: int = 128

    def __post_init__(self) -> None:
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(f"policy: must be one of {SCHEDULING_POLICIES}, got {self.policy!r}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode: must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
        if self.num_host_blocks < 0:
            raise ValueError(f"num_host_blocks: must be >= 0, got {self.num_host_blocks}")
        for name in ("num_blocks", "max_model_len", "block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_model_len "
                f"({self.max_model_len}) when chunked prefill is disabled, or long prompts could never run"
            )

    @classmethod
    def from_engine_config(cls, config: EngineConfig, num_blocks: int, max_model_len: int, model_id: str,
                           num_host_blocks: int = 0) -> "SchedulerConfig":
        return cls(
            num_blocks=num_blocks,
            max_model_len=max_model_len,
            block_size=config.block_size,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            enable_chunked_prefill=config.enable_chunked_prefill,
            enable_prefix_caching=config.enable_prefix_caching,
            policy=config.scheduling_policy,
            model_id=model_id,
            max_block_events=config.max_block_events,
            num_host_blocks=num_host_blocks,
            preemption_mode=config.preemption_mode,
            default_max_tokens=config.default_max_tokens,
            max_loras=config.max_loras if config.enable_lora else 0,
            min_shared_prefix_to_wait=config.min_shared_prefix_to_wait,
        )


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


@dataclass
class RequestUpdate:
    request: Request
    new_token_ids: list[int]
    finished: bool


class Scheduler:
    """Args:
    config: limits and features.
    swap_cost_model: swap-vs-recompute costs for ``preemption_mode="auto"`` (none: recompute).
    """

    def __init__(self, config: SchedulerConfig, swap_cost_model: Optional[SwapCostModel] = None) -> None:
        self.config = config
        self.event_buffer = KVEventBuffer(max_events=config.max_block_events)
        self.block_pool = BlockPool(config.num_blocks, config.enable_prefix_caching, self.event_buffer)
        self.kv_cache_manager = KVCacheManager(self.block_pool, config.block_size, config.enable_prefix_caching)
        self.waiting: Union[FcfsQueue, PriorityQueue] = PriorityQueue() if config.policy == "priority" else FcfsQueue()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}  # live (unfinished) requests by id
        self.num_preemptions_total = 0
        self.num_recomputed_preemptions = 0
        self.offload: Optional[KVOffloadManager] = None
        if config.num_host_blocks > 0:
            self.offload = KVOffloadManager(config.num_host_blocks, config.block_size, config.preemption_mode,
                                            swap_cost_model, enable_prefix_tier=config.enable_prefix_caching)
            self.block_pool.on_evict = self.offload.on_device_evict
        self._finished_request_ids: list[str] = []
        self._num_added = 0
        self._num_steps = 0
        self._unapplied: dict[int, SchedulerOutput] = {}  # step id -> a step whose results are not applied
        self.lora_constraint = LoRAConstraint(config.max_loras) if config.max_loras > 0 else None

    # Requests in ---------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue ``request``; resolves ``max_tokens=None`` to what max_model_len leaves
        (at most ``config.default_max_tokens`` when that is set).

        Raises:
            ValueError: as ``check_request``.
        """
        request.max_tokens = self.check_request(request)
        cfg = self.config
        if cfg.enable_prefix_caching:
            request.init_block_hashes(cfg.block_size, cfg.model_id)
        request.insertion_index = self._num_added
        self._num_added += 1
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def check_request(self, request: Request) -> int:
        """The request's resolved ``max_tokens`` if it can ever run; queues nothing.

        Raises:
            ValueError: the request could never run (empty prompt, too long for
                max_model_len, or more KV blocks than the whole cache), or its id is live.
        """
        cfg = self.config
        prompt_len = request.num_prompt_tokens
        if prompt_len == 0:
            raise ValueError(f"request {request.request_id!r}: the prompt is empty")
        if request.request_id in self.requests:
            raise ValueError(f"request {request.request_id!r}: a request with this id is already running")
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is None:
            max_tokens = cfg.max_model_len - prompt_len
            if cfg.default_max_tokens is not None:
                max_tokens = min(max_tokens, cfg.default_max_tokens)
            if max_tokens < 1:
                raise ValueError(
                    f"request {request.request_id!r}: prompt of {prompt_len} tokens leaves no room to generate "
                    f"within max_model_len {cfg.max_model_len}"
                )
        if prompt_len + max_tokens > cfg.max_model_len:
            raise ValueError(
                f"request {request.request_id!r}: prompt of {prompt_len} tokens + max_tokens {max_tokens} = "
                f"{prompt_len + max_tokens} exceeds max_model_len {cfg.max_model_len}"
            )
        num_blocks_needed = -(-(prompt_len + max_tokens) // cfg.block_size)
        if num_blocks_needed > self.block_pool.num_usable_blocks:
            raise ValueError(
                f"request {request.request_id!r}: needs {num_blocks_needed} KV blocks for {prompt_len + max_tokens} "
                f"tokens but the whole cache has {self.block_pool.num_usable_blocks}; lower max_tokens"
            )
        return max_tokens

    def finish_requests(self, request_ids: Union[str, Iterable[str]], status: RequestStatus) -> None:
        """Finish live requests (abort, or stop string found) from any state; frees blocks.

        Unknown or already finished ids are ignored. Set ``request.stop_reason`` first if
        it should carry a stop string.
        """
        if not status.is_finished():
            raise ValueError(f"status: must be a finished status, got {status.name}")
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self._free(request, status)

    def _free(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.kv_cache_manager.free(request)
        if self.offload is not None:
            self.offload.free_request(request.request_id)
        del self.requests[request.request_id]
        self._finished_request_ids.append(request.request_id)

    # One step ------------------------------------------------------------------------

    def schedule(self, spec_token_ids: Optional[Mapping[str, Sequence[int]]] = None) -> SchedulerOutput:
        """Choose this step's requests and token counts; see the module docstring.

        Args:
            spec_token_ids: request id -> drafted tokens to verify after its next token
                (speculative decoding); read only for running requests at a decode.
        """
        step = _Step(self.config.max_num_batched_tokens, self.config.block_size)
        self._schedule_running(step, spec_token_ids or {})
        if not step.preempted:
            self._schedule_waiting(step)
        output = SchedulerOutput(
            preempted_request_ids=[r.request_id for r in step.preempted],
            finished_request_ids=self._finished_request_ids,
        )
        self._finished_request_ids = []
        if self.offload is not None:
            output.blocks_to_swap_out, output.blocks_to_swap_in, output.blocks_to_copy_back = \
                self.offload.take_copies()
        for request in self.running:
            num_new = step.num_new_tokens.get(request.request_id)
            if num_new is None:
                continue
            output.scheduled.append(self._make_scheduled(request, num_new, step, spec_token_ids))
            output.total_num_scheduled_tokens += num_new
        assert output.total_num_scheduled_tokens <= self.config.max_num_batched_tokens, "token budget exceeded"
        self._num_steps += 1
        output.step_id = self._num_steps
        if output.scheduled:
            self._unapplied[output.step_id] = output
        return output

    def _make_scheduled(self, request: Request, num_new: int, step: "_Step",
                        spec_token_ids: Optional[Mapping[str, Sequence[int]]]) -> ScheduledRequest:
        """The plan of one request; advances its ``num_computed_tokens`` (and placeholders)."""
        start = request.num_computed_tokens
        num_spec = step.num_spec_tokens.get(request.request_id, 0)
        drafts = list(spec_token_ids[request.request_id][:num_spec]) if num_spec else []
        end = start + num_new - num_spec
        assert not (drafts and request.num_output_placeholders), "drafts need the previous step applied"
        assert end <= request.num_tokens + request.num_output_placeholders, "scheduled past the placeholders"
        assert request.num_tokens >= end - 1, "more than one placeholder token in a step"
        scheduled = ScheduledRequest(
            request=request,
            num_computed_tokens=start,
            num_new_tokens=num_new,
            token_ids=request.all_token_ids[start:end] + drafts,
            block_ids=self.kv_cache_manager.get_block_ids(request.request_id),
            is_sampling=end == request.num_tokens + request.num_output_placeholders,
            spec_token_ids=drafts,
        )
        request.num_computed_tokens += num_new
        if scheduled.is_sampling:
            request.num_output_placeholders += 1
        return scheduled

    def _schedule_running(self, step: "_Step", spec_token_ids: Mapping[str, Sequence[int]]) -> None:
        for request in list(self.running):
            if step.budget == 0:
                break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this pass
            if request.num_output_placeholders and _is_sure_to_finish(request):
                continue  # its last token is being sampled (async scheduling)
            num_new = min(request.num_tokens + request.num_output_placeholders - request.num_computed_tokens,
                          step.budget)
            if num_new <= 0:
                continue
            if self._schedule_with_drafts(request, spec_token_ids.get(request.request_id), step):
                continue
            while self.kv_cache_manager.allocate_slots(request, num_new) is None:
                victim = max(self.running, key=lambda r: policy_key(r, self.config.policy))
                self._preempt(victim, step)
                if victim is request:
                    break
            else:
                step.add(request, num_new)

    def _schedule_with_drafts(self, request: Request, drafts: Optional[Sequence[int]], step: "_Step") -> bool:
        """Schedule a decode plus as many of its drafted tokens as the budget leaves.

        Returns False, changing nothing, when there are no drafts, the request is not at a
        decode, or the drafts' slots would eat into the blocks that the running requests
        need (fewer free blocks than running requests): drafts never cause preemption.
        """
        if not drafts or request.num_tokens - request.num_computed_tokens != 1:
            return False
        num_spec = min(len(drafts), step.budget - 1)
        if num_spec <= 0 or self.block_pool.num_free_blocks < len(self.running):
            return False
        if self.kv_cache_manager.allocate_slots(request, 1 + num_spec) is None:
            return False
        step.add(request, 1 + num_spec, num_spec)
        return True

    def _schedule_waiting(self, step: "_Step") -> None:
        skipped: list[Request] = []  # waiting for an adapter slot; back at the front afterwards
        try:
            self._admit_waiting(step, skipped)
        finally:
            for request in reversed(skipped):
                self.waiting.add_preempted(request)

    def _admit_waiting(self, step: "_Step", skipped: list[Request]) -> None:
        cfg = self.config
        draining: Optional[str] = None  # the adapter held back while another waits for its slot
        while len(self.waiting) > 0 and step.budget > 0:
            request = self.waiting.peek()
            if request in step.preempted:
                break
            assert request.num_output_placeholders == 0, "a waiting request's last step was not applied"
            if self.lora_constraint is not None and request.adapter_id is not None and (
                    request.adapter_id == draining
                    or not self.lora_constraint.can_admit(request.adapter_id, self.running)):
                # Its adapter needs a slot (or is being drained to free one): requests behind
                # it that need no new slot go first (LoRAConstraint).
                if draining is None:
                    draining = self.lora_constraint.to_drain(self.running)
                skipped.append(self.waiting.pop())
                continue
            if len(self.running) >= cfg.max_num_seqs and not self._preempt_for(request, step):
                break
            if self.offload is not None and self.offload.is_swapped_out(request.request_id):
                if not self._admit_swapped(request, step):
                    return
                continue
            hit_blocks, host_hit, num_hit = self._lookup_prefix(request)
            if 0 < cfg.min_shared_prefix_to_wait <= step.num_shared_computing(request, num_hit):
                break  # its next blocks are being prefilled this step: admitted next step, it hits them
            num_new = request.num_tokens - num_hit
            if not cfg.enable_chunked_prefill and num_new > step.budget:
                break
            num_new = min(num_new, step.budget)
            while (new_blocks := self._allocate_with_hit(request, num_new, hit_blocks, host_hit)) is None:
                if not self._preempt_for(request, step):
                    return
                # The victim's blocks may have been part of the hit: look up again.
                hit_blocks, host_hit, num_hit = self._lookup_prefix(request)
                num_new = request.num_tokens - num_hit
                if not cfg.enable_chunked_prefill and num_new > step.budget:
                    return
                num_new = min(num_new, step.budget)
            self.waiting.pop()
            if host_hit:
                self.offload.copy_back(host_hit, [b.block_id for b in new_blocks[:len(host_hit)]])
            step.admitted.add(request.request_id)
            self.kv_cache_manager.record_prefix_lookup(request.num_tokens, num_hit)
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit
            request.num_computed_tokens = num_hit
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            step.add(request, num_new)

    def _lookup_prefix(self, request: Request) -> tuple[list, list, int]:
        """(device hit blocks, host hit blocks continuing them, hit tokens of both)."""
        hit_blocks, num_hit = self.kv_cache_manager.get_computed_blocks(request)
        if self.offload is None or not self.kv_cache_manager.enable_caching:
            return hit_blocks, [], num_hit
        max_blocks = (request.num_tokens - 1) // self.config.block_size
        host_hit = self.offload.lookup_prefix(request.block_hashes, request.all_token_ids, len(hit_blocks), max_blocks)
        return hit_blocks, host_hit, num_hit + len(host_hit) * self.config.block_size

    def _allocate_with_hit(self, request: Request, num_new: int, hit_blocks: list, host_hit: list) -> Optional[list]:
        """``allocate_slots`` with a prefix hit; host hits stay pinned on success."""
        if host_hit:  # evictions during allocation must not reuse the host blocks we read
            self.offload.pin(host_hit)
        new_blocks = self.kv_cache_manager.allocate_slots(request, num_new, hit_blocks, len(host_hit))
        if new_blocks is None and host_hit:
            self.offload.unpin(host_hit)
        return new_blocks

    def _admit_swapped(self, request: Request, step: "_Step") -> bool:
        """Admit a swapped-out request: new blocks, filled from its host blocks. False: it
        does not fit (admission stops)."""
        num_new = request.num_tokens - request.num_computed_tokens
        if not self.config.enable_chunked_prefill and num_new > step.budget:
            return False
        num_new = min(num_new, step.budget)
        while self.kv_cache_manager.allocate_slots(request, num_new) is None:
            if not self._preempt_for(request, step):
                return False
        self.waiting.pop()
        self.offload.swap_in(request.request_id, self.kv_cache_manager.get_block_ids(request.request_id))
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        step.add(request, num_new)
        step.admitted.add(request.request_id)
        return True

    def _swap_out(self, request: Request, step: "_Step") -> bool:
        """Try to preempt ``request`` by swap; False: recompute instead."""
        if self.offload is None or request.request_id in step.admitted:
            return False
        num_blocks = blocks_for_tokens(request.num_computed_tokens, self.config.block_size)
        if not self.offload.wants_swap(request.num_computed_tokens, num_blocks):
            return False
        return self.offload.swap_out(request.request_id,
                                     self.kv_cache_manager.get_block_ids(request.request_id)[:num_blocks])

    def _preempt_for(self, request: Request, step: "_Step") -> bool:
        """Priority policy: preempt the lowest-priority running request if it is strictly
        lower priority than waiting ``request``. Returns whether one was preempted."""
        if self.config.policy != "priority" or not self.running:
            return False
        victim = max(self.running, key=lambda r: policy_key(r, "priority"))
        if victim.priority <= request.priority:
            return False
        self._preempt(victim, step)
        return True

    def _preempt(self, request: Request, step: "_Step") -> None:
        self.running.remove(request)
        step.remove(request)
        if not self._swap_out(request, step):
            request.num_computed_tokens = 0
            self.num_recomputed_preemptions += 1
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        step.preempted.append(request)
        self.waiting.add_preempted(request)

    # Results in ----------------------------------------------------------------------

    def update_from_output(self, runner_output: ModelRunnerOutput) -> list[RequestUpdate]:
        """Apply one step's results (steps are applied in the order they were scheduled).

        Args:
            runner_output: the step's ``ModelRunnerOutput`` (its ``step_id`` names the
                ``schedule()`` result it answers); only requests with ``is_sampling`` are
                read. For a request with ``spec_token_ids``: the accepted drafts, then one
                token.
        Returns:
            One update per request that received tokens or finished, in batch order.
            Finished requests are already freed. Requests that finished (or were
            aborted) since the step was scheduled get nothing: their tokens are dropped.
        """
        scheduler_output = self._unapplied.pop(runner_output.step_id, None)
        if scheduler_output is None:  # a step that scheduled no request (only KV copies)
            assert not runner_output.req_ids, f"tokens for step {runner_output.step_id}, which is not in flight"
            return []
        sampled = runner_output.tokens_by_id()
        updates = []
        for scheduled in scheduler_output.scheduled:
            request = scheduled.request
            if self.requests.get(request.request_id) is not request:
                continue  # finished or aborted since the step was scheduled
            computed_end = scheduled.num_computed_tokens + scheduled.num_new_tokens
            if not scheduled.is_sampling:
                self.kv_cache_manager.cache_blocks(request, computed_end)
                continue
            request.num_output_placeholders -= 1
            assert request.num_output_placeholders >= 0, "step applied twice"
            tokens = sampled.get(request.request_id)
            # Without a token the request would sit at num_computed == num_tokens forever.
            assert tokens, f"no sampled token for {request.request_id!r}, which sampled this step"
            update = self._apply_sampled(request, scheduled, list(tokens), computed_end)
            if update is not None:
                updates.append(update)
        return updates

    def _apply_sampled(self, request: Request, scheduled: ScheduledRequest, tokens: list[int],
                       computed_end: int) -> Optional[RequestUpdate]:
        """Append one request's sampled tokens, check stops, cache filled blocks."""
        if scheduled.spec_token_ids:
            assert request.status == RequestStatus.RUNNING, "speculative steps are applied before the next schedule"
            # Roll back the KV of the rejected drafts: their slots get overwritten later.
            num_rejected = len(scheduled.spec_token_ids) + 1 - len(tokens)
            assert 0 <= num_rejected <= len(scheduled.spec_token_ids), "more tokens than drafts + 1"
            request.num_computed_tokens -= num_rejected
            computed_end -= num_rejected
        new_token_ids = []
        status = None
        for token_id in tokens:
            request.append_output_token_ids(token_id)
            new_token_ids.append(token_id)
            status = self._check_stop(request, token_id)
            if status is not None:
                break
        # Accepted tokens past a stop were computed but do not belong to the request.
        request.num_computed_tokens = min(request.num_computed_tokens,
                                          request.num_tokens + request.num_output_placeholders - 1)
        # After appending: accepted drafts are part of the request (and hashed) only now.
        self.kv_cache_manager.cache_blocks(request, min(computed_end, request.num_tokens - 1))
        if status is not None:
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:  # preempted while its step ran: it waits, possibly swapped out
                self.waiting.remove(request)
            self._free(request, status)
        if new_token_ids or status is not None:
            return RequestUpdate(request, new_token_ids, status is not None)
        return None

    def undo_step(self, scheduler_output: SchedulerOutput) -> None:
        """Forget a scheduled step whose results will never come (its device job failed):
        its requests continue from where it started, keeping their blocks. Steps may be
        undone in any order."""
        self._unapplied.pop(scheduler_output.step_id, None)
        for scheduled in scheduler_output.scheduled:
            request = scheduled.request
            if self.requests.get(request.request_id) is not request:
                continue
            if scheduled.is_sampling:
                request.num_output_placeholders -= 1
            if request.status == RequestStatus.RUNNING:
                request.num_computed_tokens = min(request.num_computed_tokens, scheduled.num_computed_tokens)

    def _check_stop(self, request: Request, token_id: int) -> Optional[RequestStatus]:
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if token_id in params.stop_token_ids:
                request.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
            if not params.ignore_eos and token_id in request.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= request.max_tokens or request.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

    # Introspection -------------------------------------------------------------------

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_request(self, request_id: str) -> Optional[Request]:
        """The live request with this id, or None (unknown or finished)."""
        return self.requests.get(request_id)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def kv_cache_usage(self) -> float:
        return self.block_pool.usage

    @property
    def prefix_cache_queries(self) -> int:
        return self.kv_cache_manager.prefix_cache_queries

    @property
    def prefix_cache_hits(self) -> int:
        return self.kv_cache_manager.prefix_cache_hits

    def take_events(self) -> list[KVEvent]:
        return self.event_buffer.take()

    def reset_prefix_cache(self) -> bool:
        """Forget cached blocks (both tiers); False (no change) while any request holds blocks."""
        if not self.kv_cache_manager.reset_prefix_cache():
            return False
        if self.offload is not None:
            self.offload.reset_prefix_cache()
        return True

    def is_swapped_out(self, request_id: str) -> bool:
        """Whether a preempted request waits with its KV in host blocks."""
        return self.offload is not None and self.offload.is_swapped_out(request_id)


def _is_sure_to_finish(request: Request) -> bool:
    """Whether the tokens being sampled already reach ``max_tokens``."""
    return request.num_output_tokens + request.num_output_placeholders >= request.max_tokens


class _Step:
    """Bookkeeping of one ``schedule()`` call: the budget and who got what."""

    def __init__(self, budget: int, block_size: int = 16) -> None:
        self.budget = budget
        self.block_size = block_size
        # Hashes of the full blocks this step's requests will compute: a waiting request
        # whose next uncached block is among them waits one step and then hits it, instead
        # of prefilling the same prefix again beside its first owner (bursts of requests
        # sharing a prompt, e.g. an agent's fan-out or n parallel completions).
        self.computing: set = set()
        self.num_new_tokens: dict[str, int] = {}
        self.num_spec_tokens: dict[str, int] = {}  # of num_new_tokens, drafted tokens
        self.preempted: list[Request] = []
        # Admitted this step: their blocks may still await host -> device copies (or share
        # blocks that do), so they are never swapped out in this step.
        self.admitted: set[str] = set()

    def add(self, request: Request, num_new_tokens: int, num_spec_tokens: int = 0) -> None:
        self.num_new_tokens[request.request_id] = num_new_tokens
        if num_spec_tokens:
            self.num_spec_tokens[request.request_id] = num_spec_tokens
        self.budget -= num_new_tokens
        start = request.num_computed_tokens // self.block_size
        end = (request.num_computed_tokens + num_new_tokens - num_spec_tokens) // self.block_size
        self.computing.update(request.block_hashes[start:end])

    def num_shared_computing(self, request: Request, num_cached_tokens: int) -> int:
        """Tokens of ``request``'s uncached blocks, from its first one on, that this step computes."""
        index = num_cached_tokens // self.block_size
        start = index
        while index < len(request.block_hashes) and request.block_hashes[index] in self.computing:
            index += 1
        return (index - start) * self.block_size

    def remove(self, request: Request) -> None:
        self.budget += self.num_new_tokens.pop(request.request_id, 0)
        self.num_spec_tokens.pop(request.request_id, None)
