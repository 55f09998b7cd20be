"""Admission of waiting requests into a step, in policy order (the second pass of ``schedule()``).

After the running requests got their tokens, and only if nothing was preempted, waiting
requests are admitted in the policy's order until one cannot be: the budget, the sequence
limit or the KV cache is exhausted, or an admission constraint (``core.sched.constraints``) says
stop. For each request:

1. constraints asked before the prefix lookup may set it aside (``Admit.SKIP``: it goes
   back to the queue's front after this pass, requests behind it go on) or stop;
2. a swapped-out request (host tier) gets fresh blocks filled from its host blocks;
3. otherwise its prefix-cache lookup (device, then the host tier continuing it) sets
   ``num_cached_tokens`` (first admission only) and moves ``num_computed_tokens`` to the
   hit (none for a request asking for prompt log-probabilities: cached positions have no
   logits, so it computes its whole prompt, as vLLM skips prefix-cache hits for it); constraints asked after the
   lookup may stop admission; the rest of the prompt is scheduled (a chunk of it with chunked prefill, else all or
   nothing: ``StepPlan.chunk``);
4. when blocks or sequence slots run out, the policy may preempt a strictly less urgent
   running request (priority); the lookup is repeated, as the victim's blocks may have
   been part of the hit.

Admission stops at the first request that does not fit, or that was preempted while a step
holding it is still in flight (``busy``, batch queue), so policy order is never
violated except by ``SKIP``. Host blocks read for a hit stay pinned until the step's
copies are taken, so a later eviction in the same step cannot reuse them.
"""

from __future__ import annotations

from typing import Callable, Container, NamedTuple, Optional, Sequence

from pagoda.engine.core.sched.constraints import AdmissionConstraint, Admit
from pagoda.engine.core.sched.policy import FcfsPolicy
from pagoda.engine.core.sched.request_queue import FcfsQueue, PriorityQueue
from pagoda.engine.core.sched.step_plan import StepPlan
from pagoda.engine.kv.block_pool import KVCacheBlock
from pagoda.engine.kv.host_tier import HostTier
from pagoda.engine.kv.kv_cache_manager import CacheHit, KVCacheManager
from pagoda.engine.request import Request, RequestStatus


class PrefixHit(NamedTuple):
    """A waiting request's cached prefix: the device hit (every KV cache group's tables), the
    host blocks continuing group 0's, tokens in all; a hybrid's host state checkpoint where the
    hit ends (``kv.host_states``) and the hit's tokens only the CPU tier made usable."""

    device: Optional[CacheHit]
    host_blocks: list[KVCacheBlock]
    num_tokens: int
    host_state: Optional[KVCacheBlock] = None
    num_host_tokens: int = 0


