"""Per-request sampling parameters, validated on construction.

Mirrors vLLM's ``SamplingParams`` so that users of vLLM (and of Triton's vLLM backend,
which passes these as a JSON ``sampling_parameters`` input) need not learn new names.
Every invalid field raises ``ValueError`` whose message starts with the field's name.
``from_dict`` additionally rejects unknown keys and wrong JSON types, for the server edge.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from pagoda.engine.guided.params import GuidedDecodingParams

# Upper bounds that no legitimate request approaches; past them a value is a mistake.
MAX_N = 64
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 64
MAX_BEAM_WIDTH = MAX_LOGPROBS // 2  # each beam's step reads its top 2 * beam_width log-probabilities
_MAX_SEED = 2**64 - 1


class RequestOutputKind(enum.IntEnum):
    """What a request's outputs carry of what is not cheap to repeat (vLLM's name and values).

    pagoda's outputs always hold both the whole and the new tokens, text and log-probabilities;
    ``output_kind`` decides only for the raw generation logits (``return_generation_logits``,
    ``engine.logits_output``): each output carries its new tokens' rows either way
    (``CompletionOutput.delta_generation_logits``); ``CUMULATIVE`` also keeps every row for the
    finished output (``generation_logits``), ``DELTA`` keeps none past the output that carries
    them (a stream's memory stays one step's rows). vLLM's ``FINAL_ONLY`` is not offered.
    """

    CUMULATIVE = 0
    DELTA = 1


@dataclass
class SamplingParams:
    """How to sample one request's continuation.

    Attributes mirror vLLM: ``temperature == 0`` means greedy; ``top_k`` of 0 or -1
    disables top-k; ``top_p`` of 1 and ``min_p`` of 0 disable those filters; penalties
    at their neutral values (1, 0, 0) do nothing. ``seed`` makes a request's samples
    independent of what else shares its batch. ``logprobs=N`` returns the sampled
    token's log-probability and the top N alternatives at every step. ``speculative``
    opts in or out of speculative decoding (``None``: the server's default); it never
    changes greedy or seeded outputs, only how fast they come. ``guided_decoding``
    constrains the output to a format (JSON schema, any JSON, regex, choice, grammar; a
    ``GuidedDecodingParams`` or its dict form); it combines with speculative decoding
    (drafts are cut to the grammar and verified against masked target distributions).
    ``allowed_token_ids`` (a non-empty list) limits sampling to those ids; ``logit_bias``
    (token id -> bias in [-100, 100]; JSON's string keys are read as ids) is added to the
    logits; both apply before penalties and the grammar, and change what logprobs report
    only through the sampled token (logprobs are the raw model's, as vLLM's default).
    ``truncate_prompt_tokens`` keeps the prompt's last k tokens (-1: ``max_model_len``).
    ``prompt_logprobs=K`` (as vLLM's) returns, with the request's first output, one entry per
    prompt position: ``None`` for the first, then the log-probability of the prompt's actual
    token given the tokens before it, its rank and the top K alternatives (raw model, fp32
    ``log_softmax``). Such a request never takes its prefix from the prefix cache (cached
    positions have no logits), as vLLM skips prefix-cache hits for it; ``max_tokens`` stays
    at least 1 (vLLM's rule: the OpenAI door's ``echo`` with ``max_tokens=0`` generates one
    token and drops it).
    ``spaces_between_special_tokens``: pagoda's detokenizer joins special tokens without
    spaces (as vLLM's fast detokenizer does whatever this says), so ``True`` together with
    ``skip_special_tokens=False`` is refused rather than ignored; elsewhere it changes nothing.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: Optional[int] = None
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    skip_special_tokens: bool = True
    speculative: Optional[bool] = None
    guided_decoding: Optional[GuidedDecodingParams] = None
    allowed_token_ids: Optional[list[int]] = None
    logit_bias: Optional[dict[int, float]] = None
    bad_words: Optional[list[str]] = None
    truncate_prompt_tokens: Optional[int] = None
    spaces_between_special_tokens: Optional[bool] = None  # None: not given (vLLM's default, True)
    # Beam search (engine.request_groups.beam_search): vLLM's old names; beam_width is TensorRT-LLM's.
    use_beam_search: bool = False
    best_of: Optional[int] = None
    beam_width: Optional[int] = None
    length_penalty: float = 1.0
    early_stopping: Union[bool, str] = False
    # TensorRT-LLM's raw logits outputs (engine.logits_output): the prompt's, the generated tokens'.
    return_context_logits: bool = False
    return_generation_logits: bool = False
    # Whether the finished output keeps every generation-logit row (RequestOutputKind); a server sets it
    # from its stream flag (serving.wire.WireRequest.engine_params).
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # The fields a request gave (``from_dict``: its keys). ``None``: built in Python, every field
    # meant as written. The model's sampling defaults fill the others (``with_defaults``).
    given: Optional[frozenset] = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.given is not None and not isinstance(self.given, frozenset):
            self.given = frozenset(self.given)
        self.stop = _as_list("stop", [self.stop] if isinstance(self.stop, str) else self.stop)
        self.stop_token_ids = _as_list("stop_token_ids", self.stop_token_ids)
        # Only the integer -1 means "disabled"; -1.0 or True must still fail validation.
        if type(self.top_k) is int and self.top_k == -1:
            self.top_k = 0
        self._validate()

    @property
    def is_greedy(self) -> bool:
        return self.temperature < 1e-5

    def _validate(self) -> None:
        _check_int("n", self.n, 1, MAX_N)
        _check_float("temperature", self.temperature, 0.0, 100.0)
        _check_float("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _check_int("top_k", self.top_k, 0, None)
        _check_float("min_p", self.min_p, 0.0, 1.0)
        _check_float("repetition_penalty", self.repetition_penalty, 0.0, 100.0, low_open=True)
        _check_float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if self.seed is not None:
            _check_int("seed", self.seed, 0, _MAX_SEED)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, 1, None)
        _check_int("min_tokens", self.min_tokens, 0, None)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens: must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop: every stop string must be a non-empty string, got {s!r}")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, 0, None)
        _check_bool("include_stop_str_in_output", self.include_stop_str_in_output)
        _check_bool("ignore_eos", self.ignore_eos)
        _check_bool("skip_special_tokens", self.skip_special_tokens)
        _check_bool("return_context_logits", self.return_context_logits)
        _check_bool("return_generation_logits", self.return_generation_logits)
        if not isinstance(self.output_kind, RequestOutputKind):  # JSON: its value
            _check_int("output_kind", self.output_kind, min(RequestOutputKind), max(RequestOutputKind))
            self.output_kind = RequestOutputKind(self.output_kind)
        if self.speculative is not None:
            _check_bool("speculative", self.speculative)
        if self.guided_decoding is not None:
            self.guided_decoding = GuidedDecodingParams.from_dict(self.guided_decoding)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS)
        self._validate_vllm_extras()
        self._validate_beam_search()

    @property
    def num_beams(self) -> int:
        """The beam width of a beam-search request (``beam_width``, else ``best_of``, else ``n``); 0 without."""
        if not self.use_beam_search:
            return 0
        return self.beam_width or self.best_of or self.n

    def _validate_beam_search(self) -> None:
        _check_bool("use_beam_search", self.use_beam_search)
        _check_float("length_penalty", self.length_penalty, -100.0, 100.0)
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(f"early_stopping: must be true, false or \"never\", got {self.early_stopping!r}")
        for name in ("best_of", "beam_width"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), 1, MAX_BEAM_WIDTH if self.use_beam_search else MAX_N)
        if not self.use_beam_search:
            if self.best_of not in (None, self.n):
                raise ValueError(f"best_of: {self.best_of} != n only with use_beam_search (pagoda does not sample "
                                 "best_of > n candidates to return the n most likely)")
            if self.beam_width not in (None, 1):
                raise ValueError(f"beam_width: {self.beam_width} needs use_beam_search")
            return
        if self.best_of is not None and self.beam_width is not None and self.best_of != self.beam_width:
            raise ValueError(f"beam_width: {self.beam_width} differs from best_of {self.best_of} (they are aliases)")
        _check_int("beam_width" if self.beam_width else "best_of" if self.best_of else "n", self.num_beams, 1,
                   MAX_BEAM_WIDTH)
        if self.n > self.num_beams:
            raise ValueError(f"n: at most the beam width ({self.num_beams}) beams can be returned, got {self.n}")
        if self.speculative:
            raise ValueError("speculative: beam search does not run with speculative decoding (a beam's next "
                             "token is chosen among all its group's candidates after each step, so there is no one "
                             "token per position to verify drafts against); "
                             "leave speculative out or false")
        for name in ("return_context_logits", "return_generation_logits"):
            if getattr(self, name):
                raise ValueError(f"{name}: not supported with beam search yet (a beam's rows would have to follow "
                                 "its forks and reorderings); ask for log-probabilities (logprobs) instead")
        for name, neutral in _BEAM_NEUTRAL:
            if getattr(self, name) != neutral:
                raise ValueError(f"{name}: must be {neutral!r} with use_beam_search (beam search ranks the raw "
                                 f"model's log-probabilities), got {getattr(self, name)!r}")

    def _validate_vllm_extras(self) -> None:
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _as_list("allowed_token_ids", self.allowed_token_ids)
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids: must not be empty (leave it out to allow every token)")
            for t in self.allowed_token_ids:
                _check_int("allowed_token_ids", t, 0, None)
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias: must be an object of token id -> bias, got {self.logit_bias!r}")
            self.logit_bias = {_token_id_key(key): value for key, value in self.logit_bias.items()}
            for value in self.logit_bias.values():
                _check_float("logit_bias", value, -100.0, 100.0)
        if self.bad_words is not None:
            self.bad_words = _as_list("bad_words", [self.bad_words] if isinstance(self.bad_words, str)
                                      else self.bad_words)
            if len(self.bad_words) > MAX_STOP_STRINGS:
                raise ValueError(f"bad_words: at most {MAX_STOP_STRINGS} words, got {len(self.bad_words)}")
            for word in self.bad_words:
                if not isinstance(word, str) or not word.strip():
                    raise ValueError(f"bad_words: every bad word must be a non-empty string, got {word!r}")
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens != -1:
            _check_int("truncate_prompt_tokens", self.truncate_prompt_tokens, 1, None)
        if self.spaces_between_special_tokens is None:
            return
        _check_bool("spaces_between_special_tokens", self.spaces_between_special_tokens)
        if self.spaces_between_special_tokens and not self.skip_special_tokens:
            raise ValueError("spaces_between_special_tokens: pagoda joins special tokens without spaces; "
                             "with skip_special_tokens false, send spaces_between_special_tokens false")

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "SamplingParams":
        """Build from a JSON-like dict, rejecting unknown keys with a message naming them.

        Raises:
            ValueError: on unknown keys or any invalid field.
        """
        if not isinstance(values, dict):
            raise ValueError(f"sampling parameters must be a JSON object, got {type(values).__name__}")
        known = {f.name for f in dataclasses.fields(cls)} - {"given"}
        # str(): JSON keys are strings, but a dict built in Python may mix key types.
        unknown = sorted(str(key) for key in set(values) - known)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**values, given=frozenset(values))

    def to_dict(self) -> dict[str, Any]:
        """The fields given or differing from their defaults, as JSON values (``from_dict`` reads
        them back, with the same ``given``)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if f.name == "given":
                continue
            value = getattr(self, f.name)
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            if value != default or f.name in (self.given or ()):
                out[f.name] = value.to_dict() if isinstance(value, GuidedDecodingParams) else value
        return out

    def with_defaults(self, defaults: dict[str, Any]) -> "SamplingParams":
        """These params with ``defaults`` (the model's: ``models.generation_config``) for the fields
        the request did not give; built in Python (``given`` None), they are kept as written.

        Raises:
            ValueError: a default that is not valid for its field (naming it).
        """
        unset = {name: value for name, value in defaults.items() if self.given is not None and name not in self.given}
        return self.clone(**unset) if unset else self

    def clone(self, **changes: Any) -> "SamplingParams":
        """A copy with ``changes`` (checked again); what the request gave stays given."""
        return dataclasses.replace(self, **changes)


# Fields that would change the distribution beam search ranks, or ask for output it does not
# produce (prompt log-probabilities); each must keep this value with use_beam_search (as
# vLLM's old API). ``logprobs`` is allowed: each beam's per-token values (request_groups.beam_search).
_BEAM_NEUTRAL = [("temperature", 0.0), ("top_p", 1.0), ("top_k", 0), ("min_p", 0.0), ("repetition_penalty", 1.0),
                 ("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("min_tokens", 0),
                 ("prompt_logprobs", None), ("allowed_token_ids", None),
                 ("logit_bias", None), ("bad_words", None)]


def _as_list(name: str, value: Any) -> list:
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{name}: must be a list, got {type(value).__name__}")
    return list(value)


def _token_id_key(key: Any) -> int:
    """A ``logit_bias`` key: an int, or a string of digits (JSON object keys are strings)."""
    if isinstance(key, str) and key.strip().isdigit():
        return int(key)
    if isinstance(key, bool) or not isinstance(key, int) or key < 0:
        raise ValueError(f"logit_bias: keys must be token ids (integers >= 0), got {key!r}")
    return key


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name}: must be a boolean, got {value!r}")


def _check_int(name: str, value: Any, low: Optional[int], high: Optional[int]) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}: must be an integer, got {value!r}")
    if low is not None and value < low:
        raise ValueError(f"{name}: must be >= {low}, got {value}")
    if high is not None and value > high:
        raise ValueError(f"{name}: must be <= {high}, got {value}")


def _check_float(name: str, value: Any, low: float, high: float, low_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name}: must be a number, got {value!r}")
    if value != value:  # NaN
        raise ValueError(f"{name}: must be a number, got NaN")
    if (value <= low) if low_open else (value < low):
        raise ValueError(f"{name}: must be {'>' if low_open else '>='} {low}, got {value}")
    if value > high:
        raise ValueError(f"{name}: must be <= {high}, got {value}")
