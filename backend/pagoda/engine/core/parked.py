"""Requests the engine accepted that wait outside the scheduler: one registry.

A request can be accepted by ``EngineCore.add_requests`` and yet not be in the
scheduler's ``requests`` for a while:

- a guided request waits for its grammar to compile (``pagoda.engine.guided``), all of its
  children together, under the user request's id (its *group*);
- with ``n > 1`` and prefix caching, children ``1..n-1`` are held until child 0's prompt
  is computed (``parallel_sampling.SiblingGate``).

(A request waiting for a LoRA slot is in the scheduler's waiting queue, which
``Scheduler.requests`` covers.) ``ParkedRequests`` owns both kinds, so that every
question about "the live requests" reads one place: admission control counts them
(``queued``), an abort drops them (``drop``), and unloading a LoRA adapter is refused
while any of them uses it (``uses_adapter``), as it is for a scheduled request.

Invariants: a request is either parked here or in the scheduler, never both; ``drop``
forgets every parked request whose id it is given (and a group with any of them).
"""

from __future__ import annotations

from typing import Iterable, Iterator, Optional

from pagoda.engine.request_groups.parallel_sampling import SiblingGate
from pagoda.engine.request import Request


class ParkedRequests:
    """Args:
    hold_siblings: hold ``n > 1`` siblings for child 0's prompt (prefix caching on).
    """

    def __init__(self, hold_siblings: bool) -> None:
        self._grammar: dict[str, list[Request]] = {}  # group (user request) id -> its children
        self._siblings = SiblingGate(hold_siblings)

    # ---- waiting for a grammar ----------------------------------------------------------
    def await_grammar(self, group_id: str, children: list[Request]) -> None:
        self._grammar[group_id] = list(children)

    def take_grammar(self, group_id: str) -> list[Request]:
        """The group's children (its grammar is ready or failed); ``[]`` if it was dropped."""
        return self._grammar.pop(group_id, [])

    @property
    def num_awaiting_grammar(self) -> int:
        return sum(len(children) for children in self._grammar.values())

    # ---- n > 1 siblings -----------------------------------------------------------------
    def hold_siblings(self, children: list[Request]) -> list[Request]:
        """Hold ``children[1:]`` behind ``children[0]``; returns the siblings to schedule now."""
        return self._siblings.hold(children)

    def release_siblings(self) -> list[Request]:
        """The held siblings whose child 0 has a computed prompt (or finished)."""
        return self._siblings.release()

    @property
    def num_held(self) -> int:
        return self._siblings.num_held

    # ---- what every check reads ---------------------------------------------------------
    def drop(self, request_ids: Iterable[str]) -> list[str]:
        """Forget these requests (abort, stop); returns the grammar groups dropped with them."""
        dropped = set(request_ids)
        self._siblings.drop(dropped)
        groups = [g for g, children in self._grammar.items() if any(c.request_id in dropped for c in children)]
        for group_id in groups:
            del self._grammar[group_id]
        return groups

    def queued(self) -> Iterator[Request]:
        """Every parked request (held siblings, then requests waiting for a grammar)."""
        yield from self._siblings.queued()
        for children in self._grammar.values():
            yield from children

    def uses_adapter(self, adapter_id: Optional[str]) -> bool:
        return any(r.adapter_id == adapter_id for r in self.queued())

    def __bool__(self) -> bool:
        return bool(self._siblings) or bool(self._grammar)
