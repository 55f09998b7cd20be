"""The disk and shared KV tiers end to end on a tiny random Llama (engine.kv.file_tier, docs/kv_offload.md).

Every prefix block served from a file must give the tokens the same engine computes cold
(greedy, fp32); a restarted engine finds the blocks an earlier one wrote; a bad file is
counted and recomputed, never served.
"""

from __future__ import annotations

import json
import os
import random
import struct

import pytest

from pagoda.engine.config import EngineConfig
from pagoda.engine.kv.block_file import encode_block
from pagoda.engine.sampling_params import SamplingParams
from tests.engine.driving import drain

RNG = random.Random(46)
PREFIX = [RNG.randrange(1000, 30000) for _ in range(96)]  # 6 blocks of 16
OTHER = [RNG.randrange(1000, 30000) for _ in range(136)]  # 9 blocks with its output: evicts all of PREFIX
QUERY = PREFIX + [RNG.randrange(1000, 30000) for _ in range(10)]
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def _engine(model_path, cpu_offload_bytes=2**22, **tiers):
    from pagoda.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(model=model_path, num_gpu_blocks_override=10, cpu_offload_bytes=cpu_offload_bytes,
                                  preemption_mode="recompute", **tiers))


def _generate(engine, prompt, rid="q"):
    engine.add_request(rid, prompt, GREEDY)
    return drain(engine)[rid]


@pytest.fixture(scope="module")
def cold(model_path):
    from pagoda.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=model_path, enable_prefix_caching=False))
    return _generate(engine, QUERY).outputs[0].token_ids


def _write_prefix(model_path, **tiers):
    """An engine serves PREFIX, then OTHER evicts it from the device into the CPU tier (and so the files)."""
    engine = _engine(model_path, **tiers)
    _generate(engine, PREFIX, "p")
    _generate(engine, OTHER, "o")
    engine.core.executor.host_kv_cache.file_io.flush()
    stats = engine.get_stats()
    engine.shutdown()
    return stats


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_restarted_engine_serves_the_prefix_from_the_disk_tier(model_path, cold, tmp_path, async_scheduling):
    tiers = dict(kv_disk_dir=str(tmp_path), kv_disk_bytes=2**24, async_scheduling=async_scheduling)
    written = _write_prefix(model_path, **tiers)
    assert written.num_disk_blocks_written >= 6
    engine = _engine(model_path, **tiers)  # empty device and CPU tiers: every hit comes from the files
    assert engine.get_stats().num_disk_files == written.num_disk_files
    out = _generate(engine, QUERY)
    stats = engine.get_stats()
    assert out.num_cached_tokens == stats.prefix_cache_hits_disk == stats.prefix_cache_hits_host
    assert out.num_cached_tokens == 96
    assert out.outputs[0].token_ids == cold
    assert stats.num_rejected_block_files == 0
    assert stats.num_free_blocks == stats.num_blocks and stats.num_free_host_blocks == stats.num_host_blocks
    engine.shutdown()


def _file_of_block(directory, block_index):
    """The path of the file holding PREFIX's block ``block_index`` (read from the headers)."""
    wanted = PREFIX[block_index * 16:(block_index + 1) * 16]
    for root, _, names in os.walk(directory):
        for name in names:
            data = open(os.path.join(root, name), "rb").read()
            header = json.loads(data[10:10 + struct.unpack_from("<I", data, 6)[0]])
            if header["token_ids"] == wanted:
                return os.path.join(root, name)
    raise AssertionError(f"no file holds block {block_index}")


def _foreign(data):
    header_len = struct.unpack_from("<I", data, 6)[0]
    header = json.loads(data[10:10 + header_len])
    payload = data[10 + header_len:-4]
    return encode_block("0123456789abcdef", bytes.fromhex(header["block_hash"]), header["token_ids"], payload)


@pytest.mark.parametrize("damage, reason", [
    (lambda d: d[: len(d) - 1000], "truncated"),
    (lambda d: d[:5000] + bytes([d[5000] ^ 0x10]) + d[5001:], "checksum"),
    (_foreign, "fingerprint"),
])
def test_a_bad_block_file_is_counted_and_recomputed_never_served(model_path, cold, tmp_path, damage, reason):
    tiers = dict(kv_disk_dir=str(tmp_path), kv_disk_bytes=2**24)
    _write_prefix(model_path, **tiers)
    path = _file_of_block(tmp_path, 3)
    data = open(path, "rb").read()
    open(path, "wb").write(damage(data))
    engine = _engine(model_path, **tiers)
    out = _generate(engine, QUERY)
    stats = engine.get_stats()
    assert out.num_cached_tokens == stats.prefix_cache_hits_disk == 3 * 16  # the hit ends before the bad block
    assert stats.num_rejected_block_files == 1 and not os.path.exists(path)
    assert engine.core.scheduler.host_tier.file_tiers.stores[0].num_rejected[reason] == 1
    assert out.outputs[0].token_ids == cold
    engine.shutdown()


