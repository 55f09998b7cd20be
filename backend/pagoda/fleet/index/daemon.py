"""One background thread per fleet component, started and stopped the same way.

The publisher, the index follower and the affinity share each run a loop on a daemon
thread: ``start()`` launches ``_run`` (once; a second ``start`` is a bug), ``_run``
loops while ``_stop`` is unset and sleeps with ``_stop.wait(seconds)`` so that
``stop()`` ends it at once, and ``stop()`` sets the event and joins the thread.
"""

from __future__ import annotations

import threading
from typing import Optional


class DaemonThread:
    """Base class: subclasses call ``super().__init__(thread_name)`` and implement ``_run``."""

    def __init__(self, thread_name: str) -> None:
        self._thread_name = thread_name
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> None:
        """Run ``_run`` on a daemon thread until ``stop()``."""
        assert self._thread is None, f"{type(self).__name__} already started"
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name=self._thread_name, daemon=True)
        self._thread.start()

    def stop(self, timeout: Optional[float] = 5.0) -> None:
        """Ask the loop to end and join it (up to ``timeout`` seconds)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def _run(self) -> None:
        raise NotImplementedError
