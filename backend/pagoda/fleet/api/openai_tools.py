"""Tool calling at ``/v1/chat/completions``: ``tools``, ``tool_choice``, ``parallel_tool_calls``.

Request (OpenAI's shapes, checked here; a wrong field is a 400 naming it):
``tools: [{"type": "function", "function": {"name", "description"?, "parameters"?,
"strict"?}}]`` (names ``[A-Za-z0-9_-]{1,64}``, unique; ``parameters`` a JSON-schema object);
``tool_choice``: ``"none"``, ``"auto"`` (the default with tools), ``"required"`` or
``{"type": "function", "function": {"name": ...}}``; ``parallel_tool_calls`` (default true).
``tool_choice`` without ``tools``, an unknown name, or a forced call together with another
output format (``response_format``, ``guided_*``) is refused. The legacy
``functions``/``function_call`` stay refused (openai_io).

Forced calls are enforced by the grammar engine, so they are always well-formed JSON
(unless ``max_tokens`` cuts them, which ``finish_reason: "length"`` says):
- a named function: the output is its ``arguments``, constrained by its ``parameters``
  schema (as vLLM);
- ``"required"``: the output is a JSON array of ``{"name", "parameters"}`` objects, each item
  one of the tools (``anyOf`` of the tools, the name an ``enum``), at least one item, at
  most one when ``parallel_tool_calls`` is false (vLLM's schema).

``"auto"``: the model writes freely and its text is read by the model family's format
(``fleet.parsers``: Hermes, Qwen3-Coder XML, Llama 3 JSON, Mistral, gpt-oss harmony), chosen
from the chat template unless the server names one (``--tool-call-parser``, as vLLM's). Text
that does not parse is the answer's ``content`` (never an error), as in vLLM.

Templates that ignore ``tools`` (SmolLM2's, for one: rendering with and without them gives
the same text) get the tools described in a system message in Hermes' format, and earlier
assistant tool calls written as ``<tool_call>`` text, so the model can still call them
(vLLM sends such a template's prompt without any tool description).

Answers: ``message.tool_calls`` (``id`` ``call_<hex>``, ``type`` ``function``, ``function:
{name, arguments}`` with ``arguments`` a JSON string), ``content`` the text outside the calls
(``null`` when none), ``finish_reason`` ``"tool_calls"`` (``"stop"`` for a named function, as
OpenAI; ``"length"`` when cut). Streaming: an ``auto`` call streams as it is written (its id
and name in one delta, its arguments in fragments, as vLLM's); a forced call is sent whole when
its choice finishes; the role chunk, usage and ``[DONE]`` are as without tools.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Optional

PARSERS = ("hermes", "llama3_json", "mistral")


@dataclass
class ToolPlan:
    """What a request's tools mean for its prompt, its grammar and its answer."""

    tools: list[dict]
    choice: str  # none | auto | required | named
    name: Optional[str] = None  # the forced function (choice "named")
    parallel: bool = True

    @property
    def active(self) -> bool:
        """Whether the answer is read for tool calls."""
        return self.choice != "none"

    def guided(self) -> Optional[dict]:
        """The grammar of a forced call (``guided_decoding``), or ``None``."""
        if self.choice == "named":
            return {"json": _parameters(_function(self.tools, self.name))}
        if self.choice == "required":
            items = {"anyOf": [{"type": "object", "properties": {"name": {"type": "string", "enum": [f["name"]]},
                                                                  "parameters": _parameters(f)},
                                "required": ["name", "parameters"]} for f in (t["function"] for t in self.tools)]}
            schema = {"type": "array", "minItems": 1, "items": items}
            if not self.parallel:
                schema["maxItems"] = 1
            return {"json": schema}
        return None


def _function(tools: list[dict], name: Optional[str]) -> dict:
    return next(t["function"] for t in tools if t["function"]["name"] == name)


def _parameters(function: dict) -> dict:
    return function.get("parameters") or {"type": "object", "properties": {}}


