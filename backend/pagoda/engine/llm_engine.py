"""LLMEngine: requests in, streamed outputs out, one ``step()`` at a time.

A thin facade over two halves (see each module's docstring):

* ``EngineCore`` (``engine_core.py``): token ids in, token ids out. One step schedules,
  launches the forward pass and sampling (speculative decoding included), and applies
  the sampled tokens to the scheduler. With ``EngineConfig.async_scheduling`` it
  overlaps the host's work with the device's, one step deep; under pipeline parallelism
  ``BatchQueueCore`` (``batch_queue.py``) keeps a step in flight per stage.
* ``OutputProcessor`` (``output_processor.py``): detokenization, stop strings (a stop
  string found there is passed back to the core as an abort), logprobs, n > 1 groups,
  and ``RequestOutput``s with deltas and timestamps.

Structured output (``SamplingParams.guided_decoding``, ``pagoda.engine.guided``) lives in
the core: a guided request waits outside the scheduler until its grammar compiled (a
grammar that fails to compile ends it with ``RequestOutput.error``); every step the host
fills the grammar's bitmask before the forward, the sampler (or the speculator) applies
it, and the matcher follows the kept tokens (a terminated grammar finishes the request
with ``stop``). Guided requests overlap like the others (see ``engine_core.py``).

Requests enter as ``EngineRequest`` envelopes (``add``; ``add_request`` builds one from
keyword arguments). The ``InputProcessor`` (``input_processor.py``) makes the engine's own
checks and the prompt's token ids (none when the request brings them: the router tokenized
it); the facade has the core fan a user request with ``n > 1`` out into ``n`` core requests
("children", ``"{id}#{i}"``) that share the prompt's KV blocks through the prefix cache.
``get_stats`` (``stats.collect_stats``) includes per-step timing: host time in ``step()``,
device time (copies, forward, sampling) and device idle time (see ``device_worker.py``).

The engine is single-threaded: a server drives it from one thread (see
``pagoda.serving``); with async scheduling the core owns one extra worker thread for the
device, joined by ``shutdown()``.

Invariant: the engine is no reference cycle. The callbacks its parts hold (the beam search's
stop-string finder, the input processor's LoRA check, the core's adapter check, the grammar
backend's factory) hold the parts they read, never the engine, so an engine dropped without
``shutdown()`` frees its weights and KV cache at once by reference counting
(tests/engine/test_engine_freed.py), not at CPython's next full collection.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from typing import TYPE_CHECKING, Iterable, Optional, Union

from pagoda.contracts.request_options import RequestOptions
from pagoda.engine.core.load_shedding import Admission, EngineOverloaded, deadline_message, overload_message
from pagoda.engine.config import EngineConfig
from pagoda.engine.core.batch_queue import make_engine_core
from pagoda.engine.request_groups.parallel_sampling import child_request_ids
from pagoda.engine.guided.backend import XGrammarBackend
from pagoda.engine.image_inputs import make_image_inputs
from pagoda.engine.input_processor import EngineCapabilities, InputProcessor
from pagoda.engine.output_processor import OutputProcessor
from pagoda.engine.parallel import make_executor
from pagoda.engine.outputs import RequestOutput
from pagoda.engine.request import EngineRequest, PromptType, RequestStatus, split_prompt
from pagoda.engine.resume import resumed_output
from pagoda.engine.sampling_params import SamplingParams
from pagoda.engine.stats import EngineStats, collect_stats
from pagoda.models.generation_config import generation_defaults
from pagoda.models.registry import config_from_pretrained
from pagoda.models.gguf_import import ensure_default_model
from pagoda.models.tokenizer import Tokenizer

if TYPE_CHECKING:
    from pagoda.engine.lora.manager import LoRAManager
    from pagoda.models.lora import LoRAAdapter

logger = logging.getLogger(__name__)



class LLMEngine:
    def __init__(self, config: Optional[EngineConfig] = None) -> None:
        self.config = config or EngineConfig()
        model_path = str(self.config.model or ensure_default_model())
        self.model_path = model_path
        self.model_config = config_from_pretrained(model_path)
        self.tokenizer = Tokenizer.from_pretrained(model_path)
        # The model's sampling defaults (generation_config.json) unless turned off; SamplingParams.with_defaults.
        self.generation_defaults = generation_defaults(model_path) if self.config.generation_config == "auto" else {}
        vocab_size = self.model_config.vocab_size
        eos_ids = sorted(self.tokenizer.eos_token_ids)
        # The callbacks handed to the parts hold the parts they read, never the engine: the
        # engine is then no reference cycle, and dropping it frees its weights and KV cache at
        # once (a cycle would wait for CPython's rare full collection).
        self.executor = make_executor(self.config, self.model_config, model_path,
                                      make_grammar_backend=functools.partial(XGrammarBackend, self.tokenizer,
                                                                             vocab_size, eos_ids))
        self.core = make_engine_core(self.config, self.model_config, self.model_id, eos_ids, self.executor,
                                     has_adapter=functools.partial(_has_lora, self.executor))
        self.output_processor = OutputProcessor(self.tokenizer)
        self.input_processor = InputProcessor(self.tokenizer, vocab_size, self.max_model_len, EngineCapabilities(
            has_speculator=self.speculator is not None, world_size=self.config.world_size,
            check_lora_name=functools.partial(_check_lora_name, self.executor),
            has_request=self.output_processor.has_request),
            make_image_inputs(self.model_config, model_path, self.config.multimodal, _max_step_tokens(self.config)))
        # Beams end at stop strings too.
        self.core.beams.find_stop_string = functools.partial(_find_stop_string, self.tokenizer)
        self.admission = Admission(self.config.max_waiting_requests, self.config.max_waiting_prompt_tokens,
                                   max_queue_delay_s=self.config.max_queue_delay_s, slots=self.config.max_num_seqs)
        for lora_name, lora_path in self.config.lora_modules.items():
            self.add_lora(lora_name, lora_path)

    @property
    def model_id(self) -> str:
        """Identity that seeds block hashes: the model folder's name."""
        return _folder_name(self.model_path)

    # The core's parts, for callers and tests that inspect them.
    @property
    def scheduler(self):
        return self.core.scheduler

    @property
    def runner(self):
        return self.executor.runner

    @property
    def sampler(self):
        return self.executor.runner.sampler

    @property
    def speculator(self):
        return self.executor.speculator

    @property
    def host_kv_cache(self):
        return self.executor.host_kv_cache

    @property
    def guided(self):
        return self.core.guided

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.core.eos_token_ids

    # ----------------------------------------------------------------- requests
    def add(self, request: EngineRequest) -> None:
        """Queue a request: the seam every door uses (``add_request`` builds the envelope).

        Its ``options.lora_name`` must name a loaded adapter; past its ``options.timeout``
        (seconds from arrival) it ends with a "deadline exceeded" error output
        (``pagoda.engine.core.load_shedding``); ``params.n > 1`` runs ``n`` children;
        ``options.resume`` continues a request another replica began (``engine.resume``).

        Raises:
            ValueError: as ``InputProcessor.process`` (duplicate id, empty prompt, token ids
                outside the vocabulary, a capability this engine lacks, an unknown
                ``lora_name``), or a request that can never fit (prompt + max_tokens over
                ``max_model_len`` or over the whole KV cache), a ``resume`` it cannot continue.
                Nothing is queued then.
            EngineOverloaded: the waiting queue is full (admission control); nothing is
                queued, retry later.
        """
        if self.generation_defaults:  # the model's own, for what the request left unset (vLLM's "auto")
            request = dataclasses.replace(request, params=request.params.with_defaults(self.generation_defaults))
        processed = self.input_processor.process(request)
        if request.arrival_time is None:
            request = dataclasses.replace(request, arrival_time=time.time())
        options = request.options
        verdict = self.admission.can_admit(len(processed.token_ids), options.priority, self.core.queued_requests(),
                                           self.core.scheduler.num_running)
        if not verdict.admit:
            raise EngineOverloaded(verdict.reason, self.admission.retry_after_s)
        resumed = resumed_output(request, processed.token_ids, self.tokenizer, self.input_processor.vocab_size)
        children = self.core.make_requests(request, processed.token_ids, processed.bad_words_token_ids,
                                           processed.mm_features)
        if resumed is not None:  # its output so far, before anything reads the request (engine.resume)
            children[0].append_output_token_ids(resumed.token_ids)
        # Validates fit (raises ValueError) before anything is tracked; a guided request
        # waits for its grammar in the core.
        self.core.add_requests(children, request.params.guided_decoding, request.request_id)
        if resumed is not None and request.params.guided_decoding is not None:
            self.core.guided.replay(request.request_id, resumed.token_ids)  # its matcher consumes them first
        self.output_processor.add_request(request.request_id, processed.text, processed.token_ids, request.params,
                                          child_request_ids(request.request_id, request.params.n),
                                          request.arrival_time, resumed)
        self._fail_requests({self.output_processor.group_of(v.request_id) for v in verdict.victims},
                            lambda child0: overload_message(
            "displaced from the waiting queue by a more urgent request", self.admission.retry_after_s))
        if options.timeout is not None:
            self.admission.track_deadline(request.request_id, request.arrival_time + options.timeout, options.timeout)

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
        """``add(EngineRequest(...))`` with the envelope's fields as arguments (the offline
        API, tests and benches); ``params=None``: the model's sampling defaults (``SamplingParams.from_dict({})``
        then ``with_defaults``). ``prompt`` may be vLLM's dict form (``split_prompt``: with
        ``multi_modal_data``). Raises as ``add``, and
        ValueError naming an option that is not valid (``RequestOptions``)."""
        options = RequestOptions(priority=priority, cache_salt=cache_salt, lora_name=lora_name, timeout=timeout)
        params = params if params is not None else SamplingParams.from_dict({})
        prompt, multi_modal_data = split_prompt(prompt)
        self.add(EngineRequest(request_id, prompt, params, options, arrival_time=arrival_time,
                               multi_modal_data=multi_modal_data))

    def tokenize_prompt(self, text: str, params: Optional[SamplingParams] = None) -> list[int]:
        """A text prompt's token ids, for ``EngineRequest.prompt_token_ids`` (any thread:
        ``InputProcessor.tokenize_prompt``). Raises ValueError for a text that can never fit."""
        return self.input_processor.tokenize_prompt(text, params)

    # ---- LoRA adapters (engine/lora/manager.py) ----------------------------------------

    def add_lora(self, name: str, path: str) -> None:
        """Load a PEFT LoRA adapter under ``name``. Raises ValueError (LoRA off, bad adapter, name taken)."""
        self.register_lora(self.load_lora(name, path))

    def load_lora(self, name: str, path: str) -> LoRAAdapter:
        """Read adapter ``name`` from ``path`` on the host without registering it.

        Thread-safe (it touches no engine state), so a server calls it off the engine
        thread and hands the result to ``register_lora`` on that thread.

        Raises:
            ValueError: LoRA off, name invalid or taken, registry full, or a bad adapter.
        """
        return self._lora_manager().load(name, path)

    def register_lora(self, adapter: LoRAAdapter) -> None:
        """Serve an adapter from ``load_lora``; the next step may use it. Raises ValueError
        (LoRA off, name taken, registry full)."""
        self._lora_manager().register(adapter)

    def _lora_manager(self) -> LoRAManager:
        if self.runner.lora is None:
            raise ValueError("LoRA is not enabled on this engine (enable_lora=False; `pagoda serve --lora` or "
                             "--allow-runtime-lora turns it on)")
        return self.runner.lora

    def remove_lora(self, name: str) -> None:
        """Unload adapter ``name``. Raises ValueError when unknown or still used by a live
        request: running, waiting, or waiting outside the scheduler (``EngineCore.adapter_in_use``)."""
        self._lora_manager().check(name)
        if self.core.adapter_in_use(name):
            raise ValueError(f"lora_name: adapter {name!r} is in use by running or waiting requests "
                             "(including requests waiting for their grammar); retry when they have finished")
        self.core.wait_idle()  # a step in flight may still read the adapter's slot (async scheduling)
        self.runner.lora.remove(name)

    def list_loras(self) -> list[str]:
        return _lora_names(self.executor)

    def lora_paths(self) -> dict[str, str]:
        """Loaded adapter name -> the folder it came from (empty with LoRA off)."""
        return self.runner.lora.paths() if self.runner.lora is not None else {}

    # ---- ending requests ----------------------------------------------------------------

    def _fail_requests(self, request_ids: Iterable[Optional[str]], message_of) -> None:
        """End live user requests with an error output (admission: displaced, deadline passed).

        Their blocks are freed as by ``abort_request``; the final output carries
        ``error = message_of(child 0's scheduler request, or None while it is not scheduled)``."""
        for request_id in request_ids:
            child_ids = self.output_processor.child_ids(request_id) if request_id is not None else []
            if not child_ids:
                continue
            message = message_of(self.core.scheduler.get_request(child_ids[0]))
            self.core.abort_requests(self.output_processor.abort(request_id, error=message))

    def _expire_deadlines(self) -> None:
        for request_id, timeout in self.admission.take_expired(self.admission.clock()):
            if self.output_processor.has_request(request_id):
                self.admission.num_expired += 1
                self._fail_requests([request_id], lambda child0: deadline_message(timeout, child0))

    def abort_request(self, request_ids: Union[str, Iterable[str]]) -> None:
        """Abort requests (unknown or finished ids are ignored); their blocks are freed now
        and their final outputs, with ``finish_reason == "abort"``, come from the next step()."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for request_id in request_ids:
            self.core.abort_requests(self.output_processor.abort(request_id))

    def has_unfinished_requests(self) -> bool:
        """Requests in flight, or device work the core still has to run (``EngineCore.has_pending_device_work``)."""
        return self.output_processor.has_unfinished_requests() or self.core.has_pending_device_work

    # --------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """Advance every schedulable request by one iteration; return what progressed
        (with async scheduling: what the previous iteration produced)."""
        start = time.perf_counter()
        self._expire_deadlines()
        core_outputs = self.core.step()
        outputs, stopped = self.output_processor.process(core_outputs)
        if stopped:  # stop strings end these children; the core frees them now
            self.core.abort_requests(stopped, RequestStatus.FINISHED_STOPPED)
        self._observe_service(outputs)
        self.core.timer.record_host(time.perf_counter() - start - self.core.last_wait_s, self.core.last_wait_s)
        return outputs

    def _observe_service(self, outputs: list[RequestOutput]) -> None:
        """Feed admission's capacity estimate with requests that ran to their natural end."""
        for output in outputs:
            m = output.metrics
            if output.finished and output.error is None and m.first_scheduled_time is not None \
                    and m.finished_time is not None and all(c.finish_reason in ("stop", "length")
                                                             for c in output.outputs):
                self.admission.observe_service(m.finished_time - m.first_scheduled_time)

    def shutdown(self) -> None:
        """Stop the core's device worker thread (async scheduling); idempotent."""
        self.core.shutdown()

    def get_stats(self) -> EngineStats:
        """A snapshot of the engine's counters and gauges (``stats.collect_stats``)."""
        return collect_stats(self)

    def take_block_events(self) -> list:
        """Block events (ARCHITECTURE contract 3) since the last call, oldest first."""
        return self.core.scheduler.take_events()


