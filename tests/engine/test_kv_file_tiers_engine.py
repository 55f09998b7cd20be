"""The disk and shared KV tiers end to end on a tiny random Llama (engine.kv.file_tier, docs/kv_offload.md).

Every prefix block served from a file must give the tokens the same engine computes cold
(greedy, fp32); a restarted engine finds the blocks an earlier one wrote; a bad file is
counted and recomputed, never served.
"""

from __future__ import annotations

import os
import random

import pytest

from pagoda.engine.config import EngineConfig
from pagoda.engine.sampling_params import SamplingParams
from tests.engine.driving import drain

RNG = random.Random(46)
PREFIX = [RNG.randrange(1000, 30000) for _ in range(96)]  # 6 blocks of 16
OTHER = [RNG.randrange(1000, 30000) for _ in range(136)]  # 9 blocks with its output: evicts all of PREFIX
QUERY = PREFIX + [RNG.randrange(1000, 30000) for _ in range(10)]
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def _engine(model_path, **tiers):
    from pagoda.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(model=model_path, num_gpu_blocks_override=10, cpu_offload_bytes=2**22,
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


def test_a_restarted_engine_serves_the_prefix_from_the_disk_tier(model_path, cold, tmp_path):
    tiers = dict(kv_disk_dir=str(tmp_path), kv_disk_bytes=2**24)
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
