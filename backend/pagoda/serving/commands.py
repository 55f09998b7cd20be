"""What crosses the engine loop's command queue: ``ServingRequest`` and the commands.

Triton's threads (and the LoRA loader thread) never touch the engine: they queue one of
these typed commands, and the loop thread (``serving.engine_loop``) runs it between steps,
dispatching on its type:

- ``Add``: a generation request for the engine;
- ``Abort``: end a request in flight (a cancelled client, a failed delivery);
- ``LoRACommand``: a LoRA control request run on the loop thread (``unload``, ``list``);
- ``RegisterLoRA``: an adapter the loader thread read, to be made servable (``load``);
- ``Wake``: nothing to run; unblocks an idle loop so it sees its stop signal.

Invariant: every command that carries a ``ServingRequest`` (``Add``, ``LoRACommand``,
``RegisterLoRA``) owes that request exactly one final response, so commands still queued
when the loop stops are answered with the shutdown error (``request_of``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional, Union

from pagoda.serving.dialects.pagoda import LoRAControl
from pagoda.serving.wire import WireRequest

if TYPE_CHECKING:
    from pagoda.models.lora import LoRAAdapter


@dataclass
class ServingRequest:
    """One request as the engine loop tracks it, with its per-request serving state.

    Exactly one of ``wire`` (a generation request) and ``control`` (a LoRA control request)
    is set, or neither for a request that failed to parse (it only gets its error).
    ``handle`` is the adapter's response sender, opaque here.
    """

    request_id: str
    wire: Optional[WireRequest]
    handle: object
    is_cancelled: Callable[[], bool] = lambda: False
    arrival_time: float = field(default_factory=time.time)
    traceparent: Optional[str] = None  # W3C trace context from the router (serving/tracing.py)
    control: Optional[LoRAControl] = None
    # The shape of logprobs and finish_reason: the request's output_dialect, else the model's.
    output_dialect: str = "pagoda"
    # A text prompt's token ids, encoded by ``EngineLoop.submit`` on the caller's thread (the
    # engine loop's thread never tokenizes: a huge prompt would stall every stream's step).
    prompt_token_ids: Optional[list[int]] = None
    prompt_logprobs_sent: bool = False  # set by make_response once the prompt_logprobs output went
    context_logits_sent: bool = False  # set by make_response once the context_logits output went


@dataclass(frozen=True)
class Add:
    request: ServingRequest


@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class LoRACommand:
    request: ServingRequest  # its ``control``: ``unload`` or ``list``


@dataclass(frozen=True)
class RegisterLoRA:
    request: ServingRequest  # the ``load`` control request
    adapter: LoRAAdapter


@dataclass(frozen=True)
class Wake:
    pass


Command = Union[Add, Abort, LoRACommand, RegisterLoRA, Wake]


def request_of(command: Command) -> Optional[ServingRequest]:
    """The request a command owes a final response, or None (``Abort``, ``Wake``)."""
    if isinstance(command, (Add, LoRACommand, RegisterLoRA)):
        return command.request
    return None
