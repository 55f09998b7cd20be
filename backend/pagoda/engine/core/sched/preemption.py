"""Preemption: how a running request gives its KV blocks back when the cache runs out.

The scheduler (its running pass) and the waiting-queue admission (``admit_waiting``, for a
more urgent waiting request under the priority policy) choose the victim with the policy;
``Preemption.preempt`` carries it out, with every running beam of its group (beams are one
unit: ``request_groups.beam_search``). For each request:

1. by *swap* when the host tier takes it (``kv.host_tier``: the cost model or
   ``preemption_mode`` decides; ``NoHostTier`` never does): its computed blocks are copied to
   host blocks and it keeps ``num_computed_tokens``. A request admitted in this same step,
   or a beam, always recomputes (an admitted request's inbound copies have not run yet);
2. otherwise by *recompute*: ``num_computed_tokens`` goes back to 0;
3. either way its device blocks are freed, the runner forgets it (``preempted_request_ids``),
   it is marked ``PREEMPTED`` and goes back to the waiting queue (``add_preempted``: FCFS puts
   it at the front).

Invariant: ``num_preemptions_total`` equals the sum of every request's ``num_preemptions``;
``num_recomputed_preemptions`` counts those of them that recomputed.
"""

from __future__ import annotations

from pagoda.engine.core.sched.request_queue import FcfsQueue, PriorityQueue
from pagoda.engine.core.sched.runner_view import RunnerView
from pagoda.engine.core.sched.step_plan import StepPlan
from pagoda.engine.kv.host_tier import HostTier, blocks_for_tokens
from pagoda.engine.kv.kv_cache_manager import KVCacheManager
from pagoda.engine.request import Request, RequestStatus


class Preemption:
    """Preempts running requests of the scheduler it shares its queues with.

    Args:
        running: the scheduler's running list (shared, changed in place).
        waiting: the scheduler's waiting queue (shared).
        kv_cache_manager: frees the victims' device blocks.
        host_tier: takes a victim's blocks by swap, or declines (``NoHostTier`` always does).
        runner_view: forgets what the runner held for each victim.
        block_size: tokens per KV block.
    """

    def __init__(self, running: list[Request], waiting: FcfsQueue | PriorityQueue,
                 kv_cache_manager: KVCacheManager, host_tier: HostTier, runner_view: RunnerView,
                 block_size: int) -> None:
        self.running = running
        self.waiting = waiting
        self.kv_cache_manager = kv_cache_manager
        self.host_tier = host_tier
        self.runner_view = runner_view
        self.block_size = block_size
        self.num_preemptions_total = 0
        self.num_recomputed_preemptions = 0

    def preempt(self, victim: Request, step: StepPlan) -> None:
        """Preempt ``victim`` (with every running beam of its group) in this ``step``."""
        for request in victim.beam_group.members if victim.beam_group else [victim]:
            if request.status == RequestStatus.RUNNING:
                self._preempt_one(request, step)

    def _preempt_one(self, request: Request, step: StepPlan) -> None:
        self.running.remove(request)
        step.remove(request)
        if not self._swap_out(request, step):
            request.num_computed_tokens = 0
            self.num_recomputed_preemptions += 1
        self.kv_cache_manager.free(request)
        self.runner_view.forget(request.request_id)  # the runner drops it on preempted_request_ids
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        step.preempted.append(request)
        self.waiting.add_preempted(request)

    def _swap_out(self, request: Request, step: StepPlan) -> bool:
        """Try to preempt ``request`` by swap; False: recompute instead."""
        if request.request_id in step.admitted or request.beam_group is not None:  # beams recompute (beam_search)
            return False
        num_blocks = blocks_for_tokens(request.num_computed_tokens, self.block_size)
        if not self.host_tier.wants_swap(request.num_computed_tokens, num_blocks):
            return False
        # Every KV cache group's live blocks, and a hybrid model's state slot (kv.host_tier).
        return self.host_tier.swap_out(request.request_id, *self.kv_cache_manager.get_swap_block_ids(request))
