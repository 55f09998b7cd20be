"""The faults ``pagoda bench soak`` injects into its fleet while the traffic runs.

- ``timeline`` (on unless ``--no-faults``; not in ``--hostile``, whose phases have their own
  Redis losses): Redis killed with SIGKILL and restarted empty at 25% of the duration, replica
  r1 killed with SIGKILL at 45% and started again. A fault is never skipped: when the traffic
  ends early (``--max-requests``), the rest are injected at once, before the invariants.
- ``periodic_kills`` (``--kill-replica-every S``, any mode): every S seconds a replica is
  killed with SIGKILL, r0 then r1 in turn, and started again before the next kill, so one
  replica is always serving; the timeline's own replica kill is then left out. The router
  migrates what was running on it (docs/reliability.md), so no client request may fail: each
  ``failed:*`` outcome is a violation (``check_nothing_failed``).
"""

from __future__ import annotations

import threading
import time
from typing import Any

REPLICA_ORDER = ("r0", "r1")


def timeline(fleet: Any, config: Any, start: float, report: Any, stop: threading.Event) -> None:
    """Redis at 25%, replica r1 at 45% (module docstring); the replica only without periodic kills."""
    def at(fraction: float) -> bool:
        stop.wait(max(0.0, start + fraction * config.duration_s - time.monotonic()))
        return True

    if at(0.25):
        fleet.redis.stop()
        time.sleep(1.0)
        fleet.redis.start()
        report.faults.append("Redis killed (SIGKILL) and restarted after 1 s")
    if not config.kill_every_s and at(0.45):
        _kill_and_restart(fleet, "r1", report)


def periodic_kills(fleet: Any, config: Any, start: float, report: Any, stop: threading.Event) -> None:
    """A replica killed every ``config.kill_every_s`` seconds, in turn, each restarted before the next."""
    count = 0
    while not stop.wait(max(0.0, start + (count + 1) * config.kill_every_s - time.monotonic())):
        _kill_and_restart(fleet, REPLICA_ORDER[count % len(REPLICA_ORDER)], report, time.monotonic() - start)
        count += 1


def _kill_and_restart(fleet: Any, rid: str, report: Any, at_s: float = -1.0) -> None:
    fleet.kill_replica(rid)
    report.faults.append(f"replica {rid} killed (SIGKILL)" + (f" at {at_s:.0f} s" if at_s >= 0 else ""))
    began = time.monotonic()
    fleet.start_replica(rid)
    report.faults.append(f"replica {rid} restarted (ready after {time.monotonic() - began:.0f} s)")


def check_nothing_failed(config: Any, report: Any) -> None:
    """With periodic kills the router migrates every request a dead replica held: a client
    request that failed anyway is a violation."""
    failed = {k: v for k, v in report.outcomes.items() if k.startswith("failed")}
    if config.kill_every_s and failed:
        report.violations.append(f"requests failed although the router migrates them: {failed}")
