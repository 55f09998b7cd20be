"""OpenAI request bodies -> contract-1 Triton requests, and Triton outputs -> OpenAI pieces.

Pure functions (no I/O), tested without a server. ``build_*_request`` validate a body and
raise ``OpenAIError`` (naming the offending parameter) for anything wrong or unsupported;
the parameter mapping is documented in ``pagoda.fleet.api.openai_api``.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from tritonclient.grpc import service_pb2

from pagoda.fleet.api.openai_guided import guided_decoding_from_body
from pagoda.fleet.api.openai_tools import ToolPlan, detect_parser, render_prompt, tool_plan_from_body

MODEL_NAME = "pagoda"
# Prompts in one completions request (a list of strings or of token-id lists); each is one
# engine request, routed on its own. Past this a batch is a mistake (lm-eval sends its batch size).
MAX_PROMPTS = 256
PromptInput = Union[str, list[int]]  # text, or token ids

# OpenAI name -> (SamplingParams name, accepted Python types)
_NUMBER = (int, float)
_COMMON_FIELDS: dict[str, tuple[str, tuple]] = {
    "temperature": ("temperature", _NUMBER),
    "top_p": ("top_p", _NUMBER),
    "n": ("n", (int,)),
    "seed": ("seed", (int,)),
    "presence_penalty": ("presence_penalty", _NUMBER),
    "frequency_penalty": ("frequency_penalty", _NUMBER),
    # vLLM-style extras
    "top_k": ("top_k", (int,)),
    "min_p": ("min_p", _NUMBER),
    "min_tokens": ("min_tokens", (int,)),
    "repetition_penalty": ("repetition_penalty", _NUMBER),
    "ignore_eos": ("ignore_eos", (bool,)),
    "skip_special_tokens": ("skip_special_tokens", (bool,)),
    "include_stop_str_in_output": ("include_stop_str_in_output", (bool,)),
    "stop_token_ids": ("stop_token_ids", (list,)),
    "cache_salt": ("cache_salt", (str,)),
    "priority": ("priority", (int,)),
    "timeout": ("timeout", _NUMBER),  # seconds; pagoda.engine.core.admission deadlines
    # beam search, as vLLM's extra parameters (best_of is the beam width then)
    "use_beam_search": ("use_beam_search", (bool,)),
    "length_penalty": ("length_penalty", _NUMBER),
    "early_stopping": ("early_stopping", (bool, str)),
}
# Chat roles the chat templates know; "developer" (OpenAI's newer name) is a system message.
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
_REFUSED = {
    "suffix": "suffix (fill-in-the-middle) is not supported",
    "prompt_embeds": "prompt_embeds are not supported; send text or token ids",
    "functions": "functions (OpenAI's legacy name) are not supported; send them as tools",
    "function_call": "function_call (OpenAI's legacy name) is not supported; use tool_choice",
}


class OpenAIError(ValueError):
    """A request the OpenAI endpoints refuse; ``param`` names the offending field."""

    def __init__(self, message: str, param: Optional[str] = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class BuiltRequest:
    """What one OpenAI request (or one prompt of a completions request) becomes."""

    prompt: PromptInput
    sampling: dict[str, Any]
    stream: bool
    n: int = 1
    logprobs: Optional[int] = None  # alternatives per token; None: no logprobs
    include_usage: bool = False
    echo_prefix: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    echo: bool = False  # completions: the prompt comes first (text, and its tokens' logprobs)
    echo_only: bool = False  # echo with max_tokens=0: one token is generated and dropped (as vLLM)
    tools: Optional[ToolPlan] = None  # chat with tools (pagoda.fleet.api.openai_tools)
    tool_parser: str = "hermes"


def _check_type(body: dict, name: str, types: tuple) -> Any:
    value = body[name]
    if isinstance(value, bool) and bool not in types:
        raise OpenAIError(f"{name}: expected {'/'.join(t.__name__ for t in types)}, got a boolean", name)
    if not isinstance(value, types):
        raise OpenAIError(f"{name}: expected {'/'.join(t.__name__ for t in types)}, got {json.dumps(value)}", name)
    return value


def _common(body: dict, max_tokens_default: Optional[int],
            echo: Optional[bool] = None) -> tuple[dict[str, Any], bool, int, bool]:
    """Fields chat and completions share; ``echo``: the completions' flag (None for chat)."""
    for name, message in _REFUSED.items():
        if body.get(name):
            raise OpenAIError(message, name)
    if body.get("logit_bias"):
        raise OpenAIError("logit_bias is not supported; omit it or send {}", "logit_bias")
    sampling: dict[str, Any] = {}
    for name, (target, types) in _COMMON_FIELDS.items():
        if body.get(name) is not None:
            sampling[target] = _check_type(body, name, types)
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens", max_tokens_default))
    if max_tokens is not None:
        lowest = 0 if echo else 1  # vLLM: max_tokens=0 only with echo (the prompt alone)
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < lowest:
            hint = " (0 only with echo)" if echo is False else " or 0" if echo else ""
            raise OpenAIError(f"max_tokens: must be a positive integer{hint}, got {json.dumps(max_tokens)}",
                              "max_tokens")
    sampling["max_tokens"] = max_tokens
    guided = guided_decoding_from_body(body, OpenAIError)
    if guided is not None:
        sampling["guided_decoding"] = guided
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise OpenAIError("stop: must be a string or a list of strings", "stop")
        sampling["stop"] = stop
    n = sampling.get("n", 1)
    if n < 1:
        raise OpenAIError(f"n: must be at least 1, got {n}", "n")
    best_of = body.get("best_of")
    if sampling.get("use_beam_search"):  # vLLM: beam search is greedy unless a temperature is given
        sampling.setdefault("temperature", 0.0)
        if best_of is not None:
            sampling["best_of"] = _check_type(body, "best_of", (int,))
    elif best_of is not None and best_of != n:
        raise OpenAIError("best_of: only best_of == n is supported (or the beam width, with use_beam_search)",
                          "best_of")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise OpenAIError("stream: must be a boolean", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise OpenAIError("stream_options: must be an object", "stream_options")
    return sampling, stream, n, bool(options.get("include_usage", False))


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool)
                                                           for t in value)


