"""OpenAI's Responses API (``POST /v1/responses``): its request as typed models, and the chat turn it is.

The body is checked as ``ResponsesRequest`` (strict types, unknown fields refused naming them,
as the OpenAI door does) and translated into a chat-completions body (``to_chat_body``), which
the door builds into its wire request like any chat (``openai_io.build_chat_request``):

- ``instructions`` is the system message; ``input`` a string (one user message) or items:
  messages (``role`` user / system / developer / assistant; content a string or
  ``input_text`` / ``output_text`` parts, and in user messages ``input_image`` parts: their
  ``image_url`` a ``data:`` URL, or ``http(s)`` as the chat door's URL rules say, becoming chat
  ``image_url`` parts checked here so a bad one is a 400 naming ``input[i].content[j].image_url``
  (``openai_images``); ``file_id`` is refused: no Files API here; ``detail`` is ignored),
  ``function_call`` items (an assistant's earlier calls, consecutive ones one message) and
  ``function_call_output`` items (a tool message each); ``reasoning`` items written back are
  dropped (the model does not read its old thinking, as vLLM);
- ``tools``: function tools (``{"type": "function", "name", "parameters", ...}``); other
  tool types (web search, file search, ...) are refused naming them; ``tool_choice``:
  ``auto`` / ``none`` / ``required`` / ``{"type": "function", "name"}``;
  ``parallel_tool_calls``;
- ``text.format``: ``json_schema`` (its schema through the structured-output path),
  ``json_object``, ``text``; ``max_output_tokens`` is ``max_tokens``; ``temperature``,
  ``top_p``, ``top_logprobs`` as chat's; ``reasoning.effort`` reaches the chat template as
  ``reasoning_effort`` (gpt-oss reads it);
- ``previous_response_id`` prepends the stored turn's conversation (``response_store``);
  ``store``, ``metadata``, ``user``, ``truncation`` (``disabled``), ``service_tier`` and
  ``include`` are accepted without effect on generation;
- vLLM's extras as chat's: ``seed``, ``top_k``, ``cache_salt``, ``priority``, and the
  structured-output ``guided_regex`` / ``guided_grammar`` / ``guided_choice`` (``GUIDED_EXTRAS``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BeforeValidator, Discriminator, Field, Tag

from pagoda.fleet.api.openai_images import image_url_part
from pagoda.fleet.api.openai_protocol import MAX_LOGPROBS, JsonSchemaFormat, Number, OpenAIError, _Strict, one_of


GUIDED_EXTRAS = ("guided_regex", "guided_grammar", "guided_choice")


class InputText(_Strict):
    type: Literal["input_text", "output_text", "text"]
    text: str
    annotations: Optional[list[Any]] = None
    logprobs: Optional[list[Any]] = None


class InputImage(_Strict):
    type: Literal["input_image"]
    image_url: Optional[str] = None
    file_id: Optional[str] = None
    detail: Optional[Literal["low", "high", "auto", "original"]] = None


InputPart = Annotated[Union[InputText, InputImage], Field(discriminator="type")]


class MessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Annotated[Union[str, list[InputPart]], one_of("a string or a list of input_text / input_image parts")]
    id: Optional[str] = None
    status: Optional[str] = None


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: Optional[str] = None
    status: Optional[str] = None


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: Optional[str] = None
    status: Optional[str] = None


class ReasoningItem(_Strict):
    type: Literal["reasoning"]
    id: Optional[str] = None
    summary: list[Any] = []
    content: Optional[list[Any]] = None
    encrypted_content: Optional[str] = None
    status: Optional[str] = None


def _item_type(value: Any) -> Optional[str]:
    return value.get("type", "message") if isinstance(value, dict) else None  # a message may omit its type


InputItem = Annotated[Union[Annotated[MessageItem, Tag("message")], Annotated[FunctionCallItem, Tag("function_call")],
                            Annotated[FunctionCallOutputItem, Tag("function_call_output")],
                            Annotated[ReasoningItem, Tag("reasoning")]], Discriminator(_item_type)]


def _one_user_message(value: Any) -> Any:
    """A string input is one user message (the API's own shorthand): its items' errors name the item."""
    return [{"type": "message", "role": "user", "content": value}] if isinstance(value, str) else value


class FunctionTool(_Strict):
    type: Literal["function"]
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class NamedFunction(_Strict):
    type: Literal["function"]
    name: str


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: Optional[str] = None
    description: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None


class TextConfig(_Strict):
    format: Optional[TextFormat] = None
    verbosity: Optional[str] = None


class ReasoningConfig(_Strict):
    effort: Optional[Literal["minimal", "low", "medium", "high"]] = None
    summary: Optional[str] = None
    generate_summary: Optional[str] = None


class ResponsesRequest(_Strict):
    """``POST /v1/responses`` (module docstring)."""

    model: Optional[str] = None
    input: Annotated[list[InputItem], BeforeValidator(_one_user_message)]
    instructions: Optional[str] = None
    tools: Optional[list[dict[str, Any]]] = None  # checked one by one (other tool types named)
    tool_choice: Annotated[Optional[Union[Literal["none", "auto", "required"], NamedFunction]], one_of(
        "none, auto, required or {type: function, name}")] = None
    parallel_tool_calls: bool = True
    text: Optional[TextConfig] = None
    reasoning: Optional[ReasoningConfig] = None
    max_output_tokens: Optional[Annotated[int, Field(ge=1)]] = None
    temperature: Optional[Annotated[Number, Field(ge=0)]] = None
    top_p: Optional[Annotated[Number, Field(gt=0, le=1)]] = None
    top_logprobs: Optional[Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]] = None
    stream: bool = False
    store: Optional[bool] = None
    previous_response_id: Optional[str] = None
    metadata: Optional[dict[str, str]] = None
    user: Optional[str] = None
    truncation: Optional[Literal["disabled"]] = None
    service_tier: Optional[str] = None
    include: Optional[list[str]] = None
    seed: Optional[int] = None  # vLLM's extras
    top_k: Optional[int] = None
    cache_salt: Optional[str] = None
    priority: Optional[int] = None
    guided_regex: Optional[str] = None  # vLLM's structured-output extras, as chat's
    guided_grammar: Optional[str] = None
    guided_choice: Optional[list[str]] = None


def function_tools(tools: Optional[list[dict[str, Any]]]) -> Optional[list[dict]]:
    """Chat's tools from the Responses tools. Raises OpenAIError naming a tool type pagoda does not run."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            raise OpenAIError(f"tools[{i}].type: {kind!r} tools are not run by pagoda; send function tools",
                              "tools")
        try:
            function = FunctionTool.model_validate(tool)
        except ValueError as exc:
            raise OpenAIError(f"tools[{i}]: {exc}", "tools") from None
        out.append({"type": "function", "function": function.model_dump(exclude_none=True, exclude={"type"})})
    return out


