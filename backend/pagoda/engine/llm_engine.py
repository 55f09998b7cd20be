"""LLMEngine: requests in, streamed outputs out, one ``step()`` at a time.

One step = ``Scheduler.schedule()`` (which requests advance, by how many tokens) →
``ModelRunner.execute()`` (one forward pass over the flat mixed batch) → ``Sampler`` (a
token for every request that reached the end of its known tokens) →
``Scheduler.update_from_output()`` (append tokens, stop checks, free finished requests) →
incremental detokenization, stop strings, and ``RequestOutput``s with deltas and
timestamps.

With speculative decoding configured (``EngineConfig.speculative_method``), each step
first asks the ``Speculator`` for drafted tokens, which the scheduler schedules as
ordinary tokens; the speculator then verifies them from the runner's logits in place of
the plain sampler (``pagoda.engine.spec_decode``). Several tokens may then arrive for a
request in one step; stop strings are still matched token by token, so outputs end
exactly where they would without speculation.

Structured output (``SamplingParams.guided_decoding``, ``pagoda.engine.guided``): a
guided request waits outside the scheduler until its grammar is compiled on the compile
pool (``_admit_guided`` at the start of each step; a grammar that fails to compile ends
that request with ``RequestOutput.error``); then, every step, the host fills the grammar's
token bitmask before the forward pass, the sampler (or the speculator's verification,
after drafts were cut to the grammar) applies it, and the matcher follows the tokens kept
(a terminated grammar finishes the request with ``stop``).

A user request with ``n > 1`` becomes ``n`` scheduler requests ("children") that share
the prompt's KV blocks through the prefix cache: child 0 is scheduled first and the others
join once its prompt is computed, so they hit every full prompt block instead of
recomputing it. Their outputs are reported together under the user's request id.

The engine is single-threaded: a server drives it from one thread (see
``pagoda.serving``).
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Iterable, Optional, Union

from pagoda.engine.admission import Admission, EngineOverloaded, check_timeout, deadline_message, overload_message
from pagoda.engine.config import EngineConfig
from pagoda.engine.guided.backend import XGrammarBackend
from pagoda.engine.guided.manager import GuidedDecodingManager
from pagoda.engine.model_runner import ModelRunner, resolve_device, resolve_dtype
from pagoda.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprob
from pagoda.engine.request import Request, RequestStatus
from pagoda.engine.sampler import Sampler, SamplingRow, make_seed
from pagoda.engine.sampling_params import SamplingParams
from pagoda.engine.kv_transfer import HostKVCache, calibrate
from pagoda.engine.scheduler import Scheduler, SchedulerConfig
from pagoda.engine.spec_decode import SpeculativePlan
from pagoda.models.config import ModelConfig
from pagoda.models.gguf_import import ensure_default_model
from pagoda.models.tokenizer import IncrementalDetokenizer, Tokenizer

logger = logging.getLogger(__name__)

PromptType = Union[str, list[int]]


@dataclass
class EngineStats:
    num_waiting: int
    num_running: int
    kv_cache_usage: float
    num_blocks: int
    num_free_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_prompt_tokens: int
    num_generation_tokens: int
    num_steps: int
    max_num_running_seen: int
    last_step_num_seqs: int
    last_step_num_decode_seqs: int
    last_step_num_prefill_seqs: int
    last_step_num_tokens: int
    # Speculative decoding (zero without it); see SpecStats.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    # KV offload (zero without a CPU tier); see pagoda.engine.kv_offload.
    num_swapped_out: int = 0  # preemptions by swap
    num_swapped_in: int = 0
    num_recomputed_preemptions: int = 0  # preemptions by recompute (with or without the tier)
    prefix_cache_hits_host: int = 0  # tokens, included in prefix_cache_hits
    num_offloaded_blocks: int = 0  # cached blocks evicted from the device, copied to the host
    num_host_blocks: int = 0
    num_free_host_blocks: int = 0
    # LoRA (vLLM's lora_requests_info): adapters of running / waiting requests, and the slot count.
    running_lora_adapters: tuple = ()
    waiting_lora_adapters: tuple = ()
    max_lora: int = 0
    # Admission control (pagoda.engine.admission).
    num_admission_refused: int = 0  # refused at add_request: the waiting queue was full
    num_admission_displaced: int = 0  # waiting requests ended by a more urgent one
    num_deadline_expired: int = 0  # requests ended by their timeout


@dataclass
class _Completion:
    """Text state of one child: what has been decoded, and what has been emitted."""

    request: Request
    detokenizer: IncrementalDetokenizer
    text: str = ""
    num_emitted_chars: int = 0
    num_emitted_tokens: int = 0
    logprobs: Optional[list[TokenLogprob]] = None
    num_emitted_logprobs: int = 0
    cumulative_logprob: Optional[float] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None
    is_reported_final: bool = False
    num_kept_tokens: Optional[int] = None  # set when a stop string ends the output before the last token


@dataclass
class _Group:
    """One user request: its children and the metrics reported under its id."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    completions: list[_Completion]
    pending: list[Request] = field(default_factory=list)  # children not yet handed to the scheduler

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.completions)


