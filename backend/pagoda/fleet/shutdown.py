"""Bounded shutdown phases for the router: a phase that overruns its bound is logged and
left behind, so stopping a router never hangs on one stuck piece (a channel, a door)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

logger = logging.getLogger(__name__)

STOP_PHASE_S = 5.0  # the bound of a stop phase other than the doors' drain


async def bounded(what: str, awaitable: Any, timeout_s: float = STOP_PHASE_S) -> None:
    """Await ``awaitable`` for at most ``timeout_s``; past it, log ``what`` and return."""
    try:
        await asyncio.wait_for(awaitable, timeout_s)
    except asyncio.TimeoutError:
        logger.warning("router stop: %s took longer than %.0f s; stopping anyway", what, timeout_s)
