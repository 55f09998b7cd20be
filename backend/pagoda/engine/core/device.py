"""What the engine core needs from the device side: the ``Executor`` protocol.

The core schedules, launches one device job per step and applies its
``ModelRunnerOutput``; everything that touches the device (weights, KV cache, sampling,
speculative drafts, the host KV tier, the worker thread) sits behind this protocol,
built outside (``pagoda.engine.runner.executor.make_executor``). This module and the core
import no torch; CPU tests may pass a fake executor.

Threading: ``launch`` is called on the engine thread and returns at once with a
``StepHandle``; the job may run on a worker thread. ``wait_previous`` (the gate) is
called by the job after its forward pass and before it samples; it raises when the
previous step failed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterable, Optional, Protocol

from pagoda.engine.kv.swap_cost import SwapCostModel
from pagoda.engine.kv.layout import KVCacheLayout
from pagoda.engine.request import Request
from pagoda.engine.runner.runner_output import ModelRunnerOutput

if TYPE_CHECKING:
    from pagoda.engine.core.sched.scheduler import SchedulerOutput
    from pagoda.engine.guided.manager import GuidedDecodingManager
    from pagoda.engine.runner.device_worker import DeviceTimer


class StepHandle(Protocol):
    """A launched step. ``wait_s``: how long the host has waited for it."""

    wait_s: float

    def get(self) -> ModelRunnerOutput:
        """Wait for the step's results (re-raises the job's failure)."""

    def wait(self) -> None:
        """Block until the job ended, leaving its result for ``get``."""


class Executor(Protocol):
    """Attributes:
    is_async: jobs run on a worker thread (async scheduling), overlapping the host.
    num_blocks: device KV blocks (the scheduler's pool, null block included).
    num_host_blocks: host KV-tier blocks (0 without KV offload).
    num_host_state_slots: host recurrent-state slots (0 without KV offload or states).
    kv_layout: the KV cache groups and pool sizes (``engine.kv.layout``); None: one group.
    swap_cost_model: for ``preemption_mode="auto"``, else None.
    guided: the structured-output manager (grammar compiles and matchers).
    timer: device busy/idle time (``DeviceTimer``).
    """

    is_async: bool
    swap_cost_model: Optional[SwapCostModel]
    guided: "GuidedDecodingManager"
    timer: "DeviceTimer"

    @property
    def num_blocks(self) -> int: ...

    @property
    def num_host_blocks(self) -> int: ...

    @property
    def num_host_state_slots(self) -> int: ...

    @property
    def kv_layout(self) -> Optional[KVCacheLayout]: ...

    def propose_drafts(self, running: list[Request]) -> Optional[dict[str, list[int]]]:
        """Drafted tokens per request for the next ``schedule``; None without speculation."""

    def release(self, request_ids: Iterable[str]) -> None:
        """Forget finished requests' device-side state."""

    def launch(self, scheduler_output: "SchedulerOutput",
               wait_previous: Optional[Callable[[], None]]) -> StepHandle:
        """Queue one step's device job; its ``ModelRunnerOutput`` answers ``scheduler_output``."""

    def shutdown(self) -> None:
        """Finish queued jobs and stop any worker thread."""
