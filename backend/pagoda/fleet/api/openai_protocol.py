"""The OpenAI door's request bodies as typed models (pydantic v2): one schema per endpoint.

Every field of ``/v1/completions`` and ``/v1/chat/completions`` that pagoda serves is declared
here with its type and range, in strict mode (``true`` is not an integer, ``"5"`` is not a
number; an integer is a number), as vLLM's server and the openai SDK declare the same
protocol. A body that does not fit is one ``OpenAIError`` (a 400) whose message starts with
the field's path (``messages[1].role``, ``tools[0].function.name``) and whose ``param`` is
the top-level field; never a traceback. ``openai_io`` turns a validated model into engine
sampling parameters; ``openai_tools`` and ``openai_guided`` check what a type cannot say
(unique tool names, a named tool that exists, one output format per request).

Unknown top-level fields are refused, naming the field, as OpenAI's own API does (vLLM
accepts and ignores them with a log line; pagoda never drops a parameter silently). Fields
accepted and ignored on purpose, because they carry no generation semantics: ``user``,
``metadata``, ``store``, ``service_tier``. Messages accept the fields the openai SDK writes
back when a caller appends a response's message to the conversation (``refusal``,
``audio``, ``function_call``, ``annotations``, ``reasoning_content``) when they are ``null``.
A message's content is a string or a list of ``text`` and ``image_url`` parts (the images'
URLs are read by ``openai_images``).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import (BaseModel, ConfigDict, Field, StringConstraints, ValidationError, WrapValidator,
                      field_validator)
from pydantic_core import PydanticCustomError

from pagoda.contracts.request_options import OPTION_NAMES
from pagoda.engine.sampling_params import SamplingParams
from pagoda.fleet.gate.limits import error_path, show_value

# Chat roles the chat templates know; "developer" (OpenAI's newer name) is a system message.
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
MAX_LOGPROBS = 20  # OpenAI's bound for logprobs / top_logprobs (vLLM's default max_logprobs is 20 too)
Number = float  # strict: an int is a number, a bool is not
# Body fields each endpoint maps to SamplingParams itself (other names, defaults or checks).
_MAPPED = frozenset({"max_tokens", "stop", "n", "logit_bias", "logprobs", "prompt_logprobs", "best_of",
                     "use_beam_search", "length_penalty", "early_stopping"})
# Body fields that pass to SamplingParams under their own name: the one list is SamplingParams'.
_SAMPLING_NAMES = frozenset(SamplingParams.__dataclass_fields__) - _MAPPED - {"given"}


def one_of(hint: str) -> WrapValidator:
    """A union's error as one message (``must be <hint>``) at the field's own path, instead
    of pydantic's one error per member with the member's name in the path."""
    def check(value: Any, handler: Any) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError("union_type", "must be {hint}", {"hint": hint}) from None
    return WrapValidator(check)


TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
Prompt = Union[str, TokenIds]  # text, or token ids
PromptField = Annotated[Union[Prompt, Annotated[list[Prompt], Field(min_length=1)]], one_of(
    "a string, a list of token ids (integers >= 0), or a non-empty list of strings or of token-id lists")]


class OpenAIError(ValueError):
    """A request the OpenAI endpoints refuse; ``param`` names the offending field."""

    def __init__(self, message: str, param: Optional[str] = None) -> None:
        super().__init__(message)
        self.param = param


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class FunctionDefinition(_Strict):
    name: Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class JsonSchemaFormat(_Strict):
    name: Optional[str] = None
    description: Optional[str] = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ImageURL(_Strict):
    url: str
    detail: Optional[Literal["auto", "low", "high"]] = None  # accepted; the model's processor decides the size


class ImageURLPart(_Strict):
    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[Union[TextPart, ImageURLPart], Field(discriminator="type")]


class ToolCallFunction(_Strict):
    name: str
    arguments: Annotated[Union[str, dict[str, Any]], one_of("a JSON string or an object")] = "{}"


class ToolCall(_Strict):
    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Strict):
    role: str
    content: Annotated[Union[str, list[ContentPart], None],
                       one_of("a string or a list of text and image_url parts")] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None
    tool_call_id: Annotated[Optional[Union[str, int]], one_of("a string")] = None
    # Written back by the openai SDK with a response's message; accepted when null.
    refusal: None = None
    audio: None = None
    function_call: None = None
    annotations: None = None
    reasoning_content: None = None

    @field_validator("role")
    @classmethod
    def _known_role(cls, role: str) -> str:
        if role not in CHAT_ROLES:
            raise ValueError(f"must be one of {', '.join(CHAT_ROLES)}, got {json.dumps(role)}")
        return role

    def text(self) -> str:
        """The content as one string (text parts joined, images left out; ``null`` is empty)."""
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content if isinstance(part, TextPart))
        return self.content or ""


class _Common(_Strict):
    """Fields both endpoints share: sampling (OpenAI's and vLLM's extras), stream, structured output."""

    model: Optional[str] = None
    max_tokens: Optional[Annotated[int, Field(ge=0)]] = None
    temperature: Optional[Annotated[Number, Field(ge=0)]] = None
    top_p: Optional[Annotated[Number, Field(gt=0, le=1)]] = None
    n: Annotated[int, Field(ge=1)] = 1
    best_of: Optional[Annotated[int, Field(ge=1)]] = None
    seed: Optional[int] = None
    stop: Annotated[Optional[Union[str, list[str]]], one_of("a string or a list of strings")] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    presence_penalty: Optional[Annotated[Number, Field(ge=-2, le=2)]] = None
    frequency_penalty: Optional[Annotated[Number, Field(ge=-2, le=2)]] = None
    logit_bias: Optional[dict[str, Annotated[Number, Field(ge=-100, le=100)]]] = None
    response_format: Optional[ResponseFormat] = None
    # vLLM's extra sampling parameters
    top_k: Optional[int] = None
    min_p: Optional[Annotated[Number, Field(ge=0, le=1)]] = None
    min_tokens: Optional[Annotated[int, Field(ge=0)]] = None
    repetition_penalty: Optional[Annotated[Number, Field(gt=0)]] = None
    ignore_eos: Optional[bool] = None
    skip_special_tokens: Optional[bool] = None
    spaces_between_special_tokens: Optional[bool] = None
    include_stop_str_in_output: Optional[bool] = None
    stop_token_ids: Optional[list[Annotated[int, Field(ge=0)]]] = None
    allowed_token_ids: Optional[Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]] = None
    bad_words: Optional[list[str]] = None
    truncate_prompt_tokens: Optional[Annotated[int, Field(ge=-1)]] = None
    cache_salt: Optional[str] = None
    priority: Optional[int] = None
    timeout: Optional[Annotated[Number, Field(gt=0)]] = None  # seconds; engine.core.load_shedding deadlines
    allow_migration: Optional[bool] = None  # false: not moved to another replica when its replica fails
    # beam search as vLLM's extras (best_of is the beam width then; docs/beam_search.md)
    use_beam_search: bool = False
    length_penalty: Optional[Number] = None
    early_stopping: Annotated[Optional[Union[bool, Literal["never"]]], one_of("true, false or \"never\"")] = None
    # vLLM's structured output (openai_guided checks their meaning)
    guided_json: Annotated[Optional[Union[dict[str, Any], str]], one_of("a JSON schema object or its text")] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    guided_decoding_backend: Optional[str] = None
    guided_whitespace_pattern: Optional[str] = None
    # refused with a reason (openai_io._REFUSED), declared so the reason is the answer
    functions: Optional[Any] = None
    function_call: Optional[Any] = None
    # accepted and ignored: no generation semantics
    user: Optional[str] = None
    metadata: Optional[dict[str, str]] = None
    store: Optional[bool] = None
    service_tier: Optional[str] = None

    def sampling_fields(self) -> dict[str, Any]:
        """The given fields that pass to ``SamplingParams`` under the same name (those the
        endpoints map themselves, ``_MAPPED``, aside)."""
        out = {name: getattr(self, name) for name in _SAMPLING_NAMES & type(self).model_fields.keys()
               if getattr(self, name) is not None}
        if self.n != 1 or "n" in self.model_fields_set:
            out["n"] = self.n
        if self.logit_bias:
            out["logit_bias"] = {_token_id(key): value for key, value in self.logit_bias.items()}
        return out

    def request_options(self) -> dict[str, Any]:
        """The given fields that are request options (``RequestOptions``: vLLM's extras)."""
        return {name: getattr(self, name) for name in OPTION_NAMES
                if name in type(self).model_fields and getattr(self, name) is not None}


class CompletionRequest(_Common):
    """``POST /v1/completions``."""

    prompt: PromptField
    echo: bool = False
    logprobs: Optional[Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]] = None
    prompt_logprobs: Optional[Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]] = None
    suffix: Optional[str] = None
    prompt_embeds: Optional[Any] = None

    def prompts(self) -> list[Prompt]:
        """The prompt as a list (one engine request each)."""
        if isinstance(self.prompt, str) or (self.prompt and isinstance(self.prompt[0], int)):
            return [self.prompt]  # type: ignore[list-item]
        return list(self.prompt)  # type: ignore[arg-type]


