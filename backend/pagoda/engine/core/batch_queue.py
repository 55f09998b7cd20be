"""The batch queue: up to N steps in flight through N pipeline stages (vLLM v1's
``step_with_batch_queue``), so no stage idles in steady decode.

With ``pipeline_parallel_size = N`` one step is one batch that passes the stages in turn: if
the engine waited for each step's logits before it issued the next, every stage would idle
``(N-1)/N`` of the time. ``BatchQueueCore`` keeps a queue of up to ``micro_batches`` launched
steps instead; one ``step()`` call is::

    if the queue is not full:  schedule -> launch (rank 0: deltas sent, stage 0 run, hidden
                               states handed over; returns at once) -> append
    if a step with requests was launched: return (no wait, no outputs yet)
    else: pop the oldest -> its logits (received from the last stage), sampling ->
          update_from_output -> its outputs

So rank 0 runs stage 0 of step i+1 while the later stages still run step i, and results are
applied in step order. The scheduler (``SchedulerConfig.micro_batches`` N) fills a step only
from requests that have no step in flight: a request's next token is unknown until its step
is applied, so with one running request only one step is ever in flight (and a preempted
request is not admitted back while its old step is in flight). A step takes at most
``ceil(min(live requests, max_num_seqs) / N)`` requests, so the N steps in flight share the
running requests (with one step taking them all, the next would find none free; vLLM v0
split them between its virtual engines, each its own scheduler, and v1 does not split them). Sampling runs
when the step is popped, after every earlier step was applied, so penalties, grammar
matchers and seeded generators see the same history as with one step at a time: outputs
are token-identical.

Async scheduling does not combine with the queue: it schedules a request again before its
token is known (a placeholder), which the queue's rule forbids; under the queue the host's
scheduling already overlaps the later stages. So ``micro_batches > 1`` runs the device jobs
on the engine thread, split in two (``runner.device_worker.SplitStepHandle``), and
``async_scheduling`` is ignored with a warning (vLLM's async scheduling first refused
pipeline parallelism, then combined with it under this same one-step-per-request rule).
``pipeline_micro_batches=1`` keeps one step at a time, async scheduling included.

Abort and finish need nothing more: a queued step holding a request that ended has its
tokens dropped when it is applied (``Scheduler.update_from_output``), and its KV writes land
before any later step reuses the freed blocks (each stage runs the steps in order).

``step_events`` records ``("issue", step_id, in_flight)`` at each launch of a step with
requests and ``("complete", step_id, in_flight)`` as each is popped (bounded): what the
tests read to see the overlap, without timing anything. ``max_in_flight`` is the most steps
with requests seen in flight at once.
"""

from __future__ import annotations

from collections import deque
from pagoda.engine.config import EngineConfig
from pagoda.engine.core.core_output import EngineCoreOutput
from pagoda.engine.core.engine_core import EngineCore, _InFlight

_MAX_EVENTS = 4096


def make_engine_core(config: EngineConfig, *args, **kwargs) -> EngineCore:
    """The engine core for ``config``: ``BatchQueueCore`` with several micro-batches, else ``EngineCore``."""
    if config.micro_batches > 1:
        return BatchQueueCore(config, *args, **kwargs)
    return EngineCore(config, *args, **kwargs)


class BatchQueueCore(EngineCore):
    """``EngineCore`` with up to ``config.micro_batches`` steps in flight (see the module docstring)."""

    def __init__(self, config: EngineConfig, *args, **kwargs) -> None:
        super().__init__(config, *args, **kwargs)
        assert not self.is_async, "the batch queue runs its device jobs on the engine thread"
        self.micro_batches = config.micro_batches
        self._queue: deque[_InFlight] = deque()
        self.step_events: deque[tuple[str, int, int]] = deque(maxlen=_MAX_EVENTS)
        self.max_in_flight = 0

    @property
    def num_in_flight(self) -> int:
        """Launched steps with requests whose results are not applied yet."""
        return sum(1 for launched in self._queue if launched.scheduler_output.scheduled)

    def step(self) -> list[EngineCoreOutput]:
        """Launch a step if the queue has room (and return nothing yet); else, or when nothing new
        could be launched, wait for the oldest step and return its outputs (vLLM's order)."""
        self.last_wait_s = 0.0
        early = self._admit_guided()
        launched = self._launch_next() if len(self._queue) < self.micro_batches else False
        if launched or not self._queue:
            if not self._queue:
                self.timer.break_chain()
            return early
        done = self._queue.popleft()
        try:
            outputs = early + self._finish(done)
        except BaseException:
            self._drain_queue()  # later steps may hold tokens of requests the failed step undid
            raise
        finally:
            self.last_wait_s += done.handle.finish_s  # its first half counted in the call that launched it
        if done.scheduler_output.scheduled:
            self.step_events.append(("complete", done.scheduler_output.step_id, self.num_in_flight))
        if not self._queue and not self.has_unfinished_requests():
            self.timer.break_chain()
        return outputs

    def _launch_next(self) -> bool:
        """Schedule and launch one step; whether it holds requests."""
        try:
            scheduler_output = self._schedule()
            if not scheduler_output.has_device_work:
                return False
            self._queue.append(self._launch(scheduler_output, None))
            self.last_wait_s += self._queue[-1].handle.start_s
        except BaseException:
            self._drain_queue()
            raise
        if not scheduler_output.scheduled:
            return False
        in_flight = self.num_in_flight
        self.max_in_flight = max(self.max_in_flight, in_flight)
        self.step_events.append(("issue", scheduler_output.step_id, in_flight))
        return True

    def _drain_queue(self) -> None:
        """After a failure: end every queued step, dropping its results and undoing its schedule."""
        while self._queue:
            self._drain(self._queue.popleft())

    def wait_idle(self) -> None:
        """Block until every queued step's device job ended (results stay for ``step()``)."""
        for launched in self._queue:
            launched.handle.wait()

    def shutdown(self) -> None:
        """End what is in flight, then the device side."""
        self._drain_queue()
        self.executor.shutdown()
