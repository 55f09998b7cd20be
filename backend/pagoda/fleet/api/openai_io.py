"""OpenAI request bodies -> ``WireRequest``s, and Triton outputs -> OpenAI pieces.

Pure functions (no I/O), tested without a server. ``build_*_request`` validate a body as
its typed model (``openai_protocol``: one schema per endpoint, strict types and ranges),
build each prompt's ``WireRequest`` from it (its ``SamplingParams`` and ``RequestOptions``
check themselves here, once: a bad value is a 400 before any replica is asked) and raise
``OpenAIError`` (naming the offending parameter) for anything wrong or unsupported; the
parameter mapping is documented in ``pagoda.fleet.api.openai_api``. An ``OpenAIRequest`` is
the wire request plus what only the door uses (echo, tools, usage, the client's stream).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Union

from pydantic import ValidationError

from pagoda.contracts.request_options import RequestOptions
from pagoda.engine.sampling_params import SamplingParams
from pagoda.fleet.api.openai_guided import guided_decoding_from_body
from pagoda.fleet.api.openai_images import message_for_template
from pagoda.fleet.api.openai_protocol import (CHAT_ROLES, ChatCompletionRequest, ChatMessage, CompletionRequest,
                                              OpenAIError, describe, parse)
from pagoda.fleet.api.openai_tools import ToolPlan, render_prompt, tool_plan_from_body
from pagoda.fleet.parsers.output import ParserChoice
from pagoda.serving.wire import OutputOptions, WireRequest

if TYPE_CHECKING:
    from pagoda.models.tokenizer import Tokenizer

# Prompts in one completions request (a list of strings or of token-id lists); each is one
# engine request, routed on its own. Past this a batch is a mistake (lm-eval sends its batch size).
MAX_PROMPTS = 256
PromptInput = Union[str, list[int]]  # text, or token ids

_REFUSED = {
    "suffix": "suffix (fill-in-the-middle) is not supported",
    "prompt_embeds": "prompt_embeds are not supported; send text or token ids",
    "functions": "functions (OpenAI's legacy name) are not supported; send them as tools",
    "function_call": "function_call (OpenAI's legacy name) is not supported; use tool_choice",
}


@dataclass
class OpenAIRequest:
    """What one OpenAI request (or one prompt of a completions request) becomes: the replica's
    ``WireRequest`` (always streamed from the replica, in pagoda's output shapes) and what the
    door alone reads."""

    wire: WireRequest
    stream: bool  # the client's: events as they come, or one object at the end
    logprobs: Optional[int] = None  # alternatives per token; None: no logprobs
    include_usage: bool = False
    echo_prefix: str = ""
    echo: bool = False  # completions: the prompt comes first (text, and its tokens' logprobs)
    echo_only: bool = False  # echo with max_tokens=0: one token is generated and dropped (as vLLM)
    tools: Optional[ToolPlan] = None  # chat with tools (pagoda.fleet.api.openai_tools)
    parsers: Optional[ParserChoice] = None  # chat: how the answer's reasoning and calls are read

    @property
    def prompt(self) -> PromptInput:
        wire = self.wire
        return wire.prompt if wire.prompt is not None else list(wire.prompt_token_ids)

    @property
    def n(self) -> int:
        return self.wire.params.n


# What the door asks of the replica: every completion streamed as deltas, pagoda's shapes.
_OUTPUTS = dict(stream=True, exclude_input_in_output=True, return_finish_reason=True, return_num_input_tokens=True,
                return_num_output_tokens=True, return_num_cached_tokens=True, output_dialect="pagoda")


def _wire(prompt: PromptInput, sampling: dict[str, Any], options: dict[str, Any], logprobs: bool,
          images: tuple[bytes, ...] = ()) -> WireRequest:
    """A prompt's wire request; a value ``SamplingParams`` or ``RequestOptions`` refuses is an
    ``OpenAIError`` naming it (their messages start with the field's name)."""
    try:
        params = SamplingParams.from_dict(sampling)
        return WireRequest(prompt=prompt if isinstance(prompt, str) else None,
                           prompt_token_ids=None if isinstance(prompt, str) else tuple(prompt), params=params,
                           options=RequestOptions(**options),
                           output=OutputOptions(**_OUTPUTS, return_logprobs=logprobs), images=images)
    except ValueError as exc:
        raise OpenAIError(str(exc), str(exc).split(":", 1)[0]) from None


def _common(request: Any, max_tokens: Optional[int], echo: Optional[bool] = None) -> tuple[dict[str, Any], bool]:
    """Fields chat and completions share, from a validated request; ``echo``: the
    completions' flag (None for chat). Returns (SamplingParams values, include_usage)."""
    for name, message in _REFUSED.items():
        if getattr(request, name, None):
            raise OpenAIError(message, name)
    sampling = request.sampling_fields()
    if max_tokens is not None and max_tokens < (0 if echo else 1):  # vLLM: max_tokens=0 only with echo
        hint = " (0 only with echo)" if echo is False else " or 0" if echo else ""
        raise OpenAIError(f"max_tokens: must be a positive integer{hint}, got {max_tokens}", "max_tokens")
    sampling["max_tokens"] = max_tokens
    guided = guided_decoding_from_body(request, OpenAIError)
    if guided is not None:
        sampling["guided_decoding"] = guided
    if request.stop is not None:
        sampling["stop"] = [request.stop] if isinstance(request.stop, str) else list(request.stop)
    if request.use_beam_search:  # vLLM: beam search is greedy unless a temperature is given
        sampling["use_beam_search"] = True
        sampling.setdefault("temperature", 0.0)
        for name in ("best_of", "length_penalty", "early_stopping"):
            if getattr(request, name) is not None:
                sampling[name] = getattr(request, name)
    elif request.best_of is not None and request.best_of != request.n:
        raise OpenAIError("best_of: only best_of == n is supported (or the beam width, with use_beam_search)",
                          "best_of")
    elif request.length_penalty is not None or request.early_stopping is not None:
        name = "length_penalty" if request.length_penalty is not None else "early_stopping"
        raise OpenAIError(f"{name}: needs use_beam_search", name)
    options = request.stream_options
    return sampling, bool(options is not None and options.include_usage)


def read_prompts(body: dict) -> list[PromptInput]:
    """The completions ``prompt``: a string, a list of token ids, or a list of either (one
    engine request each, in order). Raises ``OpenAIError`` naming ``prompt``."""
    if not isinstance(body, dict) or "prompt" not in body:
        raise OpenAIError("prompt: required", "prompt")
    try:
        prompt = CompletionRequest.model_validate({"prompt": body["prompt"]})
    except ValidationError as exc:
        raise describe(exc.errors(include_url=False), body) from None
    return _checked_prompts(prompt.prompts())


def _checked_prompts(prompts: list[PromptInput]) -> list[PromptInput]:
    if len(prompts) > MAX_PROMPTS:
        raise OpenAIError(f"prompt: {len(prompts)} prompts in one request, at most {MAX_PROMPTS}; send several "
                          "requests", "prompt")
    if any(isinstance(p, str) and not p for p in prompts):
        raise OpenAIError("prompt: must not be empty", "prompt")
    return prompts


def build_completion_requests(body: dict, tokenizer: Optional["Tokenizer"] = None) -> list[OpenAIRequest]:
    """``/v1/completions`` body -> one ``OpenAIRequest`` per prompt (raises ``OpenAIError``).

    The body is validated as ``CompletionRequest`` (openai_protocol). ``echo`` puts the
    prompt first (a token prompt's text is ``tokenizer.decode`` of it); with ``logprobs`` it
    also asks the replica for the prompt's log-probabilities (``prompt_logprobs``, vLLM's
    rule: as many alternatives as ``logprobs`` unless the body names ``prompt_logprobs``).
    ``max_tokens=0`` is allowed with ``echo`` only: one token is generated and dropped, as
    vLLM does."""
    request = parse(CompletionRequest, body)
    prompts = _checked_prompts(request.prompts())
    echo = request.echo
    max_tokens = request.max_tokens if request.max_tokens is not None else 16  # OpenAI's default
    sampling, include_usage = _common(request, max_tokens, echo)
    if request.logprobs is not None:
        sampling["logprobs"] = request.logprobs
    prompt_logprobs = request.prompt_logprobs
    if prompt_logprobs is None and echo and request.logprobs is not None:
        prompt_logprobs = request.logprobs
    if prompt_logprobs is not None:
        sampling["prompt_logprobs"] = prompt_logprobs
    echo_only = echo and sampling["max_tokens"] == 0
    if echo_only:
        sampling["max_tokens"] = 1
    options = request.request_options()
    built = []
    for prompt in prompts:
        prefix = (prompt if isinstance(prompt, str) else tokenizer.decode(prompt)) if echo else ""
        built.append(OpenAIRequest(_wire(prompt, sampling, options, request.logprobs is not None), request.stream,
                                   request.logprobs, include_usage, prefix, echo=echo, echo_only=echo_only))
    return built


def build_completion_request(body: dict, tokenizer: Optional["Tokenizer"] = None) -> OpenAIRequest:
    """A ``/v1/completions`` body of one prompt -> its ``OpenAIRequest`` (raises ``OpenAIError``)."""
    built = build_completion_requests(body, tokenizer)
    if len(built) != 1:
        raise OpenAIError(f"prompt: expected one prompt, got {len(built)}", "prompt")
    return built[0]


def _message_dict(message: ChatMessage, index: int, images: list[bytes]) -> dict[str, Any]:
    """The message the chat template renders; its images' bytes go to ``images`` (``openai_images``)."""
    out: dict[str, Any] = {"role": CHAT_ROLES[message.role], "content": message_for_template(message, index, images)}
    if message.tool_calls is not None and out["role"] == "assistant":
        out["tool_calls"] = [call.model_dump(exclude_none=True) for call in message.tool_calls]
    if out["role"] == "tool" and message.tool_call_id is not None:
        out["tool_call_id"] = str(message.tool_call_id)
    return out


def build_chat_request(body: dict, tokenizer: "Tokenizer", reasoning_parser: Optional[str] = None,
                       tool_parser: Optional[str] = None) -> OpenAIRequest:
    """``/v1/chat/completions`` body -> ``OpenAIRequest``: the prompt is the chat template's
    rendering (with ``chat_template_kwargs``, as vLLM). Validated as ``ChatCompletionRequest``."""
    request = parse(ChatCompletionRequest, body)
    max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
    sampling, include_usage = _common(request, max_tokens)
    logprobs = None
    if request.logprobs:
        logprobs = request.top_logprobs or 0
        sampling["logprobs"] = logprobs
    elif request.top_logprobs:
        raise OpenAIError("top_logprobs: needs logprobs: true", "top_logprobs")
    plan = tool_plan_from_body(request, OpenAIError)
    forced = plan.guided() if plan is not None else None
    if forced is not None:
        if "guided_decoding" in sampling:
            raise OpenAIError("tool_choice: a forced tool call is an output format; do not combine it with "
                              "response_format or guided_*", "tool_choice")
        sampling["guided_decoding"] = forced
    images: list[bytes] = []
    checked = [_message_dict(m, i, images) for i, m in enumerate(request.messages)]
    try:
        prompt = render_prompt(tokenizer, checked, plan, request.chat_template_kwargs or {})
    except (ValueError, TypeError) as exc:
        if images:  # a text-only model's template concatenates content as a string
            raise OpenAIError(f"messages: the model's chat template cannot render image parts (does this model "
                              f"take images?): {exc}", "messages") from None
        raise OpenAIError(f"messages: {exc}", "chat_template_kwargs" if request.chat_template_kwargs else "messages") \
            from None
    parsers = ParserChoice.detect(getattr(tokenizer, "chat_template", None), prompt, reasoning_parser, tool_parser)
    if parsers.needs_special_tokens and request.skip_special_tokens is None:
        sampling["skip_special_tokens"] = False  # gpt-oss's channels are special tokens (fleet.parsers.harmony)
    wire = _wire(prompt, sampling, request.request_options(), logprobs is not None, tuple(images))
    return OpenAIRequest(wire, request.stream, logprobs, include_usage, tools=plan, parsers=parsers)


# ------------------------------------------------------------------ Triton tensors
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
def _token_text(tokenizer: "Tokenizer", token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def chat_logprobs(entries: list[dict], tokenizer: "Tokenizer") -> dict:
    """Engine ``TokenLogprob`` dicts -> the chat ``logprobs`` object."""
    def item(token_id: int, logprob: float) -> dict:
        text = _token_text(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**item(e["token_id"], e["logprob"]),
                         "top_logprobs": [item(t["token_id"], t["logprob"]) for t in e.get("top_logprobs", [])]}
                        for e in entries]}


def completion_logprobs(entries: list[dict], tokenizer: "Tokenizer", offset: int = 0) -> dict:
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
