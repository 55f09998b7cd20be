"""Triton generate-extension bodies as typed models (pydantic v2), checked at the router's HTTP door.

tritonserver answers a generate body it cannot parse with a 500, so the router checks each
body first, against one schema per model built from the model's own inputs:

- pagoda's model (``GenerateBody``, made once by ``generate_body_model``): every input of
  model_repository/pagoda/config.pbtxt (``serving.dialects.pagoda.INPUTS``) with its JSON type, in strict
  mode (``true`` is not an integer, ``"5"`` is not a number; an integer is a number):
  ``text_input`` a string or a list of one string, booleans ``true``/``false``, integers,
  non-negative seeds, numbers, token-id lists, a string or a list of strings for word
  lists, and ``sampling_parameters`` an object or a string holding one (sent on as the JSON
  string the replica expects); ``traceparent``; the extension's ``id`` (a string,
  echoed by tritonserver) and ``parameters`` (an object); and every key the replica reads
  as a request parameter (``request_parameter_keys``: tritonserver turns any other
  top-level key into one, and the replica reads them as sampling parameters the way
  Triton's vLLM backend does; their values may be strings, as that backend's are, so the
  replica checks them). The same vocabulary as the replica's, so a body one accepts the
  other accepts too. ``parameters`` holds request-parameter keys and input names (typed as
  the input: tritonserver makes such a parameter that input). A body needs ``text_input``
  or ``input_ids`` unless it is a LoRA control request (``lora_action``).
- TensorRT-LLM's front models (``FRONT_INPUTS``: ``ensemble``, ``tensorrt_llm_bls``,
  ``tensorrt_llm``): their own inputs (values checked by the replica's front, which knows
  their tensor types), no request parameter but ``cache_salt`` (the tenant salt the HTTP
  door adds for them), ``text_input`` required.

Any value that does not fit is one ``LimitError`` (a 400) naming the field and what it must
be (``stream: must be true or false, got "yes"``); an unknown key is named with the
vocabulary it is not in. The router's limits then apply to the prompt and to the sampling
values wherever they come (``sampling_of_generate``).
"""

from __future__ import annotations

import functools
import json
from typing import Annotated, Any, Optional, Union

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictInt, StrictStr,
                      ValidationError, create_model, model_validator)
from pydantic_core import PydanticCustomError

from pagoda.contracts import json_input
from pagoda.fleet.gate.limits import LimitError, RequestLimits, json_kind, sampling_object, show_value
from pagoda.serving.dialects import llmapi, trtllm
from pagoda.serving.dialects.pagoda import INPUTS as GENERATE_INPUTS
from pagoda.serving.dialects.vllm import request_parameter_vocabulary

# TensorRT-LLM's front models on the replica (serving.dialects.trtllm / llmapi): their own inputs,
# and the ones the router's limits read (max tokens, samples, stop strings).
FRONT_INPUTS = {"ensemble": trtllm.INPUTS, "tensorrt_llm_bls": trtllm.INPUTS, "tensorrt_llm": llmapi.INPUTS}
FRONT_SAMPLING = {"max_tokens": "max_tokens", "sampling_param_max_tokens": "max_tokens", "num_return_sequences": "n",
                  "stop_words": "stop", "sampling_param_stop": "stop"}


def _one_string(value: Any) -> Any:
    return value[0] if isinstance(value, list) and len(value) == 1 else value  # ["text"]: batch-of-one style


def _json_text(value: Any) -> Any:
    return json.dumps(value) if isinstance(value, dict) else value


Number = Annotated[float, Field(strict=True)]  # an int is a number, a bool is not
# Each input kind: its type, and what the error says it must be.
KINDS: dict[str, tuple[Any, str]] = {
    "string": (Annotated[StrictStr, BeforeValidator(_one_string)], "must be a string"),
    "json": (Annotated[Union[dict[str, Any], StrictStr], Field(union_mode="left_to_right")],
             "must be a JSON object (or a string holding one)"),
    "bool": (StrictBool, "must be true or false"),
    "int": (StrictInt, "must be an integer"),
    "uint": (Annotated[StrictInt, Field(ge=0)], "must be a non-negative integer"),
    "number": (Number, "must be a number"),
    "ints": (list[StrictInt], "must be a list of integers"),
    "numbers": (Union[Number, list[Number]], "must be a number or a list of numbers"),
    "strings": (Union[StrictStr, list[StrictStr]], "must be a string or a list of strings"),
}
_CONFIG = ConfigDict(extra="forbid", protected_namespaces=(), strict=True)


def request_parameter_keys() -> frozenset[str]:
    """The keys the replica reads as request parameters (``serving.dialects.vllm``'s one list):
    tritonserver turns a top-level generate key that is not an input into one, so the
    router accepts exactly the keys the replica would."""
    return request_parameter_vocabulary()


def _fields(names: dict[str, Optional[str]]) -> dict[str, Any]:
    """Fields of those kinds (``None``: any JSON value, the replica reads it), each may be absent
    (default None, not validated) but not null. Aliases keep the wire names whatever they are
    (``json``, ``schema`` would shadow BaseModel's)."""
    return {f"f_{name}": (Annotated[KINDS[kind][0] if kind else Any, Field(alias=name)], None)
            for name, kind in names.items()}


class _Body(BaseModel):
    model_config = _CONFIG

    @model_validator(mode="after")
    def _has_a_prompt(self) -> "_Body":
        given = self.model_fields_set
        if "f_text_input" not in given and "f_input_ids" not in given and "f_lora_action" not in given:
            raise PydanticCustomError("missing_prompt", "required input is missing (or give input_ids)")
        return self