def input_messages(request: ResponsesRequest) -> list[dict]:
    """The turn's conversation as chat messages (``instructions`` first, ``reasoning`` items dropped)."""
    messages: list[dict] = [{"role": "system", "content": request.instructions}] if request.instructions else []
    for i, item in enumerate(request.input):
        if isinstance(item, MessageItem):
            messages.append({"role": "system" if item.role == "developer" else item.role,
                             "content": _content(item, f"input[{i}]")})
        elif isinstance(item, FunctionCallItem):
            function = {"name": item.name, "arguments": item.arguments}
            call = {"id": item.call_id, "type": "function", "function": function}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") is not None:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
    return messages


def _content(item: MessageItem, where: str) -> Union[str, list[dict[str, Any]]]:
    """A message item's chat content: its text, or chat's parts when it holds images (module
    docstring). Raises OpenAIError naming ``where``'s part."""
    if isinstance(item.content, str):
        return item.content
    if not any(isinstance(part, InputImage) for part in item.content):
        return "".join(part.text for part in item.content)
    parts = []
    for j, part in enumerate(item.content):
        if isinstance(part, InputText):
            parts.append({"type": "text", "text": part.text})
            continue
        field = f"{where}.content[{j}]"
        if item.role != "user":
            raise OpenAIError(f"{field}: input_image parts are taken in user messages only, not in a {item.role} "
                              "message", "input")
        if part.file_id is not None or not part.image_url:
            raise OpenAIError(f"{field}.image_url: required (file_id is not served: this server has no Files "
                              "API); send the image as a data: URL", "input")
        parts.append(image_url_part(part.image_url, f"{field}.image_url", "input"))
    return parts


def to_chat_body(request: ResponsesRequest, history: list[dict]) -> dict[str, Any]:
    """The chat-completions body of this turn (``history``: a stored previous turn's messages)."""
    body: dict[str, Any] = {"messages": history + input_messages(request)}
    if not body["messages"]:
        raise OpenAIError("input: the turn has no message", "input")
    tools = function_tools(request.tools)
    if tools is not None:
        body["tools"] = tools
        body["parallel_tool_calls"] = request.parallel_tool_calls
    if request.tool_choice is not None:
        choice = request.tool_choice
        body["tool_choice"] = choice if isinstance(choice, str) else {"type": "function",
                                                                        "function": {"name": choice.name}}
    text_format = request.text.format if request.text is not None else None
    if text_format is not None and text_format.type == "json_schema":
        if text_format.schema_ is None:
            raise OpenAIError("text.format.schema: required with type json_schema", "text")
        body["response_format"] = {"type": "json_schema", "json_schema": JsonSchemaFormat(
            name=text_format.name, schema=text_format.schema_, strict=text_format.strict).model_dump(by_alias=True)}
    elif text_format is not None and text_format.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    if request.max_output_tokens is not None:
        body["max_tokens"] = request.max_output_tokens
    if request.top_logprobs is not None:
        body.update(logprobs=True, top_logprobs=request.top_logprobs)
    if request.reasoning is not None and request.reasoning.effort is not None:
        body["chat_template_kwargs"] = {"reasoning_effort": request.reasoning.effort}
    for name in ("temperature", "top_p", "seed", "top_k", "cache_salt", "priority", *GUIDED_EXTRAS):
        if getattr(request, name) is not None:
            body[name] = getattr(request, name)
    return body
