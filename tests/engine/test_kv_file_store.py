"""Block files and their stores (engine.kv.block_file, engine.kv.file_tier): no torch, no model."""

from __future__ import annotations

import os
import time

import pytest

from pagoda.contracts.block_hash import hash_block, root_hash
from pagoda.contracts.kv_events import KVEventBuffer
from pagoda.engine.config import EngineConfig
from pagoda.engine.kv.block_file import BlockFileError, decode_block, encode_block, make_fingerprint
from pagoda.engine.kv.block_pool import KVCacheBlock
from pagoda.engine.kv.file_tier import BlockFileStore, FileTiers, emit_events
from pagoda.engine.kv.host_tier import KVOffloadManager

FP = make_fingerprint({"model": "tiny", "block_size": 4})
TOKENS = [(1, 2, 3, 4), (5, 6, 7, 8), (9, 10, 11, 12)]
HASHES = [hash_block(root_hash("tiny"), TOKENS[0])]
for _tokens in TOKENS[1:]:
    HASHES.append(hash_block(HASHES[-1], _tokens))
PAYLOAD = bytes(range(256)) * 4  # 1 KiB


def _payload(i: int) -> bytes:
    return bytes([i]) * len(PAYLOAD)


def test_fingerprint_is_canonical_and_names_every_field():
    assert make_fingerprint({"a": 1, "b": [2]}) == make_fingerprint({"b": [2], "a": 1})
    assert make_fingerprint({"a": 1, "b": [2]}) != make_fingerprint({"a": 1, "b": [3]})
    assert len(FP) == 16


def test_a_block_file_round_trips():
    data = encode_block(FP, HASHES[0], TOKENS[0], PAYLOAD)
    assert decode_block(data, FP, HASHES[0], TOKENS[0]) == PAYLOAD


@pytest.mark.parametrize("damage, reason", [
    (lambda d: d[:-1], "truncated"),
    (lambda d: d[:10], "truncated"),
    (lambda d: d[:40] + bytes([d[40] ^ 1]) + d[41:], "checksum"),
    (lambda d: d[:-5] + bytes([d[-5] ^ 0x80]) + d[-4:], "checksum"),
    (lambda d: d + b"x", "checksum"),
])
def test_damaged_files_are_refused_naming_why(damage, reason):
    data = encode_block(FP, HASHES[0], TOKENS[0], PAYLOAD)
    with pytest.raises(BlockFileError) as info:
        decode_block(damage(data), FP, HASHES[0], TOKENS[0])
    assert info.value.reason == reason


def test_a_foreign_or_misnamed_file_is_refused():
    other = encode_block(make_fingerprint({"model": "other"}), HASHES[0], TOKENS[0], PAYLOAD)
    with pytest.raises(BlockFileError, match="fingerprint"):
        decode_block(other, FP, HASHES[0], TOKENS[0])
    data = encode_block(FP, HASHES[0], TOKENS[0], PAYLOAD)
    with pytest.raises(BlockFileError, match="mismatch"):
        decode_block(data, FP, HASHES[1], TOKENS[0])
    with pytest.raises(BlockFileError, match="mismatch"):
        decode_block(data, FP, HASHES[0], TOKENS[1])


def _size(i: int) -> int:
    return len(encode_block(FP, HASHES[i], TOKENS[i], PAYLOAD))


def _store(path, max_bytes=0, is_shared=False):
    return BlockFileStore(str(path), FP, len(PAYLOAD), max_bytes, is_shared)


def _put(store, i):
    assert store.reserve(HASHES[i])
    assert store.write(HASHES[i], TOKENS[i], _payload(i))


def test_disk_store_evicts_least_recently_used_files_over_its_cap(tmp_path):
    store = _store(tmp_path, max_bytes=_size(0) + _size(2))
    _put(store, 0)
    _put(store, 1)
    assert store.read(HASHES[0], TOKENS[0]) == _payload(0)  # 0 is now the most recent
    _put(store, 2)
    assert store.num_files == 2 and store.num_evicted == 1 and store.num_bytes == _size(0) + _size(2)
    assert store.read(HASHES[1], TOKENS[1]) is None  # evicted: its file is gone
    assert not os.path.exists(os.path.join(store.root, HASHES[1].hex() + ".kvb"))
    assert store.read(HASHES[2], TOKENS[2]) == _payload(2)
    assert not store.reserve(HASHES[2])  # already there: written once


def test_restart_rebuilds_the_index_oldest_first_and_drops_a_killed_writers_temp_files(tmp_path):
    store = _store(tmp_path, max_bytes=10**6)
    for i in range(3):
        _put(store, i)
    for i, age in enumerate((30, 10, 20)):  # block 1 most recent, block 0 least
        path = os.path.join(store.root, HASHES[i].hex() + ".kvb")
        os.utime(path, (time.time() - age, time.time() - age))
    open(os.path.join(store.root, ".tmp-1-2-abc"), "wb").write(b"half")
    again = _store(tmp_path, max_bytes=_size(1) + _size(2))  # smaller cap: the oldest (block 0) goes
    assert again.num_files == 2 and again.read(HASHES[0], TOKENS[0]) is None
    assert again.read(HASHES[1], TOKENS[1]) == _payload(1)
    assert not any(name.startswith(".tmp-") for name in os.listdir(again.root))


