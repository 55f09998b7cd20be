"""LLMEngine: requests in, streamed outputs out, one ``step()`` at a time.

A thin facade over two halves (see each module's docstring):

* ``EngineCore`` (``engine_core.py``): token ids in, token ids out. One step schedules,
  launches the forward pass and sampling (speculative decoding included), and applies
  the sampled tokens to the scheduler. With ``EngineConfig.async_scheduling`` it
  overlaps the host's work with the device's, one step deep.
* ``OutputProcessor`` (``output_processor.py``): detokenization, stop strings (a stop
  string found there is passed back to the core as an abort), logprobs, n > 1 groups,
  and ``RequestOutput``s with deltas and timestamps.

Structured output (``SamplingParams.guided_decoding``, ``pagoda.engine.guided``) lives in
the core: a guided request waits outside the scheduler until its grammar compiled (a
grammar that fails to compile ends it with ``RequestOutput.error``); every step the host
fills the grammar's bitmask before the forward, the sampler (or the speculator) applies
it, and the matcher follows the kept tokens (a terminated grammar finishes the request
with ``stop``). Guided requests overlap like the others (see ``engine_core.py``).

The facade tokenizes and validates requests, fans a user request with ``n > 1`` out into
``n`` core requests ("children", ``"{id}#{i}"``) that share the prompt's KV blocks
through the prefix cache, and assembles ``EngineStats``, including per-step timing: host
time in ``step()``, device time (copies, forward, sampling) and device idle time (see
``device_worker.py``).

The engine is single-threaded: a server drives it from one thread (see
``pagoda.serving``); with async scheduling the core owns one extra worker thread for the
device, joined by ``shutdown()``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Optional, Union

from pagoda.engine.core.admission import Admission, EngineOverloaded, check_timeout, deadline_message, overload_message
from pagoda.engine.config import EngineConfig
from pagoda.engine.core.engine_core import EngineCore
from pagoda.engine.guided.backend import XGrammarBackend
from pagoda.engine.output_processor import OutputProcessor
from pagoda.engine.runner.executor import make_executor
from pagoda.engine.outputs import RequestOutput
from pagoda.engine.request import RequestStatus
from pagoda.engine.sampling_params import SamplingParams
from pagoda.models.config import ModelConfig
from pagoda.models.gguf_import import ensure_default_model
from pagoda.models.tokenizer import Tokenizer

if TYPE_CHECKING:
    from pagoda.engine.lora.manager import LoRAManager
    from pagoda.models.lora import LoRAAdapter

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
    # KV offload (zero without a CPU tier); see pagoda.engine.kv.host_tier.
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
    # Admission control (pagoda.engine.core.admission).
    num_admission_refused: int = 0  # refused at add_request: the waiting queue was full
    num_admission_displaced: int = 0  # waiting requests ended by a more urgent one
    num_deadline_expired: int = 0  # requests ended by their timeout
    # Time to first token over the last 30 s (engine.latency_window; the fleet heartbeat).
    ttft_p90: float = 0.0
    recent_ttfts: tuple = ()
    # Step timing, seconds summed over steps (see pagoda.engine.runner.device_worker).
    step_host_s: float = 0.0  # host work inside step(), not counting waits on the device
    step_device_s: float = 0.0  # device jobs: KV-tier copies, forward, sampling
    step_device_idle_s: float = 0.0  # the device waiting for the host between steps
    step_wait_s: float = 0.0  # the host blocked waiting for the device
    last_step_host_s: float = 0.0
    last_step_device_s: float = 0.0
    last_step_device_idle_s: float = 0.0


class LLMEngine:
    def __init__(self, config: Optional[EngineConfig] = None) -> None:
        self.config = config or EngineConfig()
        model_path = str(self.config.model or ensure_default_model())
        self.model_path = model_path
        self.model_config = ModelConfig.from_pretrained(model_path)
        self.tokenizer = Tokenizer.from_pretrained(model_path)
        vocab_size = self.model_config.vocab_size
        eos_ids = sorted(self.tokenizer.eos_token_ids)
        self.executor = make_executor(self.config, self.model_config, model_path,
                                      make_grammar_backend=lambda: XGrammarBackend(self.tokenizer, vocab_size, eos_ids))
        self.core = EngineCore(self.config, self.model_config, self.model_id, eos_ids, self.executor)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.admission = Admission(self.config.max_waiting_requests, self.config.max_waiting_prompt_tokens)
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
        exceeded" error output (``pagoda.engine.core.admission``).

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
        if self.output_processor.has_request(request_id):
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
        verdict = self.admission.can_admit(len(token_ids), priority, self.core.queued_requests())
        if not verdict.admit:
            raise EngineOverloaded(verdict.reason, self.admission.retry_after_s)
        child_ids = [request_id if params.n == 1 else f"{request_id}#{i}" for i in range(params.n)]
        children = [self.core.make_request(child_id, token_ids, params, i, arrival, priority, cache_salt, lora_name)
                    for i, child_id in enumerate(child_ids)]
        # Validates fit (raises ValueError) before anything is tracked; a guided request
        # waits for its grammar in the core.
        self.core.add_requests(children, params.guided_decoding, request_id)
        self.output_processor.add_request(request_id, text, token_ids, params, child_ids, arrival)
        self._fail_requests({self.output_processor.group_of(v.request_id) for v in verdict.victims},
                            lambda child0: overload_message(
            "displaced from the waiting queue by a more urgent request", self.admission.retry_after_s))
        if timeout is not None:
            self.admission.track_deadline(request_id, arrival + timeout, timeout)

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

    # ---- LoRA adapters (engine/lora/manager.py) ----------------------------------------

    def _check_lora_name(self, lora_name: Optional[str]) -> None:
        if lora_name is None:
            return
        if self.runner.lora is None:
            raise ValueError(f"lora_name: {lora_name!r} was requested but this engine serves no LoRA adapters "
                             "(start it with enable_lora / --lora)")
        self.runner.lora.check(lora_name)

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
        """Unload adapter ``name``. Raises ValueError when unknown or still used by a live request."""
        self._lora_manager().check(name)
        if any(r.adapter_id == name for r in self.scheduler.requests.values()):
            raise ValueError(f"lora_name: adapter {name!r} is in use by running or waiting requests")
        self.core.wait_idle()  # a step in flight may still read the adapter's slot (async scheduling)
        self.runner.lora.remove(name)

    def list_loras(self) -> list[str]:
        return self.runner.lora.names() if self.runner.lora is not None else []

    def lora_paths(self) -> dict[str, str]:
        """Loaded adapter name -> the folder it came from (empty with LoRA off)."""
        return self.runner.lora.paths() if self.runner.lora is not None else {}

    def _check_stop_token_ids(self, params: SamplingParams) -> None:
        vocab = self.model_config.vocab_size
        for t in params.stop_token_ids:
            if not 0 <= t < vocab:
                raise ValueError(f"stop_token_ids: token id {t} is not in the vocabulary [0, {vocab})")

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
        return self.output_processor.has_unfinished_requests()

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
        self.core.timer.record_host(time.perf_counter() - start - self.core.last_wait_s, self.core.last_wait_s)
        return outputs

    def shutdown(self) -> None:
        """Stop the core's device worker thread (async scheduling); idempotent."""
        self.core.shutdown()

    # -------------------------------------------------------------------- stats
    def get_stats(self) -> EngineStats:
        s = self.core.scheduler
        last, total = self.core.timer.snapshot()
        ttft_p90, recent_ttfts = self.output_processor.recent_ttfts.p90_snapshot()
        return EngineStats(
            num_waiting=s.num_waiting + self.core.num_pending + self.core.guided.num_waiting,
            num_running=s.num_running,
            kv_cache_usage=s.kv_cache_usage,
            num_blocks=self.runner.num_blocks - 1,  # block 0 is the pool's reserved null block
            num_free_blocks=s.num_free_blocks,
            prefix_cache_queries=s.prefix_cache_queries,
            prefix_cache_hits=s.prefix_cache_hits,
            num_preemptions=s.num_preemptions_total,
            num_prompt_tokens=self.output_processor.num_prompt_tokens,
            num_generation_tokens=self.output_processor.num_generation_tokens,
            num_steps=self.core.num_steps,
            max_num_running_seen=self.core.max_num_running_seen,
            last_step_num_seqs=self.core.last_step[0],
            last_step_num_decode_seqs=self.core.last_step[1],
            last_step_num_prefill_seqs=self.core.last_step[2],
            last_step_num_tokens=self.core.last_step[3],
            num_recomputed_preemptions=s.num_recomputed_preemptions,
            step_host_s=total.host_s, step_device_s=total.device_s, step_device_idle_s=total.device_idle_s,
            step_wait_s=total.wait_s, last_step_host_s=last.host_s, last_step_device_s=last.device_s,
            last_step_device_idle_s=last.device_idle_s,
            **self._spec_stats(),
            **self._offload_stats(),
            **self._lora_stats(),
            **self.admission.stats(),
            ttft_p90=ttft_p90, recent_ttfts=recent_ttfts,
        )

    def _lora_stats(self) -> dict:
        if self.runner.lora is None:
            return {}
        s = self.scheduler
        return dict(running_lora_adapters=tuple(sorted({r.adapter_id for r in s.running if r.adapter_id})),
                    waiting_lora_adapters=tuple(sorted({r.adapter_id for r in s.waiting if r.adapter_id})),
                    max_lora=self.config.max_loras)

    def _offload_stats(self) -> dict:
        offload = self.core.scheduler.offload
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
        return self.core.scheduler.take_events()


def _folder_name(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1]
