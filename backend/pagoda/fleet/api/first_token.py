"""The prefill replica's first token, streamed to the client early (issue 30; docs/kv_transfer.md).

In the router's two stages (``api.upstream``, ``api.http_stages``) the decode replica
recomputes the prompt's last partial block and samples the first token itself, so a client
would wait for the prefill stage, the transfer and that step before its first token. For a
streaming request the router instead sends the prefill replica's first token on as soon as
the prefill stage produces it, then the decode replica's stream with that token cut from
its front. Pure functions over the ``WireRequest`` and one small state object; the doors do
the I/O.

Exactness. Both replicas sample the first token from the same logits with the same
randomness (greedy: argmax; seeded: the sampler's draw is a function of the request's
seed and the token's position, ``engine.sampling.noise``), so the decode replica's first
token is the prefill replica's. For a sampled request without a seed the router chooses
one (``seeded_for_stages``: 63 random bits, as random as the replica's own stream) and sends it
to both stages; the client's request is otherwise unchanged. The prefill stage runs with
``max_tokens`` 2 (so its first response is an ordinary, non-final streamed response: the
same text, stop-string hold-back and fields a single replica sends for its first token)
and ``min_tokens`` min(the request's, 2) (end-of-sequence and stop strings are allowed at
the first token exactly when the request allows them); only that first response is sent
on, its second token is dropped with the stage. ``Splice`` then removes what was sent from
the decode stream: the text (character by character, across responses), the
``num_output_tokens`` counted and the ``logprobs`` entries. If the decode stream does not
begin with the text already sent (the replicas computed different logits: a near tie
under different floating-point order), ``FirstTokenMismatch`` ends the request with an
error naming it: the token the client has cannot be taken back.

Which requests: streaming ones with one completion (``n`` 1, no ``best_of`` > 1, no beam
search, whose candidates the prefill stage cannot rank), no ``prompt_logprobs`` (the
decode replica sends them with its first tokens) and ``max_tokens`` not 1 (the prefill
stage's first response would then be its last). The others run the two stages as before
(the first stage's token dropped; ``max_tokens`` 1, ``min_tokens`` 0).
"""

from __future__ import annotations

import dataclasses
import json
import random
from dataclasses import dataclass
from typing import Any, Optional

from pagoda.serving.wire import WireRequest


class FirstTokenMismatch(RuntimeError):
    """The decode replica's stream does not begin with the token already streamed."""


def is_early(wire: WireRequest) -> bool:
    """Whether the prefill stage's first token may be streamed early (module docstring)."""
    params = wire.params
    return (wire.output.stream and params.n == 1 and params.best_of in (None, 1) and not params.use_beam_search
            and params.prompt_logprobs is None and params.max_tokens != 1)


def seeded_for_stages(wire: WireRequest, early: bool) -> WireRequest:
    """The request with a seed both stages share when it streams early, samples and has none
    (63 random bits, as random as the replica's own stream); else the request unchanged."""
    params = wire.params
    if not early or params.seed is not None or params.is_greedy:
        return wire
    return wire.replace(params=params.clone(seed=random.getrandbits(63)))


def prefill_stage(wire: WireRequest, early: bool) -> WireRequest:
    """The first stage's request: this one on a prefill replica, keeping its KV for a decode
    replica to pull (``kv_transfer_params``), with the stage's ``max_tokens``/``min_tokens``."""
    min_tokens = min(wire.params.min_tokens, 2) if early else 0
    params = wire.params.clone(max_tokens=2 if early else 1, min_tokens=min_tokens)
    return wire.replace(params=params, options=wire.options.replace(kv_transfer_params={"do_remote_decode": True}),
                        output=dataclasses.replace(wire.output, stream=early))


def _first(value: Any) -> Any:
    """A response's one-completion value (the HTTP door may give a one-element list)."""
    return value[0] if isinstance(value, list) and len(value) == 1 else value


@dataclass
class Splice:
    """What the client already has of the decode stream's front (the prefill stage's first
    response), to be cut from it: ``text`` left to cut, and the ``num_tokens`` and
    ``num_logprobs`` entries (None where the response did not carry them)."""

    text: str
    num_tokens: Optional[int] = None
    num_logprobs: Optional[int] = None

    @classmethod
    def of(cls, text: Any, num_output_tokens: Any = None, logprobs: Any = None) -> "Splice":
        """From the early response's ``text_output``, ``num_output_tokens`` and ``logprobs`` values."""
        entries = _entries(_first(logprobs))
        count = _first(num_output_tokens)
        return cls(str(_first(text) or ""), int(count) if count is not None else None,
                   len(entries) if entries is not None else None)

    @property
    def is_done(self) -> bool:
        return not self.text and not self.num_tokens and not self.num_logprobs

    def cut_text(self, text: str) -> str:
        """``text`` (the decode stream's next piece) without what was already sent.

        Raises:
            FirstTokenMismatch: the stream does not continue the text already sent.
        """
        if not self.text:
            return text
        if text.startswith(self.text):
            text, self.text = text[len(self.text):], ""
            return text
        if self.text.startswith(text):
            self.text = self.text[len(text):]
            return ""
        raise FirstTokenMismatch(
            f"the decode replica's first token ({text!r}) differs from the one the prefill replica streamed "
            f"({self.text!r}): the two replicas computed different logits for it; retry the request")

    def cut_count(self, count: int) -> int:
        """``num_output_tokens`` of the next decode response, less the tokens already counted."""
        taken = min(count, self.num_tokens or 0)
        if self.num_tokens:
            self.num_tokens -= taken
        return count - taken

    def cut_logprobs(self, text: str) -> str:
        """The next decode response's ``logprobs`` JSON without the entries already sent."""
        entries = _entries(text)
        if entries is None or not self.num_logprobs:
            return text
        taken = min(len(entries), self.num_logprobs)
        self.num_logprobs -= taken
        return json.dumps(entries[taken:])

    def cut(self, outputs: dict[str, Any]) -> dict[str, Any]:
        """A response's outputs (name -> one-completion value, as ``_first`` reads them) with
        the front cut; only ``text_output``, ``num_output_tokens`` and ``logprobs`` change."""
        out = dict(outputs)
        if "text_output" in out:
            out["text_output"] = _like(out["text_output"], self.cut_text(str(_first(out["text_output"]) or "")))
        if out.get("num_output_tokens") is not None:
            out["num_output_tokens"] = _like(out["num_output_tokens"],
                                             self.cut_count(int(_first(out["num_output_tokens"]))))
        if isinstance(_first(out.get("logprobs")), str):
            out["logprobs"] = _like(out["logprobs"], self.cut_logprobs(_first(out["logprobs"])))
        return out


def _like(original: Any, value: Any) -> Any:
    """``value`` in ``original``'s shape (a one-element list stays one)."""
    return [value] if isinstance(original, list) else value


def _entries(text: Any) -> Optional[list]:
    """A ``logprobs`` JSON text's per-token entries (None: absent or ``null``)."""
    if not isinstance(text, str):
        return None
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, list) else None
