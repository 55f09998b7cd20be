"""Admission constraints: the rules that may hold a waiting request back, as a list.

The scheduler admits waiting requests in policy order until the budget, the sequence limit
or the KV cache says stop. Each entry here adds one rule, asked at one of two points:

- ``before_lookup(request)``, before its prefix-cache lookup;
- ``after_lookup(request, step, num_hit)``, once its cached prefix (``num_hit`` tokens)
  is known.

Each answers ``Admit.YES`` (go on), ``Admit.SKIP`` (leave this request at the front of the
queue and try the ones behind it: the only exception to strict policy order) or
``Admit.STOP`` (admit nothing more this step). ``begin_step(running)`` comes first in
every ``schedule()``; ``running`` is the scheduler's own list, updated as requests are
admitted. A new scheduling rule is a new class here, registered in
``make_constraints``; the scheduler's admission loop does not change.

Entries:
- ``LoRASlotLimit`` (``max_loras > 0``): the running set never needs more than ``max_loras``
  adapters. A request whose adapter cannot get a slot is skipped (as vLLM does) so that
  requests of resident adapters and of the base model behind it still run; so that it is
  not starved by a steady stream for the resident adapters, one of them is *drained*: the
  active adapter with the fewest running requests (ties: by name) takes no new request
  while another waits for a slot. Its count only falls, so a slot frees and the skipped
  request (back at the queue's front) takes it.
- ``SharedPrefixWait`` (``min_shared_prefix_to_wait > 0``): a request whose next
  ``min_tokens`` (or more) uncached tokens are blocks this step already computes for
  another request stops admission: admitted together, both would prefill the same prefix;
  one step later those blocks are cached and it hits them. A burst of requests sharing a
  long prompt therefore prefills it once, for one step of extra wait.
- ``BeamGroupReserve`` (always; asks nothing of other requests): a beam-search group
  (``request_groups.beam_search``) is one admission unit with its worst-case need. While none of
  its beams runs (its first admission, or after the group was preempted), its beam stops
  admission until the free blocks, plus its cached prefix, cover the group's worst case
  (``BeamGroup.worst_case_blocks``), so a group is not admitted only to be preempted by
  its own forks.
"""

from __future__ import annotations

import enum
from typing import Callable, Optional, Sequence

from pagoda.engine.core.sched.step_plan import StepPlan
from pagoda.engine.request import Request, RequestStatus


class Admit(enum.Enum):
    YES = "yes"
    SKIP = "skip"  # try the requests behind it; it stays at the front
    STOP = "stop"  # admit nothing more this step


class AdmissionConstraint:
    """Base: admits everything. Subclasses override the hooks they need."""

    def begin_step(self, running: Sequence[Request]) -> None:
        pass

    def before_lookup(self, request: Request) -> Admit:  # noqa: ARG002
        return Admit.YES

    def after_lookup(self, request: Request, step: StepPlan, num_hit: int) -> Admit:  # noqa: ARG002
        return Admit.YES


class LoRASlotLimit(AdmissionConstraint):
    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self._running: Sequence[Request] = ()
        self._draining: Optional[str] = None  # the adapter held back while another waits for a slot

    def begin_step(self, running: Sequence[Request]) -> None:
        self._running = running
        self._draining = None

    def before_lookup(self, request: Request) -> Admit:
        adapter_id = request.adapter_id
        if adapter_id is None or (adapter_id != self._draining and self.can_admit(adapter_id, self._running)):
            return Admit.YES
        if self._draining is None:
            self._draining = self.to_drain(self._running)
        return Admit.SKIP

    def can_admit(self, adapter_id: Optional[str], running: Sequence[Request]) -> bool:
        if adapter_id is None:
            return True
        active = {r.adapter_id for r in running if r.adapter_id is not None}
        return adapter_id in active or len(active) < self.max_loras

    @staticmethod
    def to_drain(running: Sequence[Request]) -> Optional[str]:
        """The active adapter with the fewest running requests (ties: by name); None if none."""
        counts: dict[str, int] = {}
        for r in running:
            if r.adapter_id is not None:
                counts[r.adapter_id] = counts.get(r.adapter_id, 0) + 1
        return min(counts, key=lambda name: (counts[name], name)) if counts else None


class SharedPrefixWait(AdmissionConstraint):
    def __init__(self, min_tokens: int) -> None:
        self.min_tokens = min_tokens

    def after_lookup(self, request: Request, step: StepPlan, num_hit: int) -> Admit:
        return Admit.STOP if step.num_shared_computing(request, num_hit) >= self.min_tokens else Admit.YES


class BeamGroupReserve(AdmissionConstraint):
    def __init__(self, num_free_blocks: Callable[[], int], block_size: int) -> None:
        self.num_free_blocks = num_free_blocks
        self.block_size = block_size

    def after_lookup(self, request: Request, step: StepPlan, num_hit: int) -> Admit:  # noqa: ARG002
        group = request.beam_group
        if group is None or any(m.status == RequestStatus.RUNNING for m in group.members):
            return Admit.YES
        need = group.worst_case_blocks - num_hit // self.block_size
        return Admit.YES if self.num_free_blocks() >= need else Admit.STOP


def make_constraints(max_loras: int, min_shared_prefix_to_wait: int, num_free_blocks: Callable[[], int],
                     block_size: int) -> list[AdmissionConstraint]:
    """The constraints a scheduler with these settings applies, in the order they are asked."""
    constraints: list[AdmissionConstraint] = []
    if max_loras > 0:
        constraints.append(LoRASlotLimit(max_loras))
    if min_shared_prefix_to_wait > 0:
        constraints.append(SharedPrefixWait(min_shared_prefix_to_wait))
    constraints.append(BeamGroupReserve(num_free_blocks, block_size))  # a no-op without beam search
    return constraints