class LLMEngine:
    def __init__(self, config: Optional[EngineConfig] = None) -> None:
        self.config = config or EngineConfig()
        model_path = str(self.config.model or ensure_default_model())
        self.model_path = model_path
        self.model_config = ModelConfig.from_pretrained(model_path)
        self.tokenizer = Tokenizer.from_pretrained(model_path)
        device = resolve_device(self.config)
        spec_plan = SpeculativePlan.from_config(self.config, self.model_config, device,
                                                resolve_dtype(self.config, device))
        self.runner = ModelRunner(self.config, self.model_config, model_path,
                                  draft_config=spec_plan.draft_config if spec_plan else None)
        # Refuses lengths past the model's positions (or a Mistral sliding window).
        self.max_model_len = self.model_config.check_max_model_len(self.config.max_model_len)
        self.host_kv_cache, cost_model = self._make_host_tier()
        self.scheduler = Scheduler(SchedulerConfig.from_engine_config(
            self.config, num_blocks=self.runner.num_blocks, max_model_len=self.max_model_len, model_id=self.model_id,
            num_host_blocks=self.host_kv_cache.num_blocks if self.host_kv_cache else 0), swap_cost_model=cost_model)
        self.sampler = Sampler(vocab_size=self.model_config.vocab_size, seed=self.config.seed)
        self.speculator = spec_plan.build(self.model_config, self.runner.model, self.runner.num_blocks, self.sampler,
                                          self.max_model_len) if spec_plan else None
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids)
        for lora_name, lora_path in self.config.lora_modules.items():
            self.add_lora(lora_name, lora_path)
        vocab_size = self.model_config.vocab_size
        self.guided = GuidedDecodingManager(
            lambda: XGrammarBackend(self.tokenizer, vocab_size, sorted(self.eos_token_ids)), vocab_size,
            pin_memory=device.type == "cuda")
        self.admission = Admission(self.config.max_waiting_requests, self.config.max_waiting_prompt_tokens)
        self._groups: dict[str, _Group] = {}
        self._child_of: dict[str, tuple[_Group, int]] = {}
        self._aborted_outputs: list[RequestOutput] = []
        self._num_steps = 0
        self._num_prompt_tokens = 0
        self._num_generation_tokens = 0
        self._max_num_running_seen = 0
        self._last_step = (0, 0, 0, 0)

    @property
    def model_id(self) -> str:
        """Identity that seeds block hashes: the model folder's name."""
        return _folder_name(self.model_path)

    # ----------------------------------------------------------------- requests
    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: Optional[SamplingParams] = None,
        *,
        arrival_time: Optional[float] = None,
        priority: int = 0,
        cache_salt: Optional[str] = None,
        lora_name: Optional[str] = None,
        timeout: Optional[float] = None,
    ) -> None:
        """Queue a request (``lora_name``: a loaded LoRA adapter to generate with; None: the base model).

        ``timeout`` (seconds from arrival): past it the request ends with a "deadline
        exceeded" error output (``pagoda.engine.admission``).

        Raises:
            ValueError: duplicate id, empty prompt, token ids outside the vocabulary, a
                request that can never fit (prompt + max_tokens over ``max_model_len`` or
                over the whole KV cache), ``speculative=True`` on an engine without
                speculative decoding, or an unknown ``lora_name`` (or any on an engine
                without LoRA). Nothing is queued then.
            EngineOverloaded: the waiting queue is full (admission control); nothing is
                queued, retry later.
        """
        params = params or SamplingParams()
        if params.speculative and self.speculator is None:
            raise ValueError("speculative: this server has no speculative decoding configured "
                             "(EngineConfig.speculative_method is None)")
        if not isinstance(request_id, str) or not request_id:
            raise ValueError("request_id: must be a non-empty string")
        if request_id in self._groups:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority: must be an integer, got {priority!r}")
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError("cache_salt: must be a non-empty string when given")
        self._check_lora_name(lora_name)
        check_timeout(timeout)
        text, token_ids = self._tokenize(prompt)
        self._check_stop_token_ids(params)
        arrival = time.time() if arrival_time is None else arrival_time
        verdict = self.admission.can_admit(len(token_ids), priority, self.scheduler.waiting)
        if not verdict.admit:
            raise EngineOverloaded(verdict.reason, self.admission.retry_after_s)
        children = [
            self._make_child(request_id if params.n == 1 else f"{request_id}#{i}", token_ids, params, i,
                             arrival, priority, cache_salt, lora_name)
            for i in range(params.n)
        ]
        # Validates fit (raises ValueError) before anything is registered. A guided request
        # waits for its grammar outside the scheduler (see _admit_guided).
        guided = params.guided_decoding
        if guided is None:
            self.scheduler.add_request(children[0])
        else:
            self.scheduler.check_request(children[0])
        self._fail_requests({self._child_of[v.request_id][0].request_id for v in verdict.victims},
                            lambda group: overload_message(
            "displaced from the waiting queue by a more urgent request", self.admission.retry_after_s))
        if timeout is not None:
            self.admission.track_deadline(request_id, arrival + timeout, timeout)
        group = _Group(request_id, text, token_ids, params, RequestMetrics(arrival_time=arrival),
                       [_Completion(c, IncrementalDetokenizer(self.tokenizer, token_ids, params.skip_special_tokens),
                                    logprobs=[] if params.logprobs is not None else None,
                                    cumulative_logprob=0.0 if params.logprobs is not None else None)
                        for c in children])
        self._groups[request_id] = group
        for i, child in enumerate(children):
            self._child_of[child.request_id] = (group, i)
        if self.config.enable_prefix_caching:
            group.pending = children[1:]
        elif guided is None:
            for child in children[1:]:
                self.scheduler.add_request(child)
        if guided is not None:
            self.guided.submit(request_id, [c.request_id for c in children], guided)

    def _tokenize(self, prompt: PromptType) -> tuple[Optional[str], list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt: must not be empty")
            return prompt, self.tokenizer.encode(prompt)
        if not isinstance(prompt, (list, tuple)) or not prompt:
            raise ValueError("prompt: must be a non-empty string or a non-empty list of token ids")
        vocab = self.model_config.vocab_size
        for t in prompt:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise ValueError(f"prompt: token id {t!r} is not in the vocabulary [0, {vocab})")
        return None, list(prompt)

    def _check_stop_token_ids(self, params: SamplingParams) -> None:
        vocab = self.model_config.vocab_size
        for t in params.stop_token_ids:
            if not 0 <= t < vocab:
                raise ValueError(f"stop_token_ids: token id {t} is not in the vocabulary [0, {vocab})")

    def _fail_requests(self, request_ids: Iterable[str], message_of) -> None:
        """End live requests with an error output (admission: displaced, deadline passed).

        Their blocks are freed as by ``abort_request``; the final output carries
        ``error = message_of(group)``."""
        for request_id in request_ids:
            group = self._groups.get(request_id)
            if group is None:
                continue
            message = message_of(group)
            self.abort_request(request_id)
            self._aborted_outputs[-1].error = message

    def _expire_deadlines(self) -> None:
        for request_id, timeout in self.admission.take_expired(self.admission.clock()):
            if request_id in self._groups:
                self.admission.num_expired += 1
                self._fail_requests([request_id], lambda group: deadline_message(timeout, group.completions[0].request))

    def _make_child(self, child_id, token_ids, params, index, arrival, priority, cache_salt, lora_name) -> Request:
        request = Request(child_id, list(token_ids), params, eos_token_ids=self.eos_token_ids,
                          arrival_time=arrival, priority=priority, cache_salt=cache_salt, adapter_id=lora_name)
        blocked = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids)
        request.sampling_state = SamplingRow(
            params=params,
            seed=make_seed(params.seed, index),
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=request.output_token_ids,
            min_tokens_blocked_ids=blocked,
        )
        return request

    # ---- LoRA adapters (engine/lora_manager.py) ----------------------------------------

    def _check_lora_name(self, lora_name: Optional[str]) -> None:
        if lora_name is None:
            return
        if self.runner.lora is None:
            raise ValueError(f"lora_name: {lora_name!r} was requested but this engine serves no LoRA adapters "
                             "(start it with enable_lora / --lora)")
        self.runner.lora.check(lora_name)

    def add_lora(self, name: str, path: str) -> None:
        """Load a PEFT LoRA adapter under ``name``. Raises ValueError (LoRA off, bad adapter, name taken)."""
        if self.runner.lora is None:
            raise ValueError("LoRA is not enabled on this engine (enable_lora=False)")
        self.runner.lora.add(name, path)

    def remove_lora(self, name: str) -> None:
        """Unload adapter ``name``. Raises ValueError when unknown or still used by a live request."""
        if self.runner.lora is None:
            raise ValueError("LoRA is not enabled on this engine (enable_lora=False)")
        self.runner.lora.check(name)
        if any(r.adapter_id == name for r in self.scheduler.requests.values()):
            raise ValueError(f"lora_name: adapter {name!r} is in use by running or waiting requests")
        self.runner.lora.remove(name)

    def list_loras(self) -> list[str]:
        return self.runner.lora.names() if self.runner.lora is not None else []

    def abort_request(self, request_ids: Union[str, Iterable[str]]) -> None:
        """Abort requests (unknown or finished ids are ignored); their blocks are freed now
        and their final outputs, with ``finish_reason == "abort"``, come from the next step()."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for request_id in request_ids:
            group = self._groups.get(request_id)
            if group is None:
                continue
            live = [c.request.request_id for c in group.completions
                    if c.finish_reason is None and c.request not in group.pending]
            self.scheduler.finish_requests(live, RequestStatus.FINISHED_ABORTED)
            self.guided.cancel(request_id)
            group.pending = []
            now = time.time()
            for completion in group.completions:
                if completion.finish_reason is None:
                    completion.finish_reason = "abort"
            group.metrics.finished_time = now
            self._aborted_outputs.append(self._make_output(group))
            self._forget(group)

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups) or bool(self._aborted_outputs)

    # --------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """Advance every schedulable request by one iteration; return what progressed."""
        self._expire_deadlines()
        outputs, self._aborted_outputs = self._aborted_outputs, []
        outputs += self._admit_guided()
        drafts = self.speculator.propose(self.scheduler.running) if self.speculator else None
        if drafts:
            drafts = self.guided.truncate_drafts(drafts)
        sched = self.scheduler.schedule(drafts)
        if self.host_kv_cache is not None:  # KV offload copies run before the forward pass
            self.host_kv_cache.execute(sched)
        if self.speculator:
            self.speculator.release(sched.finished_request_ids)
        self.guided.release(sched.finished_request_ids)
        if not sched.scheduled:
            if self.guided.num_waiting:  # nothing to run but compiles: wait for one, do not spin
                self.guided.wait(0.01)
            return outputs
        now = time.time()
        for item in sched.scheduled:
            group, _ = self._child_of[item.request.request_id]
            if group.metrics.first_scheduled_time is None:
                group.metrics.first_scheduled_time = now
        items = [item for item in sched.scheduled if item.is_sampling]
        # Filled on the host before the forward, so on a GPU it overlaps the kernels.
        bitmask = self.guided.prepare_bitmask(items)
        logits = self.runner.execute(sched.scheduled)
        sampled, logprobs = self._sample(logits, items, bitmask)
        updates = self.scheduler.update_from_output(sched, sampled)
        self._record_step(sched)
        now = time.time()
        touched: dict[str, _Group] = {}
        for update in updates:
            group, _ = self._child_of[update.request.request_id]
            if self.guided.accept(update.request.request_id, update.new_token_ids) and not update.finished:
                self.scheduler.finish_requests([update.request.request_id], RequestStatus.FINISHED_STOPPED)
                update.finished = True  # the grammar is complete: nothing more may follow
            self._absorb(update, now, logprobs.get(update.request.request_id, []))
            touched[group.request_id] = group
        if self.speculator:
            self.speculator.release(u.request.request_id for u in updates if u.request.is_finished)
        self._release_pending_children()
        for group in touched.values():
            outputs.append(self._make_output(group))
            if group.finished:
                self._forget(group)
        return outputs

    def _sample(self, logits, items, bitmask) -> tuple[dict[str, list[int]], dict[str, list]]:
        """Tokens and raw logprobs (``None`` where not asked for) per sampling request."""
        if self.speculator is not None:
            return self.speculator.sample(logits, items, bitmask)
        if not items:
            return {}, {}
        result = self.sampler(logits, [item.request.sampling_state for item in items], bitmask)
        ids = [item.request.request_id for item in items]
        return ({i: [t] for i, t in zip(ids, result.token_ids)}, {i: [lp] for i, lp in zip(ids, result.logprobs)})

    def _admit_guided(self) -> list[RequestOutput]:
        """Hand requests whose grammar compiled to the scheduler; end those whose grammar
        failed to compile with the error (their only output)."""
        ready, failed = self.guided.poll()
        for request_id in ready:
            group = self._groups[request_id]
            self.scheduler.add_request(group.completions[0].request)
            if not self.config.enable_prefix_caching:
                for completion in group.completions[1:]:
                    self.scheduler.add_request(completion.request)
        outputs = []
        for request_id, message in failed:
            group = self._groups[request_id]
            for completion in group.completions:
                completion.finish_reason = "abort"
            group.pending = []
            group.metrics.finished_time = time.time()
            output = self._make_output(group)
            output.error = message
            outputs.append(output)
            self._forget(group)
        return outputs

    def _absorb(self, update, now: float, logprobs: list) -> None:
        """Detokenize a child's new tokens, apply stop strings, stamp metrics."""
        request = update.request
        group, index = self._child_of[request.request_id]
        completion = group.completions[index]
        new_ids = update.new_token_ids
        if new_ids:
            self._num_generation_tokens += len(new_ids)
            m = group.metrics
            if m.first_token_time is None:
                m.first_token_time = now
                self._num_prompt_tokens += len(group.prompt_token_ids)
            else:
                m.inter_token_latencies.append(now - m.last_token_time)
            m.last_token_time = now
        # Several tokens at once (speculative decoding) go one at a time through the stop
        # strings, so the output ends exactly where it would without speculation.
        pieces = [[t] for t in new_ids] if group.params.stop and len(new_ids) > 1 else [new_ids]
        stopped = False
        for i, piece in enumerate(pieces):
            if piece:
                completion.text += completion.detokenizer.add(piece)
            is_last = i == len(pieces) - 1
            if update.finished and is_last:
                completion.text += completion.detokenizer.finish()
            num_outputs = request.num_output_tokens - (len(new_ids) - sum(len(p) for p in pieces[: i + 1]))
            # A stop string wins over a length/EOS finish reached in the same step.
            stopped = (bool(group.params.stop) and num_outputs >= group.params.min_tokens
                       and self._apply_stop_strings(completion, group.params))
            if stopped:
                if not is_last:
                    completion.num_kept_tokens = num_outputs
                    self._num_generation_tokens -= request.num_output_tokens - num_outputs
                break
        num_new_kept = len(new_ids) if completion.num_kept_tokens is None else completion.num_kept_tokens - (
            request.num_output_tokens - len(new_ids))
        for lp in logprobs[:num_new_kept] if completion.logprobs is not None else ():
            completion.logprobs.append(TokenLogprob(lp.token_id, lp.logprob, lp.rank, list(lp.top)))
            completion.cumulative_logprob += lp.logprob
        if stopped and not update.finished:
            self.scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_STOPPED)
        elif update.finished and not stopped:
            completion.finish_reason = request.finish_reason
            completion.stop_reason = request.stop_reason
        if completion.finish_reason is not None and group.finished:
            group.metrics.finished_time = now

    def _apply_stop_strings(self, completion: _Completion, params: SamplingParams) -> bool:
        """Truncate at the earliest stop string in the unscanned tail; True if one matched."""
        # Only the tail can hold a new match: the text not yet emitted plus a stop
        # string's length of overlap with what was.
        longest = max(len(s) for s in params.stop)
        scan_from = max(0, completion.num_emitted_chars - longest)
        best = None
        for stop in params.stop:
            pos = completion.text.find(stop, scan_from)
            if pos != -1 and (best is None or pos < best[0]):
                best = (pos, stop)
        if best is None:
            return False
        pos, stop = best
        completion.text = completion.text[: pos + len(stop) if params.include_stop_str_in_output else pos]
        completion.finish_reason = "stop"
        completion.stop_reason = stop
        return True

    def _release_pending_children(self) -> None:
        """Hand n>1 siblings to the scheduler once child 0's prompt blocks are cached."""
        for group in self._groups.values():
            if not group.pending:
                continue
            first = group.completions[0].request
            if first.num_computed_tokens >= first.num_prompt_tokens or first.status.is_finished():
                for child in group.pending:
                    self.scheduler.add_request(child)
                group.pending = []

    def _make_output(self, group: _Group) -> RequestOutput:
        completions = []
        for i, c in enumerate(group.completions):
            finished = c.finish_reason is not None
            # While stop strings may still match, hold back a stop string's length of text.
            hold = 0 if finished or not group.params.stop else max(len(s) for s in group.params.stop) - 1
            visible = max(c.num_emitted_chars, len(c.text) - hold)
            delta_text = c.text[c.num_emitted_chars:visible]
            c.num_emitted_chars = visible
            token_ids = c.request.output_token_ids[: c.num_kept_tokens]
            delta_ids = token_ids[c.num_emitted_tokens:]
            c.num_emitted_tokens = len(token_ids)
            delta_lp = None
            if c.logprobs is not None:
                delta_lp = c.logprobs[c.num_emitted_logprobs:]
                c.num_emitted_logprobs = len(c.logprobs)
            completions.append(CompletionOutput(
                index=i, text=c.text[:visible], token_ids=list(token_ids), delta_text=delta_text,
                delta_token_ids=list(delta_ids), cumulative_logprob=c.cumulative_logprob,
                logprobs=list(c.logprobs) if c.logprobs is not None else None, delta_logprobs=delta_lp,
                finish_reason=c.finish_reason, stop_reason=c.stop_reason))
        first = group.completions[0].request
        return RequestOutput(
            request_id=group.request_id, prompt=group.prompt, prompt_token_ids=group.prompt_token_ids,
            outputs=completions, finished=group.finished, metrics=group.metrics,
            num_cached_tokens=max(first.num_cached_tokens, 0))

    def _forget(self, group: _Group) -> None:
        self._groups.pop(group.request_id, None)
        for c in group.completions:
            self._child_of.pop(c.request.request_id, None)

    def _record_step(self, sched) -> None:
        self._num_steps += 1
        num_decode = sum(1 for it in sched.scheduled if it.num_new_tokens - len(it.spec_token_ids) == 1
                         and it.num_computed_tokens >= it.request.num_prompt_tokens)
        self._max_num_running_seen = max(self._max_num_running_seen, len(sched.scheduled))
        self._last_step = (len(sched.scheduled), num_decode, len(sched.scheduled) - num_decode,
                           sched.total_num_scheduled_tokens)

    # -------------------------------------------------------------------- stats
    def get_stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(
            num_waiting=s.num_waiting + sum(len(g.pending) for g in self._groups.values()) + self.guided.num_waiting,
            num_running=s.num_running,
            kv_cache_usage=s.kv_cache_usage,
            num_blocks=self.runner.num_blocks - 1,  # block 0 is the pool's reserved null block
            num_free_blocks=s.num_free_blocks,
            prefix_cache_queries=s.prefix_cache_queries,
            prefix_cache_hits=s.prefix_cache_hits,
            num_preemptions=s.num_preemptions_total,
            num_prompt_tokens=self._num_prompt_tokens,
            num_generation_tokens=self._num_generation_tokens,
            num_steps=self._num_steps,
            max_num_running_seen=self._max_num_running_seen,
            last_step_num_seqs=self._last_step[0],
            last_step_num_decode_seqs=self._last_step[1],
            last_step_num_prefill_seqs=self._last_step[2],
            last_step_num_tokens=self._last_step[3],
            num_recomputed_preemptions=s.num_recomputed_preemptions,
            **self._spec_stats(),
            **self._offload_stats(),
            **self._lora_stats(),
            **self.admission.stats(),
        )

    def _lora_stats(self) -> dict:
        if self.runner.lora is None:
            return {}
        s = self.scheduler
        return dict(running_lora_adapters=tuple(sorted({r.adapter_id for r in s.running if r.adapter_id})),
                    waiting_lora_adapters=tuple(sorted({r.adapter_id for r in s.waiting if r.adapter_id})),
                    max_lora=self.config.max_loras)

    def _make_host_tier(self):
        """(host KV cache, swap cost model) for ``cpu_offload_bytes > 0``, else (None, None).
        The cost model is calibrated only for ``preemption_mode="auto"``."""
        cfg = self.config
        if cfg.cpu_offload_bytes == 0:
            return None, None
        host = HostKVCache.for_runner(self.runner, cfg.cpu_offload_bytes)
        if cfg.preemption_mode != "auto":
            return host, None
        model = calibrate(host, self.runner, cfg.offload_copy_bandwidth, cfg.offload_copy_latency_s,
                          cfg.prefill_s_per_token)
        logger.info("KV offload: %d host blocks; swap cost model %s", host.num_blocks, model)
        return host, model

    def _offload_stats(self) -> dict:
        offload = self.scheduler.offload
        if offload is None:
            return {}
        return dict(num_swapped_out=offload.num_swapped_out, num_swapped_in=offload.num_swapped_in,
                    prefix_cache_hits_host=offload.prefix_cache_hits_host,
                    num_offloaded_blocks=offload.num_offloaded_blocks,
                    num_host_blocks=offload.pool.num_blocks, num_free_host_blocks=offload.num_free_blocks)

    def _spec_stats(self) -> dict:
        if self.speculator is None:
            return {}
        st = self.speculator.stats
        return dict(spec_num_drafts=st.num_drafts, spec_num_draft_tokens=st.num_draft_tokens,
                    spec_num_accepted_tokens=st.num_accepted_tokens)

    def take_block_events(self) -> list:
        """Block events (ARCHITECTURE contract 3) since the last call, oldest first."""
        return self.scheduler.take_events()


def _folder_name(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1]
