"""Holding back less urgent prefill chunks: under the priority policy, a running request's prompt
chunk waits while a strictly more urgent request prefills in the same step.

Why: a step's time grows with its tokens (on a CPU at any size; on an accelerator once a step is
compute-bound, e.g. with long chunks), and a running request's chunk is scheduled before any
waiting request is admitted. So a more urgent short request arriving while a less urgent long
prompt prefills waits for its own step *and* pays for the other's chunk in it, up to twice its
time to first token. The router's flow control ranks a tenant below its fair share before one
above it (``fleet.gate.fair_queue``, "Rank at the replica"); this is how the replica keeps that
order inside its batch, beside admission order and preemption (``policy``).

Rule, per ``schedule()`` call (the scheduler asks only when ``policy.holds_prefill``):

1. before the running pass, the *bar* is the smallest ``priority`` among the running requests
   that are prefilling (more than one known token left to compute) and the waiting queue's head;
   a prefilling running request less urgent than the bar gets no tokens in the running pass
   (``holds``: it is *held*);
2. waiting requests are admitted as usual (they may preempt a held request: it is the least
   urgent);
3. after admission, the held requests at least as urgent as every prefill now in the step, and
   as every other held request, are scheduled after all (``take_released``), without preempting
   anyone; the others wait for the next step. So a chunk is held only when a strictly more
   urgent prompt really runs in this step: if the head could not be admitted (no slot, a LoRA
   slot, the KV cache), nothing was held for it. Decodes are never held (one token each).

Equal priorities never hold each other back (strictly more urgent only), as they never preempt
each other, so equals share steps as under FCFS. A less urgent prompt waits as long as more
urgent prompts keep prefilling: that is the priority policy's meaning (its waiting requests
wait the same way); its decode tokens and its KV blocks are kept.
"""

from __future__ import annotations

from typing import Container, Iterable, Optional, Sequence

from pagoda.engine.request import Request, RequestStatus


def is_prefilling(request: Request) -> bool:
    """More than one known token left to compute: a prompt (or a recomputed output) chunk, not a decode."""
    return request.num_computed_tokens < request.num_tokens - 1


class PrefillHold:
    """One ``schedule()`` call's held prefill chunks (module docstring).

    Args:
        running: the running requests, in the scheduler's order.
        waiting_head: the waiting request admission tries first, if any.
        busy: ids with a step in flight (batch queue): neither held nor counted.
    """

    def __init__(self, running: Sequence[Request], waiting_head: Optional[Request],
                 busy: Container[str] = frozenset()) -> None:
        urgencies = [r.priority for r in running if is_prefilling(r) and r.request_id not in busy]
        if waiting_head is not None and waiting_head.request_id not in busy:
            urgencies.append(waiting_head.priority)
        self.bar: Optional[int] = min(urgencies, default=None)
        self.held: list[Request] = []

    def holds(self, request: Request) -> bool:
        """Whether running ``request`` gets no tokens in the running pass (recorded as held)."""
        if self.bar is None or request.priority <= self.bar or not is_prefilling(request):
            return False
        self.held.append(request)
        return True

    def take_released(self, scheduled: Iterable[Request]) -> list[Request]:
        """The held requests to schedule after admission, in the running order: those at least as
        urgent as every prefill in the step (``scheduled``: the requests the step holds so far)
        and as every held one; the rest stay held. Empties the held list."""
        held, self.held = self.held, []
        live = [r for r in held if r.status == RequestStatus.RUNNING]  # admission may have preempted one
        prefills = [r.priority for r in scheduled if is_prefilling(r)] + [r.priority for r in live]
        if not prefills:
            return []
        bar = min(prefills)
        return [r for r in live if r.priority <= bar]
