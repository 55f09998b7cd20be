"""What the scheduler reports: its queues' sizes, the KV cache's use and prefix-cache counts,
preemption counts, KV events, and the cache reset (``SchedulerViews``, a mixin of
``core.sched.scheduler.Scheduler``).

Nothing here schedules: every member reads the state the scheduler keeps (``requests``,
``waiting``, ``running``, ``block_pool``, ``kv_cache_manager``, ``host_tier``, ``preemption``,
``event_buffer``), except ``reset_prefix_cache``, which forgets cached blocks in both tiers when
no request holds any. No torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from pagoda.contracts.kv_events import KVEvent

if TYPE_CHECKING:
    from pagoda.engine.request import Request


class SchedulerViews:
    """Read-only views of a ``Scheduler``'s state (and its prefix-cache reset)."""

    requests: dict[str, "Request"]
    waiting: Any
    running: Any
    block_pool: Any
    kv_cache_manager: Any
    host_tier: Any
    preemption: Any
    event_buffer: Any

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_request(self, request_id: str) -> Optional[Request]:
        """The live request with this id, or None (unknown or finished)."""
        return self.requests.get(request_id)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def kv_cache_usage(self) -> float:
        """The fraction of usable KV blocks in use, in [0, 1]."""
        return self.block_pool.usage

    @property
    def prefix_cache_queries(self) -> int:
        """Prompt tokens looked up in the prefix cache so far."""
        return self.kv_cache_manager.prefix_cache_queries

    @property
    def prefix_cache_hits(self) -> int:
        """Of those, the tokens found cached."""
        return self.kv_cache_manager.prefix_cache_hits

    @property
    def num_preemptions_total(self) -> int:
        return self.preemption.num_preemptions_total

    @property
    def num_recomputed_preemptions(self) -> int:
        """Preemptions that reset ``num_computed_tokens`` (the rest swapped out)."""
        return self.preemption.num_recomputed_preemptions

    def take_events(self) -> list[KVEvent]:
        return self.event_buffer.take()

    def reset_prefix_cache(self) -> bool:
        """Forget cached blocks (both tiers); False (no change) while any request holds blocks."""
        if not self.kv_cache_manager.reset_prefix_cache():
            return False
        self.host_tier.reset_prefix_cache()
        return True

    def is_swapped_out(self, request_id: str) -> bool:
        """Whether a preempted request waits with its KV in host blocks."""
        return self.host_tier.is_swapped_out(request_id)