def test_a_second_replica_serves_the_first_ones_prefix_from_the_shared_tier(model_path, cold, tmp_path):
    shared = str(tmp_path / "shared")
    written = _write_prefix(model_path, kv_disk_dir=str(tmp_path / "a"), kv_disk_bytes=2**24, kv_shared_dir=shared)
    assert written.num_shared_blocks_written == written.num_disk_blocks_written >= 6
    engine = _engine(model_path, kv_disk_dir=str(tmp_path / "b"), kv_disk_bytes=2**24, kv_shared_dir=shared)
    out = _generate(engine, QUERY)
    stats = engine.get_stats()
    assert out.num_cached_tokens == stats.prefix_cache_hits_shared == 96 and stats.prefix_cache_hits_disk == 0
    assert out.outputs[0].token_ids == cold
    engine.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_write_through_publishes_a_finished_prefix_without_an_eviction(model_path, cold, tmp_path, async_scheduling):
    """kv_write_through: PREFIX reaches the shared tier when its request ends, while it is still
    cached on the device (no other request evicted it); a second replica serves it from there."""
    shared = str(tmp_path / "shared")
    tiers = dict(kv_shared_dir=shared, kv_write_through=True, async_scheduling=async_scheduling)
    first = _engine(model_path, **tiers)
    _generate(first, PREFIX, "p")
    first.core.executor.host_kv_cache.file_io.flush()
    stats = first.get_stats()
    assert stats.num_shared_blocks_written == 6 and stats.num_offloaded_blocks == 6
    again = _generate(first, QUERY, "again")  # still cached on the device: a device hit, nothing loaded
    assert again.num_cached_tokens == 96 and first.get_stats().prefix_cache_hits_host == 0
    assert again.outputs[0].token_ids == cold
    first.shutdown()
    second = _engine(model_path, **tiers)
    out = _generate(second, QUERY)
    assert out.num_cached_tokens == second.get_stats().prefix_cache_hits_shared == 96
    assert out.outputs[0].token_ids == cold
    second.shutdown()
    with pytest.raises(ValueError, match="kv_write_through"):
        EngineConfig(model=model_path, cpu_offload_bytes=2**22, kv_write_through=True)


def test_layouts_the_file_tiers_cannot_serve_are_refused(tmp_path, smollm2_path):
    from pagoda.engine.llm_engine import LLMEngine
    from tests.engine.hf_reference import make_random_model

    folder = str(make_random_model(tmp_path / "m", "qwen3-window12-layer1", smollm2_path))
    with pytest.raises(ValueError, match="kv_disk_dir/kv_shared_dir: the file tiers hold prefix blocks .* 2 paged"):
        LLMEngine(EngineConfig(model=folder, cpu_offload_bytes=2**22, preemption_mode="recompute",
                               kv_shared_dir=str(tmp_path / "s")))
    with pytest.raises(ValueError, match="need enable_prefix_caching"):
        LLMEngine(EngineConfig(model=folder, cpu_offload_bytes=2**22, preemption_mode="recompute",
                               kv_shared_dir=str(tmp_path / "s"), enable_prefix_caching=False))


@pytest.mark.slow  # three SmolLM2-135M engines: ~20 s on 2 cores at load 2.5
def test_the_default_model_from_the_shared_tier_equals_it_cold(smollm2_path, tmp_path):
    """SmolLM2-135M: a 96-token prefix written by one engine, served to another from the shared tier."""
    from pagoda.engine.llm_engine import LLMEngine

    written = _write_prefix(smollm2_path, cpu_offload_bytes=2**24, kv_shared_dir=str(tmp_path))
    assert written.num_shared_blocks_written >= 6
    engine = _engine(smollm2_path, cpu_offload_bytes=2**24, kv_shared_dir=str(tmp_path))
    out = _generate(engine, QUERY)
    assert out.num_cached_tokens == engine.get_stats().prefix_cache_hits_shared == 96
    engine.shutdown()
    cold = _generate(LLMEngine(EngineConfig(model=smollm2_path, enable_prefix_caching=False)), QUERY)
    assert out.outputs[0].token_ids == cold.outputs[0].token_ids
