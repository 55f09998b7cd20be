"""The wire request: one typed request from every door to the engine.

``WireRequest`` is what a generation request is between the door that takes it and the
engine that runs it: the prompt (text, token ids, or both when a router tokenized the text to
route it), how to sample (``SamplingParams``), how to run it (``RequestOptions``: priority,
cache salt, LoRA adapter, deadline, KV-transfer handle, tenant) and what to send back
(``OutputOptions``: streaming and the ``return_*`` flags, the output dialect). It is frozen
and valid once built: each part checks itself where the request enters, so nothing
downstream checks a field again.

Who builds one, and how it travels (docs/architecture.md draws the whole path):

- the router's OpenAI door from the body's typed model (``fleet.api.openai_io``); its Triton
  doors and a replica's own Triton door from Triton inputs, through the dialect that owns the
  vocabulary (``from_dialect`` over ``serving.dialects``: the vLLM backend's JSON and
  parameters plus TensorRT-LLM style scalars on pagoda's model; TensorRT-LLM's ``ensemble`` /
  ``tensorrt_llm_bls`` items and its LLM-API requests in the front models);
- between processes it is Triton tensors, in one canonical form (``to_triton_inputs``):
  ``text_input`` and/or ``input_ids``, one ``sampling_parameters`` JSON object holding the
  sampling fields, options and wire keys that differ from their defaults, and the true
  output flags as ``BOOL`` inputs; ``to_json`` is the same as a Triton generate-extension body
  (the router's HTTP door forwards that);
- a replica reads it once (``serving.dialects.pagoda.read_request`` + ``from_dialect``) and
  hands the engine ``to_engine_request``: token ids the router made with the replica's own
  tokenizer (``prompt_tokenizer`` names it: ``Tokenizer.fingerprint``) are used as they are,
  so the prompt is not encoded twice.

Images (``images``: each image's encoded bytes, in prompt order) travel as the vLLM dialect's
``image`` input (one base64 string per image, ``serving.dialects.vllm.read_images``) in the
Triton and JSON forms, and reach the engine as ``EngineRequest.multi_modal_data["image"]``;
the engine checks them (limits, placeholders, a text-only model: docs/multimodal.md).

Invariants: a prompt is text (non-empty, at most ``MAX_PROMPT_CHARS`` characters), token ids
(non-empty, each >= 0), or both with ``prompt_tokenizer`` set; ``to_triton_inputs`` then
reading it back gives an equal ``WireRequest`` (tests/serving/test_wire_request.py).
"""

from __future__ import annotations

import base64
import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from pagoda.contracts.request_options import RequestOptions
from pagoda.engine.request import EngineRequest
from pagoda.engine.sampling_params import RequestOutputKind, SamplingParams
from pagoda.serving.dialects import pagoda as pagoda_inputs
from pagoda.serving.dialects.tensors import DialectRequest, GetInput, string_array
from pagoda.serving.dialects.trtllm import Encode
from pagoda.serving.dialects.vllm import check_output_dialect

# A prompt longer than this many characters cannot fit any supported context; refusing it
# at the door avoids tokenizing megabytes. The engine checks tokens exactly.
MAX_PROMPT_CHARS = 1_000_000


@dataclass(frozen=True)
class OutputOptions:
    """What a request wants back (the Triton ``BOOL`` inputs of the same names).

    ``output_dialect``: the shape of ``logprobs`` and ``finish_reason`` (``dialects.vllm.OUTPUT_DIALECTS``);
    ``None``: the replica's default (its ``output_dialect`` config parameter).
    """

    stream: bool = False
    exclude_input_in_output: bool = False
    return_finish_reason: bool = False
    return_stop_reason: bool = False  # the stop string or token id that ended a completion
    return_cumulative_logprob: bool = False
    return_logprobs: bool = False
    return_num_input_tokens: bool = False
    return_num_output_tokens: bool = False
    return_num_cached_tokens: bool = False  # prompt tokens served from the prefix cache
    return_output_token_ids: bool = False  # each response's token ids (the router's migration journal)
    return_context_logits: bool = False  # the prompt's raw logits (engine.logits_output)
    return_generation_logits: bool = False  # the generated tokens' raw logits
    output_dialect: Optional[str] = None

    def __post_init__(self) -> None:
        for name in FLAG_NAMES:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: must be a boolean, got {getattr(self, name)!r}")
        if self.output_dialect is not None:
            check_output_dialect("output_dialect", self.output_dialect)

    def dialect_or(self, default: str) -> str:
        """The dialect to answer in: the request's, else ``default`` (the replica's)."""
        return self.output_dialect or default


