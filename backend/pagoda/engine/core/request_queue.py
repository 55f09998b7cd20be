"""Waiting queues of the scheduler: one small strategy class per scheduling policy.

``fcfs`` serves requests in arrival order and puts preempted ones back at the front;
``priority`` serves the smallest ``(priority, arrival_time, insertion_index)`` first (a
smaller ``priority`` value is more urgent, as in vLLM) and re-sorts preempted ones.
``policy_key`` is the same order, used to pick preemption victims (largest key first).
"""

from __future__ import annotations

import heapq
from collections import deque
from typing import Iterator

from pagoda.engine.request import Request


class FcfsQueue:
    """Arrival order; preempted requests go back to the front."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def add_preempted(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        self._queue.remove(request)  # aborts only; O(n) is fine here

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityQueue:
    """Smallest (priority, arrival_time, insertion_index) first; preempted ones re-sort."""

    def __init__(self) -> None:
        self._heap: list[tuple[tuple, Request]] = []

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, (policy_key(request, "priority"), request))

    add_preempted = add

    def peek(self) -> Request:
        return self._heap[0][1]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[1]

    def remove(self, request: Request) -> None:
        self._heap = [entry for entry in self._heap if entry[1] is not request]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[1] for entry in sorted(self._heap, key=lambda e: e[0]))


def policy_key(request: Request, policy: str) -> tuple:
    """Smaller runs first; the running request with the largest key is preempted first."""
    order = (request.arrival_time, request.insertion_index)
    return (request.priority, *order) if policy == "priority" else order
