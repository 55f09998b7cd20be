"""From an ``EngineRequest`` to what the core runs: the engine's checks and the prompt's token ids.

``InputProcessor`` (vLLM's processor) is the one place the engine looks at a request before
the core takes it. What a door checked already is not checked again: ``SamplingParams`` and
``RequestOptions`` are valid once built. What only this engine knows is checked here:

- capabilities: beam search with speculative decoding or with tensor/pipeline parallelism,
  ``speculative`` on an engine without a speculator, a ``lora_name`` it does not serve;
- the prompt: text is encoded with the model's tokenizer unless the request brings its
  token ids (the router tokenized it for routing; ``EngineRequest.prompt_token_ids``); token
  ids, given or made, lie in the vocabulary; a text too long to ever fit ``max_model_len``
  is refused before it is encoded (the tokenizer's characters-per-token bound);
- token ids in ``stop_token_ids``, ``allowed_token_ids`` and ``logit_bias`` lie in the vocabulary;
- raw logits (``return_context_logits`` / ``return_generation_logits``) within their size bound
  (``engine.logits_output``); context logits on one rank only;
- ``bad_words`` become token sequences; ``truncate_prompt_tokens`` keeps the prompt's tail;
- images (``EngineRequest.multi_modal_data``): checked, hashed and preprocessed by the model's
  own image processor, placeholders expanded (``image_inputs.py``); refused for a text-only
  model, with ``truncate_prompt_tokens`` (it could cut an image's placeholders), with beam
  search or speculative decoding, and on an engine of several ranks (the step's broadcast
  carries no images yet).

Thread safety: ``tokenize_prompt`` touches no engine state (a server calls it off the
engine's thread); ``process`` runs on the engine's thread. ``num_prompts_tokenized`` counts
the texts this processor encoded (``tests/serving``: a routed request is not tokenized twice).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional

from pagoda.engine.image_inputs import ImageInputs
from pagoda.engine.logits_output import check_logits_size
from pagoda.engine.multimodal import MultiModalFeature
from pagoda.engine.request import EngineRequest, PromptType
from pagoda.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class ProcessedInput:
    """A request's prompt as the core takes it."""

    text: Optional[str]  # the prompt's text (None: given as token ids)
    token_ids: list[int]  # truncated as ``truncate_prompt_tokens`` says
    bad_words_token_ids: tuple[tuple[int, ...], ...]
    mm_features: tuple[MultiModalFeature, ...] = ()  # the prompt's images, in prompt order


