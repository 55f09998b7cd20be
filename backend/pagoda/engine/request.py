"""One generation request: its envelope at the engine's edge and its per-request state.

``EngineRequest`` is the envelope a door (the serving loop, the offline ``LLM``, a bench)
hands to ``LLMEngine.add``: what the user asked for (its prompt, perhaps tokenized already,
its ``SamplingParams`` and its ``RequestOptions``: priority, cache salt, LoRA adapter,
timeout), each part checked where it was built. It is frozen; the engine resolves a missing
``arrival_time`` with ``dataclasses.replace``. It lives here, not in ``engine.core``,
because ``engine.kv`` takes a ``Request`` and must not climb into the core
(``tests/test_layering.py``).

A ``Request`` owns everything about one sequence that outlives a step: its token ids
(prompt, then outputs), ``num_computed_tokens`` (how many of those tokens already have KV
in the paged cache), its status, why it stopped, and the chained hashes of its full
blocks. The scheduler moves ``num_computed_tokens`` toward ``num_tokens``; a step that
reaches ``num_tokens`` samples one more token, which makes the request longer again.

Block hashes: ``init_block_hashes(block_size, model_id)`` (the scheduler calls it in
``add_request``; the model id seeds the chain's root, see ``block_hash``) hashes every
full block of the prompt; afterwards ``append_output_token_ids`` extends
``block_hashes`` whenever output tokens complete another block. Before that call
``block_hashes`` is empty and stays so (prefix caching off). A block that overlaps an
image's placeholder tokens (``mm_features``) carries the image's content hash and offset in
its extra keys (``engine.multimodal.block_mm_keys``), so equal text with another image never
matches it.

Prompt log-probabilities (``SamplingParams.prompt_logprobs``): ``prompt_logprobs`` is one
slot per prompt position (``None`` for the first, and until the runner computed it); each
prompt chunk's step fills its positions (``record_prompt_logprobs``), so a chunk that is
computed again after a preemption writes the same values twice. ``None`` when not asked.
Context logits (``return_context_logits``) are kept the same way in ``kept_logits``
(``engine.logits_output.KeptLogits``; ``None`` when not asked); generation logits are never kept
here (each step's rows leave with its output: ``engine.logits_output``).

Engine-owned slots: ``sampling_state``, ``detokenizer`` and ``metrics`` belong to the
engine layer; this module only creates them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Union

from pagoda.contracts.block_hash import BlockHash, encode_extra_keys, hash_block, root_hash
from pagoda.contracts.request_options import RequestOptions
from pagoda.engine.logits_output import KeptLogits
from pagoda.engine.multimodal import MultiModalFeature, block_mm_keys
from pagoda.engine.sampling_params import SamplingParams


PromptType = Union[str, list[int]]


def split_prompt(prompt: Any) -> tuple[PromptType, Optional[dict[str, Any]]]:
    """vLLM's prompt forms: a text or token ids as they are, or a dict with ``"prompt"`` (text) or
    ``"prompt_token_ids"`` and optionally ``"multi_modal_data"``; returns (prompt, multi_modal_data).
    Raises ValueError for a dict with neither prompt key, or with unknown keys."""
    if not isinstance(prompt, dict):
        return prompt, None
    unknown = set(prompt) - {"prompt", "prompt_token_ids", "multi_modal_data"}
    if unknown or ("prompt" in prompt) == ("prompt_token_ids" in prompt):
        raise ValueError("prompt: a dict needs exactly one of 'prompt' or 'prompt_token_ids' (and optionally "
                         f"'multi_modal_data'); got keys {sorted(prompt)}")
    text_or_ids = prompt["prompt"] if "prompt" in prompt else list(prompt["prompt_token_ids"])
    return text_or_ids, prompt.get("multi_modal_data")


@dataclass(frozen=True)
class EngineRequest:
    """One user request as it enters the engine (``LLMEngine.add``).

    Attributes:
        request_id: unique among live requests; a non-empty string.
        prompt: text, or token ids.
        params: how to sample; ``n > 1`` fans the request out into ``n`` children.
        options: how it is run (priority, cache salt, LoRA adapter, timeout: the
            ``RequestOptions`` the door built and checked; the engine trusts them).
        arrival_time: seconds (``time.time()``); ``None``: when the engine takes it.
        prompt_token_ids: a text prompt's token ids when someone tokenized it already (the
            router, for routing; or ``LLMEngine.tokenize_prompt`` off the engine's thread, so
            a huge prompt does not stall every other request's step); ``None``: the engine
            encodes ``prompt``.
        multi_modal_data: ``{"image": image or list of images}`` (vLLM's offline form): each a
            PIL image or its encoded bytes; checked and hashed by the input processor.
    """

    request_id: str
    prompt: PromptType
    params: SamplingParams = field(default_factory=SamplingParams)
    options: RequestOptions = field(default_factory=RequestOptions)
    arrival_time: Optional[float] = None
    prompt_token_ids: Optional[list[int]] = None
    multi_modal_data: Optional[dict[str, Any]] = None


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5

    def is_finished(self) -> bool:
        """Works as ``status.is_finished()`` and as ``RequestStatus.is_finished(status)``."""
        return self >= RequestStatus.FINISHED_STOPPED


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass
class RequestMetrics:
    """Timestamps (seconds) the engine fills in; ``None`` until the event happens."""

    arrival_time: float = 0.0
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None


class Request:
    """A request's tokens and scheduling state.

    The engine builds it from an envelope (``from_engine_request``: one per child of an
    ``n > 1`` request); tests build it directly, naming the scheduling keys (keyword-only).

    Args:
        request_id: unique among live requests.
        prompt_token_ids: the prompt (non-empty to be schedulable; the scheduler checks).
        sampling_params: how to sample; ``max_tokens=None`` means "up to max_model_len",
            which the scheduler resolves into ``self.max_tokens``.
        eos_token_ids: tokens that end generation unless ``ignore_eos``.
        arrival_time: seconds; orders FCFS ties and chooses preemption victims.
        priority: smaller runs first (vLLM convention) under the priority policy.
        cache_salt: tenant key; requests with different salts never share KV blocks.
        adapter_id: adapter identity, also part of every block hash.
        mm_features: the prompt's images (``engine.multimodal``), in prompt order.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        eos_token_ids: frozenset[int] = frozenset(),
        arrival_time: float = 0.0,
        priority: int = 0,
        cache_salt: Optional[str] = None,
        adapter_id: Optional[str] = None,
        mm_features: tuple[MultiModalFeature, ...] = (),
    ) -> None:
        self.request_id = request_id
        self.mm_features = tuple(mm_features)
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = frozenset(eos_token_ids)
        self.arrival_time = arrival_time
        self.priority = priority
        self.cache_salt = cache_salt
        self.adapter_id = adapter_id

        self.output_token_ids: list[int] = []
        self._all_token_ids: list[int] = list(self.prompt_token_ids)
        self.max_tokens: Optional[int] = sampling_params.max_tokens
        self.status = RequestStatus.WAITING
        self.stop_reason: Union[int, str, None] = None
        self.num_computed_tokens = 0
        # Tokens sampled by scheduled steps whose results have not been applied yet
        # (the scheduler advances num_computed_tokens at schedule time; see scheduler.py).
        self.num_output_placeholders = 0
        self.num_cached_tokens = -1  # prefix-cache hit at first schedule; -1 before
        self.prompt_logprobs: Optional[list[Any]] = (
            [None] * len(self.prompt_token_ids) if sampling_params.prompt_logprobs is not None else None)
        self.kept_logits: Optional[KeptLogits] = (
            KeptLogits(len(self.prompt_token_ids)) if sampling_params.return_context_logits else None)
        self.num_preemptions = 0
        self.insertion_index = 0  # set by the scheduler; breaks ties between equal keys

        self.block_hashes: list[BlockHash] = []
        self._block_size = 0  # 0: hashing not initialised
        self._root: Optional[BlockHash] = None
        self._extra = b""

        self.sampling_state: Any = None
        self.beam_group: Any = None  # its BeamGroup when it is one beam of a beam search (request_groups.beam_search)
        self.detokenizer: Any = None
        self.metrics = RequestMetrics(arrival_time=arrival_time)

    @classmethod
    def from_engine_request(cls, envelope: EngineRequest, request_id: str, prompt_token_ids: list[int],
                            eos_token_ids: frozenset[int], mm_features: tuple[MultiModalFeature, ...] = ()) -> Request:
        """The scheduler request for one child of ``envelope`` (``request_id``: the child's id),
        with the envelope's sampling params and scheduling keys; its ``arrival_time`` must be resolved."""
        assert envelope.arrival_time is not None, "the engine resolves arrival_time before making requests"
        options = envelope.options
        return cls(request_id, prompt_token_ids, envelope.params, eos_token_ids=eos_token_ids,
                   arrival_time=envelope.arrival_time, priority=options.priority, cache_salt=options.cache_salt,
                   adapter_id=options.lora_name, mm_features=mm_features)

    # Tokens -----------------------------------------------------------------

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then outputs. The live list: read it, never mutate it."""
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token_ids(self, token_ids: Union[int, Iterable[int]]) -> None:
        """Append sampled token(s) and hash any block they complete."""
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        for token_id in token_ids:
            self.output_token_ids.append(token_id)
            self._all_token_ids.append(token_id)
        self._extend_block_hashes()

    def record_prompt_logprobs(self, start: int, entries: list[Any]) -> None:
        """Keep the runner's prompt log-probabilities of positions ``start, start + 1, ...``."""
        assert self.prompt_logprobs is not None, f"{self.request_id!r} did not ask for prompt logprobs"
        assert 0 < start and start + len(entries) <= len(self.prompt_logprobs), "prompt logprobs past the prompt"
        self.prompt_logprobs[start:start + len(entries)] = entries

    # Status -----------------------------------------------------------------

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished()

    @property
    def finish_reason(self) -> Optional[str]:
        """"stop", "length", "abort", or None while unfinished."""
        return _FINISH_REASONS.get(self.status)

    # Block hashes -----------------------------------------------------------

    def check_stop(self, token_id: int, max_model_len: int) -> Optional[RequestStatus]:
        """The finished status that ``token_id`` (just appended) gives this request, or None
        (stop token, EOS once ``min_tokens`` are out; ``max_tokens``; ``max_model_len``)."""
        params = self.sampling_params
        if self.num_output_tokens >= params.min_tokens:
            if token_id in params.stop_token_ids:
                self.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
            if not params.ignore_eos and token_id in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= self.max_tokens or self.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

    def init_block_hashes(self, block_size: int, model_id: str) -> None:
        """Start the hash chain (root seeded by ``model_id``) and hash all full blocks.

        Idempotent for the same ``block_size``; the scheduler calls it on ``add_request``.
        """
        assert block_size > 0, f"block_size must be positive, got {block_size}"
        if self._block_size == block_size:
            return
        assert self._block_size == 0, "block hashing already initialised with another block size"
        self._block_size = block_size
        self._root = root_hash(model_id)
        self._extra = encode_extra_keys(self.cache_salt, self.adapter_id)
        self._extend_block_hashes()

    def block_mm_keys(self, index: int) -> tuple[tuple[str, int], ...]:
        """(hash, offset) of each image that full block ``index`` overlaps (its hash's image keys)."""
        size = self._block_size
        return block_mm_keys(self.mm_features, index * size, (index + 1) * size)

    def _extend_block_hashes(self) -> None:
        size = self._block_size
        if size == 0:
            return
        while (len(self.block_hashes) + 1) * size <= len(self._all_token_ids):
            start = len(self.block_hashes) * size
            parent = self.block_hashes[-1] if self.block_hashes else self._root
            mm_keys = self.block_mm_keys(len(self.block_hashes)) if self.mm_features else ()
            extra = encode_extra_keys(self.cache_salt, self.adapter_id, mm_keys) if mm_keys else self._extra
            self.block_hashes.append(hash_block(parent, self._all_token_ids[start : start + size], extra))

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, outputs={self.num_output_tokens})"
        )
