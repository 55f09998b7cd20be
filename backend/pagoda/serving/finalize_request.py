"""The launcher asks the model to finalize itself, through a file, before tritonserver exits.

``pagoda serve`` runs tritonserver 2.51 with ``--model-control-mode=none``, so that any client
may read the model repository index while nobody may load or unload a model (see
``serving.launch.launcher``). Without an unload call, tritonserver unloads its models (and so
runs their ``finalize``) only at its own exit, and only within ``--exit-timeout-secs`` *after*
it waited for open HTTP connections: one idle keep-alive connection from any client uses up
the whole timeout, and tritonserver then exits ("Exit timeout expired") without finalizing.

So, after the drain (``engine_loop``), the launcher creates ``<drain file>.finalize``, if the
model announced at start that it watches for it (``<drain file>.finalize-watched``: a model
repository whose model.py predates this protocol costs no wait);
``FinalizeWatch``, a thread of the model, sees it (polling), calls the model's ``finalize``
(engine, response sender and fleet publisher stopped: the replica's Redis goodbye; threads
joined) and then creates ``<drain file>.finalized``, which the launcher waits for before it
signals tritonserver. The model's ``finalize`` must be idempotent: tritonserver calls it
again when it unloads the model at exit.
"""

from __future__ import annotations

import logging
import os
from typing import Callable

from pagoda.serving.process_tree import PollingWatch

logger = logging.getLogger(__name__)

WATCHED_SUFFIX = ".finalize-watched"  # created by the model at start
REQUEST_SUFFIX = ".finalize"  # created by the launcher
DONE_SUFFIX = ".finalized"  # created by the model once its finalize returned


class FinalizeWatch(PollingWatch):
    """Calls ``finalize`` once, on its own thread, when ``<drain_path>.finalize`` appears, then
    creates ``<drain_path>.finalized`` (also when ``finalize`` raised: the launcher stops waiting).
    ``start`` creates ``<drain_path>.finalize-watched``.

    Args:
        drain_path: the drain file's path (``PAGODA_DRAIN_FILE``).
        finalize: the model's finalize; it may call ``stop()`` of this watch.
        interval_s: polling period.
    """

    def __init__(self, drain_path: str, finalize: Callable[[], None], interval_s: float = 0.05) -> None:
        self.watched_path = drain_path + WATCHED_SUFFIX
        self.request_path = drain_path + REQUEST_SUFFIX
        self.done_path = drain_path + DONE_SUFFIX
        self._finalize = finalize
        super().__init__(lambda: os.path.exists(self.request_path), self._finalize_and_mark,
                         "pagoda-finalize-watch", interval_s)

    def start(self) -> "FinalizeWatch":
        super().start()
        try:
            open(self.watched_path, "w").close()
        except OSError:  # the launcher then lets tritonserver's exit finalize
            logger.exception("cannot announce the finalize watch")
        return self

    def _finalize_and_mark(self) -> None:
        logger.info("the launcher asked for finalize")
        try:
            self._finalize()
        except Exception:  # noqa: BLE001 - the launcher must still hear that it is over
            logger.exception("finalize failed")
        try:
            open(self.done_path, "w").close()
        except OSError:
            logger.exception("cannot mark the finalize done")
