"""KV transfer over NIXL between two engines (engine.kv_transfer.nixl, docs/kv_transfer.md).

Real NIXL agents (UCX on this machine: shared memory / TCP between processes, DRAM caches),
real loopback control connections. Engine A prefills a prompt; engine B gets its full
blocks by a NIXL READ into its own cache and serves the same prompt from its prefix cache:
hits equal the moved blocks, greedy output equals A's (A computed everything itself), and
the bytes did move over NIXL (B's agent counts them). A block failing its checksum, a
sender killed before B's READ and an engine thread that does not allocate within the TTL
leave B's pool as it was. Skipped, naming why, where the
``nixl`` package cannot run.
"""

from __future__ import annotations

import hashlib
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
from pagoda.engine.kv_transfer.nixl_memory import nixl_unavailable_reason
from pagoda.engine.kv_transfer.offer import Offer
from pagoda.engine.kv_transfer.registry import make_kv_connector
from pagoda.engine.kv_transfer.wire import FrameType
from pagoda.engine.llm_engine import LLMEngine

from tests.engine.driving import drain

UNAVAILABLE = nixl_unavailable_reason()
needs_nixl = pytest.mark.skipif(UNAVAILABLE is not None, reason=f"NIXL connector: {UNAVAILABLE}")
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPT = [random.Random(33).randrange(1000, 30000) for _ in range(100)]  # 6 full blocks of 16


def _serve(engine: LLMEngine, request_id: str, prompt=PROMPT):
    engine.add_request(request_id, prompt, GREEDY)
    return drain(engine)[request_id]


def _wait(connectors, transfer_id: str, num_sides: int = 2, timeout_s: float = 20.0) -> dict:
    """Poll every connector (as their engine loops would) until ``num_sides`` report ``transfer_id``."""
    results, deadline = {}, time.monotonic() + timeout_s
    while time.monotonic() < deadline and len(results) < num_sides:
        for connector in connectors:
            results.update({r.direction: r for r in connector.poll() if r.transfer_id == transfer_id})
        time.sleep(0.002)
    return results


@pytest.fixture(scope="module")
def pair(model_path):
    """Engines A (sender) and B (receiver, listening on loopback), each with a NIXL connector."""
    if UNAVAILABLE is not None:
        pytest.skip(f"NIXL connector: {UNAVAILABLE}")
    a, b = LLMEngine(EngineConfig(model=model_path)), LLMEngine(EngineConfig(model=model_path))
    ca, cb = make_kv_connector("nixl", a), make_kv_connector("nixl", b, listen="127.0.0.1:0")
    yield a, b, ca, cb
    ca.close()
    cb.close()


@needs_nixl
def test_a_prefix_read_over_nixl_is_a_cache_hit_with_identical_output(pair):
    a, b, ca, cb = pair
    b.scheduler.block_pool.reset_prefix_cache()
    b.take_block_events()
    reference = _serve(a, "a")
    a_free, b_free, read_before = a.get_stats().num_free_blocks, b.get_stats().num_free_blocks, cb.memory.num_bytes_read
    hashes = hash_prompt_blocks(PROMPT, 16, a.model_id)

    transfer_id = ca.send(cb.address, hashes)
    assert ca.num_pinned_blocks == 6, "sent blocks stay pinned until B confirms"
    results = _wait([ca, cb], transfer_id)
    assert results["send"].ok and results["receive"].ok, results
    assert results["send"].num_blocks == results["receive"].num_blocks == 6
    assert cb.memory.num_bytes_read - read_before == 6 * cb.block_io.block_bytes, "the bytes moved over NIXL"
    assert ca.num_pinned_blocks == 0 and a.get_stats().num_free_blocks == a_free
    assert b.get_stats().num_free_blocks == b_free, "received blocks are free but cached"
    stored = [e.event for e in b.take_block_events() if isinstance(e.event, BlockStored)]
    assert [h for e in stored for h in e.block_hashes] == [h.hex() for h in hashes]

    hits_before = b.get_stats().prefix_cache_hits
    served = _serve(b, "b")
    assert served.num_cached_tokens == 96 and b.get_stats().prefix_cache_hits - hits_before == 96
    assert served.outputs[0].token_ids == reference.outputs[0].token_ids

    again = _wait([ca, cb], ca.send(cb.address, hashes))
    assert again["send"].ok and again["send"].num_blocks == 0 and again["receive"].num_bytes == 0
    assert cb.memory.num_bytes_read - read_before == 6 * cb.block_io.block_bytes, "a second transfer reads nothing"