def _folder_name(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1]


def _max_step_tokens(config: EngineConfig) -> Optional[int]:
    """The most prompt tokens one step prefills with chunked prefill (None without: a prompt runs whole)."""
    if not config.enable_chunked_prefill:
        return None
    threshold = config.long_prefill_token_threshold
    return min(config.max_num_batched_tokens, threshold) if threshold else config.max_num_batched_tokens


def _find_stop_string(tokenizer: Tokenizer, params: SamplingParams, output_token_ids: list[int]) -> Optional[str]:
    """The stop string a beam's output text holds (the earliest), or None (``request_groups.beam_search``)."""
    text = tokenizer.decode(output_token_ids, skip_special_tokens=params.skip_special_tokens)
    found = [(text.find(stop), stop) for stop in params.stop if stop in text]
    return min(found)[1] if found else None


def _lora_names(executor) -> list[str]:
    """The adapters the executor's runner serves (none with LoRA off)."""
    return executor.runner.lora.names() if executor.runner.lora is not None else []


def _has_lora(executor, name: str) -> bool:
    return name in _lora_names(executor)


def _check_lora_name(executor, lora_name: Optional[str]) -> None:
    """Refuse a request's ``lora_name`` the engine does not serve (ValueError naming it)."""
    if lora_name is None:
        return
    lora = executor.runner.lora
    if lora is None:
        raise ValueError(f"lora_name: {lora_name!r} was requested but this engine serves no LoRA adapters "
                         "(start it with enable_lora / --lora)")
    lora.check(lora_name)
