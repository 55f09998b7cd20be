"""Admission control: a bound on a replica's waiting queue, priority shedding, deadlines.

Without a bound, a burst queues everything: 200 requests on a replica that runs 8 at a
time made the last one wait 83 s, and every queued prompt holds host memory. ``Admission``
is a small constraint object the engine consults once per new request
(``can_admit``) and once per step (``take_expired``); the scheduler's hot path is not
touched.

Bound (``EngineConfig.max_waiting_requests`` / ``max_waiting_prompt_tokens``): a request
is admitted while the waiting queue, with it added, holds at most ``max_waiting_requests``
requests and at most ``max_waiting_prompt_tokens`` not-yet-computed tokens. The waiting
queue is every request not admitted yet (``EngineCore.queued_requests``): the scheduler's
queue, ``n`` siblings held for their first child's prompt, and guided requests waiting
for their grammar. Running requests do not count: the scheduler already bounds them
(``max_num_seqs``, the KV cache).
A request that alone exceeds the token bound can never be admitted: that is a
``ValueError`` (a 400), not an overload.

Capacity (``max_queue_delay_s``, 0: off; the server's default is 30 s): constants alone do
not protect a replica (1,024 waiting requests on one CPU replica waited 69 s at the median).
So the bound also follows measured capacity: ``observe_service`` keeps an exponential mean
of how long finished requests ran (first scheduled to finished), and a new request is
refused when, with ``slots`` requests running at a time (``max_num_seqs``), the queue ahead
of it would take longer than ``max_queue_delay_s`` to reach a slot:
``(queued + 1 - free slots) / slots x mean service time``. Until ``MIN_SERVICE_SAMPLES``
requests have finished nothing is known and only the constant bounds apply. The estimate
is Little's law on the replica's own recent work, so a replica serving long answers queues
fewer requests than one serving short ones, and a faster device queues more.

Priority (smaller ``priority`` is more urgent, as everywhere in the engine): when the
bound is reached, a new request may displace waiting requests that are strictly less
urgent and were never scheduled (they hold no KV blocks), least urgent and latest first,
until it fits. The displaced requests end with the overload error; a request that cannot
displace enough is refused with it. So under pressure the lowest priorities are shed
first, and a flood of low-priority traffic never blocks an urgent request.

Overload error: ``EngineOverloaded`` (refused at ``add_request``) and a displaced
request's final output carry a message starting with ``OVERLOADED_PREFIX`` and a retry
hint (``retry_after_s``); the prefixes are wire formats and live in
``pagoda.contracts.errors``, whose ``classify_replica_error`` is how routers read them. The serving layer answers it
with Triton's ``UNAVAILABLE`` (HTTP 503); the router tries a replica with room and, when every replica is full, answers
OpenAI clients with 429 and ``Retry-After``.

Deadlines: a request may carry ``timeout`` (seconds from arrival). A request still
unfinished at its deadline ends with an error starting with ``DEADLINE_PREFIX``, whether
it is waiting (it held no blocks) or running (its blocks are released by reference count,
so blocks it shares with other requests stay theirs). Deadlines sit in a heap; each step
pops only the expired ones, O(log n) per request.
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

from pagoda.contracts.errors import DEADLINE_PREFIX, DEFAULT_RETRY_AFTER_S, OVERLOADED_PREFIX
from pagoda.engine.request import Request, RequestStatus


class EngineOverloaded(RuntimeError):
    """The waiting queue is full; the request was not queued. Retry later or elsewhere."""

    def __init__(self, message: str, retry_after_s: float = DEFAULT_RETRY_AFTER_S) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass
class Verdict:
    """``can_admit``'s answer: admit (after displacing ``victims``) or refuse with ``reason``."""

    admit: bool
    victims: list[Request]
    reason: str = ""


def overload_message(reason: str, retry_after_s: float = DEFAULT_RETRY_AFTER_S) -> str:
    """The overload error text: prefix, why, and the retry hint."""
    return (f"{OVERLOADED_PREFIX} {reason}; the request was not queued. "
            f"Retry after {math.ceil(retry_after_s)} s or on another replica.")


