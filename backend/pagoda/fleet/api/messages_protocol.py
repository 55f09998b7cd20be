"""Anthropic's Messages API (``POST /v1/messages``): its request as typed models, and the chat turn it is.

The body is checked as ``MessagesRequest`` (strict types, unknown fields refused naming them)
and translated into a chat-completions body (``to_chat_body``) the door builds like any chat:

- ``system`` (a string or text blocks) is the system message; each message's ``content`` is a
  string or blocks: ``text``; an assistant's ``tool_use`` (``id``, ``name``, ``input``) is a
  tool call of its message; a user's ``tool_result`` (``tool_use_id``, ``content`` a string or
  text blocks, ``is_error``) is a tool message; ``thinking`` / ``redacted_thinking`` blocks
  written back are dropped (the model does not read its old thinking); a user's ``image``
  blocks (``source`` ``base64`` with an ``image/...`` ``media_type``, or ``url``: a ``data:`` URL,
  or ``http(s)`` as the chat door's URL rules say) become chat ``image_url`` parts in their
  place, checked here so a bad one is a 400 naming ``messages[i].content[j].source...``
  (``openai_images``); ``file`` sources (no Files API here) and ``document`` blocks are refused,
  naming them;
- ``tools`` (``name``, ``description``, ``input_schema``) are function tools; ``tool_choice``
  ``auto`` / ``any`` (a call is required) / ``tool`` (that one) / ``none``, and
  ``disable_parallel_tool_use``;
- ``max_tokens`` (required), ``stop_sequences``, and the sampling fields today's SDK no longer
  sends but older clients and vLLM's server take: ``temperature``, ``top_p``, ``top_k``;
- ``thinking``: ``enabled`` / ``adaptive`` / ``between_tools`` reach the chat template as
  ``enable_thinking`` true, ``disabled`` as false (Qwen3 reads it; ``budget_tokens`` and
  ``display`` are accepted without effect); ``output_config.effort`` reaches it as
  ``reasoning_effort`` (gpt-oss reads it) and ``output_config.format`` (a JSON schema) goes
  through the structured-output path;
- ``metadata``, ``service_tier``, ``cache_control`` (pagoda's prefix cache is automatic),
  ``container``, ``diagnostics``, ``inference_geo``, ``speed``, ``user_profile_id`` and
  ``workspace_id`` are accepted without effect;
- pagoda's extras (``extra_body``): vLLM's structured output, ``guided_regex`` /
  ``guided_grammar`` / ``guided_choice``, as chat's.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import Field

from pagoda.fleet.api.openai_images import image_url_part
from pagoda.fleet.api.openai_protocol import Number, OpenAIError, _Strict, one_of
from pagoda.fleet.api.responses_protocol import GUIDED_EXTRAS


class TextBlock(_Strict):
    type: Literal["text"]
    text: str
    cache_control: Optional[dict[str, Any]] = None
    citations: Optional[list[Any]] = None


class ToolUseBlock(_Strict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: Optional[dict[str, Any]] = None
    caller: Optional[dict[str, Any]] = None  # newer SDKs' response fields, written back with the block
    toolset_name: Optional[str] = None


class ToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: Annotated[Union[str, list[TextBlock]], one_of("a string or a list of text blocks")] = ""
    is_error: Optional[bool] = None
    cache_control: Optional[dict[str, Any]] = None


class ThinkingBlock(_Strict):
    type: Literal["thinking", "redacted_thinking"]
    thinking: Optional[str] = None
    signature: Optional[str] = None
    data: Optional[str] = None


class MediaBlock(_Strict):
    type: Literal["document"]
    source: dict[str, Any]
    cache_control: Optional[dict[str, Any]] = None


class Base64Source(_Strict):
    type: Literal["base64"]
    media_type: str
    data: str


class URLSource(_Strict):
    type: Literal["url"]
    url: str


class FileSource(_Strict):
    type: Literal["file"]
    file_id: str


class ImageBlock(_Strict):
    type: Literal["image"]
    source: Annotated[Union[Base64Source, URLSource, FileSource], Field(discriminator="type")]
    cache_control: Optional[dict[str, Any]] = None


Block = Annotated[Union[TextBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock, ImageBlock, MediaBlock],
                  Field(discriminator="type")]


class Message(_Strict):
    role: Literal["user", "assistant"]
    content: Annotated[Union[str, list[Block]], one_of("a string or a list of content blocks")]


class Tool(_Strict):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: Optional[str] = None
    input_schema: dict[str, Any]
    type: Optional[Literal["custom"]] = None
    cache_control: Optional[dict[str, Any]] = None


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: Optional[str] = None
    disable_parallel_tool_use: Optional[bool] = None


class Thinking(_Strict):
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: Optional[int] = None
    display: Optional[Literal["summarized", "omitted"]] = None


class JsonOutputFormat(_Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Strict):
    effort: Optional[Literal["low", "medium", "high", "xhigh", "max"]] = None
    format: Optional[JsonOutputFormat] = None


class MessagesRequest(_Strict):
    """``POST /v1/messages`` (module docstring)."""

    model: str
    max_tokens: Annotated[int, Field(ge=1)]
    messages: Annotated[list[Message], Field(min_length=1)]
    system: Annotated[Optional[Union[str, list[TextBlock]]], one_of("a string or a list of text blocks")] = None
    stop_sequences: Optional[list[str]] = None
    temperature: Optional[Annotated[Number, Field(ge=0)]] = None
    top_p: Optional[Annotated[Number, Field(gt=0, le=1)]] = None
    top_k: Optional[Annotated[int, Field(ge=0)]] = None
    stream: bool = False
    tools: Optional[list[Tool]] = None
    tool_choice: Optional[ToolChoice] = None
    thinking: Optional[Thinking] = None
    output_config: Optional[OutputConfig] = None
    metadata: Optional[dict[str, Any]] = None
    service_tier: Optional[str] = None
    # accepted without effect: caching is automatic, and the rest is Anthropic's platform
    cache_control: Optional[dict[str, Any]] = None
    container: Optional[Any] = None
    diagnostics: Optional[Any] = None
    inference_geo: Optional[str] = None
    speed: Optional[str] = None
    user_profile_id: Optional[str] = None
    workspace_id: Optional[str] = None
    guided_regex: Optional[str] = None  # pagoda's extras (vLLM's structured output, as chat's)
    guided_grammar: Optional[str] = None
    guided_choice: Optional[list[str]] = None


class CountTokensRequest(_Strict):
    """``POST /v1/messages/count_tokens``: a message request's prompt, without generating."""

    model: str
    messages: Annotated[list[Message], Field(min_length=1)]
    system: Annotated[Optional[Union[str, list[TextBlock]]], one_of("a string or a list of text blocks")] = None
    tools: Optional[list[Tool]] = None
    tool_choice: Optional[ToolChoice] = None
    thinking: Optional[Thinking] = None


