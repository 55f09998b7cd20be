"""What a door hands the upstream client: one request for a replica, typed when it is pagoda's own.

``RoutedRequest`` holds a request for pagoda's model as its ``WireRequest`` (the OpenAI door
builds it from the body; the gRPC door reads it from the client's tensors, once, with the
replica's own reader ``WireRequest.from_triton_inputs``), or a request for another model of
the repository (TensorRT-LLM's front models) as the ``ModelInferRequest`` the client sent,
forwarded as it came. The upstream client builds the replica's request from it on each
attempt (``infer_request``): a changed wire (a P/D stage, a peer to pull from) is a new
``WireRequest``, never an edit of tensors already built.

Kept besides the wire: the client's request id, model version and requested outputs, and the
request parameters that are tritonserver's own (``triton_enable_empty_final_response``, the
sequence fields, ...: ``serving.dialects.vllm.TOLERATED_PARAMETERS``), which tritonserver acts
on before the model sees the request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from tritonclient.grpc import service_pb2

from pagoda.fleet.api.tracing import TRACEPARENT
from pagoda.fleet.gate.fair_queue import Turn
from pagoda.fleet.routing.router import Analysis, Router
from pagoda.fleet.triton_wire import infer_inputs, infer_request, request_parameters
from pagoda.serving.dialects.trtllm import Encode
from pagoda.serving.dialects.vllm import TOLERATED_PARAMETERS
from pagoda.serving.wire import WireRequest

PAGODA_MODEL = "pagoda"
# Larger prompts are forwarded without routing analysis (the replica refuses them anyway).
MAX_ROUTED_PROMPT_CHARS = 1_000_000


@dataclass
class RoutedRequest:
    """Attributes:
    request_id: the client's id (echoed in every response).
    wire: pagoda's model's request; ``None`` for another model's.
    raw: another model's ``ModelInferRequest`` as the client sent it.
    model_name, model_version: the model addressed.
    parameters: request parameters kept beside the wire (tritonserver's own fields).
    outputs: the outputs the client asked for (empty: every one).
    turn: its place in the router's queue (``gate.flow_control``; ``None``: flow control off).
    """

    request_id: str
    wire: Optional[WireRequest] = None
    raw: Optional[Any] = None
    model_name: str = PAGODA_MODEL
    model_version: str = ""
    parameters: dict[str, Any] = field(default_factory=dict)
    outputs: tuple[str, ...] = ()
    turn: Optional[Turn] = None

    @classmethod
    def of_infer_request(cls, request: Any, encode: Optional[Encode] = None) -> "RoutedRequest":
        """A client's ``ModelInferRequest``: read into a ``WireRequest`` when it is for pagoda's model.

        Raises:
            ValueError: naming the input, parameter or field pagoda's model would refuse.
        """
        outputs = tuple(output.name for output in request.outputs)
        if request.model_name not in (PAGODA_MODEL, ""):
            return cls(request.id, raw=request, model_name=request.model_name, model_version=request.model_version,
                       outputs=outputs)
        parameters = request_parameters(request)
        wire = WireRequest.from_triton_inputs(infer_inputs(request).get, parameters, encode)
        kept = {k: v for k, v in parameters.items() if k in TOLERATED_PARAMETERS and k != TRACEPARENT}
        return cls(request.id, wire, model_version=request.model_version, parameters=kept, outputs=outputs)

    @property
    def prompt(self) -> Optional[str]:
        """The prompt's text, when it has one."""
        return self.wire.prompt if self.wire is not None else None

    def infer_request(self, traceparent: Optional[str] = None, wire: Optional[WireRequest] = None) -> Any:
        """The replica's ``ModelInferRequest`` (``wire``: another wire for this request, e.g. one
        with a peer to pull from)."""
        if self.wire is None:
            request = service_pb2.ModelInferRequest()
            request.CopyFrom(self.raw)
        else:
            request = infer_request(self.model_name, self.request_id,
                                    as_released(wire or self.wire, self.turn).to_triton_inputs(), self.parameters)
            request.model_version = self.model_version
            for name in self.outputs:
                request.outputs.add().name = name
        if traceparent:
            request.parameters[TRACEPARENT].string_param = traceparent
        return request


def kept_deadline(wire: WireRequest, turn: Optional[Turn]) -> WireRequest:
    """``wire`` with its ``timeout`` less the time it waited in the router's queue (the replica
    counts the timeout from its own arrival; the request keeps the deadline it came with)."""
    if turn is None or not turn.waited_s or wire.options.timeout is None:
        return wire
    return wire.with_options(timeout=turn.remaining_timeout())


def as_released(wire: WireRequest, turn: Optional[Turn]) -> WireRequest:
    """``wire`` as the router sends it once the router's queue released it: its ``timeout`` less
    the wait (``kept_deadline``) and its ``priority`` the turn's rank at the replica
    (``Turn.replica_priority``: the band scaled, plus its tenant's standing), so a replica running
    the priority policy carries the router's fairness into its batch. Unchanged without a turn
    (flow control off)."""
    wire = kept_deadline(wire, turn)
    if turn is None or wire.options.priority == turn.replica_priority:
        return wire
    return wire.with_options(priority=turn.replica_priority)


def with_routing_ids(wire: WireRequest, analysis: Optional[Analysis]) -> WireRequest:
    """``wire`` with the token ids the router made of its text to route it (and the tokenizer's
    fingerprint), so a replica with that tokenizer does not encode the text again."""
    if analysis is None or analysis.tokenizer is None or wire.prompt is None or wire.prompt_token_ids is not None:
        return wire
    return wire.with_prompt_token_ids(analysis.token_ids, analysis.tokenizer)


def analysis_chars(prompt: Any, wire: Optional[WireRequest]) -> int:
    """What analyzing a request costs, counted as prompt characters for ``Gate.analyze``: the
    prompt's length, and each image's encoded bytes (the router decodes and hashes an image to
    route it: ``routing.image_routing``), so a request with images is analyzed off the event loop."""
    return len(prompt or "") + sum(len(image) for image in (wire.images if wire is not None else ()))


def analyzed(router: Router, wire: WireRequest) -> tuple[Optional[Analysis], WireRequest]:
    """The routing analysis of a wire request's prompt, and the wire with the token ids it made
    (``with_routing_ids``). Costs O(prompt): doors run it through ``Gate.analyze``, which keeps
    a long prompt off the event loop. ``None`` for a prompt too long to route by."""
    if wire.prompt is not None and len(wire.prompt) > MAX_ROUTED_PROMPT_CHARS:
        return None, wire
    prompt = wire.prompt if wire.prompt is not None else list(wire.prompt_token_ids)
    analysis = router.analyze(prompt, wire.options.cache_salt, wire.options.lora_name, wire.images)
    return analysis, with_routing_ids(wire, analysis)