def read_prompts(body: dict) -> list[PromptInput]:
    """The completions ``prompt``: a string, a list of token ids, or a list of either (one
    engine request each, in order). Raises ``OpenAIError`` naming ``prompt``."""
    if "prompt" not in body:
        raise OpenAIError("prompt: required", "prompt")
    prompt = body["prompt"]
    if isinstance(prompt, str) or _is_token_ids(prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or _is_token_ids(p) for p in prompt):
        prompts = list(prompt)
    else:
        raise OpenAIError("prompt: must be a string, a list of token ids, or a non-empty list of strings or of "
                          "token-id lists", "prompt")
    if len(prompts) > MAX_PROMPTS:
        raise OpenAIError(f"prompt: {len(prompts)} prompts in one request, at most {MAX_PROMPTS}; send several "
                          "requests", "prompt")
    for p in prompts:
        if isinstance(p, str) and not p:
            raise OpenAIError("prompt: must not be empty", "prompt")
        if isinstance(p, list) and min(p) < 0:
            raise OpenAIError("prompt: token ids must be integers >= 0", "prompt")
    return prompts


def build_completion_requests(body: dict, tokenizer: Any = None) -> list[BuiltRequest]:
    """``/v1/completions`` body -> one ``BuiltRequest`` per prompt (raises ``OpenAIError``).

    ``echo`` puts the prompt first (a token prompt's text is ``tokenizer.decode`` of it);
    with ``logprobs`` it also asks the replica for the prompt's log-probabilities
    (``prompt_logprobs``, vLLM's rule: as many alternatives as ``logprobs`` unless the body
    names ``prompt_logprobs``). ``max_tokens=0`` is allowed with ``echo`` only: one token is
    generated and dropped, as vLLM does."""
    prompts = read_prompts(body)
    echo = body.get("echo", False)
    if not isinstance(echo, bool):
        raise OpenAIError("echo: must be a boolean", "echo")
    sampling, stream, n, include_usage = _common(body, 16, echo)
    logprobs = body.get("logprobs")
    if logprobs is not None:
        if isinstance(logprobs, bool) or not isinstance(logprobs, int) or not 0 <= logprobs <= 20:
            raise OpenAIError("logprobs: must be an integer from 0 to 20", "logprobs")
        sampling["logprobs"] = logprobs
    prompt_logprobs = body.get("prompt_logprobs")
    if prompt_logprobs is not None:
        if isinstance(prompt_logprobs, bool) or not isinstance(prompt_logprobs, int) or not 0 <= prompt_logprobs <= 20:
            raise OpenAIError("prompt_logprobs: must be an integer from 0 to 20", "prompt_logprobs")
    elif echo and logprobs is not None:
        prompt_logprobs = logprobs
    if prompt_logprobs is not None:
        sampling["prompt_logprobs"] = prompt_logprobs
    echo_only = echo and sampling["max_tokens"] == 0
    if echo_only:
        sampling["max_tokens"] = 1
    built = []
    for prompt in prompts:
        prefix = (prompt if isinstance(prompt, str) else tokenizer.decode(prompt)) if echo else ""
        built.append(BuiltRequest(prompt, dict(sampling), stream, n, logprobs, include_usage, prefix,
                                  echo=echo, echo_only=echo_only))
    return built