def _text(content: Union[str, list[TextBlock]]) -> str:
    return content if isinstance(content, str) else "".join(block.text for block in content)


def chat_messages(request: Union[MessagesRequest, CountTokensRequest]) -> list[dict]:
    """The conversation as chat messages. Raises OpenAIError naming a block pagoda cannot read."""
    messages = [{"role": "system", "content": _text(request.system)}] if request.system else []
    for m, message in enumerate(request.messages):
        blocks = [TextBlock(type="text", text=message.content)] if isinstance(message.content, str) \
            else message.content
        text, calls, parts = "", [], []
        for b, block in enumerate(blocks):
            if isinstance(block, TextBlock):
                text += block.text
                parts.append({"type": "text", "text": block.text})
            elif isinstance(block, ImageBlock):
                parts.append(_image_part(block, message.role, f"messages[{m}].content[{b}]"))
            elif isinstance(block, ToolUseBlock):
                calls.append({"id": block.id, "type": "function",
                              "function": {"name": block.name, "arguments": json.dumps(block.input)}})
            elif isinstance(block, ToolResultBlock):
                prefix = "Error: " if block.is_error else ""
                messages.append({"role": "tool", "tool_call_id": block.tool_use_id,
                                 "content": prefix + _text(block.content)})
            elif isinstance(block, MediaBlock):
                raise OpenAIError(f"messages[{m}].content[{b}].type: {block.type} blocks are not served (pagoda "
                                  "takes text and images)", "messages")
        if calls:
            messages.append({"role": "assistant", "content": text or None, "tool_calls": calls})
        elif any(part["type"] == "image_url" for part in parts):
            messages.append({"role": message.role, "content": parts})
        elif text or message.role == "assistant":
            messages.append({"role": message.role, "content": text})
    return messages


def _image_part(block: ImageBlock, role: str, where: str) -> dict[str, Any]:
    """Chat's ``image_url`` part of an image block (module docstring). Raises OpenAIError naming ``where``."""
    if role != "user":
        raise OpenAIError(f"{where}: image blocks are taken in user messages only, not in an {role} message",
                          "messages")
    source = block.source
    if isinstance(source, FileSource):
        raise OpenAIError(f"{where}.source.type: file sources are not served (this server has no Files API); "
                          "send the image as base64 or a data: URL", "messages")
    if isinstance(source, URLSource):
        return image_url_part(source.url, f"{where}.source.url")
    if not source.media_type.lower().startswith("image/"):
        raise OpenAIError(f"{where}.source.media_type: must be image/..., got {source.media_type!r}", "messages")
    return image_url_part(f"data:{source.media_type};base64,{source.data}", f"{where}.source.data")


def tools_body(request: Union[MessagesRequest, CountTokensRequest]) -> dict[str, Any]:
    """Chat's ``tools``, ``tool_choice``, ``parallel_tool_calls`` and template switches of the request."""
    body: dict[str, Any] = {}
    if request.tools:
        body["tools"] = [{"type": "function", "function": {"name": t.name, "parameters": t.input_schema,
                                                           **({"description": t.description} if t.description
                                                              else {})}} for t in request.tools]
    choice = request.tool_choice
    if choice is not None:
        if choice.type == "tool" and not choice.name:
            raise OpenAIError("tool_choice.name: required with type tool", "tool_choice")
        body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(
            choice.type, {"type": "function", "function": {"name": choice.name}})
        if choice.disable_parallel_tool_use and request.tools:
            body["parallel_tool_calls"] = False
    kwargs = {}
    if request.thinking is not None:
        kwargs["enable_thinking"] = request.thinking.type != "disabled"
    config = getattr(request, "output_config", None)
    if config is not None and config.effort is not None:
        kwargs["reasoning_effort"] = config.effort
    if kwargs:
        body["chat_template_kwargs"] = kwargs
    if config is not None and config.format is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "output",
                                                                          "schema": config.format.schema_}}
    return body


def to_chat_body(request: MessagesRequest) -> dict[str, Any]:
    """The chat-completions body of a Messages request."""
    body = {"messages": chat_messages(request), "max_tokens": request.max_tokens, **tools_body(request)}
    if request.stop_sequences:
        body["stop"] = request.stop_sequences
    for name in ("temperature", "top_p", "top_k", *GUIDED_EXTRAS):
        if getattr(request, name) is not None:
            body[name] = getattr(request, name)
    return body
