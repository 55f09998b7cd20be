"""Status conditions (the Kubernetes `metav1.Condition` shape), updated without churn."""

from __future__ import annotations

import datetime as dt
from typing import Any


def now_iso(now: float) -> str:
    return dt.datetime.fromtimestamp(now, dt.timezone.utc).isoformat(timespec="seconds") \
        .replace("+00:00", "Z")


def set_condition(conditions: list[dict[str, Any]] | None, *, type_: str, status: str,
                  reason: str, message: str, generation: int, now: float) -> list[dict[str, Any]]:
    """Return `conditions` with `type_` set; lastTransitionTime moves only on a status flip.

    The whole list is returned because a merge-patch replaces lists wholesale.
    """
    result = [dict(c) for c in (conditions or []) if c.get("type") != type_]
    previous = next((c for c in (conditions or []) if c.get("type") == type_), None)
    changed = previous is None or previous.get("status") != status
    result.append({
        "type": type_,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": now_iso(now) if changed else previous["lastTransitionTime"],
        "observedGeneration": generation,
    })
    return sorted(result, key=lambda c: c["type"])
