"""The OpenAI door's response bodies as typed models (pydantic v2), beside its requests' (``openai_protocol``).

Every object the door writes — completions and chat completions, whole or as stream chunks,
their choices, log-probabilities, tool calls and usage, the model list and a model card, an
error — is built through one of these models, so a field pagoda sends has one declared type
wherever it is written (``openai_answer`` builds them; ``openai_api`` answers with them).
The shapes are OpenAI's as vLLM's server writes them, and the openai SDK's own types parse
them (tests/fleet/test_openai_responses.py).

Nullable fields that OpenAI always sends (``logprobs``, ``finish_reason``, a tool-call
message's ``content``) are written as ``null``; optional fields that OpenAI leaves out when
they do not apply (``message.tool_calls``, a delta's ``role``/``content``/``tool_calls``, a
chunk's ``usage``, a card's ``root``/``parent``) are written only when set: ``dump`` keeps
the fields a builder gave, ``null`` included, and drops the others.
"""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict


class _Out(BaseModel):
    model_config = ConfigDict(extra="forbid")  # pagoda writes these fields and no other


def dump(model: BaseModel) -> dict[str, Any]:
    """The JSON-ready dict of a response model: the fields its builder set (module docstring)."""
    return model.model_dump(exclude_unset=True)


class PromptTokensDetails(_Out):
    cached_tokens: int  # prompt tokens served from the prefix cache


class Usage(_Out):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(_Out):
    """The legacy completions ``logprobs``: parallel lists, ``null`` for an echoed prompt's first token."""

    tokens: list[str]
    token_logprobs: list[Optional[float]]
    top_logprobs: list[Optional[dict[str, float]]]
    text_offset: list[int]


class TopLogprob(_Out):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Out):
    content: list[ChatTokenLogprob]


class FunctionCall(_Out):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Out):
    id: str
    type: Literal["function"]
    function: FunctionCall


class DeltaFunctionCall(_Out):
    """A streamed call's piece: the name in its first delta, arguments fragments after it."""

    name: Optional[str] = None
    arguments: Optional[str] = None


class DeltaToolCall(_Out):
    index: int
    id: Optional[str] = None  # with the first delta of a call
    type: Optional[Literal["function"]] = None
    function: DeltaFunctionCall


class AssistantMessage(_Out):
    role: Literal["assistant"]
    content: Optional[str]
    tool_calls: Optional[list[ToolCall]] = None
    # The model's thinking (a reasoning parser's): vLLM's current name, and its former one.
    reasoning: Optional[str] = None
    reasoning_content: Optional[str] = None


class CompletionChoice(_Out):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs]
    finish_reason: Optional[str]


class ChatChoice(_Out):
    index: int
    message: AssistantMessage
    logprobs: Optional[ChatLogprobs]
    finish_reason: Optional[str]


class Delta(_Out):
    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None
    reasoning: Optional[str] = None
    reasoning_content: Optional[str] = None
    tool_calls: Optional[list[DeltaToolCall]] = None


class ChatChunkChoice(_Out):
    index: int
    delta: Delta
    logprobs: Optional[ChatLogprobs]
    finish_reason: Optional[str]


class _Object(_Out):
    id: str
    created: int
    model: str
    system_fingerprint: str


class Completion(_Object):
    object: Literal["text_completion"]
    choices: list[CompletionChoice]
    usage: Usage


class ChatCompletion(_Object):
    object: Literal["chat.completion"]
    choices: list[ChatChoice]
    usage: Usage


class CompletionChunk(_Object):
    object: Literal["text_completion"]
    choices: list[CompletionChoice]
    usage: Optional[Usage] = None


class ChatCompletionChunk(_Object):
    object: Literal["chat.completion.chunk"]
    choices: list[ChatChunkChoice]
    usage: Optional[Usage] = None


class ModelCard(_Out):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: Optional[str] = None  # a LoRA adapter: its own name; parent: the base model
    parent: Optional[str] = None


class ModelList(_Out):
    object: Literal["list"]
    data: list[ModelCard]


class ErrorBody(_Out):
    message: str
    type: str
    param: Optional[str]
    code: Optional[str]


class ErrorResponse(_Out):
    error: ErrorBody


def error_body(message: str, kind: str, param: Optional[str] = None, code: Optional[str] = None) -> dict[str, Any]:
    """OpenAI's error object (``{"error": {message, type, param, code}}``), for an answer or a stream event."""
    return dump(ErrorResponse(error=ErrorBody(message=message, type=kind, param=param, code=code)))