class ChatCompletionRequest(_Common):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Optional[Annotated[int, Field(ge=1)]] = None
    logprobs: bool = False
    top_logprobs: Optional[Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]] = None
    tools: Optional[list[Tool]] = None
    tool_choice: Annotated[Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]], one_of(
        "none, auto, required or {type: function, function: {name}}")] = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: Optional[dict[str, Any]] = None


NonEmpty = Annotated[str, StringConstraints(min_length=1)]


class LoadLoRAAdapterRequest(_Strict):
    """``POST /v1/load_lora_adapter`` (vLLM's endpoint and fields)."""

    lora_name: NonEmpty
    lora_path: NonEmpty


class UnloadLoRAAdapterRequest(_Strict):
    """``POST /v1/unload_lora_adapter``."""

    lora_name: NonEmpty


def parse(model: type[BaseModel], body: Any) -> Any:
    """``model`` validated from a parsed JSON body; raises ``OpenAIError`` naming the field."""
    if not isinstance(body, dict):
        raise OpenAIError("the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise describe(exc.errors(include_url=False), body) from None


def describe(errors: list[dict], body: dict) -> OpenAIError:
    """The first of pydantic's errors as one ``OpenAIError``: ``<path>: <what is wrong>``."""
    first = errors[0]
    loc = first["loc"]
    field = str(loc[0]) if loc else "body"
    if first["type"] == "extra_forbidden":
        return OpenAIError(f"{error_path(loc)}: unknown parameter (not an OpenAI or vLLM parameter pagoda serves)",
                           field)
    if first["type"] == "missing":
        return OpenAIError(f"{error_path(loc)}: required", field)
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] != "value_error":
        message = f"{message[:1].lower()}{message[1:]}, got {show_value(first.get('input'))}"
    return OpenAIError(f"{error_path(loc)}: {message}", field)


def _token_id(key: str) -> int:
    try:
        token = int(key)
    except ValueError:
        raise OpenAIError(f"logit_bias: keys must be token ids, got {json.dumps(key)}", "logit_bias") from None
    if token < 0:
        raise OpenAIError(f"logit_bias: token ids must be >= 0, got {token}", "logit_bias")
    return token
