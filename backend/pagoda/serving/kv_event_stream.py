"""KV events on a ZMQ socket in vLLM's format: what llm-d, Dynamo and AIBrix subscribe to.

Configured exactly as vLLM's ``--kv-events-config`` (the same JSON keys and defaults, from
vLLM 0.32.0's ``KVEventsConfig``): ``pagoda serve --kv-events-config '{...}'``, the
``kv_events_config`` parameter in ``config.pbtxt``, or the ``PAGODA_KV_EVENTS_CONFIG``
environment variable (the chart's way); the parameter wins over the variable. Events are
published only when ``enable_kv_cache_events`` is true and ``publisher`` is ``"zmq"``.

The wire (as vLLM 0.32.0's ``ZmqEventPublisher``):

- PUB socket at ``endpoint``: bound when it holds ``*`` or ``::`` or is ``ipc://`` /
  ``inproc://``, else connected. Each engine step that changed the prefix cache is one
  message of three frames: ``topic`` (utf-8), the batch's sequence number (8 bytes,
  big-endian; 0, 1, 2, ... per replica process) and the msgpack ``KVEventBatch``
  (``contracts.vllm_kv_events``). Steps without cache changes send nothing.
- ROUTER replay socket at ``replay_endpoint`` (optional): a request ``[start_seq]`` (8
  bytes, big-endian) is answered with ``[topic, seq, payload]`` for every retained batch
  with ``seq >= start_seq`` (the last ``buffer_steps``), then ``[b"", -1 (8 bytes,
  signed), b""]``.

Invariants: the engine loop never blocks on ZMQ (``publish`` only enqueues; past
``max_queue_size`` the batch is dropped and counted in ``num_dropped``, and the sequence
numbers still tell subscribers nothing was lost on the wire — a drop is logged); one
thread owns both sockets (ZMQ sockets are not thread-safe). pagoda's own events reach
the publisher in order (``contracts.kv_events``); a gap in their sequence numbers
(the engine's bounded buffer overflowed) is logged, since the batch stream cannot carry it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import queue
import threading
import time
from collections import deque
from typing import Any, Mapping, Optional, Sequence

from pagoda.contracts.kv_events import KVEvent
from pagoda.engine.stats import EngineStats
from pagoda.serving.observers import StepObserver

logger = logging.getLogger(__name__)

ENV_VAR = "PAGODA_KV_EVENTS_CONFIG"
PARAMETER = "kv_events_config"


@dataclasses.dataclass(frozen=True)
class KVEventsConfig:
    """vLLM 0.32.0's ``KVEventsConfig``: same keys, same defaults."""

    enable_kv_cache_events: bool = False
    publisher: Optional[str] = None  # "zmq" or "null"; None: "zmq" when enabled
    endpoint: str = "tcp://*:5557"
    replay_endpoint: Optional[str] = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @property
    def is_active(self) -> bool:
        return self.enable_kv_cache_events and (self.publisher or "zmq") == "zmq"

    @classmethod
    def from_json(cls, text: str, source: str = "kv_events_config") -> "KVEventsConfig":
        """Parse vLLM's JSON form. Raises ``ValueError`` naming ``source`` and the bad key or value."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"{source}: not JSON ({error})") from None
        if not isinstance(raw, dict):
            raise ValueError(f"{source}: must be a JSON object, got {type(raw).__name__}")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - set(fields))
        if unknown:
            raise ValueError(f"{source}: unknown key(s) {', '.join(unknown)}; known: {', '.join(fields)}")
        for name, value in raw.items():
            _check_type(source, name, value, fields[name].default)
        config = cls(**raw)
        if config.publisher not in (None, "zmq", "null"):
            raise ValueError(f"{source}: publisher must be 'zmq' or 'null', got {config.publisher!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            if getattr(config, name) < 1:
                raise ValueError(f"{source}: {name} must be >= 1, got {getattr(config, name)}")
        return config


def _check_type(source: str, name: str, value: Any, default: Any) -> None:
    if name in ("publisher", "replay_endpoint"):
        ok = value is None or isinstance(value, str)
    elif isinstance(default, bool):
        ok = isinstance(value, bool)
    elif isinstance(default, int):
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, str)
    if not ok:
        raise ValueError(f"{source}: {name} has the wrong type ({type(value).__name__}: {value!r})")


def kv_events_config(parameters: Mapping[str, Any],
                     environ: Mapping[str, str] = os.environ) -> Optional[KVEventsConfig]:
    """The active configuration from ``config.pbtxt`` parameters or the environment, else None."""
    value = parameters.get(PARAMETER, "")
    text = value.get("string_value", "") if isinstance(value, Mapping) else str(value)
    source = f"config.pbtxt parameter {PARAMETER}"
    if not text.strip():
        text, source = environ.get(ENV_VAR, ""), ENV_VAR
    if not text.strip():
        return None
    config = KVEventsConfig.from_json(text, source)
    return config if config.is_active else None


class ZmqEventPublisher:
    """PUB + ROUTER replay on one thread, fed through a bounded queue (see the module doc)."""

    POLL_S = 0.05

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0) -> None:
        import zmq  # pyzmq: a `serve` dependency, imported only when events are on

        self.config = config
        self.data_parallel_rank = data_parallel_rank
        self.num_dropped = 0
        self._queue: queue.Queue = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode("utf-8")
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._replay = None
        try:
            if _is_bind_endpoint(config.endpoint):
                self._pub.bind(config.endpoint)
            else:
                self._pub.connect(config.endpoint)
            if config.replay_endpoint:
                self._replay = self._context.socket(zmq.ROUTER)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as error:
            self._close_sockets()
            raise ValueError(f"kv events: cannot open {config.endpoint} / {config.replay_endpoint}: {error}") from None
        self._thread = threading.Thread(target=self._run, name="pagoda-kv-events-zmq", daemon=True)
        self._stopping = threading.Event()

    def start(self) -> "ZmqEventPublisher":
        self._thread.start()
        return self

    def publish(self, events: Sequence[KVEvent], ts: Optional[float] = None) -> None:
        """Enqueue one step's events as a batch (never blocks; see the module doc)."""
        if not events:
            return
        try:
            self._queue.put_nowait((time.time() if ts is None else ts, list(events)))
        except queue.Full:
            self.num_dropped += 1
            logger.warning("kv events: queue full (%d batches), one batch dropped (%d so far)",
                           self.config.max_queue_size, self.num_dropped)

    def stop(self, timeout_s: float = 2.0) -> None:
        """Send what is queued (within ``timeout_s``), then close the sockets."""
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._context.term()

    def _run(self) -> None:
        from pagoda.contracts import vllm_kv_events as wire

        seq = 0
        while not (self._stopping.is_set() and self._queue.empty()):
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                ts, events = self._queue.get(timeout=self.POLL_S)
            except queue.Empty:
                continue
            payload = wire.encode_batch(wire.make_batch(events, ts, self.data_parallel_rank))
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            self._buffer.append((seq, payload))
            seq += 1

    def _serve_replay(self) -> None:
        from pagoda.contracts.vllm_kv_events import END_SEQ

        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("kv events: malformed replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))


def _is_bind_endpoint(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventsObserver(StepObserver):
    """Feeds each step's block events to a ``ZmqEventPublisher`` (started and stopped with the loop)."""

    def __init__(self, publisher: ZmqEventPublisher) -> None:
        self.publisher = publisher
        self._next_seq: Optional[int] = None

    def on_start(self) -> None:
        self.publisher.start()

    def on_step(self, stats: EngineStats, block_events: Sequence[KVEvent]) -> None:
        self.on_block_events(block_events)

    def on_block_events(self, block_events: Sequence[KVEvent]) -> None:
        if not block_events:
            return
        if self._next_seq is not None and block_events[0].seq != self._next_seq:
            logger.warning("kv events: the engine dropped events %d..%d (its buffer overflowed); "
                           "subscribers' block sets may be stale", self._next_seq, block_events[0].seq - 1)
        self._next_seq = block_events[-1].seq + 1
        self.publisher.publish(block_events)

    def on_stop(self) -> None:
        self.publisher.stop()
