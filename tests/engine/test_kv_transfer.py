"""KV transfer over a real TCP socket between two engines (engine.kv_transfer, docs/kv_transfer.md).

Engine A prefills a prompt, its full blocks go to engine B over loopback TCP, B serves the
same prompt from its prefix cache: hits equal the transferred blocks and greedy output
equals A's (A computed everything itself). A corrupted chunk, a stalled receiver and a
mismatched model are refused with no block leaked on either side.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time

import pytest

from pagoda import SamplingParams
from pagoda.contracts.block_hash import hash_prompt_blocks
from pagoda.contracts.kv_events import BlockStored
from pagoda.engine.config import EngineConfig
from pagoda.engine.kv_transfer import wire
from pagoda.engine.kv_transfer.offer import Offer
from pagoda.engine.kv_transfer.tcp import TcpKVConnector
from pagoda.engine.kv_transfer.wire import FrameType
from pagoda.engine.llm_engine import LLMEngine

from tests.engine.driving import drain

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPT = [random.Random(30).randrange(1000, 30000) for _ in range(100)]  # 6 full blocks of 16


def _engine(model_path, **kwargs) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model_path, **kwargs))


def _serve(engine: LLMEngine, request_id: str, prompt=PROMPT, **kwargs):
    engine.add_request(request_id, prompt, GREEDY, **kwargs)
    return drain(engine)[request_id]


def _wait(connectors, transfer_id: str, timeout_s: float = 20.0, num_sides: int = 2) -> dict:
    """Poll every connector (as their engine loops would) until ``num_sides`` report ``transfer_id``."""
    results, deadline = {}, time.monotonic() + timeout_s
    while time.monotonic() < deadline and len(results) < num_sides:
        for connector in connectors:
            for r in connector.poll():
                if r.transfer_id == transfer_id:
                    results[r.direction] = r
        time.sleep(0.002)
    return results


@pytest.fixture(scope="module", params=["auto", "fp8_e4m3"])
def pair(request, model_path):
    """Engines A (sender) and B (receiver, listening on loopback) with one KV cache dtype."""
    a = _engine(model_path, kv_cache_dtype=request.param)
    b = _engine(model_path, kv_cache_dtype=request.param)
    ca, cb = TcpKVConnector(a), TcpKVConnector(b, listen="127.0.0.1:0")
    yield a, b, ca, cb
    ca.close()
    cb.close()


def test_transferred_prefix_is_a_cache_hit_with_identical_output(pair):
    a, b, ca, cb = pair
    b.scheduler.block_pool.reset_prefix_cache()
    b.take_block_events()
    reference = _serve(a, "a")
    a_free, b_free = a.get_stats().num_free_blocks, b.get_stats().num_free_blocks
    hashes = hash_prompt_blocks(PROMPT, a.config.block_size, a.model_id)
    assert len(hashes) == 6

    transfer_id = ca.send(cb.address, hashes)
    assert ca.num_pinned_blocks == 6 and a.get_stats().num_free_blocks < a_free, "sent blocks stay pinned"
    results = _wait([ca, cb], transfer_id)
    assert results["send"].ok and results["receive"].ok, results
    assert results["send"].num_blocks == results["receive"].num_blocks == 6
    assert results["receive"].num_bytes == 6 * cb.block_io.block_bytes
    assert ca.num_pinned_blocks == 0 and a.get_stats().num_free_blocks == a_free, "A unpinned after DONE"
    assert b.get_stats().num_free_blocks == b_free, "received blocks are free but cached"
    stored = [e.event for e in b.take_block_events() if isinstance(e.event, BlockStored)]
    assert [h for e in stored for h in e.block_hashes] == [h.hex() for h in hashes], \
        "B announces the received blocks (the publisher tells the global index)"
    assert stored[0].parent_block_hash is None and stored[0].token_ids == PROMPT[:96]

    hits_before = b.get_stats().prefix_cache_hits
    served = _serve(b, "b")
    assert served.num_cached_tokens == 6 * 16
    assert b.get_stats().prefix_cache_hits - hits_before == 6 * 16
    assert served.outputs[0].token_ids == reference.outputs[0].token_ids

    again = ca.send(cb.address, hashes)
    results = _wait([ca, cb], again)
    assert results["send"].ok and results["send"].num_blocks == 0, "B already holds them: nothing moves"
    assert results["receive"].num_bytes == 0


def test_the_receiver_commits_between_steps_while_decoding_with_async_scheduling(model_path):
    a, b = _engine(model_path, async_scheduling=True), _engine(model_path, async_scheduling=True)
    ca, cb = TcpKVConnector(a), TcpKVConnector(b, listen="127.0.0.1:0")
    try:
        prompt = [random.Random(31).randrange(1000, 30000) for _ in range(300)]
        reference = _serve(a, "a", prompt)
        b.add_request("busy", list(range(4000, 4050)), SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
        transfer_id = ca.send(cb.address, hash_prompt_blocks(prompt, 16, a.model_id))
        results, deadline = {}, time.monotonic() + 20
        while (b.has_unfinished_requests() or len(results) < 2) and time.monotonic() < deadline:
            if b.has_unfinished_requests():
                b.step()  # the transfer overlaps B's decode steps; poll() commits between them
            results.update({r.direction: r for c in (ca, cb) for r in c.poll() if r.transfer_id == transfer_id})
            time.sleep(0.001)
        assert results["receive"].ok and results["receive"].num_blocks == 18
        served = _serve(b, "b", prompt)
        assert served.num_cached_tokens == 18 * 16
        assert served.outputs[0].token_ids == reference.outputs[0].token_ids
    finally:
        ca.close()
        cb.close()
        a.shutdown()
        b.shutdown()


def test_a_replica_pulls_a_prefix_from_a_peer(pair):
    a, b, ca, cb = pair
    b.scheduler.block_pool.reset_prefix_cache()
    prompt = [random.Random(32).randrange(1000, 30000) for _ in range(100)]
    reference = _serve(a, "a-pull", prompt)
    a_free, b_free = a.get_stats().num_free_blocks, b.get_stats().num_free_blocks
    holder = TcpKVConnector(a, listen="127.0.0.1:0")  # A answers pulls from its own poll()
    try:
        transfer_id = cb.pull(holder.address, hash_prompt_blocks(prompt, 16, a.model_id))
        results = _wait([holder, cb], transfer_id)
        assert results["send"].ok and results["receive"].ok and results["receive"].num_blocks == 6, results
        missing = cb.pull(holder.address, hash_prompt_blocks(list(range(9000, 9100)), 16, a.model_id))
        refused = _wait([holder, cb], missing, num_sides=1)
    finally:
        holder.close()
    assert "none of the offered blocks is cached" in refused["receive"].error
    closed = socket.create_server(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    unreachable = cb.pull(f"127.0.0.1:{port}", hash_prompt_blocks(prompt, 16, a.model_id))
    assert "ConnectionRefusedError" in _wait([cb], unreachable, num_sides=1)["receive"].error
    assert a.get_stats().num_free_blocks == a_free and b.get_stats().num_free_blocks == b_free
    served = _serve(b, "b-pull", prompt)
    assert served.num_cached_tokens == 96 and served.outputs[0].token_ids == reference.outputs[0].token_ids


def test_a_corrupted_chunk_is_refused_and_nothing_leaks(pair):
    a, b, ca, cb = pair
    b.scheduler.block_pool.reset_prefix_cache()
    prompt = PROMPT[:50] + list(range(3000, 3050))
    _serve(a, "a-corrupt", prompt)
    b_free, hits = b.get_stats().num_free_blocks, b.get_stats().prefix_cache_hits
    blocks = [a.scheduler.block_pool.get_cached_block(h)
              for h in hash_prompt_blocks(prompt, a.config.block_size, a.model_id)]
    offer = Offer("corrupt", a.model_id, a.config.block_size, ca.block_io.layout,
                  [blk.block_hash for blk in blocks], [list(blk.token_ids) for blk in blocks])
    with socket.create_connection(_addr(cb.address), timeout=10) as sock:
        wire.send_json(sock, FrameType.OFFER, offer.to_json())
        _, accept = wire.recv_json(sock, (FrameType.ACCEPT,))
        assert accept["need"] == list(range(6))
        good = ca.block_io.read_block(blocks[0].block_id)
        wire.send_chunk(sock, 0, 0, good)
        body = bytearray(wire.encode_chunk(1, 0, ca.block_io.read_block(blocks[1].block_id)))
        body[-7] ^= 0xFF  # one payload byte flipped after the digest was taken: corrupted in flight
        wire.send_frame(sock, FrameType.CHUNK, bytes(body))
        kind, reply = wire.recv_json(sock, (FrameType.ERROR,))
    assert "checksum mismatch in the chunk of block 1" in reply["reason"]
    results = _wait([cb], "corrupt", num_sides=1)
    assert not results["receive"].ok and "checksum" in results["receive"].error
    assert b.get_stats().num_free_blocks == b_free
    assert cb.receiver.num_inflight_bytes == 0, "the buffered block was dropped"
    assert _serve(b, "b-corrupt", prompt).num_cached_tokens == 0, "nothing of the transfer was cached"


_DYING_SENDER = """
import json, socket, sys, time
from pagoda.engine.kv_transfer import wire
from pagoda.engine.kv_transfer.wire import FrameType
host, port, offer = sys.argv[1], int(sys.argv[2]), json.loads(sys.stdin.read())
sock = socket.create_connection((host, port))
wire.send_json(sock, FrameType.OFFER, offer)
wire.recv_json(sock, (FrameType.ACCEPT,))
wire.send_chunk(sock, 0, 0, bytes(1000))  # the start of block 0, then nothing
print("sent", flush=True)
time.sleep(60)
"""


def test_a_sender_killed_mid_transfer_leaves_nothing_on_the_receiver(pair):
    a, b, ca, cb = pair
    b.scheduler.block_pool.reset_prefix_cache()
    prompt = list(range(7000, 7100))
    _serve(a, "a-kill", prompt)
    b_free = b.get_stats().num_free_blocks
    blocks = [a.scheduler.block_pool.get_cached_block(h) for h in hash_prompt_blocks(prompt, 16, a.model_id)]
    offer = Offer("killed", a.model_id, 16, ca.block_io.layout, [blk.block_hash for blk in blocks],
                  [list(blk.token_ids) for blk in blocks])
    host, port = _addr(cb.address)
    child = subprocess.Popen([sys.executable, "-c", _DYING_SENDER, host, str(port)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    child.stdin.write(json.dumps(offer.to_json()))
    child.stdin.close()
    assert child.stdout.readline().strip() == "sent"
    assert cb.receiver.num_inflight_bytes == 6 * cb.block_io.block_bytes, "reserved while in flight"
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    results = _wait([cb], "killed", num_sides=1)
    assert "peer closed the connection" in results["receive"].error
    assert cb.receiver.num_inflight_bytes == 0 and b.get_stats().num_free_blocks == b_free


def test_a_stalled_sender_is_dropped_by_the_receiver_at_its_ttl(pair):
    a, b, ca, _ = pair
    _serve(a, "a-stall", PROMPT)
    blocks = [a.scheduler.block_pool.get_cached_block(h) for h in hash_prompt_blocks(PROMPT, 16, a.model_id)]
    offer = Offer("stalled-sender", a.model_id, 16, ca.block_io.layout, [blk.block_hash for blk in blocks],
                  [list(blk.token_ids) for blk in blocks])
    b.scheduler.block_pool.reset_prefix_cache()
    b_free = b.get_stats().num_free_blocks
    receiver = TcpKVConnector(b, listen="127.0.0.1:0", ttl_s=0.3)  # socket timeouts: real seconds
    try:
        with socket.create_connection(_addr(receiver.address), timeout=10) as sock:
            wire.send_json(sock, FrameType.OFFER, offer.to_json())
            wire.recv_json(sock, (FrameType.ACCEPT,))
            result = _wait([receiver], "stalled-sender", num_sides=1)["receive"]  # then nothing is sent
        assert "timed out" in result.error
        assert receiver.receiver.num_inflight_bytes == 0 and b.get_stats().num_free_blocks == b_free
    finally:
        receiver.close()


def test_a_stalled_receiver_makes_the_sender_release_at_its_ttl(model_path):
    a = _engine(model_path)
    now = [0.0]
    ca = TcpKVConnector(a, ttl_s=5.0, clock=lambda: now[0])
    _serve(a, "a")
    a_free = a.get_stats().num_free_blocks
    stalled = socket.create_server(("127.0.0.1", 0))  # accepts (kernel backlog), never reads or answers
    try:
        transfer_id = ca.send(f"127.0.0.1:{stalled.getsockname()[1]}",
                              hash_prompt_blocks(PROMPT, a.config.block_size, a.model_id))
        assert ca.poll() == [] and a.get_stats().num_free_blocks == a_free - 6, "held until TTL"
        now[0] = 5.0
        [result] = ca.poll()
        assert result.transfer_id == transfer_id and "TTL of 5 s passed" in result.error
        assert a.get_stats().num_free_blocks == a_free and ca.num_pinned_blocks == 0
    finally:
        ca.close()
        stalled.close()


def test_an_offer_over_the_in_flight_cap_is_refused_busy(pair):
    a, b, ca, _ = pair
    b.scheduler.block_pool.reset_prefix_cache()
    prompt = list(range(5000, 5100))
    _serve(a, "a-busy", prompt)
    a_free, b_free = a.get_stats().num_free_blocks, b.get_stats().num_free_blocks
    small = TcpKVConnector(b, listen="127.0.0.1:0", max_inflight_bytes=2 * ca.block_io.block_bytes)
    try:
        transfer_id = ca.send(small.address, hash_prompt_blocks(prompt, 16, a.model_id))
        results = _wait([ca, small], transfer_id)
    finally:
        small.close()
    assert "busy" in results["send"].error and "busy" in results["receive"].error
    assert a.get_stats().num_free_blocks == a_free and b.get_stats().num_free_blocks == b_free
    assert small.receiver.num_inflight_bytes == 0 and ca.num_pinned_blocks == 0


def test_connections_over_the_cap_are_refused_busy(pair):
    a, b, ca, _ = pair
    _serve(a, "a-conns", PROMPT)
    receiver = TcpKVConnector(b, listen="127.0.0.1:0")
    receiver.receiver.max_connections = 1
    try:
        with socket.create_connection(_addr(receiver.address), timeout=10):
            deadline = time.monotonic() + 10
            while not receiver.receiver._conns and time.monotonic() < deadline:
                time.sleep(0.01)
            transfer_id = ca.send(receiver.address, hash_prompt_blocks(PROMPT, 16, a.model_id))
            result = _wait([ca], transfer_id, num_sides=1)["send"]
    finally:
        receiver.close()
    assert "receiver refused: busy: 1 connections open" in result.error and ca.num_pinned_blocks == 0


def test_close_wakes_a_connection_idle_within_its_ttl(pair):
    _, b, _, _ = pair
    receiver = TcpKVConnector(b, listen="127.0.0.1:0", ttl_s=60)
    with socket.create_connection(_addr(receiver.address), timeout=10):
        deadline = time.monotonic() + 10
        while not receiver.receiver._conns and time.monotonic() < deadline:
            time.sleep(0.01)
        start = time.monotonic()
        receiver.close()
        assert time.monotonic() - start < 5, "close joined the connection thread without waiting for its TTL"
    assert not any(th.is_alive() for th in receiver.receiver._threads)


def test_offers_from_another_model_or_layout_are_refused(pair, model_path, tmp_path):
    a, b, ca, cb = pair
    _serve(a, "a-model")
    blocks = [a.scheduler.block_pool.get_cached_block(h)
              for h in hash_prompt_blocks(PROMPT, a.config.block_size, a.model_id)]
    tokens = [list(blk.token_ids) for blk in blocks]
    hashes = [blk.block_hash for blk in blocks]
    other = hash_prompt_blocks(PROMPT, 16, "another-model")
    cases = [(Offer("x1", "another-model", 16, ca.block_io.layout, other, tokens), "is not this replica's hash"),
             (Offer("x2", a.model_id, 32, ca.block_io.layout, hashes, tokens), "block_size 32 differs"),
             (Offer("x3", a.model_id, 16, {**ca.block_io.layout, "num_layers": 99}, hashes, tokens), "KV layout")]
    for offer, message in cases:
        with socket.create_connection(_addr(cb.address), timeout=10) as sock:
            wire.send_json(sock, FrameType.OFFER, offer.to_json())
            _, reply = wire.recv_json(sock, (FrameType.REFUSE,))
        assert message in reply["reason"], reply


def test_bad_connector_arguments_are_named(model_path):
    a = _engine(model_path)
    with pytest.raises(ValueError, match="ttl_s: must be > 0"):
        TcpKVConnector(a, ttl_s=0)
    ca = TcpKVConnector(a)
    try:
        with pytest.raises(ValueError, match="must be 'host:port'"):
            ca.send("localhost", hash_prompt_blocks(PROMPT, 16, a.model_id))
        with pytest.raises(ValueError, match="none of the offered blocks is cached"):
            ca.send("127.0.0.1:9", hash_prompt_blocks(PROMPT, 16, a.model_id))
    finally:
        ca.close()


def _addr(address: str) -> tuple[str, int]:
    host, port = address.rsplit(":", 1)
    return host, int(port)


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_bench_moves_a_prefix_between_two_processes(model_path, capsys, mode):
    """``pagoda bench kv-transfer``: a spawned receiver process; it asserts the first tokens agree."""
    import torch

    from pagoda.cli import main as cli_main

    threads = torch.get_num_threads()
    try:
        assert cli_main(["bench", "kv-transfer", "--model", model_path, "--prefix-tokens", "80",
                         "--repeats", "1", "--mode", mode]) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert f"mode {mode}" in out and "| 0 | 5 | 0.2 |" in out, out  # 5 blocks of 32 KiB
    assert out.rstrip().splitlines()[-3].endswith("| 64 |"), "the receiver hit 4 of the 5 blocks (last token computed)"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float8_e4m3fn"])
def test_block_bytes_round_trip_through_the_caches(dtype):
    import torch

    from pagoda.engine.kv_transfer.block_io import KVBlockIO

    caches = [(torch.zeros(4, 16, 2, 8).to(getattr(torch, dtype)), torch.zeros(4, 16, 2, 8).to(getattr(torch, dtype)))
              for _ in range(3)]
    io = KVBlockIO(caches)
    data = bytes(random.Random(5).randrange(0, 120) for _ in range(io.block_bytes))  # < 0x7F: finite fp8
    io.write_block(2, data)
    assert io.read_block(2) == data and io.read_block(1) == bytes(io.block_bytes), "only block 2 changed"
    assert io.layout == {"dtype": dtype, "num_layers": 3, "block_shape": [16, 2, 8], "block_bytes": io.block_bytes}


def test_a_model_with_several_kv_cache_groups_is_refused_naming_why(tmp_path, smollm2_path):
    """Gemma 3's sliding-window and full layers keep two block tables; a connector moves one.
    With kv_cache_layout='uniform' (one table, every block kept) it connects."""
    from tests.engine.hf_reference import make_random_model

    path = str(make_random_model(tmp_path / "g3", "gemma3-window8", smollm2_path))
    with pytest.raises(ValueError, match=r"2 groups \(full_attention, sliding_window\).*kv_cache_layout='uniform'"):
        TcpKVConnector(_engine(path))
    TcpKVConnector(_engine(path, kv_cache_layout="uniform")).close()