class WaitingAdmitter:
    """Admits the scheduler's waiting requests; holds references to the scheduler's parts.

    Args:
        running: the scheduler's running list (appended to on admission).
        preempt: the scheduler's ``Preemption.preempt(victim, step)`` (``sched.preemption``).
    """

    def __init__(self, waiting: FcfsQueue | PriorityQueue, running: list[Request], kv_cache_manager: KVCacheManager,
                 host_tier: HostTier, policy: FcfsPolicy, constraints: Sequence[AdmissionConstraint],
                 preempt: Callable[[Request, StepPlan], None], max_num_seqs: int, block_size: int,
                 busy: Container[str] = frozenset()) -> None:
        self.waiting = waiting
        self.running = running
        self.kv_cache_manager = kv_cache_manager
        self.host_tier = host_tier
        self.policy = policy
        self.constraints = constraints
        self.preempt = preempt
        self.max_num_seqs = max_num_seqs
        self.block_size = block_size
        self.busy = busy  # batch queue: ids with a step in flight (preempted meanwhile: not admitted yet)

    def admit(self, step: StepPlan) -> None:
        """Admit waiting requests into ``step`` (see the module docstring)."""
        skipped: list[Request] = []  # set aside by a constraint; back at the front afterwards
        try:
            self._admit_waiting(step, skipped)
        finally:
            for request in reversed(skipped):
                self.waiting.add_preempted(request)

    def _admit_waiting(self, step: StepPlan, skipped: list[Request]) -> None:
        """Admit waiting requests in policy order until one cannot be (``skipped``: those
        an admission constraint set aside; they go back to the front afterwards)."""
        for constraint in self.constraints:
            constraint.begin_step(self.running)
        while len(self.waiting) > 0 and not step.is_full:
            request = self.waiting.peek()
            if request in step.preempted or request.request_id in self.busy:
                break
            assert request.num_output_placeholders == 0, "a waiting request's last step was not applied"
            verdict = self._ask_constraints(lambda c: c.before_lookup(request))
            if verdict is Admit.SKIP:
                skipped.append(self.waiting.pop())
                continue
            if verdict is Admit.STOP:
                break
            if len(self.running) >= self.max_num_seqs and not self._preempt_for(request, step):
                break
            is_admitted = (self._admit_swapped(request, step) if self.host_tier.is_swapped_out(request.request_id)
                           else self._admit_fresh(request, step))
            if not is_admitted:
                break

    def _ask_constraints(self, ask) -> Admit:
        """The first answer other than YES among the constraints, in order; else YES."""
        for constraint in self.constraints:
            verdict = ask(constraint)
            if verdict is not Admit.YES:
                return verdict
        return Admit.YES

    def _admit_fresh(self, request: Request, step: StepPlan) -> bool:
        """Admit a request from its prefix hit on: allocate (preempting under the priority
        policy) and schedule the rest of its prompt, or a chunk of it. False: it does not
        fit or must wait (admission stops)."""
        hit = self._lookup_prefix(request)
        if self._ask_constraints(lambda c: c.after_lookup(request, step, hit.num_tokens)) is not Admit.YES:
            return False
        while (num_new := step.chunk(request.num_tokens - hit.num_tokens)) is not None:
            if step.enable_chunked_prefill:  # a prefill chunk ends where a state checkpoint is due
                num_new = self.kv_cache_manager.cut_at_checkpoint(request, hit.num_tokens, num_new, hit.device)
            if (num_new := step.cut_at_images(request, hit.num_tokens, num_new)) <= 0:
                return False  # its first image waits for the next step's encoder budget
            new_blocks = self._allocate_with_hit(request, num_new, hit)
            if new_blocks is not None:
                self._start_running(request, step, num_new, hit, new_blocks)
                return True
            if not self._preempt_for(request, step):
                return False
            hit = self._lookup_prefix(request)  # the victim's blocks may have been part of the hit
        return False

    def _start_running(self, request: Request, step: StepPlan, num_new: int, hit: PrefixHit,
                       new_blocks: list[KVCacheBlock]) -> None:
        self.waiting.pop()
        if hit.host_blocks:
            self.host_tier.copy_back(hit.host_blocks, [b.block_id for b in new_blocks[:len(hit.host_blocks)]])
        if hit.host_state is not None:  # counted as host hits: the tokens beyond the host blocks' own
            self.host_tier.restore_state(hit.host_state, self.kv_cache_manager.working_slot(request.request_id),
                                         hit.num_tokens, hit.num_host_tokens - len(hit.host_blocks) * self.block_size)
        step.admitted.add(request.request_id)
        self.kv_cache_manager.record_prefix_lookup(request.num_tokens, hit.num_tokens)
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = hit.num_tokens
        request.num_computed_tokens = hit.num_tokens
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        step.add(request, num_new)

    def _lookup_prefix(self, request: Request) -> PrefixHit:
        params = request.sampling_params
        if params.prompt_logprobs is not None or params.return_context_logits:
            return PrefixHit(None, [], 0)  # cached positions have no logits: compute the whole prompt (as vLLM)
        hit = self.kv_cache_manager.find_cache_hit(request)
        if not self.kv_cache_manager.enable_caching:
            return PrefixHit(hit, [], hit.num_tokens)
        max_blocks = (request.num_tokens - 1) // self.block_size
        host_hit = self.host_tier.lookup_prefix(request.block_hashes, request.all_token_ids,
                                                hit.num_attention_tokens // self.block_size, max_blocks)
        # The other groups may follow only part of it (a state group: up to its last checkpoint,
        # on the device or in the CPU tier).
        extended, num_host, host_state = self.kv_cache_manager.usable_loaded_blocks(
            hit, len(host_hit), request, self.host_tier.states)
        num_tokens = extended.num_tokens + num_host * self.block_size
        return PrefixHit(extended, host_hit[:num_host], num_tokens, host_state, num_tokens - hit.num_tokens)

    def _allocate_with_hit(self, request: Request, num_new: int, hit: PrefixHit) -> Optional[list[KVCacheBlock]]:
        """``allocate_slots`` with a prefix hit; host hits stay pinned on success."""
        self.host_tier.pin(hit.host_blocks)  # evictions during allocation must not reuse the host blocks we read
        self.host_tier.states.pin(hit.host_state)
        new_blocks = self.kv_cache_manager.allocate_slots(request, num_new, hit.device, len(hit.host_blocks))
        if new_blocks is None:
            self.host_tier.unpin(hit.host_blocks)
            self.host_tier.states.unpin(hit.host_state)
        return new_blocks

    def _admit_swapped(self, request: Request, step: StepPlan) -> bool:
        """Admit a swapped-out request: new blocks, filled from its host blocks. False: it
        does not fit (admission stops)."""
        num_new = step.chunk(request.num_tokens - request.num_computed_tokens)
        if num_new is None:
            return False
        while self.kv_cache_manager.allocate_slots(request, num_new) is None:
            if not self._preempt_for(request, step):
                return False if self.running else self._recompute_swapped(request, step)
        self.waiting.pop()
        self.host_tier.swap_in(request.request_id, *self.kv_cache_manager.get_swap_block_ids(request))
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        step.add(request, num_new)
        step.admitted.add(request.request_id)
        return True

    def _recompute_swapped(self, request: Request, step: StepPlan) -> bool:
        """Nothing runs, so no block will come free, yet the swap-in does not fit: allocating a
        sliding window's table from position 0 peaks above what the request holds once the
        blocks before its window are freed. Drop the host copy and admit it to recompute, as a
        recompute preemption would have (else admission would wait for it forever)."""
        self.host_tier.free_request(request.request_id)
        request.num_computed_tokens = 0
        return self._admit_fresh(request, step)

    def _preempt_for(self, request: Request, step: StepPlan) -> bool:
        """Preempt the policy's victim if the policy lets waiting ``request`` displace it
        (priority: strictly less urgent). Returns whether one was preempted."""
        if not self.running:
            return False
        victim = self.policy.victim(self.running)
        if not self.policy.preempts_for(request, victim):
            return False
        self.preempt(victim, step)
        return True
