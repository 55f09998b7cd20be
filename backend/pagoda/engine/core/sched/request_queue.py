"""Waiting queues of the scheduler, one per kind of order (``core.sched.policy`` picks one).

``FcfsQueue`` serves requests in arrival order and puts preempted ones back at the front;
``PriorityQueue`` serves the smallest key first (the policy's key, e.g. ``(priority,
arrival_time, insertion_index)``) and re-sorts preempted ones.
"""

from __future__ import annotations

import heapq
from collections import deque
from typing import Callable, Iterator

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
    """Smallest ``key(request)`` first; preempted ones re-sort."""

    def __init__(self, key: Callable[[Request], tuple]) -> None:
        self._key = key
        self._heap: list[tuple[tuple, Request]] = []

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, (self._key(request), request))

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