MIN_SERVICE_SAMPLES = 3
SERVICE_EWMA_WEIGHT = 0.2  # weight of the newest finished request in the mean service time


class Admission:
    """The waiting-queue bound and the deadline heap.

    Args:
        max_waiting_requests: the most requests the waiting queue may hold.
        max_waiting_prompt_tokens: the most not-yet-computed tokens it may hold.
        retry_after_s: the retry hint given with every overload error.
        clock: wall-clock seconds (``time.time``; tests inject their own).
        max_queue_delay_s: the capacity bound (module docstring); 0 turns it off.
        slots: requests that run at a time (``max_num_seqs``).

    ``may_displace`` (default true) turns priority displacement on; the offline ``LLM``
    turns it off, since it feeds a full queue as it drains and every prompt must finish.
    """

    def __init__(self, max_waiting_requests: int, max_waiting_prompt_tokens: int,
                 retry_after_s: float = DEFAULT_RETRY_AFTER_S, clock: Callable[[], float] = time.time,
                 max_queue_delay_s: float = 0.0, slots: int = 1) -> None:
        assert max_waiting_requests >= 1 and max_waiting_prompt_tokens >= 1, "bounds must be positive"
        self.max_waiting_requests = max_waiting_requests
        self.max_waiting_prompt_tokens = max_waiting_prompt_tokens
        self.max_queue_delay_s = max_queue_delay_s
        self.slots = max(1, slots)
        self.mean_service_s: Optional[float] = None
        self.num_service_samples = 0
        self._free_slots = 0  # for the can_admit call in progress
        self.retry_after_s = retry_after_s
        self.clock = clock
        self.may_displace = True
        self._deadlines: list[tuple[float, str, float]] = []  # (deadline, request_id, timeout) heap
        self.num_refused = 0
        self.num_displaced = 0
        self.num_expired = 0

    # ------------------------------------------------------------------ the bound
    def observe_service(self, seconds: float) -> None:
        """A request finished after running ``seconds`` (first scheduled to finished)."""
        if not seconds >= 0:
            return
        self.num_service_samples += 1
        mean = self.mean_service_s
        self.mean_service_s = seconds if mean is None else mean + SERVICE_EWMA_WEIGHT * (seconds - mean)

    def expected_wait_s(self, num_requests: int) -> Optional[float]:
        """Seconds until the last of ``num_requests`` queued requests gets a slot (``None``:
        not measured yet, or the bound is off)."""
        if not self.max_queue_delay_s or self.num_service_samples < MIN_SERVICE_SAMPLES:
            return None
        return max(0, num_requests - self._free_slots) / self.slots * self.mean_service_s

    def can_admit(self, num_tokens: int, priority: int, waiting: Iterable[Request], num_running: int = 0) -> Verdict:
        """Whether a request of ``num_tokens`` prompt tokens fits in the waiting queue.

        Args:
            num_tokens: the new request's prompt tokens (all of them still to compute).
            priority: its priority (smaller is more urgent).
            waiting: the scheduler's waiting queue.
            num_running: requests running now (the capacity bound's free slots).

        Returns:
            A ``Verdict``; on admit, ``victims`` are waiting requests to end with the
            overload error first (less urgent, never scheduled).

        Raises:
            ValueError: the request alone exceeds ``max_waiting_prompt_tokens``.
        """
        if num_tokens > self.max_waiting_prompt_tokens:
            raise ValueError(f"prompt: {num_tokens} tokens exceed this server's max_waiting_prompt_tokens "
                             f"({self.max_waiting_prompt_tokens}); send a shorter prompt")
        queue = list(waiting)
        self._free_slots = max(0, self.slots - num_running)
        num_requests = len(queue) + 1
        num_queued_tokens = sum(_pending_tokens(r) for r in queue) + num_tokens
        if self._fits(num_requests, num_queued_tokens):
            return Verdict(True, [])
        victims: list[Request] = []
        displaceable = [r for r in queue if _is_displaceable(r, priority)] if self.may_displace else []
        for candidate in sorted(displaceable,
                                key=lambda r: (r.priority, r.arrival_time, r.insertion_index), reverse=True):
            victims.append(candidate)
            num_requests -= 1
            num_queued_tokens -= _pending_tokens(candidate)
            if self._fits(num_requests, num_queued_tokens):
                self.num_displaced += len(victims)
                return Verdict(True, victims)
        self.num_refused += 1
        return Verdict(False, [], overload_message(self._refusal(len(queue), num_queued_tokens, num_tokens),
                                                   self.retry_after_s))

    def _refusal(self, num_queued: int, num_queued_tokens: int, num_tokens: int) -> str:
        if num_queued + 1 > self.max_waiting_requests:
            return f"this replica's waiting queue is full ({num_queued} requests, at most {self.max_waiting_requests})"
        if num_queued_tokens > self.max_waiting_prompt_tokens:
            return (f"this replica's waiting queue holds too many prompt tokens ({num_queued_tokens - num_tokens} "
                    f"queued + {num_tokens}, at most {self.max_waiting_prompt_tokens})")
        return (f"this replica's measured capacity would keep the request waiting about "
                f"{self.expected_wait_s(num_queued + 1):.0f} s for a slot ({num_queued} queued, {self.slots} running "
                f"at a time, {self.mean_service_s:.1f} s each on average; at most {self.max_queue_delay_s:g} s: "
                f"max_queue_delay_s)")

    def _fits(self, num_requests: int, num_tokens: int) -> bool:
        if num_requests > self.max_waiting_requests or num_tokens > self.max_waiting_prompt_tokens:
            return False
        wait = self.expected_wait_s(num_requests)
        return wait is None or wait <= self.max_queue_delay_s

    def stats(self) -> dict[str, int]:
        """Counters for ``EngineStats`` (and the server's metrics)."""
        return {"num_admission_refused": self.num_refused, "num_admission_displaced": self.num_displaced,
                "num_deadline_expired": self.num_expired}

    # ------------------------------------------------------------------ deadlines
    def track_deadline(self, request_id: str, deadline: float, timeout: float) -> None:
        """Remember that ``request_id`` must finish by ``deadline`` (wall-clock seconds)."""
        heapq.heappush(self._deadlines, (deadline, request_id, timeout))

    def take_expired(self, now: float) -> list[tuple[str, float]]:
        """(request id, timeout) of the deadlines that passed; some requests may have finished
        already (callers skip those: ids are never reused while live)."""
        expired = []
        while self._deadlines and self._deadlines[0][0] <= now:
            _, request_id, timeout = heapq.heappop(self._deadlines)
            expired.append((request_id, timeout))
        return expired