@functools.cache
def generate_body_model() -> type[BaseModel]:
    """The schema of a generate body for pagoda's model (module docstring)."""
    vocabulary = request_parameter_keys()
    inputs: dict[str, Optional[str]] = dict(GENERATE_INPUTS)
    parameters = create_model("GenerateParameters", __config__=_CONFIG, **_fields(
        {**{key: None for key in vocabulary}, **{k: (None if v == "json" else v) for k, v in inputs.items()}}))
    top = {**{key: None for key in vocabulary if key not in inputs}, **inputs, "traceparent": None}
    top.pop("id", None), top.pop("parameters", None)  # the extension's own keys, typed below
    return create_model("GenerateBody", __base__=_Body, **_fields(top),
                        f_id=(Annotated[StrictStr, Field(alias="id")], None),
                        f_parameters=(Annotated[parameters, Field(alias="parameters")], None))


class _FrontBody(BaseModel):
    model_config = _CONFIG

    @model_validator(mode="after")
    def _has_a_prompt(self) -> "_FrontBody":
        if "f_text_input" not in self.model_fields_set:
            raise PydanticCustomError("missing_prompt", "required input is missing")
        return self


class FrontParameters(BaseModel):
    model_config = _CONFIG
    cache_salt: Any = None


@functools.cache
def front_body_model(model: str) -> type[BaseModel]:
    """The schema of a generate body for one of TensorRT-LLM's front models."""
    return create_model(f"FrontBody_{model}", __base__=_FrontBody,
                        **_fields({**{name: None for name in FRONT_INPUTS[model]}, "traceparent": None}),
                        f_id=(Annotated[StrictStr, Field(alias="id")], None),
                        f_parameters=(Annotated[FrontParameters, Field(alias="parameters")], None))


def validate_generate_body(body: bytes, limits: RequestLimits, model: str = "pagoda") -> dict[str, Any]:
    """Parse and check a generate-extension body for ``model``; returns it with ``text_input`` a
    string and ``sampling_parameters`` as text.

    Raises:
        LimitError: naming the problem (not JSON, not an object, an unknown key, a value of
            the wrong type, a limit exceeded).
    """
    try:
        document = json_input.loads(body, "body")
    except json_input.JSONInputError as exc:
        raise LimitError(str(exc), exc.param) from None
    if not isinstance(document, dict):
        raise LimitError(f"body: must be a JSON object of inputs, got a JSON {json_kind(document)}", "body")
    schema = front_body_model(model) if model in FRONT_INPUTS else generate_body_model()
    try:
        schema.model_validate(document)
    except ValidationError as exc:
        raise _describe(exc.errors(include_url=False)[0], document, model) from None
    if model in FRONT_INPUTS:
        limits.check_prompt(prompt_of(document), "text_input")
        limits.check_sampling({FRONT_SAMPLING[k]: (v if FRONT_SAMPLING[k] == "stop" else _one_string(v))
                               for k, v in document.items() if k in FRONT_SAMPLING})
        return document
    for name, kind in GENERATE_INPUTS.items():  # the two normalizations the schema allows
        if name in document and kind in ("string", "json"):
            document[name] = (_one_string if kind == "string" else _json_text)(document[name])
    if "lora_action" in document:  # a LoRA control request: no prompt (http_api answers it)
        return document
    limits.check_prompt(prompt_of(document), "text_input")
    limits.check_sampling(sampling_of_generate(document))
    return document


def _describe(error: dict, document: dict[str, Any], model: str) -> LimitError:
    """One pydantic error as a ``LimitError`` whose message starts with the field's path."""
    loc = tuple(str(part) for part in error["loc"])
    front = model in FRONT_INPUTS
    if error["type"] == "missing_prompt":
        return LimitError(f"text_input: {error['msg']}", "text_input")
    if loc[:1] == ("parameters",) and (front or len(loc) == 1 and error["type"] == "model_type"):
        if front:
            return LimitError("parameters: TensorRT-LLM's models read no request parameters", "parameters")
        return LimitError(f"parameters: must be a JSON object, got a JSON {json_kind(document['parameters'])}",
                          "parameters")
    name = loc[1] if loc[0] == "parameters" else loc[0]
    path = "parameters." + name if loc[0] == "parameters" else name
    if error["type"] == "extra_forbidden":
        if loc[0] == "parameters":
            return LimitError(f"{path}: unknown request parameter", path)
        inputs = FRONT_INPUTS[model] if front else GENERATE_INPUTS
        whose = f"input of TensorRT-LLM's {model} model" if front else "input or request parameter"
        return LimitError(f"{name}: unknown {whose}; the inputs are {', '.join(sorted(inputs))}", name)
    value = (document.get("parameters") or {}).get(name) if loc[0] == "parameters" else document.get(name)
    what = "must be a string" if name == "id" else KINDS[GENERATE_INPUTS[name]][1]
    return LimitError(f"{name}: {what}, got {show_value(value)}", name)


def prompt_of(document: dict[str, Any]) -> str:
    prompt = document.get("text_input")
    return prompt[0] if isinstance(prompt, list) and prompt else prompt if isinstance(prompt, str) else ""


def sampling_of_generate(document: dict[str, Any]) -> dict[str, Any]:
    """SamplingParams-named values of a generate body (request parameters — top level or in
    ``parameters`` — then its JSON, then its scalar inputs, as the replica merges them)."""
    vocabulary = request_parameter_keys()
    sampling = {k: v for k, v in document.items() if k in vocabulary and k not in GENERATE_INPUTS}
    sampling.update(document.get("parameters") or {})
    sampling.update(sampling_object(document.get("sampling_parameters")))
    for name in ("max_tokens",):
        if name in document:
            sampling[name] = document[name]
    if "stop_words" in document:
        words = document["stop_words"]
        sampling["stop"] = [w for w in (words if isinstance(words, list) else [words]) if w]
    return sampling