FLAG_NAMES: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(OutputOptions) if f.type == "bool")


@dataclass(frozen=True)
class WireRequest:
    """One generation request (module docstring). Raises ValueError naming the field when not valid."""

    prompt: Optional[str] = None
    prompt_token_ids: Optional[tuple[int, ...]] = None
    params: SamplingParams = field(default_factory=SamplingParams)
    options: RequestOptions = field(default_factory=RequestOptions)
    output: OutputOptions = field(default_factory=OutputOptions)
    prompt_tokenizer: Optional[str] = None  # the tokenizer (fingerprint) that made prompt_token_ids from prompt
    images: tuple[bytes, ...] = field(default=(), repr=False)  # each image's encoded bytes, in prompt order
    # prompt_token_ids as the INT32 tensor they travel as, made once when the request is built and
    # carried by copies that keep the ids (``replace``: a 900k-token prompt's costs 0.1 s to make).
    _ids_tensor: Optional[np.ndarray] = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.prompt is None and self.prompt_token_ids is None:
            raise ValueError("text_input: required input is missing (or give input_ids)")
        if self.prompt is not None:
            if not isinstance(self.prompt, str):
                raise ValueError(f"text_input: must be a string, got {type(self.prompt).__name__}")
            if not self.prompt:
                raise ValueError("text_input: must not be empty")
            if len(self.prompt) > MAX_PROMPT_CHARS:
                raise ValueError(f"text_input: prompt is too long ({len(self.prompt)} characters, "
                                 f"at most {MAX_PROMPT_CHARS})")
        if self.prompt_token_ids is not None:
            object.__setattr__(self, "prompt_token_ids", tuple(self.prompt_token_ids))
            if self._ids_tensor is None or len(self._ids_tensor) != len(self.prompt_token_ids):
                object.__setattr__(self, "_ids_tensor", _ids_tensor(self.prompt_token_ids))
        else:
            object.__setattr__(self, "_ids_tensor", None)
        object.__setattr__(self, "images", tuple(self.images))
        if not all(isinstance(image, bytes) and image for image in self.images):
            raise ValueError("image: each image must be its encoded bytes (non-empty)")
        if self.prompt is not None and self.prompt_token_ids is not None and not self.prompt_tokenizer:
            raise ValueError("input_ids: give the prompt as text_input or as input_ids, not both (a router that "
                             "tokenized text_input sends the ids with its tokenizer's prompt_tokenizer)")
        if self.output.return_context_logits or self.output.return_generation_logits:
            self.engine_params()  # raises ValueError naming the field where the engine cannot keep them

    # ------------------------------------------------------------------ building
    @classmethod
    def from_dialect(cls, read: DialectRequest) -> "WireRequest":
        """Check what a dialect read (``serving.dialects``) into a wire request.

        Raises:
            ValueError: naming the field (``SamplingParams``, ``RequestOptions``,
                ``OutputOptions`` and the prompt's own checks).
        """
        options = dict(read.options)
        output_dialect = options.pop("output_dialect", None)
        prompt_tokenizer = options.pop("prompt_tokenizer", None)
        try:
            params = SamplingParams.from_dict(read.sampling)
        except TypeError as exc:  # a field given a value its validators cannot even compare
            raise ValueError(f"sampling_parameters: {exc}") from None
        return cls(prompt=read.prompt, prompt_token_ids=read.prompt_token_ids, params=params,
                   options=RequestOptions.from_dict(options),
                   output=OutputOptions(**read.flags, output_dialect=output_dialect),
                   prompt_tokenizer=prompt_tokenizer, images=tuple(read.images))

    @classmethod
    def from_triton_inputs(cls, get_input: GetInput, parameters: Any = None,
                           encode: Optional[Encode] = None) -> "WireRequest":
        """The request carried by pagoda's model inputs (``serving.dialects.pagoda``: the canonical
        form, the vLLM backend's vocabulary and TensorRT-LLM style scalars).

        Args:
            get_input: the named input as a numpy array, or ``None`` if absent.
            parameters: the request's parameters (JSON text or a dict), read as the vLLM backend does.
            encode: text -> token ids without special tokens (``embedding_bias_words``).

        Raises:
            ValueError: naming the offending input, request parameter or field.
        """
        return cls.from_dialect(pagoda_inputs.read_request(get_input, parameters, encode))

    @classmethod
    def from_json(cls, body: dict[str, Any], encode: Optional[Encode] = None) -> "WireRequest":
        """The request of a Triton generate-extension body for pagoda's model, read as tritonserver
        hands it to the model: inputs by name (also when ``parameters`` names one: tritonserver
        makes it that input), every other key (and ``parameters``' others) a request parameter.
        Raises ValueError as ``from_triton_inputs``."""
        parameters = dict(body.get("parameters") or {})
        values = {**{k: parameters.pop(k) for k in list(parameters) if k in pagoda_inputs.INPUTS},
                  **{k: v for k, v in body.items() if k != "parameters"}}
        arrays = {name: _json_input(name, kind, values[name]) for name, kind in pagoda_inputs.INPUTS.items()
                  if name in values}
        parameters.update({k: v for k, v in values.items() if k not in pagoda_inputs.INPUTS})
        return cls.from_triton_inputs(arrays.get, parameters, encode)

    def replace(self, **changes: Any) -> "WireRequest":
        """A copy with ``changes`` (checked as a new request; the ids' tensor kept unless they change)."""
        if "prompt_token_ids" in changes:
            changes["_ids_tensor"] = None
        return dataclasses.replace(self, **changes)

    def with_options(self, **changes: Any) -> "WireRequest":
        """A copy whose ``RequestOptions`` have ``changes``. Raises ValueError naming the option."""
        return dataclasses.replace(self, options=self.options.replace(**changes))

    def with_prompt_token_ids(self, token_ids: list[int], tokenizer: str) -> "WireRequest":
        """A text request with its token ids as ``tokenizer`` (a fingerprint) encoded them."""
        return dataclasses.replace(self, prompt_token_ids=tuple(token_ids), prompt_tokenizer=tokenizer,
                                   _ids_tensor=None)

    # ------------------------------------------------------------------ the wire
    def values(self) -> dict[str, Any]:
        """The ``sampling_parameters`` object: sampling fields, options and wire keys that differ
        from their defaults (JSON values)."""
        values = {**self.params.to_dict(), **self.options.to_dict()}
        if self.output.output_dialect is not None:
            values["output_dialect"] = self.output.output_dialect
        if self.prompt_tokenizer is not None:
            values["prompt_tokenizer"] = self.prompt_tokenizer
        return values

    def to_triton_inputs(self) -> dict[str, np.ndarray]:
        """pagoda's model inputs (numpy arrays, by name) carrying this request."""
        inputs: dict[str, np.ndarray] = {}
        if self.prompt is not None:
            inputs["text_input"] = string_array([self.prompt])
        if self._ids_tensor is not None:
            inputs["input_ids"] = self._ids_tensor
        inputs["sampling_parameters"] = string_array([json.dumps(self.values())])
        if self.images:
            inputs["image"] = np.array([base64.b64encode(image) for image in self.images], dtype=np.object_)
        for name in FLAG_NAMES:
            if getattr(self.output, name):
                inputs[name] = np.array([True])
        return inputs

    def to_json(self) -> dict[str, Any]:
        """The same inputs as a Triton generate-extension body (JSON values by input name)."""
        body: dict[str, Any] = {}
        if self.prompt is not None:
            body["text_input"] = self.prompt
        if self.prompt_token_ids is not None:
            body["input_ids"] = list(self.prompt_token_ids)
        body["sampling_parameters"] = json.dumps(self.values())
        if self.images:
            body["image"] = [base64.b64encode(image).decode("ascii") for image in self.images]
        body.update({name: True for name in FLAG_NAMES if getattr(self.output, name)})
        return body

    # ------------------------------------------------------------------ the engine
    @property
    def logprobs_asked(self) -> bool:
        """The request set ``logprobs`` (the ``return_*`` flags alone do not: the vLLM dialect
        then answers ``null``)."""
        return self.params.logprobs is not None

    def engine_params(self) -> SamplingParams:
        """The params the engine runs: log-probabilities tracked when an output flag needs them
        (0 alternatives suffice; beams carry their sums), raw logits computed when asked for; a
        stream's generation-logit rows leave with each response, nothing keeps them for the end
        (``RequestOutputKind.DELTA``).

        Raises:
            ValueError: naming ``return_*_logits`` where the engine cannot compute them (beam
                search: ``SamplingParams``).
        """
        output, params = self.output, self.params
        needs = output.return_logprobs or (output.return_cumulative_logprob and not params.use_beam_search)
        params = params.clone(logprobs=0) if needs and params.logprobs is None else params
        if output.return_context_logits or output.return_generation_logits:
            kind = RequestOutputKind.DELTA if output.stream else RequestOutputKind.CUMULATIVE
            params = params.clone(return_context_logits=params.return_context_logits or output.return_context_logits,
                                  return_generation_logits=params.return_generation_logits
                                  or output.return_generation_logits, output_kind=kind)
        return params

    def to_engine_request(self, request_id: str, arrival_time: Optional[float], tokenizer: Optional[str] = None,
                          prompt_token_ids: Optional[list[int]] = None) -> EngineRequest:
        """The engine's envelope.

        Args:
            tokenizer: the engine's tokenizer fingerprint: token ids made by that tokenizer are
                used as they are (else the engine encodes the text).
            prompt_token_ids: the text's token ids, made already (``EngineLoop.submit``, off the
                engine's thread); wins over ids made by another tokenizer.
        """
        prompt: Any = self.prompt if self.prompt is not None else list(self.prompt_token_ids or ())
        ids = prompt_token_ids
        if ids is None and self.prompt is not None and self.prompt_token_ids is not None \
                and self.prompt_tokenizer == tokenizer:
            ids = list(self.prompt_token_ids)
        images = {"image": list(self.images)} if self.images else None
        return EngineRequest(request_id, prompt, self.engine_params(), self.options, arrival_time=arrival_time,
                             prompt_token_ids=ids, multi_modal_data=images)

    def uses_given_token_ids(self, tokenizer: Optional[str]) -> bool:
        """Whether the engine takes the prompt's token ids as sent (no encoding on the replica)."""
        return self.prompt is None or (self.prompt_token_ids is not None and self.prompt_tokenizer == tokenizer)


