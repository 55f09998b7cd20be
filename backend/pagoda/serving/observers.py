"""Step observers: what watches the engine loop and may never fail it.

The engine loop (``serving.engine_loop``) holds one ``Observers`` and tells it, on the
loop's thread unless noted:

1. ``on_start()``: the loop is starting (the caller's thread, before the loop's runs);
2. ``on_output(request, output)``: each ``RequestOutput`` of a request in flight, before
   it becomes a response;
3. ``on_step(stats, block_events)``: after each engine step, *before* that step's
   responses go to the sender (a client that reads /metrics after its final response
   sees its step counted);
4. ``on_refresh(stats)``: the engine changed without a step (the loop started; requests
   in flight were failed);
   ``on_block_events(block_events)``: block events emitted while no step ran (the KV file
   tiers' writer thread writes files after the step that queued them), given while idle;
5. ``on_drain()``: the replica started draining (``pagoda serve``'s drain file);
6. ``on_stop()``: the loop ended (the caller's thread, after the loop's was joined).

Invariant: ``Observers`` calls every observer through one guarded loop (``_each``): an
observer's exception is logged and never fails a request, a step or the loop, and the
observers after it are still called.

Adapters:
- ``MetricsObserver``: ``ServingMetrics``: latency histograms per output; gauges and
  counters per step and refresh; the batched-decode counter per step only.
- ``TracerObserver``: a ``RequestTracer``: a finished request that carries a
  ``traceparent`` gets its engine spans.
- ``PublisherObserver``: a ``FleetPublisher``, the fleet's KV-event publisher, which the
  Triton adapter composes (serving imports nothing of ``pagoda.fleet``): started and
  stopped with the loop, fed each step's block events and stats, and told to set the
  replica's drain flag (routers send it nothing new; the flag expires after
  ``DRAIN_FLAG_TTL_S`` should the process die, and the publisher clears it when it
  deregisters on stop). Redis may be slow, so the flag is set off the loop thread, and
  ``on_stop`` joins that thread before stopping the publisher.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, Optional, Protocol, Sequence

from pagoda.contracts.kv_events import KVEvent
from pagoda.engine.outputs import RequestOutput
from pagoda.engine.stats import EngineStats
from pagoda.serving.commands import ServingRequest
from pagoda.serving.metrics import ServingMetrics
from pagoda.serving.tracing import RequestTracer

logger = logging.getLogger(__name__)


class StepObserver(Protocol):
    """Watches the engine loop; every method is optional (an adapter that inherits this
    protocol gets no-op defaults)."""

    def on_start(self) -> None:
        """The loop is starting."""

    def on_output(self, request: ServingRequest, output: RequestOutput) -> None:
        """One output of a request in flight, before it becomes a response."""

    def on_step(self, stats: EngineStats, block_events: Sequence[KVEvent]) -> None:
        """An engine step ended; its responses are not sent yet."""

    def on_refresh(self, stats: EngineStats) -> None:
        """The engine changed without a step."""

    def on_block_events(self, block_events: Sequence[KVEvent]) -> None:
        """Block events emitted while no step ran (non-empty; in order with the steps' ones)."""

    def on_drain(self) -> None:
        """The replica started draining."""

    def on_stop(self) -> None:
        """The loop ended."""


class FleetPublisher(Protocol):
    """What serving needs of the fleet's KV-event publisher (``pagoda.fleet.index.publisher``):
    serving imports nothing of the fleet; the Triton adapter composes the two."""

    def start(self) -> None: ...
    def stop(self) -> None: ...
    def submit_events(self, events: Sequence[KVEvent]) -> None: ...
    def submit_stats(self, stats: EngineStats) -> None: ...
    def mark_draining(self, ttl_s: float) -> None: ...


class Observers(StepObserver):
    """The loop's observers, each called through one guarded loop (see the module doc)."""

    def __init__(self, observers: Sequence[StepObserver] = ()) -> None:
        self._observers = list(observers)

    def __bool__(self) -> bool:
        return bool(self._observers)

    def _each(self, event: Callable[[StepObserver], None]) -> None:
        for observer in self._observers:
            try:
                event(observer)
            except Exception:  # noqa: BLE001 - an observer must never fail a request or the loop
                logger.exception("step observer %s failed", type(observer).__name__)

    def on_start(self) -> None:
        self._each(lambda o: o.on_start())

    def on_output(self, request: ServingRequest, output: RequestOutput) -> None:
        self._each(lambda o: o.on_output(request, output))

    def on_step(self, stats: EngineStats, block_events: Sequence[KVEvent]) -> None:
        self._each(lambda o: o.on_step(stats, block_events))

    def on_refresh(self, stats: EngineStats) -> None:
        self._each(lambda o: o.on_refresh(stats))

    def on_block_events(self, block_events: Sequence[KVEvent]) -> None:
        self._each(lambda o: o.on_block_events(block_events))

    def on_drain(self) -> None:
        self._each(lambda o: o.on_drain())

    def on_stop(self) -> None:
        self._each(lambda o: o.on_stop())


class MetricsObserver(StepObserver):
    def __init__(self, metrics: ServingMetrics) -> None:
        self.metrics = metrics

    def on_output(self, request: ServingRequest, output: RequestOutput) -> None:
        self.metrics.record_output(output)

    def on_step(self, stats: EngineStats, block_events: Sequence[KVEvent]) -> None:
        self.on_refresh(stats)
        self.metrics.record_step(stats)

    def on_refresh(self, stats: EngineStats) -> None:
        self.metrics.update_engine(stats)
        self.metrics.update_lora(stats)


class TracerObserver(StepObserver):
    def __init__(self, tracer: RequestTracer) -> None:
        self.tracer = tracer

    def on_output(self, request: ServingRequest, output: RequestOutput) -> None:
        if output.finished and request.traceparent is not None:
            self.tracer.record(request.traceparent, output, request.wire.params if request.wire else None)


class PublisherObserver(StepObserver):
    DRAIN_FLAG_TTL_S = 120

    def __init__(self, publisher: FleetPublisher) -> None:
        self.publisher = publisher
        self._drain_thread: Optional[threading.Thread] = None

    def on_start(self) -> None:
        self.publisher.start()

    def on_step(self, stats: EngineStats, block_events: Sequence[KVEvent]) -> None:
        self.publisher.submit_events(block_events)
        self.publisher.submit_stats(stats)

    def on_block_events(self, block_events: Sequence[KVEvent]) -> None:
        self.publisher.submit_events(block_events)

    def on_drain(self) -> None:
        self._drain_thread = threading.Thread(target=self._mark_draining, name="pagoda-drain-flag", daemon=True)
        self._drain_thread.start()

    def _mark_draining(self) -> None:
        try:
            self.publisher.mark_draining(self.DRAIN_FLAG_TTL_S)
        except Exception:  # noqa: BLE001 - routers still get UNAVAILABLE from the loop
            logger.exception("setting the fleet drain flag failed")

    def on_stop(self) -> None:
        if self._drain_thread is not None:
            self._drain_thread.join(10.0)  # the flag is set before deregistering clears it
        self.publisher.stop()  # deregisters: the heartbeat and the drain flag go


def make_observers(metrics: Optional[ServingMetrics] = None, tracer: Optional[RequestTracer] = None,
                   publisher: Optional[FleetPublisher] = None) -> list[StepObserver]:
    """The Triton adapter's observers, in the order they are called; ``None`` parts are left out."""
    observers: list[StepObserver] = []
    if metrics is not None:
        observers.append(MetricsObserver(metrics))
    if tracer is not None:
        observers.append(TracerObserver(tracer))
    if publisher is not None:
        observers.append(PublisherObserver(publisher))
    return observers