class InputProcessor:
    """Args:
    tokenizer: the model's ``Tokenizer`` (``encode``, ``max_chars_per_token``).
    vocab_size: the model's vocabulary size.
    max_model_len: the longest sequence the engine runs.
    capabilities: ``EngineCapabilities`` of the engine this processor feeds.
    images: the model's image preparation (``image_inputs.ImageInputs``); None: a text-only model.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, max_model_len: int,
                 capabilities: "EngineCapabilities", images: Optional[ImageInputs] = None) -> None:
        self.tokenizer = tokenizer
        self.images = images
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.capabilities = capabilities
        self.num_prompts_tokenized = 0
        self._count_lock = threading.Lock()  # tokenize_prompt runs on any thread

    def process(self, request: EngineRequest) -> ProcessedInput:
        """The request's prompt and bad-word sequences, once the engine's checks pass.

        Raises:
            ValueError: naming the field: a capability this engine lacks, an empty prompt,
                a token id outside the vocabulary, a text that can never fit.
        """
        self.capabilities.check(request)
        text, token_ids = self._prompt(request.prompt, request.prompt_token_ids, request.params)
        self._check_token_ids(request.params)
        token_ids, features = self._images(token_ids, request)
        token_ids = self._truncate(token_ids, request.params.truncate_prompt_tokens)
        check_logits_size(request.params, len(token_ids), self.max_model_len, self.vocab_size)
        return ProcessedInput(text, token_ids, self._bad_words_token_ids(request.params.bad_words), features)

    def _images(self, token_ids: list[int], request: EngineRequest) -> tuple[list[int], tuple[MultiModalFeature, ...]]:
        """The prompt with its image placeholders expanded and the images' features (``image_inputs``)."""
        data = request.multi_modal_data
        if not data:
            if self.images is not None and self.images.spec.prompt_token_id in token_ids:
                raise ValueError(f"prompt: holds the image placeholder token {self.images.spec.prompt_token_id} "
                                 "but multi_modal_data has no image")
            return token_ids, ()
        if self.images is None:
            raise ValueError("multi_modal_data: this model takes text only (its architecture has no vision tower)")
        if not isinstance(data, dict) or set(data) - {"image"}:
            raise ValueError(f"multi_modal_data: only the 'image' modality is served, got {sorted(data)}")
        if request.params.truncate_prompt_tokens is not None:
            raise ValueError("truncate_prompt_tokens: not supported with images (it could cut an image's placeholders)")
        if self.capabilities.world_size > 1 or request.params.use_beam_search or self.capabilities.has_speculator:
            raise ValueError("multi_modal_data: images are not served with tensor/pipeline parallelism, beam search "
                             "or speculative decoding yet (none carries an image's embeddings or M-RoPE positions)")
        return self.images.process(token_ids, data.get("image"))

    def tokenize_prompt(self, text: str, params: Optional[SamplingParams] = None) -> list[int]:
        """A text prompt's token ids (any thread). A text that cannot fit ``max_model_len`` is
        refused before it is encoded, unless the request truncates its prompt. Raises ValueError."""
        if not text:
            raise ValueError("prompt: must not be empty")
        per_token = self.tokenizer.max_chars_per_token() if len(text) > self.max_model_len else None
        if per_token and len(text) > self.max_model_len * per_token and (
                params is None or params.truncate_prompt_tokens is None):
            raise ValueError(f"prompt: {len(text)} characters cannot fit max_model_len {self.max_model_len} "
                             f"(this tokenizer's tokens cover at most {per_token} characters each)")
        with self._count_lock:
            self.num_prompts_tokenized += 1
        return self.tokenizer.encode(text)

    def _prompt(self, prompt: PromptType, token_ids: Optional[list[int]],
                params: SamplingParams) -> tuple[Optional[str], list[int]]:
        if isinstance(prompt, str):
            if token_ids is None:
                return prompt, self.tokenize_prompt(prompt, params)
            return prompt, self._checked_ids(token_ids)
        if not isinstance(prompt, (list, tuple)) or not prompt:
            raise ValueError("prompt: must be a non-empty string or a non-empty list of token ids")
        return None, self._checked_ids(prompt)

    def _checked_ids(self, token_ids: Any) -> list[int]:
        if not token_ids:
            raise ValueError("prompt: must not be empty")
        for t in token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                raise ValueError(f"prompt: token id {t!r} is not in the vocabulary [0, {self.vocab_size})")
        return list(token_ids)

    def _check_token_ids(self, params: SamplingParams) -> None:
        for name, ids in (("stop_token_ids", params.stop_token_ids), ("allowed_token_ids", params.allowed_token_ids),
                          ("logit_bias", params.logit_bias)):
            for t in ids or ():
                if not 0 <= t < self.vocab_size:
                    raise ValueError(f"{name}: token id {t} is not in the vocabulary [0, {self.vocab_size})")

    def _bad_words_token_ids(self, words: Optional[list[str]]) -> tuple[tuple[int, ...], ...]:
        """vLLM's ``bad_words`` as token sequences: each word as written (leading spaces
        stripped) and, when that is another sequence of the same length, with one leading
        space (the word inside a text). Raises ValueError for an id outside the vocabulary."""
        sequences: list[tuple[int, ...]] = []
        for word in words or ():
            plain = tuple(self.tokenizer.encode(word.lstrip(), add_special_tokens=False))
            spaced = tuple(self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            sequences += [plain] + ([spaced] if len(spaced) == len(plain) and spaced[0] != plain[0] else [])
        if any(not 0 <= t < self.vocab_size for sequence in sequences for t in sequence):
            raise ValueError(f"bad_words: a word's token ids fall outside the model's vocabulary "
                             f"[0, {self.vocab_size})")
        return tuple(sequence for sequence in sequences if sequence)

    def _truncate(self, token_ids: list[int], keep: Optional[int]) -> list[int]:
        """The last ``keep`` prompt tokens (vLLM's ``truncate_prompt_tokens``; -1: ``max_model_len``)."""
        if keep is None:
            return token_ids
        return token_ids[-(self.max_model_len if keep == -1 else keep):]


@dataclass(frozen=True)
class EngineCapabilities:
    """What one engine can run, for the checks a request's fields cannot make alone.

    Attributes:
        has_speculator: speculative decoding is configured.
        world_size: tensor x pipeline parallel ranks.
        check_lora_name: raises ValueError for an adapter this engine does not serve.
        has_request: whether a request id is live already.
    """

    has_speculator: bool
    world_size: int
    check_lora_name: Callable[[Optional[str]], None]
    has_request: Callable[[str], bool]

    def check(self, request: EngineRequest) -> None:
        """Raises ValueError naming the field this engine cannot serve."""
        params = request.params
        if params.use_beam_search and self.has_speculator:
            raise ValueError("use_beam_search: this server runs speculative decoding, which does not combine with "
                             "beam search (a beam's next token is chosen among all its group's candidates after "
                             "each step, so there is no one token per position to verify drafts "
                             "against); serve without speculative_method for beam search")
        if params.use_beam_search and self.world_size > 1:
            raise ValueError("use_beam_search: not supported with tensor_parallel_size or pipeline_parallel_size "
                             "> 1 yet (a fork's copy-on-write block copy is not broadcast to the workers' KV caches)")
        if params.return_context_logits and self.world_size > 1:
            raise ValueError("return_context_logits: not supported with tensor_parallel_size or "
                             "pipeline_parallel_size > 1 yet (the other ranks would have to run the same LM-head "
                             "calls for the prompt's rows)")
        if params.speculative and not self.has_speculator:
            raise ValueError("speculative: this server has no speculative decoding configured "
                             "(EngineConfig.speculative_method is None)")
        request_id = request.request_id
        if not isinstance(request_id, str) or not request_id:
            raise ValueError("request_id: must be a non-empty string")
        if self.has_request(request_id):
            raise ValueError(f"request_id: {request_id!r} is already in use")
        self.check_lora_name(request.options.lora_name)
