"""Continuous-batching scheduler: one token budget, no prefill or decode phases.

Every request has ``num_computed_tokens`` catching up with ``num_tokens``. Each step,
``schedule()`` hands out at most ``max_num_batched_tokens`` tokens and admits at most
``max_num_seqs`` running requests:

1. Running requests first, in admission order: each gets ``num_tokens -
   num_computed_tokens`` tokens (one for a decode, a chunk for an unfinished prompt),
   capped by the remaining budget and by ``long_prefill_token_threshold`` (when set: a long
   prompt's chunk leaves the rest of the step to the requests behind it, waiting ones too).
   If the KV cache cannot hold them, the scheduler preempts by recompute: the victim is the
   running request with the largest policy key (lowest priority, then latest arrival); its
   blocks are freed, its ``num_computed_tokens`` reset to 0 and it returns to the waiting queue (FCFS: at the
   front). A request that is its own victim is preempted and the pass moves on: later
   running requests have smaller keys and may still fit (e.g. in a partly filled block).
   Under the priority policy a running request's prefill chunk may be held back for a
   strictly more urgent prompt (``core.sched.prefill_hold``: scheduled after admission
   after all, without preempting, unless such a prompt does prefill in this step).
2. Then, if nothing was preempted this step, waiting requests in policy order
   (``core.sched.admit_waiting``): prefix-cache lookup, the rest of the prompt (or a chunk of
   it), preemption of a strictly less urgent running request under the priority policy;
   admission stops at the first request that does not fit, so the policy's order holds.
   Admission constraints (``core.sched.constraints``: LoRA slots, the shared-prefix wait) may
   stop it earlier or set one request aside (LoRA) so the ones behind it still run.

The policy (``core.sched.policy``: fcfs or priority) is an object looked up once: it makes the
waiting queue, picks victims and says whether a waiting request may preempt.

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
whose id is unknown on the host (``ScheduledRequest.token_ids`` leaves it out, as for
every decode of a token the runner sampled: the plan is a delta, ``core.sched.runner_view``);
the runner substitutes the token it sampled in step N, which it keeps on the device.
At most one step is unapplied when ``schedule()`` runs, so a request has at most one
placeholder then, and a waiting request none (batch queue, ``micro_batches`` N > 1: a request
in an unapplied step, ``_busy``, waits for it; a step takes ceil(live / N) requests, StepPlan).
Results may arrive late for requests that changed state since their step was scheduled:
tokens for a request that finished or was aborted meanwhile are dropped (its blocks were
freed when it finished; the late step's KV writes land in freed blocks before any later
step reuses them, as steps run in order); a request preempted meanwhile keeps its token
(it was sampled from a correct context) and recomputes or swaps in as usual. A request
whose placeholders already reach ``max_tokens`` is not scheduled again: it is sure to finish.

Speculative decoding adds no phase either: ``schedule(spec_token_ids)`` schedules a
decode together with its drafted tokens (``ScheduledRequest.spec_token_ids``), as many
as the budget leaves, and only while free blocks remain for the other running requests
(drafts never cause a preemption). ``update_from_output`` then receives the accepted
drafts plus one token and sets ``num_computed_tokens`` back past the rejected drafts;
their slots are overwritten later. Rejected tokens are never appended to the request, so
no block holding them is ever hashed or cached.

KV offload (``kv.host_tier``, on when ``num_host_blocks > 0``; ``NoHostTier`` otherwise,
so no path asks whether it is on): a victim may instead be
preempted by *swap* (``sched.preemption``; the cost model or ``preemption_mode`` decides): its computed blocks
are copied to host blocks, it keeps ``num_computed_tokens`` and waits swapped out; when
admitted again it gets fresh blocks filled from the host (``blocks_to_swap_in``), with no
prefix lookup. A victim admitted in the same step always recomputes (its inbound copies
have not run yet). Cached blocks the pool evicts go to the host tier
(``blocks_to_swap_out``), and a waiting request's prefix lookup continues there after the
device hit ends (``blocks_to_copy_back``); those blocks count as computed. The runner
executes every device -> host copy, then every host -> device copy, before the forward.

Beam search (``request_groups.beam_search``): a beam (``request.beam_group`` set) gets no token here
(its group chooses, forks and prunes after this update); preempting a beam preempts its
group's running beams; a beam with a placeholder waits (async scheduling); forks'
copy-on-write block copies ride on the next plan (``blocks_to_copy``).

No deadlock: ``add_request`` rejects requests whose worst case exceeds the whole cache,
so a request running alone always fits, and preemption always frees the request that
would otherwise block the others. Preempted requests are never rescheduled in the step
that preempted them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Optional, Sequence, Union

from pagoda.contracts.kv_events import KVEventBuffer
from pagoda.engine.core.sched.admit_waiting import WaitingAdmitter
from pagoda.engine.core.sched.constraints import make_constraints
from pagoda.engine.core.sched.policy import get_policy
from pagoda.engine.core.sched.preemption import Preemption
from pagoda.engine.core.sched.prefill_hold import PrefillHold
from pagoda.engine.core.sched.runner_view import RunnerView
from pagoda.engine.core.sched.scheduler_config import SchedulerConfig
from pagoda.engine.core.sched.scheduler_views import SchedulerViews
from pagoda.engine.core.sched.step_plan import StepPlan
from pagoda.engine.kv.file_tier import FileTiers
from pagoda.engine.kv.swap_cost import SwapCostModel
from pagoda.engine.kv.kv_cache_manager import make_kv_cache
from pagoda.engine.request import Request, RequestStatus
from pagoda.engine.runner.runner_output import ModelRunnerOutput
from pagoda.engine.scheduler_output import ScheduledRequest, SchedulerOutput

__all__ = ["RequestUpdate", "ScheduledRequest", "Scheduler", "SchedulerConfig", "SchedulerOutput"]


@dataclass
class RequestUpdate:
    request: Request
    new_token_ids: list[int]
    finished: bool


class Scheduler(SchedulerViews):
    """Args:
    config: limits and features.
    swap_cost_model: swap-vs-recompute costs for ``preemption_mode="auto"`` (none: recompute).
    file_tiers: the disk and shared tiers below the CPU tier (``kv.file_tier``), if configured.
    """

    def __init__(self, config: SchedulerConfig, swap_cost_model: Optional[SwapCostModel] = None,
                 file_tiers: Optional[FileTiers] = None) -> None:
        self.config = config
        self.event_buffer = KVEventBuffer(max_events=config.max_block_events)
        self.kv_cache_manager, self.host_tier = make_kv_cache(
            config.layout, config.enable_prefix_caching, self.event_buffer, config.state_checkpoint_interval,
            config.num_host_blocks, config.num_host_state_slots, config.preemption_mode, swap_cost_model,
            file_tiers)
        self.block_pool = self.kv_cache_manager.block_pool
        self.policy = get_policy(config.policy)
        self.waiting = self.policy.make_queue()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}  # live (unfinished) requests by id
        self._finished_request_ids: list[str] = []
        self._num_added = 0
        self._num_steps = 0
        self._unapplied: dict[int, SchedulerOutput] = {}  # step id -> a step whose results are not applied
        self._busy: set[str] = set()  # batch queue: ids in unapplied steps (the admitter reads it too)
        self.runner_view = RunnerView()  # what the runner holds: the step plan is a delta
        self.preemption = Preemption(self.running, self.waiting, self.kv_cache_manager, self.host_tier,
                                     self.runner_view, config.block_size)
        block_pool = self.block_pool  # not self: a scheduler holding a closure over itself would be a cycle
        self.constraints = make_constraints(config.max_loras, config.min_shared_prefix_to_wait,
                                            lambda: block_pool.num_free_blocks, config.block_size)
        self.admitter = WaitingAdmitter(self.waiting, self.running, self.kv_cache_manager, self.host_tier,
                                        self.policy, self.constraints, self.preemption.preempt, config.max_num_seqs,
                                        config.block_size, self._busy)

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
        if request.request_id in self.requests:
            raise ValueError(f"request {request.request_id!r}: a request with this id is already running")
        return self.config.resolve_max_tokens(request, self.block_pool.num_usable_blocks)

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
        self.host_tier.free_request(request.request_id)
        del self.requests[request.request_id]
        self.runner_view.forget(request.request_id)
        self._finished_request_ids.append(request.request_id)

    # One step ------------------------------------------------------------------------

    def schedule(self, spec_token_ids: Optional[Mapping[str, Sequence[int]]] = None) -> SchedulerOutput:
        """Choose this step's requests and token counts; see the module docstring.

        Args:
            spec_token_ids: request id -> drafted tokens to verify after its next token
                (speculative decoding); read only for running requests at a decode.
        """
        config = self.config
        step = StepPlan(config.max_num_batched_tokens, config.block_size, config.enable_chunked_prefill,
                        config.long_prefill_token_threshold)
        step.encoder_budget = config.max_num_encoder_tokens or config.max_num_batched_tokens
        if self.config.micro_batches > 1:  # batch queue: requests in flight wait; N steps share the rest
            num_live = min(len(self.requests), self.config.max_num_seqs)
            step.share_with_queue(self._unapplied.values(), self._busy, num_live, self.config.micro_batches)
        spec_token_ids = spec_token_ids or {}
        hold = PrefillHold(self.running, self.waiting.peek() if len(self.waiting) else None, self._busy) \
            if self.policy.holds_prefill else None  # core.sched.prefill_hold
        self._schedule_running(step, spec_token_ids, hold)
        if not step.preempted:
            self.admitter.admit(step)  # core.sched.admit_waiting
        if hold is not None:
            for request in hold.take_released(r for r in self.running if r.request_id in step.num_new_tokens):
                if step.is_full:
                    break
                self._schedule_one(request, step, spec_token_ids, may_preempt=False)
        output = SchedulerOutput(
            preempted_request_ids=[r.request_id for r in step.preempted],
            finished_request_ids=self._finished_request_ids,
        )
        self._finished_request_ids = []
        output.blocks_to_swap_out, output.blocks_to_swap_in, output.blocks_to_copy_back = self.host_tier.take_copies()
        output.blocks_to_store, output.blocks_to_load = self.host_tier.take_file_copies()
        output.blocks_to_copy = self.kv_cache_manager.take_copies()
        output.states_to_restore, output.states_to_checkpoint = self.kv_cache_manager.take_state_copies()
        output.states_to_swap_out, output.states_to_swap_in = self.host_tier.take_state_copies()
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

    def _make_scheduled(self, request: Request, num_new: int, step: StepPlan,
                        spec_token_ids: Optional[Mapping[str, Sequence[int]]]) -> ScheduledRequest:
        """The plan of one request; advances its ``num_computed_tokens`` (and placeholders)."""
        start = request.num_computed_tokens
        num_spec = step.num_spec_tokens.get(request.request_id, 0)
        drafts = list(spec_token_ids[request.request_id][:num_spec]) if num_spec else []
        end = start + num_new - num_spec
        assert not (drafts and request.num_output_placeholders), "drafts need the previous step applied"
        assert end <= request.num_tokens + request.num_output_placeholders, "scheduled past the placeholders"
        assert request.num_tokens >= end - 1, "more than one placeholder token in a step"
        is_sampling = end == request.num_tokens + request.num_output_placeholders
        # A delta: blocks and tokens the runner lacks (core.sched.runner_view).
        is_new, new_block_ids, skip = self.runner_view.plan(
            request, start, self.kv_cache_manager.get_group_block_ids(request.request_id), is_sampling)
        scheduled = ScheduledRequest(request, num_computed_tokens=start, num_new_tokens=num_new,
                                     token_ids=request.all_token_ids[start + skip:end] + drafts, is_new=is_new,
                                     new_block_ids=new_block_ids, is_sampling=is_sampling, spec_token_ids=drafts)
        request.num_computed_tokens += num_new
        if scheduled.is_sampling:
            request.num_output_placeholders += 1
        return scheduled

    def _schedule_running(self, step: StepPlan, spec_token_ids: Mapping[str, Sequence[int]],
                          hold: Optional[PrefillHold]) -> None:
        for request in list(self.running):
            if step.is_full:
                break
            if request.status != RequestStatus.RUNNING or request.request_id in self._busy:
                continue  # preempted earlier in this pass, or its step is in flight (batch queue)
            if request.num_output_placeholders and (request.beam_group or _is_sure_to_finish(request)):
                continue  # its last token is being sampled, or its group must choose it (async scheduling)
            if hold is not None and hold.holds(request):
                continue  # a more urgent prompt may prefill in this step (core.sched.prefill_hold)
            self._schedule_one(request, step, spec_token_ids, may_preempt=True)

    def _schedule_one(self, request: Request, step: StepPlan, spec_token_ids: Mapping[str, Sequence[int]],
                      may_preempt: bool) -> None:
        """A running request's tokens for this step: its chunk, or its decode (with drafts); when
        the KV cache cannot hold them, preempt the policy's victims (``may_preempt``) or skip it."""
        num_left = request.num_tokens + request.num_output_placeholders - request.num_computed_tokens
        num_new = step.capped(min(num_left, step.budget))
        if num_new <= 0:
            return
        if self._schedule_with_drafts(request, spec_token_ids.get(request.request_id), step):
            return
        num_new = self.kv_cache_manager.cut_at_checkpoint(request, request.num_computed_tokens, num_new)
        if (num_new := step.cut_at_images(request, request.num_computed_tokens, num_new)) <= 0:
            return  # its next image waits for the next step's encoder budget
        while self.kv_cache_manager.allocate_slots(request, num_new) is None:
            if not may_preempt:
                return
            self.preemption.preempt(self.policy.victim(self.running), step)
            if request.status != RequestStatus.RUNNING:  # itself, or a beam of its group
                return
        step.add(request, num_new)

    def _schedule_with_drafts(self, request: Request, drafts: Optional[Sequence[int]], step: StepPlan) -> bool:
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
            if request.beam_group is not None:  # its group chooses its token (request_groups.beam_search)
                self.kv_cache_manager.cache_blocks(request, computed_end)
                continue
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
            status = request.check_stop(token_id, self.config.max_model_len)
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
            self.runner_view.forget(request.request_id)  # the runner may not have applied the step
            self.kv_cache_manager.undo(request)
            if scheduled.is_sampling:
                request.num_output_placeholders -= 1
            if request.status == RequestStatus.RUNNING:
                request.num_computed_tokens = min(request.num_computed_tokens, scheduled.num_computed_tokens)


def _is_sure_to_finish(request: Request) -> bool:
    """Whether the tokens being sampled already reach ``max_tokens``."""
    return request.num_output_tokens + request.num_output_placeholders >= request.max_tokens