def is_admission_error(message: str) -> bool:
    """Whether an output's ``error`` came from admission control (overload or deadline)."""
    return message.startswith((OVERLOADED_PREFIX, DEADLINE_PREFIX))


def check_timeout(timeout: Optional[float]) -> None:
    """Validate a request's ``timeout`` (seconds); raises ``ValueError`` naming it."""
    if timeout is None:
        return
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0 or timeout != timeout:
        raise ValueError(f"timeout: must be a number of seconds > 0, got {timeout!r}")


def deadline_message(timeout: float, request: Optional[Request]) -> str:
    """The error of a request that reached its deadline (``request``: a child, to say where it was)."""
    where = ("while waiting in the queue" if request is None or request.num_computed_tokens == 0
             and request.num_output_tokens == 0 else
             f"after {request.num_output_tokens} generated tokens")
    return f"{DEADLINE_PREFIX} the request's timeout of {timeout:g} s passed {where}"


def _pending_tokens(request: Request) -> int:
    return max(0, request.num_tokens - request.num_computed_tokens)


def _is_displaceable(request: Request, priority: int) -> bool:
    """Less urgent than ``priority`` and never scheduled (so it holds no blocks, host or device)."""
    return (request.priority > priority and request.status == RequestStatus.WAITING
            and request.num_computed_tokens == 0 and request.num_output_tokens == 0)
