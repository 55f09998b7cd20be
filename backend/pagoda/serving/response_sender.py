"""The thread that sends responses: ``ResponseSender``.

The engine loop (``serving.engine_loop``) puts each response here and goes on stepping;
this thread calls the adapter's ``deliver(handle, response)``, so a slow client socket
never stalls the engine.

Invariants:
- responses are delivered in the order they were put;
- a failed non-final delivery (the client is gone) is reported to
  ``on_failure(request_id)``, which the loop turns into an abort;
- ``stop()`` delivers what is queued, then ends the thread and joins it.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Callable, Optional, Union

from pagoda.serving.commands import ServingRequest
from pagoda.serving.responses import Response

logger = logging.getLogger(__name__)

_STOP = object()


class ResponseSender:
    """Delivers responses in order from its own thread.

    Args:
        deliver: ``deliver(handle, response)`` sends one response; raising means the
            client is gone.
        on_failure: called with the request id when a non-final delivery fails, so the
            engine can abort that request.
    """

    def __init__(self, deliver: Callable[[object, Response], None],
                 on_failure: Callable[[str], None] = lambda request_id: None) -> None:
        self._deliver = deliver
        self._on_failure = on_failure
        self._queue: "queue.Queue[Union[tuple[ServingRequest, Response], object]]" = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="pagoda-response-sender", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def put(self, request: ServingRequest, response: Response) -> None:
        self._queue.put((request, response))

    def stop(self, timeout: Optional[float] = 30.0) -> None:
        """Send what is queued, then end the thread and join it."""
        self._queue.put(_STOP)
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            request, response = item
            try:
                self._deliver(request.handle, response)
            except Exception as exc:  # noqa: BLE001 - any failure means the client is unreachable
                logger.info("response to %s not delivered: %s", request.request_id, exc)
                if not response.is_final:
                    self._on_failure(request.request_id)
