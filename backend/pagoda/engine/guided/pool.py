"""The grammar compile pool: bounded in time and threads, fair across tenants, cancellable.

A compile runs in C++ (xgrammar) and cannot be interrupted from Python, so the pool never
kills one; it stops *waiting* for it:

- **Time budget**: a compile running longer than ``timeout_s`` (``guided_compile_timeout_s``)
  fails its future at the deadline (checked by ``expire``, which the engine calls every
  step), so only the requests waiting for that format fail, with an error naming the
  limit. Its thread, still busy in C++, is counted in ``num_stuck`` until the call returns
  (its late result is dropped), and its running slot goes to the next queued compile.
- **Bounded threads**: at most ``max_workers`` compiles run within their budget; at most
  ``max_stuck`` threads are stuck. With all of them stuck, ``submit`` raises
  ``CompilePoolFull`` (the engine answers an overload: retry later or elsewhere), so the
  pool never holds more than ``max_workers + max_stuck`` threads.
- **Fairness**: queued compiles wait per tenant (the request's ``cache_salt``); a free slot
  goes to the tenant served least recently (a tenant with nothing queued or running is
  new, and goes first), FIFO within a tenant, so one tenant's backlog delays another's compile by at most the compiles
  already running.
- **Cancellation**: ``discard`` removes a queued job that nobody waits for any more; it
  never starts.

Threads are started per job (a compile takes milliseconds to minutes; a thread start is
~0.1 ms) and end with it. Every method is thread-safe (one lock).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import Any, Callable, Optional


class CompilePoolFull(RuntimeError):
    """Every stuck-compile slot is taken; no new compile is accepted until one returns."""


class CompileJob:
    """One compile: ``future`` ends with the compiled grammar or the error."""

    def __init__(self, fn: Callable[[], Any], tenant: str) -> None:
        self.fn = fn
        self.tenant = tenant
        self.future: Future = Future()
        self.started_at: Optional[float] = None
        self.timed_out = False
        self.num_waiters = 0  # requests waiting for it (kept by the manager)


class CompilePool:
    def __init__(self, max_workers: int, timeout_s: float, max_stuck: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._max_workers = max_workers
        self._timeout_s = timeout_s
        self._max_stuck = max_stuck
        self._clock = clock
        self._lock = threading.Lock()
        self._queues: dict[str, deque[CompileJob]] = {}
        self._last_served: dict[str, int] = {}  # tenants with queued or running jobs only
        self._turn = itertools.count()
        self._running: set[CompileJob] = set()
        self.num_stuck = 0

    def submit(self, fn: Callable[[], Any], tenant: str) -> CompileJob:
        """Queue ``fn`` for ``tenant``; raises ``CompilePoolFull`` when every stuck slot is taken."""
        with self._lock:
            if self.num_stuck >= self._max_stuck:
                raise CompilePoolFull(
                    f"guided_decoding: {self.num_stuck} grammar compiles ran past guided_compile_timeout_s="
                    f"{self._timeout_s:g} s and are still running (guided_max_stuck_compiles={self._max_stuck}); "
                    f"no new grammar is compiled until one ends")
            job = CompileJob(fn, tenant)
            if tenant not in self._queues:
                self._queues[tenant] = deque()
                self._last_served.setdefault(tenant, -1)
            self._queues[tenant].append(job)
            self._dispatch()
        return job

    def discard(self, job: CompileJob) -> bool:
        """Drop a job that has not started (it never will); ``False`` when it already started."""
        with self._lock:
            if job.started_at is not None:
                return False
            queue = self._queues.get(job.tenant)
            if queue is not None and job in queue:
                queue.remove(job)
                if not queue:
                    self._forget(job.tenant)
            job.future.cancel()
            return True

    def expire(self) -> None:
        """Fail every running compile past its time budget; count its thread as stuck."""
        now = self._clock()
        with self._lock:
            for job in [j for j in self._running if now - j.started_at > self._timeout_s]:
                self._running.discard(job)
                self._done(job.tenant)
                job.timed_out = True
                self.num_stuck += 1
                job.future.set_exception(ValueError(
                    f"guided_decoding: the grammar did not compile within guided_compile_timeout_s="
                    f"{self._timeout_s:g} s; a simpler format (fewer or shorter bounded fields) compiles faster"))
            self._dispatch()

    def next_deadline(self) -> Optional[float]:
        """Seconds until the first running compile times out (``None``: none running)."""
        with self._lock:
            if not self._running:
                return None
            return max(0.0, min(j.started_at for j in self._running) + self._timeout_s - self._clock())

    # ---- under the lock ------------------------------------------------------------------
    def _dispatch(self) -> None:
        while len(self._running) < self._max_workers and self._queues:
            tenant = min(self._queues, key=self._last_served.__getitem__)  # ties: first queued
            queue = self._queues[tenant]
            job = queue.popleft()
            self._last_served[tenant] = next(self._turn)
            job.started_at = self._clock()
            self._running.add(job)
            if not queue:
                self._forget(tenant)
            threading.Thread(target=self._run, args=(job,), name="pagoda-grammar", daemon=True).start()

    def _forget(self, tenant: str) -> None:
        del self._queues[tenant]
        if not any(job.tenant == tenant for job in self._running):
            del self._last_served[tenant]

    def _run(self, job: CompileJob) -> None:
        try:
            result, error = job.fn(), None
        except BaseException as exc:  # noqa: BLE001 - the request gets it
            result, error = None, exc
        with self._lock:
            if job.timed_out:
                self.num_stuck -= 1  # its requests already failed; the late result is dropped
            else:
                self._running.discard(job)
                if error is None:
                    job.future.set_result(result)
                else:
                    job.future.set_exception(error)
                self._done(job.tenant)
            self._dispatch()

    def _done(self, tenant: str) -> None:
        """A job of ``tenant`` left the running set: forget the tenant when it has no other."""
        if tenant not in self._queues and not any(job.tenant == tenant for job in self._running):
            self._last_served.pop(tenant, None)
