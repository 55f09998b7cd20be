"""LoRAConstraint: the scheduler's rule that a step never needs more adapters than slots.

Pure Python (no torch): the scheduler imports it, and the engine core imports no torch.
The device side of the same promise is ``manager.py`` (``LoRAManager.prepare`` always
finds a slot because of this rule).
"""

from __future__ import annotations

from typing import Optional


class LoRAConstraint:
    """Scheduler-side rule: the running set never needs more than ``max_loras`` adapters.

    When a waiting request's adapter cannot get a slot, the scheduler skips it (as vLLM
    does) so requests of resident adapters and of the base model behind it still run. So
    that the skipped request is not starved by a steady stream for the resident adapters,
    one of them is *drained*: ``to_drain`` names the active adapter with the fewest running
    requests, and no new request of it is admitted while an adapter waits for a slot. Its
    count only falls, so a slot frees, and the skipped request (back at the queue's front)
    takes it.
    """

    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras

    def can_admit(self, adapter_id: Optional[str], running) -> bool:
        if adapter_id is None:
            return True
        active = {r.adapter_id for r in running if r.adapter_id is not None}
        return adapter_id in active or len(active) < self.max_loras

    @staticmethod
    def to_drain(running) -> Optional[str]:
        """The active adapter with the fewest running requests (ties: by name); None if none."""
        counts: dict[str, int] = {}
        for r in running:
            if r.adapter_id is not None:
                counts[r.adapter_id] = counts.get(r.adapter_id, 0) + 1
        return min(counts, key=lambda name: (counts[name], name)) if counts else None
