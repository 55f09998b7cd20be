"""Engine outputs -> the response tensors of pagoda's model (ARCHITECTURE contract 1).

Pure functions over numpy arrays (tested without a server); ``model.py`` only wraps them.

Outputs: one element per completion (``n``) in ``text_output``, ``finish_reason``,
``stop_reason`` (the stop string or token id that ended it, ``"None"`` otherwise),
``cumulative_logprob``, ``logprobs`` (JSON, in the request's output dialect:
``serving.dialects.vllm``), ``num_output_tokens`` and ``output_token_ids`` (a JSON list
of token ids: the router's migration journal reads it); ``num_input_tokens`` and
``num_cached_tokens`` (the prompt tokens found in the prefix cache) have one element, and so
does ``prompt_logprobs`` (JSON), sent once (with the first tokens when streaming) to a
request that set the ``prompt_logprobs`` sampling parameter. Raw logits
(``return_context_logits`` / ``return_generation_logits``, ``engine.logits_output``):
``context_logits`` (FP32 ``[prompt tokens, vocab]``) comes once, on the final response, or when
streaming on the first (with the first tokens, as ``prompt_logprobs``); ``generation_logits`` (FP32
``[n, tokens, vocab]``, a completion with fewer rows padded with 0.0) holds every output token's
row on the final response, or when streaming each response's own tokens' rows (those of its
``num_output_tokens``: several with speculative decoding), so the rows leave with their response.
Each optional output answers its ``return_*`` flag (``OutputOptions``). Streaming responses carry this step's deltas; a
non-streaming response carries the whole text, with the prompt in front unless
``exclude_input_in_output`` is true (the vLLM backend's behaviour). ``finish_reason`` is
``""`` (pagoda dialect) or ``"None"`` (vLLM) until a completion finishes.

A LoRA control request's one final response (``make_control_response``) holds a JSON
document in ``text_output``; a failed request gets one final error (``make_error_response``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

import numpy as np

from pagoda.contracts.errors import TRITON_CODES, ErrorKind, TritonCode, triton_code_of
from pagoda.engine.core.load_shedding import is_admission_error
from pagoda.engine.outputs import RequestOutput
from pagoda.serving.dialects.tensors import string_array
from pagoda.serving.dialects.vllm import finish_reason_text, logprobs_text, prompt_logprobs_text

if TYPE_CHECKING:
    from pagoda.serving.commands import ServingRequest


@dataclass
class Response:
    """One response to send: tensors, or an error; ``is_final`` marks the request's last."""

    tensors: dict[str, np.ndarray] = field(default_factory=dict)
    error: Optional[str] = None
    # What kind of failure ``error`` is, as a Triton error code name
    # (``pagoda.contracts.errors.TritonCode``): INVALID_ARG (bad input, HTTP 400), INTERNAL
    # (engine fault), UNAVAILABLE (shutting down, overloaded, or the request's deadline
    # passed; the message says which; tritonserver's generate endpoint answers every error
    # with HTTP 400, see docs/serving.md).
    error_code: str = TritonCode.INVALID_ARG
    is_final: bool = False