def build_completion_request(body: dict, tokenizer: Any = None) -> BuiltRequest:
    """A ``/v1/completions`` body of one prompt -> its ``BuiltRequest`` (raises ``OpenAIError``)."""
    built = build_completion_requests(body, tokenizer)
    if len(built) != 1:
        raise OpenAIError(f"prompt: expected one prompt, got {len(built)}", "prompt")
    return built[0]


def _message_text(message: Any, index: int) -> dict[str, Any]:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise OpenAIError(f"messages[{index}]: must be an object with a 'role'", "messages")
    role = CHAT_ROLES.get(message["role"])
    if role is None:
        raise OpenAIError(f"messages[{index}].role: must be one of {', '.join(CHAT_ROLES)}, got "
                          f"{json.dumps(message['role'])}", "messages")
    content = message.get("content")
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise OpenAIError(f"messages[{index}].content: only text parts are supported", "messages")
            parts.append(part["text"])
        content = "".join(parts)
    if content is None:
        content = ""
    if not isinstance(content, str):
        raise OpenAIError(f"messages[{index}].content: must be a string or a list of text parts", "messages")
    out = {"role": role, "content": content}
    calls = message.get("tool_calls")
    if calls is not None and role == "assistant":
        if not isinstance(calls, list) or not all(
                isinstance(c, dict) and isinstance(c.get("function"), dict) and isinstance(c["function"].get("name"), str)
                for c in calls):
            raise OpenAIError(f"messages[{index}].tool_calls: must be a list of {{id, type, function: {{name, "
                              "arguments}}}} objects", "messages")
        out["tool_calls"] = calls
    if role == "tool" and message.get("tool_call_id") is not None:
        out["tool_call_id"] = str(message["tool_call_id"])
    return out