def tool_plan_from_body(request: Any, error: type) -> Optional[ToolPlan]:
    """The request's ``ToolPlan`` (``None`` without tools); raises ``error(message, param)``.

    ``request`` is a validated ``ChatCompletionRequest`` (openai_protocol checks the shapes:
    tool and function fields, names, ``tool_choice``'s forms); here: what a type cannot say."""
    tools, choice = request.tools, request.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise error("tool_choice: needs tools", "tool_choice")
        return None
    checked = [{"type": "function", "function": tool.function.model_dump(exclude_none=True)} for tool in tools]
    names = [t["function"]["name"] for t in checked]
    if len(set(names)) != len(names):
        raise error(f"tools: function names must be unique, got {names}", "tools")
    parallel = request.parallel_tool_calls
    if choice is None or isinstance(choice, str):
        return ToolPlan(checked, choice or "auto", parallel=parallel)
    name = choice.function.name
    if name not in names:
        raise error(f"tool_choice: no tool is named {name!r} (tools: {', '.join(names)})", "tool_choice")
    return ToolPlan(checked, "named", name=name, parallel=parallel)


# ------------------------------------------------------------------ the prompt
def hermes_system_text(tools: list[dict]) -> str:
    """Hermes' tool instructions, for templates that ignore ``tools``."""
    listed = "\n".join(json.dumps(t, separators=(", ", ": ")) for t in tools)
    return ("You are a function calling AI model. You may call one or more functions to assist with the user "
            f"query. Here are the available tools: <tools>\n{listed}\n</tools>\nFor each function call, return a "
            "JSON object with the function name and arguments within <tool_call></tool_call> tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def inline_tool_messages(messages: list[dict], tools: list[dict]) -> list[dict]:
    """The conversation for a template that ignores tools: instructions in the system
    message, earlier tool calls as ``<tool_call>`` text."""
    out = []
    for message in messages:
        calls = message.get("tool_calls") or []
        text = message.get("content") or ""
        text += "".join(f"<tool_call>\n{json.dumps({'name': c['function']['name'], 'arguments': _arguments(c)})}"
                        "\n</tool_call>" for c in calls)
        out.append({"role": message["role"], "content": text})
    instructions = hermes_system_text(tools)
    if out and out[0]["role"] == "system":
        out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + instructions}
    else:
        out.insert(0, {"role": "system", "content": instructions})
    return out


def _arguments(call: dict) -> Any:
    arguments = call["function"].get("arguments", "{}")
    try:
        return json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        return arguments


def render_prompt(tokenizer: Any, messages: list[dict], plan: Optional[ToolPlan],
                  template_kwargs: Optional[dict[str, Any]] = None) -> str:
    """The chat prompt with the tools in it (module docstring); raises ``ValueError``.
    ``template_kwargs``: the request's ``chat_template_kwargs`` (e.g. Qwen3's
    ``enable_thinking``), passed to the template as vLLM does."""
    kwargs = dict(template_kwargs or {})
    if plan is None:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, **kwargs)
    with_tools = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=plan.tools, **kwargs)
    plain = [{k: v for k, v in m.items() if k in ("role", "content")} for m in messages]
    if with_tools != tokenizer.apply_chat_template(plain, add_generation_prompt=True, **kwargs):
        return with_tools  # the template renders tools (and tool calls) itself
    return tokenizer.apply_chat_template(inline_tool_messages(messages, plan.tools), add_generation_prompt=True,
                                         **kwargs)


# ------------------------------------------------------------------ the answer
def _call(name: str, arguments: Any) -> dict:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": text}}


def parse_answer(text: str, plan: ToolPlan) -> tuple[Optional[str], list[dict]]:
    """(content, tool_calls) of one finished choice whose call was forced (``named`` or
    ``required``: the grammar wrote it); ``auto`` answers are ``fleet.parsers``'. Text that does
    not parse (cut by ``max_tokens``) is content."""
    if plan.choice == "named":
        return None, [_call(plan.name, text.strip())]
    try:
        items = json.loads(text)
        return None, [_call(item["name"], item["parameters"]) for item in items]
    except (ValueError, TypeError, KeyError):
        return text or None, []  # cut by max_tokens: finish_reason "length" says so


def finish_reason(reason: Optional[str], plan: ToolPlan, calls: list[dict]) -> Optional[str]:
    """``tool_calls`` when calls were made (``stop`` for a named function); ``length`` stays."""
    if not calls or reason == "length":
        return reason
    return "stop" if plan.choice == "named" else "tool_calls"
