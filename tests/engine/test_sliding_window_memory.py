"""Sliding-window layers free their out-of-window blocks: memory stays bounded, outputs unchanged.

A long greedy generation on tiny random Gemma 3, gpt-oss and Mistral configs (8- and
16-token windows): at every step the blocks a sliding-window group holds stay within the
window's bound, the freed blocks are reused, and the tokens equal transformers' and
the uniform layout's (every block kept, as before KV cache groups). Mistral windows every
layer, so the whole request fits a cache far smaller than its length.
"""

from __future__ import annotations

import pytest

from pagoda.engine.config import EngineConfig
from pagoda.engine.kv.group_managers import SlidingWindowManager
from pagoda.engine.llm_engine import LLMEngine
from pagoda.engine.sampling_params import SamplingParams

from tests.engine.hf_reference import HFGreedy, make_random_model

NEW_TOKENS = 64
PROMPT = "In a quiet village by the sea, an old lighthouse keeper kept a journal"


def _generate(engine: LLMEngine, prompt: list[int], watch=None) -> list[int]:
    engine.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True))
    tokens = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens = out.outputs[0].token_ids
        if watch is not None and engine.has_unfinished_requests():
            watch(engine.scheduler)
    return tokens


@pytest.mark.parametrize("name", ["gemma3-window8", "gpt-oss-window8", "mistral-window16"])
def test_long_generation_holds_the_window_and_matches_hf(name, tmp_path, smollm2_path):
    path = str(make_random_model(tmp_path / name, name, smollm2_path))
    grouped = LLMEngine(EngineConfig(model=path, max_num_batched_tokens=16))
    prompt = grouped.tokenizer.encode(PROMPT)
    peaks: dict[int, int] = {}

    def watch(scheduler) -> None:
        for manager in scheduler.kv_cache_manager.paged:
            if isinstance(manager, SlidingWindowManager):
                peaks[manager.group_idx] = max(peaks.get(manager.group_idx, 0), manager.num_live_blocks("r"))

    ours = _generate(grouped, prompt, watch)
    layout = grouped.executor.kv_layout
    sliding = [g for g in layout.groups if g.spec.kind == "sliding_window"]
    assert sliding and set(peaks) == {g.index for g in sliding}
    for group in sliding:  # bounded by the window and a 16-token chunk, never by the length
        bound = group.spec.max_live_blocks(10_000, layout.block_size, max_chunk=16)
        assert 0 < peaks[group.index] <= bound < -(-(len(prompt) + NEW_TOKENS) // layout.block_size)
    assert grouped.get_stats().num_free_blocks == grouped.get_stats().num_blocks  # all freed at the end

    uniform = LLMEngine(EngineConfig(model=path, max_num_batched_tokens=16, kv_cache_layout="uniform"))
    assert [g.spec.kind for g in uniform.executor.kv_layout.groups] == ["full_attention"]
    assert ours == _generate(uniform, prompt)
    assert ours == HFGreedy(path).generate(prompt, NEW_TOKENS)


def test_a_windowed_request_fits_a_cache_smaller_than_itself(tmp_path, smollm2_path):
    """Mistral (every layer windowed): 3 blocks of 16 tokens serve a 77-token request."""
    path = str(make_random_model(tmp_path / "m", "mistral-window16", smollm2_path))
    small = LLMEngine(EngineConfig(model=path, max_num_batched_tokens=16, num_gpu_blocks_override=4))
    assert -(-(len(small.tokenizer.encode(PROMPT)) + NEW_TOKENS) // 16) == 5
    ours = _generate(small, small.tokenizer.encode(PROMPT))
    assert ours == HFGreedy(path).generate(small.tokenizer.encode(PROMPT), NEW_TOKENS)
    with pytest.raises(ValueError, match="needs 5 KV blocks"):
        uniform = LLMEngine(EngineConfig(model=path, max_num_batched_tokens=16, num_gpu_blocks_override=4,
                                         kv_cache_layout="uniform"))
        uniform.add_request("u", uniform.tokenizer.encode(PROMPT), SamplingParams(max_tokens=NEW_TOKENS))


def test_beam_search_forks_every_groups_table(tmp_path, smollm2_path):
    """Beams of a windowed model fork both KV cache groups' tables (a window's null entries
    stay null, each group's partial block copied): the beams equal the uniform layout's."""
    path = str(make_random_model(tmp_path / "oss", "gpt-oss-window8", smollm2_path))
    params = SamplingParams(use_beam_search=True, n=2, best_of=3, temperature=0.0, max_tokens=12)

    def beams(layout: str) -> list[list[int]]:
        engine = LLMEngine(EngineConfig(model=path, kv_cache_layout=layout, max_num_batched_tokens=16))
        engine.add_request("b", engine.tokenizer.encode(PROMPT), params)
        outputs = []
        while engine.has_unfinished_requests():
            outputs += [o for o in engine.step() if o.finished]
        assert engine.get_stats().num_free_blocks == engine.get_stats().num_blocks
        return [c.token_ids for c in outputs[0].outputs]

    assert beams("grouped") == beams("uniform")
