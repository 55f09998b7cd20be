"""LoRA control requests on a replica: ``lora_action`` load | unload | list (docs/lora.md).

They share the engine loop (``serving.engine_loop``), which owns the only thread that may
touch the engine: ``unload`` and ``list`` are commands run on the loop thread between
steps (a ``LoRACommand``); ``load`` reads and fuses the adapter on this module's loader
thread (``LLMEngine.load_lora``: file I/O that must not stall the steps), then a
``RegisterLoRA`` command makes it servable on the loop thread, so the next step may use
it (the commands: ``serving.commands``).
``load``/``unload`` are refused unless the replica allows runtime updates
(``pagoda serve --allow-runtime-lora``); ``list`` always answers. Each request gets one
final response: a JSON document (``responses.make_control_response``) or an error naming
the problem.

Memory: an adapter's fused host tensors are freed at ``unload``, but glibc keeps freed heap
pages in its arenas; under load/unload churn beside traffic the replica's RSS grew ~0.3 MB
per cycle (5% in 260 cycles of ``pagoda bench soak --hostile-actions lora_churn``), all of
it returned by ``malloc_trim``. So after each unload the loader thread calls
``serving.heap.release_free_heap``, off the engine thread (3.5% in the same soak).
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Callable

from pagoda.contracts.errors import SHUTDOWN_MESSAGE
from pagoda.engine.client import EngineClient
from pagoda.serving.heap import release_free_heap
from pagoda.serving.commands import Command, LoRACommand, RegisterLoRA, ServingRequest
from pagoda.serving.response_sender import ResponseSender
from pagoda.serving.dialects.pagoda import LoRAControl
from pagoda.serving.responses import make_control_response, make_error_response

if TYPE_CHECKING:
    from pagoda.models.lora import LoRAAdapter

logger = logging.getLogger(__name__)


class LoRAController:
    """Answers a replica's LoRA control requests.

    Args:
        engine: the engine (touched only from ``register``/``command``, which the loop
            thread calls, and ``load_lora``, which is thread-safe).
        sender: the loop's ``ResponseSender``.
        enqueue: queues a command for the loop thread (``RegisterLoRA``, ``LoRACommand``).
        is_stopping: whether the loop is stopping (new work gets the shutdown error).
        allow_runtime_lora: accept ``load``/``unload``.
    """

    def __init__(self, engine: EngineClient, sender: ResponseSender, enqueue: Callable[[Command], None],
                 is_stopping: Callable[[], bool], allow_runtime_lora: bool = False) -> None:
        self._engine = engine
        self._sender = sender
        self._enqueue = enqueue
        self._is_stopping = is_stopping
        self.allow_runtime_lora = allow_runtime_lora
        # One adapter read at a time: bounded host memory, and loads answer in order.
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagoda-lora-loader")

    # ------------------------------------------------------------ any thread
    def submit(self, request: ServingRequest) -> None:
        """Take a control request (``request.control`` is a ``LoRAControl``); returns at once.

        Its one final response follows: a JSON document, or an error (runtime updates not
        allowed, LoRA off, bad folder, name taken, adapter unknown or in use: by a running or
        waiting request, also one waiting for its grammar or a held n > 1 sibling).
        """
        control: LoRAControl = request.control
        if self._is_stopping():
            self._sender.put(request, make_error_response(SHUTDOWN_MESSAGE, "UNAVAILABLE"))
        elif control.changes_adapters and not self.allow_runtime_lora:
            self._sender.put(request, make_error_response(
                f"lora_action {control.action!r}: runtime LoRA updating is not enabled on this replica; start it "
                "with `pagoda serve --allow-runtime-lora` (config.pbtxt parameter allow_runtime_lora \"true\")"))
        elif control.action == "load":
            self._loader.submit(self._load, request)
        else:
            self._enqueue(LoRACommand(request))

    def shutdown(self) -> None:
        """Join the loader; loads still queued answer the shutdown error."""
        self._loader.shutdown(wait=True)

    # ---------------------------------------------------- the loader thread
    def _load(self, request: ServingRequest) -> None:
        """Read and fuse the adapter here, then let the loop thread register it."""
        if self._is_stopping():
            self._sender.put(request, make_error_response(SHUTDOWN_MESSAGE, "UNAVAILABLE"))
            return
        control: LoRAControl = request.control
        try:
            adapter = self._engine.load_lora(control.lora_name, control.lora_path)
        except ValueError as exc:
            self._sender.put(request, make_error_response(str(exc)))
            return
        except Exception as exc:  # noqa: BLE001 - a broken file must not take the loader down
            logger.exception("loading LoRA adapter %r failed", control.lora_name)
            self._sender.put(request, make_error_response(f"loading LoRA adapter {control.lora_name!r} failed: "
                                                          f"{type(exc).__name__}: {exc}"))
            return
        self._enqueue(RegisterLoRA(request, adapter))

    # ------------------------------------------------------ the loop thread
    def register(self, request: ServingRequest, adapter: LoRAAdapter) -> None:
        """Make a loaded adapter servable and answer its load request."""
        try:
            self._engine.register_lora(adapter)
        except ValueError as exc:  # the name was taken meanwhile
            self._sender.put(request, make_error_response(str(exc)))
            return
        self._sender.put(request, make_control_response({
            "action": "load", "lora_name": adapter.name, "lora_path": adapter.path,
            "loaded": self._engine.list_loras()}))

    def command(self, request: ServingRequest) -> None:
        """Answer ``list``, or run ``unload``."""
        control: LoRAControl = request.control
        paths = self._engine.lora_paths()
        if control.action == "list":
            self._sender.put(request, make_control_response({
                "action": "list", "loaded": sorted(paths), "paths": paths,
                "allow_runtime_lora": self.allow_runtime_lora}))
            return
        try:
            self._engine.remove_lora(control.lora_name)
        except ValueError as exc:
            self._sender.put(request, make_error_response(str(exc)))
            return
        except Exception as exc:  # noqa: BLE001
            logger.exception("unloading LoRA adapter %r failed", control.lora_name)
            self._sender.put(request, make_error_response(f"engine error while unloading: {exc}", "INTERNAL"))
            return
        self._sender.put(request, make_control_response({
            "action": "unload", "lora_name": control.lora_name, "lora_path": paths.get(control.lora_name),
            "loaded": self._engine.list_loras()}))
        try:
            self._loader.submit(release_free_heap)  # the adapter's freed pages (module docstring)
        except RuntimeError:  # the loader was shut down (the replica stops)
            pass
