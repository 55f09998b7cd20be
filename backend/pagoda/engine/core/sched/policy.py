"""Scheduling policies as objects: the waiting order, the preemption victim, and whether a
waiting request may preempt a running one. Looked up once (``get_policy``) by the scheduler.

- ``fcfs``: arrival order; preempted requests go back to the front; a waiting request
  never preempts.
- ``priority``: the smallest ``(priority, arrival_time, insertion_index)`` first (a
  smaller ``priority`` value is more urgent, as in vLLM); a waiting request preempts the
  least urgent running one when that one is strictly less urgent; and a running request's
  prefill chunk waits while a strictly more urgent prompt prefills in the same step
  (``prefill_hold``), so the urgent one's step is not lengthened by the other's chunk.

Either way the running request with the largest ``key`` is the preemption victim when the
KV cache runs out.
"""

from __future__ import annotations

from typing import Sequence, Union

from pagoda.engine.core.sched.request_queue import FcfsQueue, PriorityQueue
from pagoda.engine.request import Request


class FcfsPolicy:
    name = "fcfs"
    holds_prefill = False  # whether a more urgent prompt holds back less urgent prefill chunks (prefill_hold)

    @staticmethod
    def key(request: Request) -> tuple:
        """Smaller runs first; the running request with the largest key is preempted first."""
        return (request.arrival_time, request.insertion_index)

    def make_queue(self) -> Union[FcfsQueue, PriorityQueue]:
        return FcfsQueue()

    def victim(self, running: Sequence[Request]) -> Request:
        return max(running, key=self.key)

    def preempts_for(self, waiting: Request, victim: Request) -> bool:  # noqa: ARG002 - never
        """Whether admitting ``waiting`` justifies preempting running ``victim``."""
        return False


class PriorityPolicy(FcfsPolicy):
    name = "priority"
    holds_prefill = True

    @staticmethod
    def key(request: Request) -> tuple:
        return (request.priority, request.arrival_time, request.insertion_index)

    def make_queue(self) -> Union[FcfsQueue, PriorityQueue]:
        return PriorityQueue(self.key)

    def preempts_for(self, waiting: Request, victim: Request) -> bool:
        return victim.priority > waiting.priority


POLICIES = {policy.name: policy for policy in (FcfsPolicy(), PriorityPolicy())}


def get_policy(name: str) -> FcfsPolicy:
    """The policy named ``name``.

    Raises:
        ValueError: no such policy.
    """
    if name not in POLICIES:
        raise ValueError(f"policy: must be one of {tuple(POLICIES)}, got {name!r}")
    return POLICIES[name]