@needs_nixl
def test_a_replica_pulls_over_nixl_and_interoperates_with_tcp(pair):
    a, b, ca, cb = pair
    b.scheduler.block_pool.reset_prefix_cache()
    prompt = [random.Random(34).randrange(1000, 30000) for _ in range(100)]
    reference = _serve(a, "a-pull", prompt)
    hashes = hash_prompt_blocks(prompt, 16, a.model_id)
    a_free, read_before = a.get_stats().num_free_blocks, cb.memory.num_bytes_read
    holder = make_kv_connector("nixl", a, listen="127.0.0.1:0")
    tcp_b = make_kv_connector("tcp", b, listen="127.0.0.1:0")
    try:
        pulled = _wait([holder, cb], cb.pull(holder.address, hashes[:3]))
        assert pulled["receive"].ok and pulled["receive"].num_blocks == 3, pulled
        assert cb.memory.num_bytes_read - read_before == 3 * cb.block_io.block_bytes
        b.scheduler.block_pool.reset_prefix_cache()
        to_tcp = _wait([ca, tcp_b], ca.send(tcp_b.address, hashes))  # a TCP receiver: NIXL sender sends CHUNKs
        assert to_tcp["send"].ok and to_tcp["receive"].num_blocks == 6, to_tcp
        assert cb.memory.num_bytes_read - read_before == 3 * cb.block_io.block_bytes
    finally:
        holder.close()
        tcp_b.close()
    assert a.get_stats().num_free_blocks == a_free and ca.num_pinned_blocks == 0
    served = _serve(b, "b-pull", prompt)
    assert served.num_cached_tokens == 96 and served.outputs[0].token_ids == reference.outputs[0].token_ids


def _fake_sender_offer(layout: dict, model_id: str, transfer_id: str, prompt: list[int]):
    """A sender's OFFER and NIXL memory over fake KV (random fp32), its block digests by index."""
    import torch

    from pagoda.engine.kv_transfer.block_io import KVBlockIO
    from pagoda.engine.kv_transfer.nixl_memory import NixlKVMemory

    hashes = hash_prompt_blocks(prompt, 16, model_id)
    shape = (len(hashes), *layout["block_shape"])
    caches = [(torch.randn(shape), torch.randn(shape)) for _ in range(layout["num_layers"])]
    memory = NixlKVMemory(caches)
    offer = Offer(transfer_id, model_id, 16, layout, hashes, [prompt[i * 16:(i + 1) * 16] for i in range(len(hashes))],
                  nixl=memory.describe(list(range(len(hashes)))))
    io = KVBlockIO(caches)
    return offer, memory, [hashlib.sha256(io.read_block(i)).hexdigest() for i in range(len(hashes))]


@needs_nixl
def test_a_block_failing_its_checksum_is_refused_and_the_read_blocks_are_freed(pair):
    a, b, ca, cb = pair
    assert cb.block_io.layout["dtype"] == "float32"
    b.scheduler.block_pool.reset_prefix_cache()
    b_free = b.get_stats().num_free_blocks
    prompt = list(range(6000, 6100))
    offer, memory, digests = _fake_sender_offer(cb.block_io.layout, b.model_id, "bad-digest", prompt)
    digests[1] = hashlib.sha256(b"not block 1").hexdigest()
    try:
        with socket.create_connection(_addr(cb.address), timeout=10) as sock:
            wire.send_json(sock, FrameType.OFFER, offer.to_json())
            _, accept = wire.recv_json(sock, (FrameType.ACCEPT,))
            assert accept == {"need": list(range(6)), "transport": "nixl"}
            wire.send_json(sock, FrameType.READY, {"digests": digests})
            result = _wait([cb], "bad-digest", num_sides=1)["receive"]  # B allocates, reads, checks
            _, reply = wire.recv_json(sock, (FrameType.ERROR,))
    finally:
        memory.close()
    assert "checksum mismatch in block 1 read over NIXL" in result.error == reply["reason"]
    cb.poll()  # the engine thread frees the blocks the READ wrote
    assert b.get_stats().num_free_blocks == b_free and cb.receiver.num_inflight_bytes == 0
    assert _serve(b, "b-bad", prompt).num_cached_tokens == 0, "nothing of the transfer was cached"


@needs_nixl
def test_an_allocation_the_engine_did_not_make_within_the_ttl_is_never_made(pair):
    _, b, _, _ = pair
    b_free = b.get_stats().num_free_blocks
    receiver = make_kv_connector("nixl", b, listen="127.0.0.1:0", ttl_s=0.3)  # waits: real seconds
    offer, memory, digests = _fake_sender_offer(receiver.block_io.layout, b.model_id, "stalled-engine",
                                                list(range(8000, 8100)))
    try:
        with socket.create_connection(_addr(receiver.address), timeout=10) as sock:
            wire.send_json(sock, FrameType.OFFER, offer.to_json())
            wire.recv_json(sock, (FrameType.ACCEPT,))
            wire.send_json(sock, FrameType.READY, {"digests": digests})
            _, reply = wire.recv_json(sock, (FrameType.ERROR,))  # nobody polled: the engine thread "stalled"
        assert "did not allocate blocks within the TTL of 0.3 s" in reply["reason"]
        result = _wait([receiver], "stalled-engine", num_sides=1)["receive"]  # the engine thread is back
        assert "did not allocate" in result.error
        assert b.get_stats().num_free_blocks == b_free and receiver.receiver.num_inflight_bytes == 0
    finally:
        receiver.close()
        memory.close()


