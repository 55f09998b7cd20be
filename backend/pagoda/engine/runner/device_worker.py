"""Where a step's device work runs, and how long the device worked and waited.

A *device job* is one step's device side: KV-tier copies, the forward pass, sampling
(``Executor._job``, ``executor.py``). The engine launches it and later calls ``StepHandle.get()``,
which returns the step's ``ModelRunnerOutput`` and is the only place the host waits:

* ``InlineWorker`` (synchronous engine): the job runs inside ``launch``.
* ``SplitStepHandle`` (pipeline parallelism with several steps in flight): the job's first
  half runs at launch, its second at ``get()``, both on the engine thread.
* ``ThreadWorker`` (``EngineConfig.async_scheduling``): jobs run in launch order on one
  worker thread, so the host schedules step N+1 and finishes step N-1's outputs while
  step N runs. One thread keeps the steps in order, as a CUDA stream would; torch
  releases the GIL inside its kernels (CPU) and returns at once from launches (CUDA),
  so the host's Python overlaps the device work. The thread is stopped and joined by
  ``shutdown()``.

``DeviceTimer`` keeps, per step and in total: *device time* (the job's wall time, less
any time it waited for the host inside the job), and *device idle* (the gap between the
end of the previous job and the start of this one, plus that wait). Gaps across an idle
engine (nothing to run) are not counted: ``break_chain()`` marks them.
"""

from __future__ import annotations

import threading
import time
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from pagoda.engine.runner.runner_output import ModelRunnerOutput

DeviceJob = Callable[[], ModelRunnerOutput]


@dataclass
class StepTimes:
    """Seconds spent by one step, or summed over steps."""

    host_s: float = 0.0  # host work inside the engine's step(), not counting waits on the device
    device_s: float = 0.0  # device jobs: copies, forward, sampling
    device_idle_s: float = 0.0  # device waiting for the host between (and inside) jobs
    wait_s: float = 0.0  # host blocked in StepHandle.get()


class DeviceTimer:
    """Device busy and idle time, written by the device side, read by the host (locked)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last_end: Optional[float] = None
        self.last = StepTimes()
        self.total = StepTimes()

    def record_job(self, start: float, end: float, waited_s: float) -> None:
        with self._lock:
            idle = waited_s + (start - self._last_end if self._last_end is not None else 0.0)
            self._last_end = end
            self.last.device_s = end - start - waited_s
            self.last.device_idle_s = idle
            self.total.device_s += self.last.device_s
            self.total.device_idle_s += idle

    def record_host(self, host_s: float, wait_s: float) -> None:
        with self._lock:
            self.last.host_s, self.last.wait_s = host_s, wait_s
            self.total.host_s += host_s
            self.total.wait_s += wait_s

    def break_chain(self) -> None:
        """The engine ran out of work: the next job's gap is not the host's doing."""
        with self._lock:
            self._last_end = None

    def snapshot(self) -> tuple[StepTimes, StepTimes]:
        """(last step, totals), copied under the lock."""
        with self._lock:
            return StepTimes(**vars(self.last)), StepTimes(**vars(self.total))


class StepHandle:
    """A launched step; ``get()`` waits for its result (and re-raises its failure)."""

    def __init__(self, future: Future, wait_s: float = 0.0) -> None:
        self._future = future
        self.wait_s = wait_s  # how long the host waited for this step (inline: the whole job)

    def get(self) -> ModelRunnerOutput:
        start = time.perf_counter()
        try:
            return self._future.result()
        finally:
            self.wait_s += time.perf_counter() - start

    def done(self) -> bool:
        return self._future.done()

    def wait(self) -> None:
        """Block until the job ended (its result or failure stays for ``get()``)."""
        futures.wait([self._future])


class SplitStepHandle:
    """A step whose job is cut in two (pipeline parallelism's batch queue, ``core.batch_queue``):
    ``start()`` runs now, on the engine thread; ``finish(started)`` on the first ``get`` or
    ``wait``. The host waits for the device throughout both: ``start_s`` and ``finish_s`` (0
    until it ran) are their seconds, ``wait_s`` their sum."""

    def __init__(self, start: Callable[[], object], finish: Callable[[object], ModelRunnerOutput]) -> None:
        self._future: Future = Future()
        self._finish: Optional[Callable[[], ModelRunnerOutput]] = None
        begin = time.perf_counter()
        try:
            started = start()
            self._finish = lambda: finish(started)
        except Exception as exc:  # noqa: BLE001 - delivered by get(), like the other workers
            self._future.set_exception(exc)
        self.start_s, self.finish_s = time.perf_counter() - begin, 0.0

    @property
    def wait_s(self) -> float:
        return self.start_s + self.finish_s

    def get(self) -> ModelRunnerOutput:
        self.wait()
        return self._future.result()

    def done(self) -> bool:
        return self._future.done()

    def wait(self) -> None:
        """Run the second half (once); its result or failure stays for ``get()``."""
        finish, self._finish = self._finish, None
        if finish is None:
            return
        begin = time.perf_counter()
        try:
            self._future.set_result(finish())
        except Exception as exc:  # noqa: BLE001 - delivered by get()
            self._future.set_exception(exc)
        self.finish_s = time.perf_counter() - begin


class InlineWorker:
    """Runs each job inside ``launch`` (the synchronous engine)."""

    def launch(self, job: DeviceJob) -> StepHandle:
        future: Future = Future()
        start = time.perf_counter()
        try:
            future.set_result(job())
        except Exception as exc:  # noqa: BLE001 - delivered by get(), like the threaded worker
            future.set_exception(exc)
        return StepHandle(future, wait_s=time.perf_counter() - start)

    def shutdown(self) -> None:
        pass


class ThreadWorker:
    """Runs jobs in launch order on one thread (async scheduling)."""

    def __init__(self) -> None:
        # The CUDA current device is per thread: the worker inherits the engine thread's
        # (a Triton model instance on GPU k sets device k), so "cuda" means the same GPU.
        device = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagoda-device",
                                            initializer=_set_cuda_device, initargs=(device,))

    def launch(self, job: DeviceJob) -> StepHandle:
        return StepHandle(self._executor.submit(job))

    def shutdown(self) -> None:
        """Finish the queued jobs, then stop and join the thread."""
        self._executor.shutdown(wait=True)


def _set_cuda_device(device: Optional[int]) -> None:
    if device is not None:
        torch.cuda.set_device(device)
