"""EngineCore: token ids in, token ids out, one ``step()`` at a time. No tokenizer, no torch.

One step = ``Scheduler.schedule()`` (which requests advance, by how many tokens) →
``Executor.launch`` (the device job: KV-tier copies, then ``ModelRunner.execute``: one
forward pass over the flat mixed batch, then sampling or, with speculative decoding,
draft verification, all on the device side) → ``Scheduler.update_from_output()`` with
the job's ``ModelRunnerOutput`` → one ``EngineCoreOutput`` per request that got tokens or
finished. Text, stop strings and ``RequestOutput``s are the ``OutputProcessor``'s.

The device side (runner, sampler, speculator, host KV tier, worker thread) is built
outside (``pagoda.engine.runner.executor.make_executor``) and reaches the core through the
``Executor`` protocol (``device.py``): importing this module imports no torch, which
``tests/engine/test_core_imports.py`` checks.

Overlap (``EngineConfig.async_scheduling``): the job runs on a worker thread
(``device_worker``) and ``step()`` is pipelined one step deep::

    step() call k:   schedule N+1 → launch N+1 → get N → update N → outputs of N
    device:          ...... N ......|...... N+1 (forward) ...|gate|sample N+1|

``schedule()`` counts step N's sampled tokens as placeholders, so N+1 is planned before
N's tokens are known; the runner fills them in on the device (``sched/scheduler.py``,
``model_runner.py``). Sampling of N+1 waits for the *gate* of N, opened once N's tokens
are applied (after ``update_from_output`` and the grammar matchers' advance): sampling
reads each request's output history (penalties, min_tokens). A request that finishes
(EOS, stop token, stop string, abort) while N+1 runs gets its extra token dropped by the
scheduler; its blocks were freed when it finished. Structured output overlaps too: a
step's grammar bitmask is filled in its device job behind the gate, from matchers the
previous step's update advanced (``GuidedDecodingManager.accept`` runs before the gate
opens). With speculative decoding the core stays synchronous (drafts need the previous
step's tokens on the host before scheduling); ``async_scheduling`` is then ignored, with a
warning. Pipeline parallelism keeps N steps in flight instead: ``batch_queue.BatchQueueCore``.

Step hooks (``StepHook``): told which tokens were accepted after each update. Nothing in
the core edits logits: that is the sampler's logits-processor list (the grammar bitmask
is its last entry).

n > 1: ``make_requests`` turns a user request (an ``EngineRequest``) into its children,
which are added together; with prefix caching, a ``SiblingGate`` holds siblings of child 0
back until child 0's prompt is computed (``request_groups/parallel_sampling.py`` owns the fan-out).

Beam search (``params.use_beam_search``): ``make_requests`` makes the group's first beam
only; ``BeamSearch`` (``request_groups/beam_search.py``) chooses, forks and prunes beams after each update
and hands back a done group's ``n`` best beams (with their per-token log-probabilities when
asked), which become its only outputs; an abort of
the user request's output ids finishes the group's live beams.

Requests waiting outside the scheduler (for their grammar, or held siblings) are owned by
one registry, ``ParkedRequests`` (``parked.py``): admission counts them, aborts drop them,
and ``adapter_in_use`` reads them with the scheduler's requests (a LoRA unload is refused
while any uses the adapter). A parked request whose adapter is gone anyway when it enters
the scheduler ends alone with an error output; no step raises for it.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Optional, Protocol

from pagoda.engine.config import EngineConfig
from pagoda.engine.core.core_output import EngineCoreOutput, beam_outputs, core_output, failed_outputs
from pagoda.engine.core.load_shedding import EngineOverloaded, overload_message
from pagoda.engine.core.device import Executor, StepHandle
from pagoda.engine.core.sched.scheduler import RequestUpdate, Scheduler, SchedulerConfig, SchedulerOutput
from pagoda.engine.guided.params import GuidedDecodingParams
from pagoda.engine.guided.pool import CompilePoolFull
from pagoda.engine.request_groups.beam_search import BeamSearch
from pagoda.engine.request_groups.parallel_sampling import child_request_ids
from pagoda.engine.core.parked import ParkedRequests
from pagoda.engine.request import EngineRequest, Request, RequestStatus
from pagoda.engine.runner.runner_output import ModelRunnerOutput
from pagoda.engine.sampling.row import SamplingRow, make_seed

if TYPE_CHECKING:
    from pagoda.models.config import ModelConfig

logger = logging.getLogger(__name__)


class StepHook(Protocol):
    """Told, on the host after each ``update_from_output``, which tokens each request
    accepted. (Logits are edited only by the sampler's logits processors.)"""

    def on_update(self, updates: list[RequestUpdate]) -> None: ...


@dataclass
class _InFlight:
    """A launched step; ``applied`` is set once its results are applied (its gate)."""

    scheduler_output: SchedulerOutput
    handle: Optional[StepHandle] = None
    applied: threading.Event = field(default_factory=threading.Event)
    ok: bool = True

    def wait_applied(self) -> None:
        """The gate, called by the next step's device job before it samples."""
        self.applied.wait()
        if not self.ok:
            raise RuntimeError("the previous engine step failed; this one depends on its tokens")


class EngineCore:
    """Args:
    config: the engine configuration.
    model_config: the target model's config.
    model_id: seeds block hashes.
    eos_token_ids: the tokenizer's end-of-sequence ids.
    executor: the device side (``pagoda.engine.runner.executor.make_executor``).
    has_adapter: whether a LoRA adapter is (still) loaded; checked as a parked request
        enters the scheduler.
    """

    max_in_flight = 1  # steps with requests in flight at once, at most (``BatchQueueCore``: up to N)

    def __init__(self, config: EngineConfig, model_config: "ModelConfig", model_id: str,
                 eos_token_ids: Iterable[int], executor: Executor,
                 has_adapter: Callable[[str], bool] = lambda name: True) -> None:
        self.config = config
        self.model_config = model_config
        self.eos_token_ids = frozenset(eos_token_ids)
        self.executor = executor
        # Refuses lengths past the model's positions (or a Mistral sliding window).
        self.max_model_len = model_config.check_max_model_len(config.max_model_len)
        self.scheduler = Scheduler(SchedulerConfig.from_engine_config(
            config, num_blocks=executor.num_blocks, max_model_len=self.max_model_len, model_id=model_id,
            num_host_blocks=executor.num_host_blocks, kv_layout=executor.kv_layout,
            num_host_state_slots=executor.num_host_state_slots), swap_cost_model=executor.swap_cost_model,
            file_tiers=executor.file_tiers)
        self.is_async = executor.is_async
        self.timer = executor.timer
        self.guided = executor.guided
        self.step_hooks: list[StepHook] = []
        self._has_adapter = has_adapter
        self._in_flight: Optional[_InFlight] = None
        self.parked = ParkedRequests(config.enable_prefix_caching)  # outside the scheduler (parked.py)
        self.beams = BeamSearch(self.scheduler, self.guided)  # beam-search groups (beam_search.py)
        self.num_steps = 0
        self.max_num_running_seen = 0
        self.last_step = (0, 0, 0, 0)  # seqs, decode seqs, prefill seqs, tokens
        self.last_wait_s = 0.0  # how long the last step() blocked on the device

    # ----------------------------------------------------------------- requests
    def make_requests(self, request: EngineRequest, prompt_token_ids: list[int],
                      bad_words_token_ids: tuple[tuple[int, ...], ...] = (),
                      mm_features: tuple = ()) -> list[Request]:
        """The scheduler requests of one user request (``arrival_time`` resolved): itself for
        ``n == 1``, else children ``"{id}#{i}"``, child ``i`` seeded by ``make_seed(seed, i)``;
        each with the prompt's images (``mm_features``)."""
        params = request.params
        blocked = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids)
        if params.use_beam_search:  # one first beam; its group forks the others (beam_search.py)
            first = Request.from_engine_request(request, child_request_ids(request.request_id, params.n)[0],
                                                list(prompt_token_ids), self.eos_token_ids)
            return [self.beams.make_first_beam(first, request.request_id, self.eos_token_ids)]
        children = []
        for index, child_id in enumerate(child_request_ids(request.request_id, params.n)):
            child = Request.from_engine_request(request, child_id, list(prompt_token_ids), self.eos_token_ids,
                                                mm_features)
            child.sampling_state = SamplingRow(params=params, seed=make_seed(params.seed, index),
                                               prompt_token_ids=child.prompt_token_ids,
                                               output_token_ids=child.output_token_ids, min_tokens_blocked_ids=blocked,
                                               bad_words_token_ids=bad_words_token_ids)
            children.append(child)
        return children

    def add_requests(self, requests: list[Request], guided: Optional[GuidedDecodingParams] = None,
                     group_id: Optional[str] = None) -> None:
        """Queue one user request's children (one, or ``n`` siblings of one prompt). With
        ``guided``, they wait outside the scheduler until the grammar compiled
        (``pagoda.engine.guided``), under ``group_id``.

        Raises:
            ValueError: the first child can never run (see ``Scheduler.add_request``), or
                its format is over a grammar size/complexity limit; nothing is queued then.
            EngineOverloaded: its grammar needs a compile and every stuck-compile slot
                is taken (``pagoda.engine.guided.pool``); nothing is queued.
        """
        if requests[0].beam_group is not None:
            self.beams.check(requests[0])  # before a grammar wait too: its refusal is the caller's
        if guided is not None:
            self.scheduler.check_request(requests[0])
            try:  # refused formats and a full compile pool keep nothing
                self.guided.submit(group_id, [r.request_id for r in requests], guided, tenant=requests[0].cache_salt)
            except CompilePoolFull as exc:
                raise EngineOverloaded(overload_message(str(exc))) from None
            self.parked.await_grammar(group_id, requests)
            return
        self.scheduler.add_request(requests[0])
        if requests[0].beam_group is not None:
            self.beams.add(requests[0])
        for request in self.parked.hold_siblings(requests):
            self.scheduler.add_request(request)

    def abort_requests(self, request_ids: Iterable[str],
                       status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        """Finish requests now (abort, or a stop string found); frees their blocks. Unknown
        ids are ignored; a step in flight for them has its tokens dropped."""
        request_ids = self.beams.expand(request_ids)  # a beam group's output ids: its live beams
        for group_id in self.parked.drop(request_ids):
            self.guided.cancel(group_id)
        self.scheduler.finish_requests(request_ids, status)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self.parked) or self.has_pending_device_work

    @property
    def has_pending_device_work(self) -> bool:
        """KV copies recorded since the last step (``kv_write_through``: a finished request's blocks
        go to the files with one more step), or a launched step not finished yet (async scheduling)."""
        return self.scheduler.host_tier.has_pending_copies or self._in_flight is not None

    def queued_requests(self) -> Iterator[Request]:
        """Every request not admitted yet: the scheduler's waiting queue, siblings held
        for their first child's prompt, and requests waiting for their grammar
        (admission control bounds them all)."""
        yield from self.scheduler.waiting
        yield from self.parked.queued()

    def adapter_in_use(self, adapter_id: str) -> bool:
        """Whether any live request uses the adapter: scheduled (running, waiting, waiting
        for a LoRA slot) or parked (grammar, held sibling)."""
        return any(r.adapter_id == adapter_id for r in self.scheduler.requests.values()) or \
            self.parked.uses_adapter(adapter_id)

    @property
    def num_pending(self) -> int:
        """Siblings held back until their first child's prompt is computed."""
        return self.parked.num_held

    # --------------------------------------------------------------------- step
    def step(self) -> list[EngineCoreOutput]:
        """Schedule and launch one step; return the outputs of the step that completed
        (this one when synchronous, the previous one with async scheduling)."""
        previous, self._in_flight = self._in_flight, None
        self.last_wait_s = 0.0
        early = self._admit_guided()
        try:
            scheduler_output = self._schedule()
            launched = None
            if scheduler_output.has_device_work:  # requests, KV copies, or runner states to drop
                launched = self._launch(scheduler_output, previous)
        except BaseException:
            if previous is not None:
                self._drain(previous)
            raise
        if self.is_async:
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
        drafts = self.executor.propose_drafts(self.scheduler.running)
        if drafts:
            drafts = self.guided.truncate_drafts(drafts)
        scheduler_output = self.scheduler.schedule(drafts)
        self.executor.release(scheduler_output.finished_request_ids)
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
        launched = _InFlight(scheduler_output)
        launched.handle = self.executor.launch(scheduler_output, previous.wait_applied if previous else None)
        return launched

    def _finish(self, done: _InFlight) -> list[EngineCoreOutput]:
        """Wait for a launched step, apply it, then open its gate."""
        try:
            runner_output = done.handle.get()
        except BaseException:
            done.ok = False
            done.applied.set()
            self.scheduler.undo_step(done.scheduler_output)
            raise
        _record_prompt_logprobs(done.scheduler_output, runner_output)
        logprobs = runner_output.logprobs_by_id()
        try:
            updates = self._apply(runner_output)
            beams_done = self.beams.advance(logprobs)  # before the gate: beams' tokens are history
        finally:
            done.applied.set()
        orphans = self._release_pending()
        rows = runner_output.generation_logits  # each step's rows leave with its outputs (engine.logits_output)
        return [core_output(update, logprobs.get(update.request.request_id, []), rows.get(update.request.request_id))
                for update in updates] + \
            [out for group, best in beams_done for out in beam_outputs(group, best)] + orphans

    def _apply(self, runner_output: ModelRunnerOutput) -> list[RequestUpdate]:
        """The step's tokens into the scheduler, the grammar matchers and the hooks."""
        updates = self.scheduler.update_from_output(runner_output)
        for update in updates:
            if self.guided.accept(update.request.request_id, update.new_token_ids) and not update.finished:
                self.scheduler.finish_requests([update.request.request_id], RequestStatus.FINISHED_STOPPED)
                update.finished = True  # the grammar is complete: nothing more may follow
        self.executor.release(u.request.request_id for u in updates if u.request.is_finished)
        for hook in self.step_hooks:
            hook.on_update(updates)
        return updates

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
        outputs = []
        for group_id in ready:
            children = self.parked.take_grammar(group_id)
            if children and self._adapter_gone(children[0]):
                outputs += failed_outputs(children, _adapter_gone_message(children[0].adapter_id))
            elif children:
                self.add_requests(children)
        for group_id, message in failed:
            outputs += failed_outputs(self.parked.take_grammar(group_id), message)
        return outputs

    def _release_pending(self) -> list[EngineCoreOutput]:
        """Hand n>1 siblings to the scheduler once child 0's prompt is computed (those
        whose adapter is gone end with the error instead)."""
        orphans = []
        for sibling in self.parked.release_siblings():
            if self._adapter_gone(sibling):
                orphans += failed_outputs([sibling], _adapter_gone_message(sibling.adapter_id))
            else:
                self.scheduler.add_request(sibling)
        return orphans

    def _adapter_gone(self, request: Request) -> bool:
        return request.adapter_id is not None and not self._has_adapter(request.adapter_id)

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
        self.executor.shutdown()


def _adapter_gone_message(adapter_id: Optional[str]) -> str:
    return (f"lora_name: adapter {adapter_id!r} was unloaded while this request waited to be scheduled; "
            "load it again and retry")


def _record_prompt_logprobs(scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> None:
    """The step's prompt log-probabilities and context logits into their requests (before their outputs are made)."""
    if not (runner_output.prompt_logprobs or runner_output.context_logits):
        return
    requests = {item.request_id: item.request for item in scheduler_output.scheduled}
    for request_id, (start, entries) in runner_output.prompt_logprobs.items():
        requests[request_id].record_prompt_logprobs(start, entries)
    for request_id, (start, rows) in runner_output.context_logits.items():
        requests[request_id].kept_logits.add_context(start, rows)
