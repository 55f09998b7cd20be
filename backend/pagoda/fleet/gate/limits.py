"""Limits on every input the router accepts, and the sampling values read from Triton requests.

Every limit is a field of ``RequestLimits`` (``pagoda router --max-*`` flags) and every
refusal is a ``LimitError`` whose message starts with the offending parameter and names
the limit, answered as 400 (413 for the body size). The checks run before routing, so a
refused request costs no replica anything:

- body size (``max_body_bytes``): from ``Content-Length`` before a byte of the body is
  read (a chunked body is cut off by aiohttp at the same size), so a 10 MB body is
  refused in milliseconds instead of being parsed, rendered and tokenized first;
- prompt characters (``max_prompt_chars``, the replicas' own bound), chat messages
  (``max_messages``);
- sampling: ``max_tokens`` (``max_tokens_limit``), ``n``, ``logprobs``/``top_logprobs``,
  the number and length of stop strings, the number of ``stop_token_ids``.

``default_max_tokens`` is no limit but a fact about the replicas (their own
``--default-max-tokens``, 1024 by default): token quotas charge ``n`` x it for a request
without ``max_tokens`` (``Gate.num_tokens``). It is a router flag rather than a heartbeat
field because the charge is taken before the request is routed.

The Triton bodies' own schemas live beside: ``generate_body`` (the generate extension) and
``infer_body`` (KServe v2 ``/infer``); both raise ``LimitError`` and apply these limits.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from typing import Any, Optional

from pagoda.contracts import json_input


class LimitError(ValueError):
    """A request refused before routing; ``param`` names the field, ``status`` the HTTP code."""

    def __init__(self, message: str, param: Optional[str] = None, status: int = 400) -> None:
        super().__init__(message)
        self.param = param
        self.status = status


@dataclass
class RequestLimits:
    """The router's input limits (see the module docstring); every one is a router flag."""

    max_body_bytes: int = 4 * 2**20
    max_prompt_chars: int = 1_000_000
    max_tokens_limit: int = 32_768
    max_n: int = 16
    max_logprobs: int = 20
    max_stop_strings: int = 16
    max_stop_string_chars: int = 512
    max_stop_token_ids: int = 64
    max_messages: int = 1024
    # What the replicas apply to a request without max_tokens (`pagoda serve
    # --default-max-tokens`, the model repository's 1024): quotas charge it (gate.py).
    default_max_tokens: int = 1024

    def check_body_size(self, content_length: Optional[int]) -> None:
        if content_length is not None and content_length > self.max_body_bytes:
            raise LimitError(f"body: {content_length} bytes exceed this server's limit of {self.max_body_bytes} "
                             "bytes (router --max-body-bytes)", "body", status=413)

    def check_prompt(self, prompt: str, param: str = "prompt") -> None:
        if len(prompt) > self.max_prompt_chars:
            raise LimitError(f"{param}: {len(prompt)} characters exceed this server's limit of "
                             f"{self.max_prompt_chars} (router --max-prompt-chars)", param)

    def check_messages(self, messages: list) -> None:
        if len(messages) > self.max_messages:
            raise LimitError(f"messages: {len(messages)} messages exceed this server's limit of "
                             f"{self.max_messages} (router --max-messages)", "messages")

    def check_params(self, params: Any) -> None:
        """Check a request's ``SamplingParams`` (a wire request's, typed and valid)."""
        self._check(params.max_tokens, params.n, params.logprobs, params.stop, params.stop_token_ids)

    def check_sampling(self, sampling: dict[str, Any]) -> None:
        """Check SamplingParams-named values of a request the router forwards as it came (a
        TensorRT-LLM front's: numbers may be strings, nothing is typed yet)."""
        stop = sampling.get("stop")
        self._check(as_int(sampling.get("max_tokens")), as_int(sampling.get("n")), as_int(sampling.get("logprobs")),
                    [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else [],
                    sampling.get("stop_token_ids") if isinstance(sampling.get("stop_token_ids"), list) else [])

    def _check(self, max_tokens: Optional[int], n: Optional[int], logprobs: Optional[int], stops: list,
               stop_token_ids: list) -> None:
        for name, value, limit, flag in (("max_tokens", max_tokens, self.max_tokens_limit, "max-tokens-limit"),
                                         ("n", n, self.max_n, "max-n"),
                                         ("logprobs", logprobs, self.max_logprobs, "max-logprobs")):
            if value is not None and value > limit:
                raise LimitError(f"{name}: {value} exceeds this server's limit of {limit} (router --{flag})", name)
        if len(stops) > self.max_stop_strings:
            raise LimitError(f"stop: {len(stops)} stop strings exceed this server's limit of "
                             f"{self.max_stop_strings} (router --max-stop-strings)", "stop")
        longest = max((len(s) for s in stops if isinstance(s, str)), default=0)
        if longest > self.max_stop_string_chars:
            raise LimitError(f"stop: a stop string of {longest} characters exceeds this server's limit of "
                             f"{self.max_stop_string_chars} (router --max-stop-string-chars)", "stop")
        if len(stop_token_ids) > self.max_stop_token_ids:
            raise LimitError(f"stop_token_ids: {len(stop_token_ids)} ids exceed this server's limit of "
                             f"{self.max_stop_token_ids} (router --max-stop-token-ids)", "stop_token_ids")


def openai_sampling_values(body: dict, chat: bool) -> dict[str, Any]:
    """The limited values of an OpenAI body as it came, under SamplingParams names, so that a
    value past the router's limit is refused as over the limit (with the flag that raises
    it) before the request's own validation refuses it as invalid (``n`` past
    SamplingParams' 64)."""
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens")) if chat else body.get("max_tokens")
    return {"max_tokens": max_tokens, "n": body.get("n"), "stop": body.get("stop"),
            "logprobs": body.get("top_logprobs") if chat else body.get("logprobs"),
            "stop_token_ids": body.get("stop_token_ids")}


def as_int(value: Any) -> Optional[int]:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return int(value) if math.isfinite(value) else None
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            return None
    return None


def json_kind(value: Any) -> str:
    """A parsed JSON value's kind as the JSON spec names it (for error messages)."""
    return ("array" if isinstance(value, list) else "object" if isinstance(value, dict)
            else "boolean" if isinstance(value, bool) else "number" if isinstance(value, (int, float))
            else "null" if value is None else "string")


def error_path(loc: tuple) -> str:
    """A pydantic error's location as the field's JSON path (``messages[0].content``); a field
    aliased to dodge a pydantic name (``schema_``) shows its wire name. One form for every door's
    schema (OpenAI bodies, generate bodies, KServe v2 bodies)."""
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            name = "schema" if part == "schema_" else str(part)
            text += f".{name}" if text else name
    return text


def show_value(value: Any) -> str:
    """A value as an error message quotes it: its JSON, cut at 80 characters."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def sampling_object(text: Any) -> dict[str, Any]:
    """The ``sampling_parameters`` object (``{}`` if absent or not an object: the replica names
    that); JSON that is invalid, non-finite, too deep or not Unicode is a ``LimitError`` here."""
    if isinstance(text, dict):
        json_input.check(text, "sampling_parameters")
        return dict(text)
    try:
        value = json_input.loads(text, "sampling_parameters") if isinstance(text, str) and text.strip() else {}
    except json_input.JSONInputError as exc:
        raise LimitError(str(exc), exc.param) from None
    return value if isinstance(value, dict) else {}


# ------------------------------------------------------------------ gRPC requests
def sampling_of_infer_request(request: Any) -> dict[str, Any]:
    """SamplingParams-named values of a ``ModelInferRequest`` (JSON + ``max_tokens``/``stop_words``)."""
    from pagoda.fleet.triton_wire import bytes_elements, read_string_input

    sampling = sampling_object(read_string_input(request, "sampling_parameters"))
    for index, tensor in enumerate(request.inputs):
        raw = request.raw_input_contents[index] if index < len(request.raw_input_contents) else b""
        if tensor.name == "max_tokens" and tensor.datatype == "INT32" and len(raw) == 4:
            sampling["max_tokens"] = struct.unpack("<i", raw)[0]
        elif tensor.name == "stop_words" and tensor.datatype == "BYTES":
            sampling["stop"] = [w.decode("utf-8", "replace") for w in bytes_elements(raw) if w]
    return sampling