def make_response(request: "ServingRequest", output: RequestOutput,
                  decode_token: Callable[[int], str] = str) -> Optional[Response]:
    """Tensors for one engine output of this request.

    Streaming: this step's deltas; ``None`` when there is nothing to say yet (no new token
    and not finished). Not streaming: ``None`` until the request finishes, then the whole
    text. ``is_final`` is set on the response built from the finished output. An output
    carrying ``error`` becomes the request's one error response: ``UNAVAILABLE`` when
    admission control ended it (overloaded, deadline passed), else ``INVALID_ARG`` (a
    guided-decoding format that does not compile). ``decode_token``: a token id's text, for
    the vLLM dialect's ``decoded_token``.
    """
    if output.error is not None:
        return make_error_response(output.error, TritonCode.UNAVAILABLE if is_admission_error(output.error)
                                   else TritonCode.INVALID_ARG)
    wire = request.wire
    assert wire is not None, f"request {request.request_id} is not a generation request"
    flags, dialect = wire.output, request.output_dialect
    if not flags.stream and not output.finished:
        return None
    completions = output.outputs
    if flags.stream and not output.finished and not any(c.delta_token_ids or c.delta_text for c in completions):
        return None
    if flags.stream:
        texts = [c.delta_text for c in completions]
    else:
        prefix = "" if flags.exclude_input_in_output else (output.prompt or "")
        texts = [prefix + c.text for c in completions]
    tensors = {"text_output": string_array(texts)}
    if flags.return_finish_reason:
        tensors["finish_reason"] = string_array([finish_reason_text(c.finish_reason, dialect) for c in completions])
    if flags.return_stop_reason:
        tensors["stop_reason"] = string_array([str(c.stop_reason) for c in completions])
    if flags.return_cumulative_logprob:
        tensors["cumulative_logprob"] = np.array(
            [c.cumulative_logprob if c.cumulative_logprob is not None else 0.0 for c in completions], dtype=np.float32)
    if flags.return_logprobs:
        tensors["logprobs"] = string_array([
            logprobs_text(c.delta_logprobs if flags.stream else c.logprobs, wire.logprobs_asked, dialect,
                          decode_token) for c in completions])
    if flags.return_num_input_tokens:
        tensors["num_input_tokens"] = np.array([len(output.prompt_token_ids)], dtype=np.uint32)
    if flags.return_num_output_tokens:
        tensors["num_output_tokens"] = np.array(
            [len(c.delta_token_ids) if flags.stream else len(c.token_ids) for c in completions], dtype=np.uint32)
    if flags.return_output_token_ids:
        tensors["output_token_ids"] = string_array([
            json.dumps(c.delta_token_ids if flags.stream else c.token_ids) for c in completions])
    if flags.return_num_cached_tokens:  # prompt tokens served from the prefix cache (OpenAI's cached_tokens)
        tensors["num_cached_tokens"] = np.array([output.num_cached_tokens or 0], dtype=np.uint32)
    tensors.update(_logits(request, flags, output))
    if output.prompt_logprobs is not None and not request.prompt_logprobs_sent:
        tensors["prompt_logprobs"] = string_array([prompt_logprobs_text(output.prompt_logprobs, dialect,
                                                                        decode_token)])
        request.prompt_logprobs_sent = True
    return Response(tensors=tensors, is_final=output.finished)


def _logits(request: "ServingRequest", flags, output: RequestOutput) -> dict[str, np.ndarray]:
    """The raw logits asked for (module docstring): whole on the final response, or a stream's
    context logits once and each response's own generation rows."""
    out: dict[str, np.ndarray] = {}
    if not (flags.stream or output.finished):
        return out
    if flags.return_context_logits and output.context_logits is not None and not request.context_logits_sent:
        out["context_logits"] = np.ascontiguousarray(output.context_logits, dtype=np.float32)
        request.context_logits_sent = True
    rows = [c.delta_generation_logits if flags.stream else c.generation_logits for c in output.outputs]
    if flags.return_generation_logits and any(r is not None for r in rows):
        width = max(len(r) for r in rows if r is not None)
        vocab = max(r.shape[1] for r in rows if r is not None)
        stacked = np.zeros((len(rows), width, vocab), dtype=np.float32)
        for i, r in enumerate(rows):
            if r is not None:
                stacked[i, :len(r), :r.shape[1]] = r
        out["generation_logits"] = stacked
    return out


def make_control_response(document: dict[str, Any]) -> Response:
    """The single, final response of a LoRA control request: ``document`` as JSON in ``text_output``."""
    return Response(tensors={"text_output": string_array([json.dumps(document)])}, is_final=True)


def make_error_response(message: str, error: Union[ErrorKind, str] = ErrorKind.INVALID_REQUEST) -> Response:
    """The single, final response of a request that failed.

    Args:
        message: the client's error text (``pagoda.contracts.errors`` names the prefixes
            that tell kinds apart).
        error: its ``ErrorKind`` (whose Triton code is sent), or a Triton code name.
    """
    code = triton_code_of(error) if isinstance(error, ErrorKind) else error
    assert code in TRITON_CODES, f"unknown Triton error code {code!r}"
    return Response(error=message, error_code=code, is_final=True)
