"""Greedy outputs of the whole engine equal Hugging Face ``generate``, token for token.

Each model is checked twice: every request alone, and all requests in one batch under
a tiny token budget (chunked prefill mixed with decodes), with prompts sharing a prefix
(prefix-cache hits) and a KV cache so small that requests are preempted and recomputed.
"""

from __future__ import annotations

import pytest

from pagoda.engine.config import EngineConfig
from pagoda.engine.llm_engine import LLMEngine
from pagoda.engine.sampling_params import SamplingParams

from tests.engine.hf_reference import RANDOM_CONFIGS, HFGreedy, make_random_model

MAX_NEW = 12


def _prompts(tokenizer) -> list[list[int]]:
    shared = tokenizer.encode("In a quiet village by the sea, an old lighthouse keeper kept a journal of every ship "
                              "that passed, noting the weather, the colour of the sails and the hour of the tide.")
    return [
        tokenizer.encode("The capital of France is"),
        shared + tokenizer.encode(" One morning he wrote"),
        shared + tokenizer.encode(" Years later, his granddaughter found it and"),
        tokenizer.encode("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"),
    ]


def _run(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return [done[str(i)] for i in range(len(prompts))]


def _assert_matches_hf(ours: list[int], hf: list[int], eos_ids) -> None:
    # HF stops at EOS; ours ignores it. Up to HF's stop they must agree exactly.
    assert ours[: len(hf)] == hf
    assert len(hf) == MAX_NEW or hf[-1] in eos_ids


def _check_model(path: str) -> None:
    hf = HFGreedy(path)
    alone = LLMEngine(EngineConfig(model=path, enable_prefix_caching=False))
    prompts = _prompts(alone.tokenizer)
    expected = [hf.generate(p, MAX_NEW) for p in prompts]
    eos = alone.eos_token_ids | {2}
    for p, exp in zip(prompts, expected):
        _assert_matches_hf(_run(alone, [p])[0], exp, eos)

    # The most blocks one request holds, over the KV cache groups (a sliding window's are bounded).
    layout = alone.executor.kv_layout
    blocks_needed = max(layout.max_blocks_per_request(len(p) + MAX_NEW, 24) for p in prompts)
    # Chunks of at most 7 tokens a request (long_prefill_token_threshold) in 24-token steps: prompts
    # cut at odd places, several prefilling in one step beside decodes.
    batched = LLMEngine(EngineConfig(model=path, max_num_batched_tokens=24, long_prefill_token_threshold=7,
                                     num_gpu_blocks_override=blocks_needed + 3))
    got = _run(batched, prompts)
    for ours, exp in zip(got, expected):
        _assert_matches_hf(ours, exp, eos)
    stats = batched.get_stats()
    assert stats.num_preemptions > 0, "the tiny cache should have forced preemption"
    assert stats.prefix_cache_hits > 0, "the shared prefix should have hit the cache"
    assert stats.num_free_blocks == stats.num_blocks


def test_smollm2_greedy_matches_hf(smollm2_path):
    _check_model(smollm2_path)


@pytest.mark.parametrize("name", sorted(RANDOM_CONFIGS))
def test_random_configs_greedy_match_hf(name, tmp_path, smollm2_path):
    _check_model(str(make_random_model(tmp_path / name, name, smollm2_path)))
