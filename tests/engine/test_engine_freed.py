"""A dropped engine frees its weights and KV cache at once, by reference counting.

An offline user who builds engines one after another in a process (``LLMEngine``, or ``LLM``)
must not keep each one's weights and KV cache until CPython's next full collection, which a
large heap makes rare. So the engine is no reference cycle: the callbacks its parts hold (the
beam search's stop-string finder, the input processor's LoRA and request checks, the core's
adapter check, the guided manager's compile jobs, the scheduler's free-block count) hold the
parts they read, never the engine or their own owner, and the block pool's free queue unlinks
its blocks when it goes. Checked with the cycle collector off: after ``del`` the engine and
its KV cache tensor are gone.
"""

from __future__ import annotations

import gc
import weakref

import pytest

from pagoda.engine.config import EngineConfig
from pagoda.engine.llm import LLM
from pagoda.engine.llm_engine import LLMEngine
from pagoda.engine.sampling_params import SamplingParams

from tests.engine.hf_reference import make_random_model

KV_BYTES = 8 * 2**20


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory, smollm2_path):
    return str(make_random_model(tmp_path_factory.mktemp("freed") / "llama", "llama-gqa3-hd64", smollm2_path))


def _kv_tensor(engine: LLMEngine):
    first = engine.runner.kv_tensors[0]
    return first[0] if isinstance(first, (tuple, list)) else first


def _served(engine: LLMEngine) -> tuple[weakref.ref, weakref.ref]:
    """Run one request of each kind that wires a callback (greedy, a beam group with a stop
    string, n=2 seeded, guided), then the engine's and its KV cache's weak references."""
    requests = {"greedy": SamplingParams(max_tokens=3, temperature=0.0),
                "beam": SamplingParams(max_tokens=3, use_beam_search=True, n=2, best_of=2, temperature=0.0,
                                       stop=["tea"]),
                "n2": SamplingParams(max_tokens=3, n=2, seed=1, temperature=1.0),
                "guided": SamplingParams(max_tokens=3, guided_decoding={"choice": ["yes", "no"]})}
    for request_id, params in requests.items():
        engine.add_request(request_id, "Green tea is", params)
    finished = set()
    while engine.has_unfinished_requests():
        finished |= {out.request_id for out in engine.step() if out.finished}
    assert finished == set(requests)
    return weakref.ref(engine), weakref.ref(_kv_tensor(engine))


def _assert_freed_without_collection(build) -> None:
    gc.collect()
    gc.disable()  # only reference counting may free them
    try:
        engine_ref, kv_ref = build()
        assert engine_ref() is None, "the dropped engine is alive: it is (or hangs from) a reference cycle"
        assert kv_ref() is None, "the dropped engine's KV cache is alive"
    finally:
        gc.enable()


def test_a_dropped_engine_frees_its_kv_cache_without_a_collection(tiny_path):
    def build():
        return _served(LLMEngine(EngineConfig(model=tiny_path, kv_cache_memory_bytes=KV_BYTES)))

    _assert_freed_without_collection(build)


def test_a_dropped_engine_with_async_scheduling_and_lora_is_freed_too(tiny_path):
    def build():
        engine = LLMEngine(EngineConfig(model=tiny_path, kv_cache_memory_bytes=KV_BYTES, async_scheduling=True,
                                        enable_lora=True, max_lora_rank=8))
        return _served(engine)

    _assert_freed_without_collection(build)


def test_a_dropped_llm_frees_its_engine(tiny_path):
    def build():
        llm = LLM(tiny_path, kv_cache_memory_bytes=KV_BYTES)
        outputs = llm.generate(["Green tea is", "Oolong"], SamplingParams(max_tokens=3, temperature=0.0),
                               use_tqdm=False)
        assert [len(out.outputs[0].token_ids) for out in outputs] == [3, 3]
        return weakref.ref(llm.engine), weakref.ref(_kv_tensor(llm.engine))

    _assert_freed_without_collection(build)


def test_a_dropped_free_queue_unlinks_its_blocks():
    """The free queue's links are a cycle (dummy head <-> blocks <-> dummy tail); unlinked when
    the queue goes, its blocks need no collection either."""
    from pagoda.engine.kv.block_pool import FreeBlockQueue, KVCacheBlock

    blocks = [KVCacheBlock(i) for i in range(4)]
    queue = FreeBlockQueue(blocks)
    assert queue.get_all_free_blocks() == blocks and blocks[1].prev_free is blocks[0]
    del queue
    assert all(b.prev_free is None and b.next_free is None for b in blocks)