@pytest.mark.parametrize("damage, reason", [
    (lambda d: d[: len(d) // 2], "truncated"),
    (lambda d: d[:-100] + bytes([d[-100] ^ 1]) + d[-99:], "checksum"),
    (lambda d: encode_block(make_fingerprint({"model": "other"}), HASHES[0], TOKENS[0], PAYLOAD), "fingerprint"),
])
def test_a_bad_file_is_counted_deleted_and_a_miss(tmp_path, damage, reason):
    store = _store(tmp_path, max_bytes=10**6)
    _put(store, 0)
    path = os.path.join(store.root, HASHES[0].hex() + ".kvb")
    data = open(path, "rb").read()
    open(path, "wb").write(damage(data))
    assert store.read(HASHES[0], TOKENS[0]) is None
    assert store.num_rejected[reason] == 1 and sum(store.num_rejected.values()) == 1
    assert not os.path.exists(path) and store.num_files == 0 and store.num_bytes == 0
    assert store.reserve(HASHES[0])  # it may be written again


def test_shared_store_sees_another_replicas_files_and_writes_once(tmp_path):
    first, second = _store(tmp_path, is_shared=True), _store(tmp_path, is_shared=True)
    _put(first, 0)
    assert second.read(HASHES[0], TOKENS[0]) == _payload(0)  # found by a stat, not in its own index
    assert not second.reserve(HASHES[0])  # already written by the other replica
    assert [n for n in os.listdir(first.root)] == [HASHES[0].hex() + ".kvb"]  # no temp file left


def test_the_shared_tier_id_names_the_volume_and_fingerprint_alike_on_every_mount(tmp_path):
    """Two replicas mounting one volume (under different paths) announce one id; another volume or
    fingerprint, another id; the disk tier has none. The fleet's index keys the tier by it."""
    (tmp_path / "vol").mkdir()
    os.symlink(tmp_path / "vol", tmp_path / "mount2")
    first, second = _store(tmp_path / "vol", is_shared=True), _store(tmp_path / "mount2", is_shared=True)
    assert first.tier_id == second.tier_id and len(first.tier_id) == 16
    assert _store(tmp_path / "other", is_shared=True).tier_id != first.tier_id
    assert BlockFileStore(str(tmp_path / "vol"), "f" * 16, len(PAYLOAD), is_shared=True).tier_id != first.tier_id
    assert _store(tmp_path / "disk").tier_id == ""
    assert FileTiers([first], 4).stats()["kv_shared_tier_id"] == first.tier_id


def test_a_failed_write_is_counted_and_releases_its_reservation(tmp_path):
    store = _store(tmp_path)
    assert store.reserve(HASHES[0])
    os.rmdir(store.root)  # the directory vanished (an unmounted volume)
    assert not store.write(HASHES[0], TOKENS[0], PAYLOAD)
    assert store.num_write_errors == 1 and store.reserve(HASHES[0])


def test_promotion_loads_verified_blocks_into_host_blocks_and_a_reused_block_cancels_its_load(tmp_path):
    store = _store(tmp_path, max_bytes=10**6)
    for i in range(2):
        _put(store, i)
    tiers = FileTiers([store], block_size=4)
    manager = KVOffloadManager(2, 4, preemption_mode="recompute", file_tiers=tiers)
    tokens = [t for block in TOKENS for t in block]
    hit = manager.lookup_prefix(HASHES, tokens, start=0, max_blocks=3)
    assert [b.block_hash for b in hit] == HASHES[:2]  # block 2 is on no tier
    assert all(b.ref_cnt == 0 for b in hit) and tiers.stats()["prefix_cache_hits_disk"] == 8
    # A device eviction reuses the least recent host block this step: its load no longer applies.
    manager.on_device_evict(_evicted(7, HASHES[2], TOKENS[2]))
    writes, loads = manager.take_file_copies()
    assert [host for host, _ in loads] == [hit[1].block_id]
    assert [(host, w.block_hash) for host, w in writes] == [(hit[0].block_id, HASHES[2])]


def test_writes_and_the_disk_tiers_removals_are_kv_events_with_their_medium(tmp_path):
    events = KVEventBuffer()
    disk = _store(tmp_path / "d", max_bytes=_size(1) + _size(2))
    shared = _store(tmp_path / "s", is_shared=True)
    emit_events(FileTiers([disk, shared], block_size=4), events, block_size=4)
    for i in range(3):
        _put(disk, i)  # the third evicts the first
    _put(shared, 0)
    got = [(type(e.event).__name__, e.event.block_hashes, e.event.medium) for e in events.take()]
    assert got == [("BlockStored", [HASHES[0].hex()], "DISK"), ("BlockStored", [HASHES[1].hex()], "DISK"),
                   ("BlockStored", [HASHES[2].hex()], "DISK"), ("BlockRemoved", [HASHES[0].hex()], "DISK"),
                   ("BlockStored", [HASHES[0].hex()], "SHARED")]


def _evicted(block_id, block_hash, tokens):
    block = KVCacheBlock(block_id)
    block.block_hash, block.token_ids = block_hash, tokens
    return block


@pytest.mark.parametrize("fields, match", [
    (dict(kv_disk_dir="/tmp/x", kv_disk_bytes=2**20), "kv_disk_dir: the file tiers are written from"),
    (dict(kv_shared_dir="/tmp/x"), "kv_shared_dir: the file tiers are written from"),
    (dict(kv_disk_dir="/tmp/x", cpu_offload_bytes=2**20), "kv_disk_bytes: the disk tier needs a size cap"),
    (dict(kv_disk_bytes=2**20, cpu_offload_bytes=2**20), "kv_disk_bytes: set kv_disk_dir"),
    (dict(kv_disk_bytes=-1), "kv_disk_bytes: must be an integer"),
    (dict(kv_disk_dir="", kv_disk_bytes=1, cpu_offload_bytes=2**20), "kv_disk_dir: must be a directory"),
    (dict(kv_disk_dir="/tmp/x", kv_disk_bytes=1, kv_shared_dir="/tmp/x", cpu_offload_bytes=2**20),
     "kv_shared_dir: must differ"),
])
def test_bad_file_tier_settings_name_the_field(fields, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**fields)
