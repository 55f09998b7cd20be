"""A subscriber to one replica's vLLM-format KV events: its block set, rebuilt from the stream.

What llm-d's precise scorer or Dynamo's KV router does with a replica's stream, in the
small: ``KVEventSubscriber`` reads ``[topic, seq, payload]`` messages from the replica's
PUB socket (``serving.kv_event_stream``) and applies each batch to ``blocks`` (the set of
vLLM-form block hashes the replica holds). Sequence numbers are per batch; when one is
skipped (the subscriber joined late, or the PUB socket's high-water mark dropped
messages) it asks the replica's replay socket for every batch from the first missing one
and applies those it has not applied yet, so ``blocks`` ends equal to the replica's.

It works with vLLM's own publisher too (the wire is vLLM 0.32.0's); ``pagoda kv-events``
(``main``) prints a replica's stream with it, one JSON line per batch.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from typing import Callable, Optional

from pagoda.contracts import vllm_kv_events as wire

logger = logging.getLogger(__name__)


class KVEventSubscriber:
    """Args:
        endpoint: the replica's PUB endpoint (``tcp://host:5557``).
        replay_endpoint: its replay endpoint; without one, a gap is only counted.
        topic: the subscription prefix (``""``: every topic).
        on_batch: called with ``(seq, batch)`` for each batch applied, in order.
    """

    def __init__(self, endpoint: str, replay_endpoint: Optional[str] = None, topic: str = "",
                 on_batch: Optional[Callable[[int, wire.KVEventBatch], None]] = None,
                 replay_timeout_s: float = 5.0) -> None:
        import zmq

        self._zmq = zmq
        self._context = zmq.Context()
        self._sub = self._context.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode("utf-8"))
        self._sub.connect(endpoint)
        self._replay_endpoint = replay_endpoint
        self._replay_timeout_ms = int(replay_timeout_s * 1000)
        self._on_batch = on_batch
        self.blocks: set[wire.ExternalBlockHash] = set()
        self.next_seq = 0  # the sequence number of the next batch to apply
        self.num_replayed = 0
        self.num_gaps = 0  # gaps seen (each one replayed when a replay endpoint is known)

    def poll(self, timeout_s: float) -> int:
        """Apply what arrives within ``timeout_s`` (at least one message's wait); returns batches applied."""
        applied = 0
        timeout_ms = int(timeout_s * 1000)
        while self._sub.poll(timeout_ms):
            _, seq_bytes, payload = self._sub.recv_multipart()
            applied += self._receive(int.from_bytes(seq_bytes, "big"), payload)
            timeout_ms = 0
        return applied

    def _receive(self, seq: int, payload: bytes) -> int:
        if seq < self.next_seq:
            return 0  # already applied through a replay
        applied = 0
        if seq > self.next_seq:
            self.num_gaps += 1
            if self._replay_endpoint is not None:
                applied += self._replay(self.next_seq, seq)
        if seq >= self.next_seq:  # without a replay the gap stays; the stream goes on
            self._apply(seq, wire.decode_batch(payload))
            applied += 1
        return applied

    def _replay(self, start_seq: int, stop_seq: int) -> int:
        """Apply the replayed batches ``start_seq <= seq < stop_seq``."""
        zmq = self._zmq
        # DEALER, not REQ: one request gets many replies. The empty frame is REQ's envelope.
        sock = self._context.socket(zmq.DEALER)
        sock.setsockopt(zmq.RCVTIMEO, self._replay_timeout_ms)
        sock.setsockopt(zmq.LINGER, 0)
        applied = 0
        try:
            sock.connect(self._replay_endpoint)
            sock.send_multipart((b"", start_seq.to_bytes(8, "big")))
            while True:
                _, _, seq_bytes, payload = sock.recv_multipart()
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if seq < 0:
                    break
                if self.next_seq <= seq < stop_seq:
                    self._apply(seq, wire.decode_batch(payload))
                    applied += 1
                    self.num_replayed += 1
        except zmq.Again:
            logger.warning("kv events: replay from %s timed out at seq %d", self._replay_endpoint, self.next_seq)
        finally:
            sock.close()
        return applied

    def _apply(self, seq: int, batch: wire.KVEventBatch) -> None:
        for event in batch.events:
            if getattr(event, "group_idx", None):
                continue  # a hybrid model's other KV cache groups hold the same hashes again
            if isinstance(event, wire.BlockStored):
                self.blocks.update(event.block_hashes)
            elif isinstance(event, wire.BlockRemoved):
                self.blocks.difference_update(event.block_hashes)
            elif isinstance(event, wire.AllBlocksCleared):
                self.blocks.clear()
        self.next_seq = seq + 1
        if self._on_batch is not None:
            self._on_batch(seq, batch)

    def close(self) -> None:
        self._sub.close(linger=0)
        self._context.term()


def main(argv: Optional[list[str]] = None) -> int:
    """``pagoda kv-events``: one JSON line per batch (``seq``, ``ts`` and the events as vLLM
    writes them, hashes as integers), then the block count; ``--duration`` bounds the run."""
    import msgspec

    parser = argparse.ArgumentParser(prog="pagoda kv-events", description=main.__doc__)
    parser.add_argument("--endpoint", required=True, help="the replica's PUB socket, e.g. tcp://10.0.0.5:5557")
    parser.add_argument("--replay-endpoint", help="its replay socket: batches missed are asked for again")
    parser.add_argument("--topic", default="", help="subscription prefix (default: every topic)")
    parser.add_argument("--duration", type=float, default=None, help="seconds to listen (default: until Ctrl-C)")
    args = parser.parse_args(argv)

    def show(seq: int, batch: wire.KVEventBatch) -> None:
        events = [{"type": type(e).__name__, **msgspec.to_builtins(e)} for e in batch.events]
        print(json.dumps({"seq": seq, "ts": batch.ts, "events": events}), flush=True)

    subscriber = KVEventSubscriber(args.endpoint, args.replay_endpoint, args.topic, on_batch=show)
    deadline = None if args.duration is None else time.monotonic() + args.duration
    try:
        while deadline is None or time.monotonic() < deadline:
            subscriber.poll(0.2)
    except KeyboardInterrupt:
        pass
    finally:
        print(json.dumps({"blocks": len(subscriber.blocks), "next_seq": subscriber.next_seq,
                          "gaps": subscriber.num_gaps, "replayed": subscriber.num_replayed}), flush=True)
        subscriber.close()
    return 0
