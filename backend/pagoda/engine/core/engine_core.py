"""EngineCore: token ids in, token ids out, one ``step()`` at a time. No tokenizer.

One step = ``Scheduler.schedule()`` (which requests advance, by how many tokens) →
launch the device job (KV-tier copies, ``ModelRunner.execute``: one forward pass over
the flat mixed batch, then the ``Sampler`` or, with speculative decoding, the
``Speculator``'s verification) → ``Scheduler.update_from_output()`` with the job's
``ModelRunnerOutput`` → one ``EngineCoreOutput`` per request that got tokens or
finished. Text, stop strings and ``RequestOutput``s are the ``OutputProcessor``'s.

Overlap (``EngineConfig.async_scheduling``): the job runs on a worker thread
(``device_worker``) and ``step()`` is pipelined one step deep::

    step() call k:   schedule N+1 → launch N+1 → get N → update N → outputs of N
    device:          ...... N ......|...... N+1 (forward) ...|gate|sample N+1|

``schedule()`` counts step N's sampled tokens as placeholders, so N+1 is planned before
N's tokens are known; the runner fills them in on the device (``scheduler.py``,
``model_runner.py``). Sampling of N+1 waits for the *gate* of N (set once N's tokens are
applied): sampling reads each request's output history (penalties, min_tokens), and a
grammar hook would read its matcher state, both of which N's update changes. A request
that finishes (EOS, stop token, stop string, abort) while N+1 runs gets its extra token
dropped by the scheduler; its blocks were freed when it finished. With speculative
decoding the core stays synchronous (drafts need the previous step's tokens on the host
before scheduling); ``async_scheduling`` is then ignored, with a warning.

Step hooks (``StepHook``): per-step extra inputs prepared beside the forward, applied to
the logits just before sampling (on the device side, after the gate: e.g. a grammar
bitmask), and told which tokens were accepted after each update (e.g. to advance a
grammar matcher).

n > 1: ``make_requests`` turns a user request (an ``EngineRequest``) into its children,
which are added together; with prefix caching, a ``SiblingGate`` holds siblings of child 0
back until child 0's prompt is computed (``parallel_sampling.py`` owns the fan-out).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Protocol, Union

import torch

from pagoda.engine.config import EngineConfig
from pagoda.engine.runner.device_worker import DeviceTimer, InlineWorker, StepHandle, ThreadWorker
from pagoda.engine.guided.bitmask import TokenBitmask
from pagoda.engine.guided.manager import GuidedDecodingManager
from pagoda.engine.guided.params import GuidedDecodingParams
from pagoda.engine.runner.host_kv_cache import HostKVCache, calibrate
from pagoda.engine.runner.model_runner import ModelRunner, resolve_device, resolve_dtype
from pagoda.engine.request import EngineRequest, Request, RequestStatus
from pagoda.engine.runner.runner_output import ModelRunnerOutput
from pagoda.engine.sampling.sampler import Sampler, SamplingRow, TokenLogprobs, make_seed
from pagoda.engine.core.parallel_sampling import SiblingGate, child_request_ids
from pagoda.engine.core.scheduler import RequestUpdate, ScheduledRequest, Scheduler, SchedulerConfig, SchedulerOutput
from pagoda.engine.spec_decode import SpeculativePlan
from pagoda.models.config import ModelConfig

logger = logging.getLogger(__name__)


@dataclass
class EngineCoreOutput:
    """What one request got from one step.

    Attributes:
        request_id: the scheduler request (a child id for ``n > 1``).
        new_token_ids: tokens appended this step (several with speculative decoding).
        logprobs: one raw ``TokenLogprobs`` per new token, ``None`` where not asked for.
        finish_reason: "stop" | "length" | "abort", or None while running.
        stop_reason: the stop token id that ended it, if any.
        num_cached_tokens: its prefix-cache hit at first admission.
        first_scheduled_time: when its first step was scheduled (``time.time()``).
    """

    request_id: str
    new_token_ids: list[int]
    logprobs: list[Optional[TokenLogprobs]] = field(default_factory=list)
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None
    num_cached_tokens: int = 0
    first_scheduled_time: Optional[float] = None
    error: Optional[str] = None  # the request failed after it was accepted (a grammar that does not compile)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class StepHook(Protocol):
    """Per-step extras beside the forward pass (e.g. structured output's grammar bitmask).

    ``process_logits`` runs on the device side after the forward and after the previous
    step's tokens were applied (``on_update``), just before sampling; ``on_update`` runs
    on the host after each ``update_from_output``.
    """

    def process_logits(self, logits: torch.Tensor, items: list[ScheduledRequest]) -> torch.Tensor: ...

    def on_update(self, updates: list[RequestUpdate]) -> None: ...


@dataclass
class _InFlight:
    """A launched step; ``applied`` is set once its results are applied (its gate)."""

    scheduler_output: SchedulerOutput
    handle: StepHandle
    applied: threading.Event = field(default_factory=threading.Event)
    ok: bool = True


class EngineCore:
    """Args:
    config: the engine configuration.
    model_config: the target model's config.
    model_path: the model folder.
    model_id: seeds block hashes.
    eos_token_ids: the tokenizer's end-of-sequence ids.
    make_grammar_backend: builds the structured-output grammar backend on first use.
    """

    def __init__(self, config: EngineConfig, model_config: ModelConfig, model_path: str, model_id: str,
                 eos_token_ids: Iterable[int], make_grammar_backend: Optional[Callable[[], Any]] = None) -> None:
        self.config = config
        self.model_config = model_config
        self.eos_token_ids = frozenset(eos_token_ids)
        device = resolve_device(config)
        spec_plan = SpeculativePlan.from_config(config, model_config, device, resolve_dtype(config, device))
        self.runner = ModelRunner(config, model_config, model_path,
                                  draft_config=spec_plan.draft_config if spec_plan else None)
        # Refuses lengths past the model's positions (or a Mistral sliding window).
        self.max_model_len = model_config.check_max_model_len(config.max_model_len)
        self.host_kv_cache, cost_model = _make_host_tier(config, self.runner)
        self.scheduler = Scheduler(SchedulerConfig.from_engine_config(
            config, num_blocks=self.runner.num_blocks, max_model_len=self.max_model_len, model_id=model_id,
            num_host_blocks=self.host_kv_cache.num_blocks if self.host_kv_cache else 0), swap_cost_model=cost_model)
        self.sampler = Sampler(vocab_size=model_config.vocab_size, seed=config.seed)
        self.speculator = spec_plan.build(model_config, self.runner.model, self.runner.num_blocks, self.sampler,
                                          self.max_model_len) if spec_plan else None
        if config.async_scheduling and self.speculator is not None:
            logger.warning("async_scheduling is ignored with speculative decoding: steps run synchronously")
        self.is_async = config.async_scheduling and self.speculator is None
        self.worker = ThreadWorker() if self.is_async else InlineWorker()
        self.timer = DeviceTimer()
        self.step_hooks: list[StepHook] = []
        self.guided = GuidedDecodingManager(make_grammar_backend, model_config.vocab_size,
                                            pin_memory=device.type == "cuda")
        self._awaiting_grammar: dict[str, list[Request]] = {}  # user request id -> children
        self._in_flight: Optional[_InFlight] = None
        self._siblings = SiblingGate(config.enable_prefix_caching)  # n > 1 (parallel_sampling.py)
        self.num_steps = 0
        self.max_num_running_seen = 0
        self.last_step = (0, 0, 0, 0)  # seqs, decode seqs, prefill seqs, tokens
        self.last_wait_s = 0.0  # how long the last step() blocked on the device

    # ----------------------------------------------------------------- requests
    def make_requests(self, request: EngineRequest, prompt_token_ids: list[int]) -> list[Request]:
        """The scheduler requests of one user request (``arrival_time`` resolved): itself for
        ``n == 1``, else children ``"{id}#{i}"``, child ``i`` seeded by ``make_seed(seed, i)``."""
        params = request.params
        blocked = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids)
        children = []
        for index, child_id in enumerate(child_request_ids(request.request_id, params.n)):
            child = Request.from_engine_request(request, child_id, list(prompt_token_ids), self.eos_token_ids)
            child.sampling_state = SamplingRow(params=params, seed=make_seed(params.seed, index),
                                               prompt_token_ids=child.prompt_token_ids,
                                               output_token_ids=child.output_token_ids, min_tokens_blocked_ids=blocked)
            children.append(child)
        return children

    def add_requests(self, requests: list[Request], guided: Optional[GuidedDecodingParams] = None,
                     group_id: Optional[str] = None) -> None:
        """Queue one user request's children (one, or ``n`` siblings of one prompt). With
        ``guided``, they wait outside the scheduler until the grammar compiled
        (``pagoda.engine.guided``), under ``group_id``.

        Raises:
            ValueError: the first child can never run (see ``Scheduler.add_request``);
                nothing is queued then.
        """
        if guided is not None:
            self.scheduler.check_request(requests[0])
            self._awaiting_grammar[group_id] = list(requests)
            self.guided.submit(group_id, [r.request_id for r in requests], guided)
            return
        self.scheduler.add_request(requests[0])
        for request in self._siblings.hold(requests):
            self.scheduler.add_request(request)

    def abort_requests(self, request_ids: Iterable[str],
                       status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        """Finish requests now (abort, or a stop string found); frees their blocks. Unknown
        ids are ignored; a step in flight for them has its tokens dropped."""
        request_ids = list(request_ids)
        dropped = set(request_ids)
        self._siblings.drop(dropped)
        for group_id, children in list(self._awaiting_grammar.items()):
            if any(c.request_id in dropped for c in children):
                del self._awaiting_grammar[group_id]
                self.guided.cancel(group_id)
        self.scheduler.finish_requests(request_ids, status)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._siblings) or bool(self._awaiting_grammar)

    def queued_requests(self) -> Iterator[Request]:
        """Every request not admitted yet: the scheduler's waiting queue, siblings held
        for their first child's prompt, and requests waiting for their grammar
        (admission control bounds them all)."""
        yield from self.scheduler.waiting
        yield from self._siblings.queued()
        for children in self._awaiting_grammar.values():
            yield from children

    @property
    def num_pending(self) -> int:
        """Siblings held back until their first child's prompt is computed."""
        return self._siblings.num_held

    # --------------------------------------------------------------------- step
    def step(self) -> list[EngineCoreOutput]:
        """Schedule and launch one step; return the outputs of the step that completed
        (this one when synchronous, the previous one with async scheduling).

        Steps with a structured-output request run synchronously even with async
        scheduling: its grammar bitmask for a step needs the previous step's tokens, and
        the grammar state is kept on the host thread."""
        previous, self._in_flight = self._in_flight, None
        self.last_wait_s = 0.0
        early = self._admit_guided()
        is_async = self.is_async and not self._has_guided_requests()
        if not is_async and previous is not None:
            early += self._finish(previous)
            self.last_wait_s += previous.handle.wait_s
            previous = None
        try:
            scheduler_output = self._schedule()
            launched = None
            if scheduler_output.scheduled or _has_copies(scheduler_output):
                launched = self._launch(scheduler_output, previous)
        except BaseException:
            if previous is not None:
                self._drain(previous)
            raise
        if is_async:
            self._in_flight, done = launched, previous
        else:
            done = launched
        if done is None:
            self.timer.break_chain()
            return early
        try:
            outputs = early + self._finish(done)
        except BaseException:
            if self._in_flight is not None:  # built on the failed step's tokens: undo it too
                self._drain(self._in_flight)
                self._in_flight = None
            raise
        self.last_wait_s += done.handle.wait_s
        if self._in_flight is None and not self.has_unfinished_requests():
            self.timer.break_chain()
        return outputs

    def _schedule(self) -> SchedulerOutput:
        drafts = self.speculator.propose(self.scheduler.running) if self.speculator else None
        if drafts:
            drafts = self.guided.truncate_drafts(drafts)
        scheduler_output = self.scheduler.schedule(drafts)
        if self.speculator:
            self.speculator.release(scheduler_output.finished_request_ids)
        self.guided.release(scheduler_output.finished_request_ids)
        if not scheduler_output.scheduled and self.guided.num_waiting:
            self.guided.wait(0.01)  # nothing to run but compiles: wait for one, do not spin
        if scheduler_output.scheduled:
            now = time.time()
            for item in scheduler_output.scheduled:
                if item.request.metrics.first_scheduled_time is None:
                    item.request.metrics.first_scheduled_time = now
            self._record_step(scheduler_output)
        return scheduler_output

    def _launch(self, scheduler_output: SchedulerOutput, previous: Optional[_InFlight]) -> _InFlight:
        # Grammar bitmask: filled on the host before the forward (None without guided requests).
        bitmask = self.guided.prepare_bitmask([item for item in scheduler_output.scheduled if item.is_sampling])
        job = functools.partial(self._execute, scheduler_output, previous, bitmask)
        return _InFlight(scheduler_output, self.worker.launch(job))

    def _execute(self, scheduler_output: SchedulerOutput, previous: Optional[_InFlight],
                 bitmask: Optional[TokenBitmask] = None) -> ModelRunnerOutput:
        """The device job (the worker thread with async scheduling)."""
        start = time.perf_counter()
        if self.host_kv_cache is not None:  # KV offload copies run before the forward pass
            self.host_kv_cache.execute(scheduler_output)
        scheduled = scheduler_output.scheduled
        logits = self.runner.execute(scheduled) if scheduled else None
        waited = 0.0
        if previous is not None:  # the gate: sampling reads state that applying the previous step changes
            wait_start = time.perf_counter()
            previous.applied.wait()
            waited = time.perf_counter() - wait_start
            if not previous.ok:
                raise RuntimeError("the previous engine step failed; this one depends on its tokens")
        items = [item for item in scheduled if item.is_sampling]
        for hook in self.step_hooks if items else ():
            logits = hook.process_logits(logits, items)
        output = self._sample(logits, items, bitmask)
        if self.is_async:
            self.runner.record_sampled(output)
        self.timer.record_job(start, time.perf_counter(), waited)
        return output

    def _sample(self, logits: Optional[torch.Tensor], items: list[ScheduledRequest],
                bitmask: Optional[TokenBitmask] = None) -> ModelRunnerOutput:
        """Tokens and raw logprobs of every sampling request, in batch order."""
        if not items:
            return ModelRunnerOutput()
        if self.speculator is not None:
            return self.speculator.sample(logits, items, bitmask)
        result = self.sampler(logits, [item.request.sampling_state for item in items], bitmask)
        return ModelRunnerOutput([item.request.request_id for item in items], [[t] for t in result.token_ids],
                                 [[lp] for lp in result.logprobs])

    def _finish(self, done: _InFlight) -> list[EngineCoreOutput]:
        """Wait for a launched step, apply it, open its gate."""
        try:
            runner_output = done.handle.get()
        except BaseException:
            done.ok = False
            self.scheduler.undo_step(done.scheduler_output)
            raise
        finally:
            done.applied.set()
        updates = self.scheduler.update_from_output(done.scheduler_output, runner_output)
        for update in updates:
            if self.guided.accept(update.request.request_id, update.new_token_ids) and not update.finished:
                self.scheduler.finish_requests([update.request.request_id], RequestStatus.FINISHED_STOPPED)
                update.finished = True  # the grammar is complete: nothing more may follow
        if self.speculator:
            self.speculator.release(u.request.request_id for u in updates if u.request.is_finished)
        for hook in self.step_hooks:
            hook.on_update(updates)
        self._release_pending()
        logprobs = runner_output.logprobs_by_id()
        return [_core_output(update, logprobs.get(update.request.request_id, [])) for update in updates]

    def _drain(self, in_flight: _InFlight) -> None:
        """After a failure: let a launched step end, drop its results, undo its schedule
        (its requests run it again in a later step)."""
        in_flight.ok = False
        in_flight.applied.set()
        try:
            in_flight.handle.get()
        except Exception:  # noqa: BLE001 - its own failure is already moot
            pass
        self.scheduler.undo_step(in_flight.scheduler_output)

    def _admit_guided(self) -> list[EngineCoreOutput]:
        """Hand requests whose grammar compiled to the scheduler; end those whose grammar
        failed to compile with the error (their only output)."""
        ready, failed = self.guided.poll()
        for group_id in ready:
            children = self._awaiting_grammar.pop(group_id, None)
            if children:
                self.add_requests(children)
        outputs = []
        for group_id, message in failed:
            for child in self._awaiting_grammar.pop(group_id, []):
                outputs.append(EngineCoreOutput(child.request_id, [], finish_reason="abort", error=message))
        return outputs

    def _has_guided_requests(self) -> bool:
        return any(self.guided.has_matcher(request_id) for request_id in self.scheduler.requests)

    def _release_pending(self) -> None:
        """Hand n>1 siblings to the scheduler once child 0's prompt is computed."""
        for sibling in self._siblings.release():
            self.scheduler.add_request(sibling)

    def _record_step(self, scheduler_output: SchedulerOutput) -> None:
        scheduled = scheduler_output.scheduled
        self.num_steps += 1
        num_decode = sum(1 for it in scheduled if it.num_new_tokens - len(it.spec_token_ids) == 1
                         and it.num_computed_tokens >= it.request.num_prompt_tokens)
        self.max_num_running_seen = max(self.max_num_running_seen, len(scheduled))
        self.last_step = (len(scheduled), num_decode, len(scheduled) - num_decode,
                          scheduler_output.total_num_scheduled_tokens)

    def wait_idle(self) -> None:
        """Block until the launched step's device job ends (its results are applied by the
        next ``step()``): e.g. before changing what a job reads, such as a LoRA slot."""
        if self._in_flight is not None:
            self._in_flight.handle.wait()

    def shutdown(self) -> None:
        """Finish what is in flight and stop the device worker thread (if any)."""
        if self._in_flight is not None:
            self._drain(self._in_flight)
            self._in_flight = None
        self.worker.shutdown()


def _core_output(update: RequestUpdate, logprobs: list) -> EngineCoreOutput:
    request = update.request
    return EngineCoreOutput(
        request_id=request.request_id,
        new_token_ids=update.new_token_ids,
        logprobs=list(logprobs[: len(update.new_token_ids)]),
        finish_reason=request.finish_reason if update.finished else None,
        stop_reason=request.stop_reason if update.finished else None,
        num_cached_tokens=max(request.num_cached_tokens, 0),
        first_scheduled_time=request.metrics.first_scheduled_time,
    )


def _has_copies(scheduler_output: SchedulerOutput) -> bool:
    return bool(scheduler_output.blocks_to_swap_out or scheduler_output.blocks_to_swap_in
                or scheduler_output.blocks_to_copy_back)


def _make_host_tier(config: EngineConfig, runner: ModelRunner) -> tuple[Optional[HostKVCache], Any]:
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