@needs_nixl
def test_an_offer_with_an_unusable_nixl_section_is_refused_before_anything_is_reserved(pair):
    _, b, _, cb = pair
    offer, memory, _ = _fake_sender_offer(cb.block_io.layout, b.model_id, "bad-nixl", list(range(6000, 6100)))
    memory.close()
    good = offer.to_json()
    cases = [({k: v for k, v in good["nixl"].items() if k != "device_id"}, "malformed OFFER nixl section: KeyError"),
             ({**good["nixl"], "regions": good["nixl"]["regions"][:-1]}, "regions for this replica's"),
             ({**good["nixl"], "block_ids": [-1] * 6}, "unsigned 64-bit integers")]
    for section, message in cases:
        with socket.create_connection(_addr(cb.address), timeout=10) as sock:
            wire.send_json(sock, FrameType.OFFER, {**good, "nixl": section})
            _, reply = wire.recv_json(sock, (FrameType.REFUSE,))
        assert message in reply["reason"], reply
    assert cb.receiver.num_inflight_bytes == 0


_DYING_NIXL_SENDER = """
import json, socket, sys, time
from pagoda.engine.kv_transfer import wire
from pagoda.engine.kv_transfer.wire import FrameType
from tests.engine.test_kv_transfer_nixl import _fake_sender_offer
host, port, args = sys.argv[1], int(sys.argv[2]), json.loads(sys.stdin.read())
offer, memory, digests = _fake_sender_offer(args["layout"], args["model_id"], "killed", args["prompt"])
sock = socket.create_connection((host, port))
wire.send_json(sock, FrameType.OFFER, offer.to_json())
_, accept = wire.recv_json(sock, (FrameType.ACCEPT,))
wire.send_json(sock, FrameType.READY, {"digests": [digests[i] for i in accept["need"]]})
print("ready", accept.get("transport"), flush=True)
time.sleep(60)
"""


@needs_nixl
def test_a_sender_killed_before_the_read_leaves_nothing_on_the_receiver(pair):
    """The sender dies after READY, while B's connection thread waits for its engine thread to
    allocate blocks: B then allocates, its READ meets a dead peer, and the blocks go back."""
    a, b, ca, cb = pair
    b.scheduler.block_pool.reset_prefix_cache()
    b_free = b.get_stats().num_free_blocks
    prompt = list(range(7000, 7100))
    host, port = _addr(cb.address)
    child = subprocess.Popen([sys.executable, "-c", _DYING_NIXL_SENDER, host, str(port)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, cwd=_REPO)
    child.stdin.write(json.dumps({"layout": cb.block_io.layout, "model_id": b.model_id, "prompt": prompt}))
    child.stdin.close()
    assert child.stdout.readline().strip() == "ready nixl"
    assert cb.receiver.num_inflight_bytes == 6 * cb.block_io.block_bytes, "reserved while in flight"
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    result = _wait([cb], "killed", num_sides=1)["receive"]
    assert "NIXL READ" in result.error, result
    cb.poll()
    assert b.get_stats().num_free_blocks == b_free and cb.receiver.num_inflight_bytes == 0
    assert cb.num_quarantined_blocks == 0
    assert _serve(b, "b-killed", prompt).num_cached_tokens == 0


def test_an_unknown_backend_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match="KV transfer backend 'shm': must be one of tcp, nixl"):
        make_kv_connector("shm", None)


def test_nixl_without_its_package_is_refused_naming_how_to_install_it(monkeypatch):
    import torch

    from pagoda.engine.kv_transfer.nixl_memory import NixlKVMemory

    monkeypatch.setitem(sys.modules, "nixl", None)  # what `import nixl` meets where it is not installed
    monkeypatch.setitem(sys.modules, "nixl._api", None)
    assert "pip install nixl" in nixl_unavailable_reason()
    with pytest.raises(ValueError, match="KV transfer backend 'nixl': the nixl package is not usable here"):
        NixlKVMemory([(torch.zeros(2, 16, 1, 8), torch.zeros(2, 16, 1, 8))])


@needs_nixl
def test_bench_moves_a_prefix_over_nixl_between_two_processes(model_path, capsys):
    import torch

    from pagoda.cli import main as cli_main

    threads = torch.get_num_threads()
    try:
        assert cli_main(["bench", "kv-transfer", "--model", model_path, "--prefix-tokens", "80",
                         "--repeats", "1", "--backend", "nixl"]) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "backend nixl; mode pull" in out and "| 0 | 5 | 0.2 |" in out, out  # 5 blocks of 32 KiB
    assert "the receiver READ 0.2 MB over NIXL" in out, out


_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _addr(address: str) -> tuple[str, int]:
    host, port = address.rsplit(":", 1)
    return host, int(port)
