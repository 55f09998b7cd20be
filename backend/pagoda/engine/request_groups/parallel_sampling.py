"""Parallel sampling (``SamplingParams.n > 1``): one user request, ``n`` children.

Fan-out (this module, used by ``EngineCore``):

- a user request ``id`` with ``n > 1`` runs as ``n`` scheduler requests ``"{id}#{i}"``
  (``child_request_ids``; with ``n == 1`` it runs under its own id). Child ``i`` samples
  with seed ``make_seed(params.seed, i)`` (``EngineCore.make_requests``), so seeded
  children differ from each other and reproduce;
- the children are added together. With prefix caching, ``SiblingGate`` holds children
  ``1..n-1`` back until child 0's prompt is computed (its first token applied, or it
  finished): they then hit every full prompt block child 0 wrote instead of computing the
  prompt ``n`` times in one step. Held siblings count as queued (admission control bounds
  them) and as unfinished work; an abort drops them.

Fan-in (``OutputProcessor``, ``pagoda.engine.output_processor``): the children form one
*group* reported under the user's request id, with one completion per child in index
order; the group is finished when every child is, and aborting the user request aborts
every live child. It lives with the detokenizers it drives, above ``engine.core``.
"""

from __future__ import annotations

from typing import Iterable, Iterator

from pagoda.engine.request import Request


def child_request_ids(request_id: str, n: int) -> list[str]:
    """The scheduler request ids of a user request: itself for ``n == 1``, else ``"{id}#{i}"``."""
    return [request_id] if n == 1 else [f"{request_id}#{i}" for i in range(n)]


class SiblingGate:
    """Holds a user request's children ``1..n-1`` until child 0's prompt is computed.

    Args:
        enabled: hold siblings (prefix caching on); without it nothing is held.
    """

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._held: dict[str, tuple[Request, list[Request]]] = {}  # child 0's id -> (child 0, held siblings)

    def hold(self, children: list[Request]) -> list[Request]:
        """Hold ``children[1:]`` behind ``children[0]`` (which the caller schedules); returns
        the siblings to schedule now (all of them when disabled, else none)."""
        if not self.enabled or len(children) == 1:
            return list(children[1:])
        self._held[children[0].request_id] = (children[0], list(children[1:]))
        return []

    def release(self) -> list[Request]:
        """Take the held siblings whose child 0 has a computed prompt (or finished)."""
        released = []
        for first_id, (first, siblings) in list(self._held.items()):
            if first.num_output_tokens > 0 or first.is_finished:
                del self._held[first_id]
                released += siblings
        return released

    def drop(self, request_ids: Iterable[str]) -> None:
        """Forget ended requests: a child 0 with its held siblings, or single siblings."""
        dropped = set(request_ids)
        for first_id in [i for i in self._held if i in dropped]:
            del self._held[first_id]
        for _, siblings in self._held.values():
            siblings[:] = [r for r in siblings if r.request_id not in dropped]

    def queued(self) -> Iterator[Request]:
        """Every held sibling."""
        for _, siblings in self._held.values():
            yield from siblings

    @property
    def num_held(self) -> int:
        return sum(len(siblings) for _, siblings in self._held.values())

    def __bool__(self) -> bool:
        return bool(self._held)
