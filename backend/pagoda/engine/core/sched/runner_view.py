"""``RunnerView``: what the runner already holds per request, as the scheduler tracks it.

The step plan is a delta (``engine.scheduler_output``): the runner keeps a per-request
state (``engine.runner.request_states``) and each ``ScheduledRequest`` carries only what
that state lacks. This module decides what that is; ``Scheduler._make_scheduled`` asks it
once per scheduled request, in schedule order.

1. **New.** A request the runner has not seen since its last (re)admission is new
   (``ScheduledRequest.is_new``): its first schedule, and its first after a preemption
   (recompute or swap: the runner drops it on ``preempted_request_ids``) or after
   ``Scheduler.undo_step`` (a failed step: the runner may or may not have applied it).
   ``forget`` is called at each of those, and when a request is freed.
2. **Blocks.** ``new_block_ids`` are, per KV cache group, the blocks appended to the
   request's table since the runner last saw it; the whole table when new. A running
   request's table only grows (``KVCacheManager`` frees a table only whole, at preemption
   or finish, both of which forget the request here; a sliding window's freed entries
   keep their place), so a count of the ids already sent per group is enough.
3. **Tokens.** The runner holds a request's last token once a sampling step was scheduled
   for it since its (re)admission: that step's sample is the token (a placeholder while
   the step is unapplied, the appended token after; a request that stops there is freed,
   accepted drafts end with the sampled bonus token). A step that starts at that token (a
   decode, with or without drafts) then leaves it out: ``token_ids`` is one short and the
   runner puts the token it sampled first. A beam's next token is chosen on the host
   (``request_groups.beam_search``), not sampled, so it always travels. Every other token travels: prompt chunks,
   recomputed outputs after a preemption, a decode of a new request, and drafts.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagoda.engine.request import Request


@dataclass
class _Seen:
    num_block_ids: tuple[int, ...] = ()  # per group, the first ids of the request's table the runner has
    holds_last_token: bool = False  # a sampling step was scheduled since (re)admission


class RunnerView:
    def __init__(self) -> None:
        self._seen: dict[str, _Seen] = {}

    def plan(self, request: Request, start: int, tables: tuple[list[int], ...], is_sampling: bool,
             ) -> tuple[bool, tuple[list[int], ...], int]:
        """One scheduled step of ``request``, starting at position ``start``; ``tables``: its
        block table per KV cache group.

        Returns:
            ``(is_new, new_block_ids, num_runner_tokens)``: per group the ids the runner lacks;
            the last is 1 when the step's first token is the one the runner sampled for it
            (leave it out), else 0.
        """
        seen = self._seen.get(request.request_id)
        is_new = seen is None
        if seen is None:
            seen = self._seen[request.request_id] = _Seen((0,) * len(tables))
        assert all(len(t) >= n for t, n in zip(tables, seen.num_block_ids)), "a running request's block table shrank"
        new_block_ids = tuple(t[n:] for t, n in zip(tables, seen.num_block_ids))
        seen.num_block_ids = tuple(len(t) for t in tables)
        last = request.num_tokens + request.num_output_placeholders - 1
        assert seen.holds_last_token or not request.num_output_placeholders, "a placeholder the runner lacks"
        num_runner_tokens = 1 if seen.holds_last_token and start == last and request.beam_group is None else 0
        if is_sampling:
            seen.holds_last_token = True
        return is_new, new_block_ids, num_runner_tokens

    def forget(self, request_id: str) -> None:
        """The runner drops (or may have lost) the request: its next schedule is new."""
        self._seen.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._seen