def build_chat_request(body: dict, tokenizer: Any) -> BuiltRequest:
    """``/v1/chat/completions`` body -> ``BuiltRequest``: the prompt is the chat template's rendering."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise OpenAIError("messages: must be a non-empty list of {role, content} objects", "messages")
    sampling, stream, n, include_usage = _common(body, None)
    logprobs = None
    if body.get("logprobs"):
        logprobs = body.get("top_logprobs") or 0
        if isinstance(logprobs, bool) or not isinstance(logprobs, int) or not 0 <= logprobs <= 20:
            raise OpenAIError("top_logprobs: must be an integer from 0 to 20", "top_logprobs")
        sampling["logprobs"] = logprobs
    elif body.get("top_logprobs"):
        raise OpenAIError("top_logprobs: needs logprobs: true", "top_logprobs")
    plan = tool_plan_from_body(body, OpenAIError)
    forced = plan.guided() if plan is not None else None
    if forced is not None:
        if "guided_decoding" in sampling:
            raise OpenAIError("tool_choice: a forced tool call is an output format; do not combine it with "
                              "response_format or guided_*", "tool_choice")
        sampling["guided_decoding"] = forced
    checked = [_message_text(m, i) for i, m in enumerate(messages)]
    try:
        prompt = render_prompt(tokenizer, checked, plan)
    except ValueError as exc:
        raise OpenAIError(f"messages: {exc}", "messages") from None
    return BuiltRequest(prompt, sampling, stream, n, logprobs, include_usage, tools=plan,
                        tool_parser=detect_parser(getattr(tokenizer, "chat_template", None)))


# ------------------------------------------------------------------ Triton tensors
def _bytes_raw(values: list[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(v)) + v for v in values)


def make_infer_request(built: BuiltRequest, request_id: str) -> Any:
    """The contract-1 ``ModelInferRequest`` for a built OpenAI request (streaming deltas)."""
    request = service_pb2.ModelInferRequest(model_name=MODEL_NAME, id=request_id)
    prompt = built.prompt
    inputs = [("text_input", "BYTES", _bytes_raw([prompt.encode("utf-8")])) if isinstance(prompt, str) else
              ("input_ids", "INT32", struct.pack(f"<{len(prompt)}i", *prompt)),
              # The door reads pagoda's output shapes, whatever the replica's default dialect.
              ("sampling_parameters", "BYTES",
               _bytes_raw([json.dumps({**built.sampling, "output_dialect": "pagoda"}).encode("utf-8")]))]
    flags = {"stream": True, "exclude_input_in_output": True, "return_finish_reason": True,
             "return_num_input_tokens": True, "return_num_output_tokens": True, "return_num_cached_tokens": True,
             "return_logprobs": built.logprobs is not None}
    inputs += [(name, "BOOL", struct.pack("?", value)) for name, value in flags.items()]
    for name, datatype, raw in inputs:
        tensor = request.inputs.add()
        tensor.name, tensor.datatype = name, datatype
        tensor.shape.append(len(prompt) if name == "input_ids" else 1)
        request.raw_input_contents.append(raw)
    return request


_NUMPY_FORMATS = {"UINT32": "I", "INT32": "i", "FP32": "f", "UINT64": "Q", "INT64": "q", "BOOL": "?"}


def read_outputs(response: Any) -> dict[str, list]:
    """A ``ModelInferResponse``'s outputs as ``{name: [python values]}`` (BYTES decoded as UTF-8)."""
    from pagoda.fleet.triton_wire import bytes_elements

    out: dict[str, list] = {}
    for index, tensor in enumerate(response.outputs):
        raw = response.raw_output_contents[index] if index < len(response.raw_output_contents) else b""
        if tensor.datatype == "BYTES":
            out[tensor.name] = [v.decode("utf-8", errors="replace") for v in bytes_elements(raw)]
        elif tensor.datatype in _NUMPY_FORMATS:
            fmt = _NUMPY_FORMATS[tensor.datatype]
            out[tensor.name] = list(struct.unpack(f"<{len(raw) // struct.calcsize(fmt)}{fmt}", raw))
    return out


# ------------------------------------------------------------------ logprobs
def _token_text(tokenizer: Any, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def chat_logprobs(entries: list[dict], tokenizer: Any) -> dict:
    """Engine ``TokenLogprob`` dicts -> the chat ``logprobs`` object."""
    def item(token_id: int, logprob: float) -> dict:
        text = _token_text(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**item(e["token_id"], e["logprob"]),
                         "top_logprobs": [item(t["token_id"], t["logprob"]) for t in e.get("top_logprobs", [])]}
                        for e in entries]}


def completion_logprobs(entries: list[dict], tokenizer: Any, offset: int = 0) -> dict:
    """Engine ``TokenLogprob`` dicts -> the legacy completions ``logprobs`` object. An entry
    whose ``logprob`` is ``None`` (the prompt's first token, echoed) gets ``null`` log-prob and
    ``null`` alternatives, as vLLM and OpenAI send them."""
    tokens, offsets = [], []
    for entry in entries:
        text = _token_text(tokenizer, entry["token_id"])
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [None if e["logprob"] is None else
                             {_token_text(tokenizer, t["token_id"]): t["logprob"] for t in e.get("top_logprobs", [])}
                             for e in entries],
            "text_offset": offsets}


def echoed_prompt_logprobs(prompt_logprobs: list[Optional[dict]], first_token_id: int) -> list[dict]:
    """The replica's ``prompt_logprobs`` (pagoda shape, ``null`` first) as entries for
    ``completion_logprobs``: the first prompt token with a ``None`` log-prob."""
    return [{"token_id": first_token_id, "logprob": None, "top_logprobs": None}] + list(prompt_logprobs[1:])
