"""The device side of the engine, as the core drives it: ``Executor`` and ``make_executor``.

``make_executor`` (called by ``LLMEngine``) builds everything that touches the device:
the ``ModelRunner`` (weights, KV cache, CUDA graphs, the ``Sampler`` and, with
speculative decoding, the ``Speculator``), the host KV tier with its swap cost model,
the device worker (inline, or one thread with async scheduling) and the ``DeviceTimer``.
The ``EngineCore`` receives the result through its ``pagoda.engine.core.device.Executor``
protocol and never imports torch.

One launched step (``Executor.launch``) is one *device job*, run by the worker in launch
order: the KV-tier copies and the device-to-device copies of beam forks' partial blocks
(``SchedulerOutput.blocks_to_copy``), then ``ModelRunner.execute`` (the plan's deltas into the
runner's request states; forward; wait for the gate and fill the grammar bitmask; sample
or verify drafts). The core launches every plan with device work, including one that only
drops runner states (``SchedulerOutput.has_device_work``), so the deltas arrive in order. With async scheduling the
bitmask is filled on the worker thread: the host advanced the matchers before it opened the gate,
and it advances them again only after this job ended, so the job reads them alone. The
job's ``ModelRunnerOutput`` carries the step's id, so ``Scheduler.update_from_output``
needs nothing else.

Tensor or pipeline parallelism (``engine.parallel``, which builds this with ``tp`` or ``pp``
and ``parallel``):
the runner is rank 0 of the group and broadcasts each step itself; the job first checks
that every worker is alive, and a failed job is re-read as the error naming a dead
worker's rank (``parallel.explain``); ``shutdown`` stops the workers after the worker
thread.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any, Callable, Iterable, Optional

from pagoda.engine.config import EngineConfig
from pagoda.engine.guided.bitmask import TokenBitmask
from pagoda.engine.guided.manager import GuidedDecodingManager
from pagoda.engine.kv.file_tier import FileTiers
from pagoda.engine.kv.swap_cost import SwapCostModel
from pagoda.engine.request import Request
from pagoda.engine.runner.device_worker import DeviceTimer, InlineWorker, SplitStepHandle, StepHandle, ThreadWorker
from pagoda.engine.runner.file_tier_io import make_file_tiers
from pagoda.engine.runner.host_kv_cache import HostKVCache, calibrate, copy_device_blocks
from pagoda.engine.runner.model_runner import ModelRunner, StartedStep
from pagoda.engine.runner.placement import resolve_device, resolve_dtype
from pagoda.engine.runner.runner_output import ModelRunnerOutput
from pagoda.engine.spec_decode import SpeculativePlan, Speculator
from pagoda.engine.thread_placement import ThreadPlacement
from pagoda.models.config import ModelConfig

logger = logging.getLogger(__name__)


class Executor:
    """Args:
    runner: the model runner (it owns the sampler and the speculator).
    guided: the structured-output manager; the device job fills its grammar bitmask
        behind the gate (the previous step's tokens already advanced the matchers).
    host_kv_cache: the host KV tier, or None without KV offload.
    swap_cost_model: calibrated for ``preemption_mode="auto"``, else None.
    is_async: jobs run on a worker thread (async scheduling), else inline.
    parallel: the tensor-parallel workers (``engine.parallel.workers``), or None.
    splits_steps: several steps in flight (pipeline parallelism's batch queue): ``launch``
        returns a ``SplitStepHandle``; jobs run on the engine thread (``is_async`` False).
    """

    def __init__(self, runner: ModelRunner, guided: GuidedDecodingManager, host_kv_cache: Optional[HostKVCache],
                 swap_cost_model: Optional[SwapCostModel], is_async: bool, parallel: Any = None,
                 splits_steps: bool = False) -> None:
        self.runner = runner
        self.guided = guided
        self.host_kv_cache = host_kv_cache
        self.swap_cost_model = swap_cost_model
        self.is_async = is_async
        self.worker = ThreadWorker() if is_async else InlineWorker()
        self.timer = DeviceTimer()
        self.parallel = parallel
        self.splits_steps = splits_steps
        spec = runner.config.cpu_threads_bind  # bound by the thread that runs the jobs (engine.thread_placement)
        self.placement = ThreadPlacement(spec) if spec is not None else None

    @property
    def num_blocks(self) -> int:
        return self.runner.num_blocks

    @property
    def num_host_blocks(self) -> int:
        return self.host_kv_cache.num_blocks if self.host_kv_cache is not None else 0

    @property
    def file_tiers(self) -> Optional[FileTiers]:
        """The disk and shared tiers' books (the scheduler's), or None."""
        file_io = self.host_kv_cache.file_io if self.host_kv_cache is not None else None
        return file_io.tiers if file_io is not None else None

    @property
    def num_host_state_slots(self) -> int:
        return self.host_kv_cache.num_state_slots if self.host_kv_cache is not None else 0

    @property
    def kv_layout(self):
        """The runner's ``engine.kv.layout.KVCacheLayout`` (groups, pool sizes)."""
        return self.runner.kv_layout

    @property
    def speculator(self) -> Optional[Speculator]:
        return self.runner.speculator

    def propose_drafts(self, running: list[Request]) -> Optional[dict[str, list[int]]]:
        """Draft tokens per request for the next schedule; None without speculative decoding."""
        return self.speculator.propose(running) if self.speculator is not None else None

    def release(self, request_ids: Iterable[str]) -> None:
        """Forget finished requests' device-side state (draft KV, acceptance estimates)."""
        if self.speculator is not None:
            self.speculator.release(request_ids)

    def launch(self, scheduler_output, wait_previous: Optional[Callable[[], None]]) -> StepHandle:
        """Queue one step's device job; ``wait_previous`` is the gate (see ``ModelRunner.execute``).
        With ``splits_steps`` (the batch queue) the job's first half (copies, the deltas, the
        forward: stage 0 and its hand-over) runs now and its second half (the logits, the
        gate, sampling) on the handle's first ``get``."""
        if self.splits_steps:
            return SplitStepHandle(functools.partial(self._start_half, scheduler_output),
                                   functools.partial(self._finish_half, wait_previous=wait_previous))
        return self.worker.launch(functools.partial(self._job, scheduler_output, wait_previous))

    def _job(self, scheduler_output, wait_previous: Optional[Callable[[], None]]) -> ModelRunnerOutput:
        start = time.perf_counter()
        self._before_forward(scheduler_output)
        return self._sample(scheduler_output, functools.partial(self.runner.execute, scheduler_output),
                            wait_previous, start)

    def _start_half(self, scheduler_output) -> StartedStep:
        start = time.perf_counter()
        self._before_forward(scheduler_output)
        started = self._named(self.runner.start_step, scheduler_output)
        self.timer.record_job(start, time.perf_counter(), 0.0)
        return started

    def _finish_half(self, started: StartedStep, wait_previous: Optional[Callable[[], None]]) -> ModelRunnerOutput:
        return self._sample(started.scheduler_output, functools.partial(self.runner.finish_step, started),
                            wait_previous, time.perf_counter())

    def _before_forward(self, scheduler_output) -> None:
        if self.placement is not None:
            self.placement.ensure()
        if self.host_kv_cache is not None:  # KV offload copies run before the forward pass
            self.host_kv_cache.execute(scheduler_output)
        if scheduler_output.blocks_to_copy:  # beam forks: copy-on-write of a shared partial block
            copy_device_blocks(self.runner.kv_tensors, scheduler_output.blocks_to_copy)
        if self.parallel is not None:
            self.parallel.check()

    def _sample(self, scheduler_output, run: Callable[[Callable[[], Optional[TokenBitmask]]], ModelRunnerOutput],
                wait_previous: Optional[Callable[[], None]], start: float) -> ModelRunnerOutput:
        """``run(before_sampling)``: the runner's ``execute`` (or ``finish_step``), behind the gate."""
        waited = [0.0]
        items = [item for item in scheduler_output.scheduled if item.is_sampling]

        def before_sampling() -> Optional[TokenBitmask]:
            if wait_previous is not None:
                wait_start = time.perf_counter()
                try:
                    wait_previous()
                finally:
                    waited[0] = time.perf_counter() - wait_start
            # Behind the gate: the previous step advanced the matchers (None without grammars).
            return self.guided.prepare_bitmask(items) if items else None

        output = self._named(run, before_sampling)
        output.step_id = scheduler_output.step_id
        self.timer.record_job(start, time.perf_counter(), waited[0])
        return output

    def _named(self, call: Callable, *args):
        """``call(*args)``; under tensor or pipeline parallelism a failure is re-read as the
        error naming a dead worker, when one died."""
        if self.parallel is None:
            return call(*args)
        try:
            return call(*args)
        except Exception as exc:
            self.parallel.explain(exc)
            raise

    def shutdown(self) -> None:
        """Finish the queued jobs and stop the worker thread (if any), then the tensor-parallel workers."""
        self.worker.shutdown()
        if self.host_kv_cache is not None and self.host_kv_cache.file_io is not None:
            self.host_kv_cache.file_io.close()  # queued block files are written first
            self.host_kv_cache.file_io = None
        if self.parallel is not None:
            self.parallel.stop()
            self.parallel = None


def make_executor(config: EngineConfig, model_config: ModelConfig, model_path: str,
                  make_grammar_backend: Optional[Callable[[], Any]] = None, tp: Any = None,
                  parallel: Any = None, pp: Any = None) -> Executor:
    """The device side for ``config``: runner, host tier, worker, and the structured-output
    manager (``make_grammar_backend`` builds its grammar backend on first use). ``tp`` (or
    ``pp``) and ``parallel``: rank 0's tensor- (or pipeline-) parallel group and the workers,
    from ``engine.parallel.make_executor``.

    Raises:
        ValueError: an unusable speculative draft folder, or a KV budget below one block.
    """
    device = resolve_device(config)
    spec_plan = SpeculativePlan.from_config(config, model_config, device, resolve_dtype(config, device))
    runner = ModelRunner(config, model_config, model_path, spec_plan=spec_plan, tp=tp, pp=pp)
    if config.async_scheduling and spec_plan is not None:
        logger.warning("async_scheduling is ignored with speculative decoding: steps run synchronously")
    splits_steps = config.micro_batches > 1
    if config.async_scheduling and splits_steps:
        logger.warning("async_scheduling is ignored with pipeline_micro_batches=%d: the batch queue overlaps "
                       "the steps instead (core.batch_queue)", config.micro_batches)
    host_kv_cache, cost_model = _make_host_tier(config, runner)
    if host_kv_cache is not None:
        host_kv_cache.file_io = make_file_tiers(config, runner, host_kv_cache.host_caches, model_path)
    guided = GuidedDecodingManager(make_grammar_backend, model_config.vocab_size, config.guided,
                                   pin_memory=device.type == "cuda")
    is_async = config.async_scheduling and spec_plan is None and not splits_steps
    return Executor(runner, guided, host_kv_cache, cost_model, is_async=is_async, parallel=parallel,
                    splits_steps=splits_steps)


def _make_host_tier(config: EngineConfig, runner: ModelRunner) -> tuple[Optional[HostKVCache], Optional[SwapCostModel]]:
    """(host KV cache, swap cost model) for ``cpu_offload_bytes > 0``, else (None, None).
    The cost model is calibrated only for ``preemption_mode="auto"``."""
    if config.cpu_offload_bytes == 0:
        return None, None
    host = HostKVCache.for_runner(runner, config.cpu_offload_bytes)
    if config.preemption_mode != "auto":
        return host, None
    model = calibrate(host, runner, config.offload_copy_bandwidth, config.offload_copy_latency_s,
                      config.prefill_s_per_token)
    logger.info("KV offload: %d host blocks; swap cost model %s", host.num_blocks, model)
    return host, model
