"""A Triton generate-extension body as the router's HTTP door forwards it.

``GenerateRequest`` holds a body for pagoda's model as its ``WireRequest`` (read once, after the
body's schema passed, ``fleet.gate.generate_body``, with the replica's own reader
``WireRequest.from_json``), and a body for one of TensorRT-LLM's front models as the document
the client sent (the front reads its own vocabulary on the replica). ``body`` is what goes to
the replica: the wire's JSON form (its canonical inputs; the client's ``id`` kept, the
router's ``traceparent`` added), or the front's document.

The door salts the request for its tenant (``salted``: the wire's ``cache_salt``; a front's
``parameters.cache_salt``, which the fronts read), analyzes its prompt for routing and keeps
the token ids that made with the wire (``analyzed``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from pagoda.fleet.api.routed_request import MAX_ROUTED_PROMPT_CHARS, analyzed
from pagoda.fleet.gate.generate_body import prompt_of, sampling_of_generate
from pagoda.fleet.routing.router import Analysis, Router
from pagoda.serving.dialects.trtllm import Encode
from pagoda.serving.wire import WireRequest


@dataclass
class GenerateRequest:
    """Attributes:
    model: the model the body addresses.
    wire: pagoda's model's request; ``None`` for a front's.
    document: a front's body as sent; for pagoda's model, only the extension's ``id``.
    """

    model: str
    wire: Optional[WireRequest]
    document: dict[str, Any]

    @classmethod
    def of_document(cls, document: dict[str, Any], model: str, is_front: bool,
                    encode: Optional[Encode] = None) -> "GenerateRequest":
        """A checked generate body. Raises ValueError naming what pagoda's model would refuse."""
        if is_front:
            return cls(model, None, document)
        kept = {"id": document["id"]} if "id" in document else {}
        return cls(model, WireRequest.from_json(document, encode), kept)

    @property
    def prompt(self) -> str:
        """The prompt's text ("" when it has none)."""
        if self.wire is None:
            return prompt_of(self.document)
        return self.wire.prompt or ""

    @property
    def sampling(self) -> Any:
        """What the rate limits charge: the wire's ``SamplingParams``, or a front's values."""
        return self.wire.params if self.wire is not None else sampling_of_generate(self.document)

    def salted(self, salt: Optional[str]) -> "GenerateRequest":
        """This request with the tenant's prefix-cache salt (``None``: unchanged)."""
        if salt is None:
            return self
        if self.wire is not None:
            return dataclasses.replace(self, wire=self.wire.with_options(cache_salt=salt))
        parameters = {**self.document.get("parameters", {}), "cache_salt": salt}
        return dataclasses.replace(self, document={**self.document, "parameters": parameters})

    def analyzed(self, router: Router) -> tuple[Optional[Analysis], "GenerateRequest"]:
        """Routing analysis of the prompt (``None`` when it has no text to route by), and this
        request with the token ids it made (pagoda's model: ``routed_request.analyzed``). Costs
        O(prompt): the door runs it through ``Gate.analyze``."""
        if self.wire is not None:
            analysis, wire = analyzed(router, self.wire)
            return analysis, dataclasses.replace(self, wire=wire)
        prompt = self.prompt
        if not prompt or len(prompt) > MAX_ROUTED_PROMPT_CHARS:
            return None, self
        parameters = self.document.get("parameters") or {}
        lora_name = self.document.get("lora_name") if isinstance(self.document.get("lora_name"), str) else None
        return router.analyze(prompt, parameters.get("cache_salt"), lora_name), self

    def body(self, traceparent: Optional[str] = None, wire: Optional[WireRequest] = None) -> dict[str, Any]:
        """The body for the replica (``wire``: another wire for this request, e.g. a stage's)."""
        body = dict(self.document) if self.wire is None else {**(wire or self.wire).to_json(), **self.document}
        if traceparent:
            body["traceparent"] = traceparent
        return body