def _ids_tensor(token_ids: tuple) -> np.ndarray:
    """Token ids as an INT32 tensor, checked in C (a Python check of each id of a 900k-token
    prompt would take a tenth of a second). Converted in slices of ``_IDS_SLICE``: numpy holds
    the GIL while it reads Python ints, and a router converts off its event loop, which must
    get the GIL back every few milliseconds. Raises ValueError naming ``input_ids``."""
    slices = [np.asarray(token_ids[i:i + _IDS_SLICE]) for i in range(0, len(token_ids), _IDS_SLICE)]
    if not slices or any(a.ndim != 1 or a.dtype.kind not in "iu" or a.min() < 0 or a.max() >= 2**31
                         for a in slices):
        raise ValueError("input_ids: must be a non-empty list of token ids (integers >= 0)")
    array = np.concatenate([a.astype(np.int32) for a in slices])
    array.setflags(write=False)
    return array


_IDS_SLICE = 16384


_JSON_DTYPES = {"string": np.object_, "json": np.object_, "strings": np.object_, "bool": np.bool_, "int": np.int32,
                "uint": np.uint64, "ints": np.int32, "number": np.float32, "numbers": np.float32}


def _json_input(name: str, kind: str, value: Any) -> np.ndarray:
    """One generate-body value as the tensor tritonserver would make of it (the model's type)."""
    if kind == "json" and isinstance(value, dict):
        value = json.dumps(value)
    values = value if isinstance(value, list) else [value]
    if _JSON_DTYPES[kind] is np.object_:
        return np.array([v.encode("utf-8") if isinstance(v, str) else v for v in values], dtype=np.object_)
    try:
        return np.array(values, dtype=_JSON_DTYPES[kind])
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"{name}: not a valid {kind} value: {value!r}") from None
