"""Gemma 4 with images through the whole engine vs transformers: a varying number of soft tokens
per image, bidirectional image attention on sliding layers only, per-layer inputs at image rows,
chunks that never split an image, and the prefix cache keyed by content.

A tiny random float32 ``Gemma4ForConditionalGeneration`` (``gemma4_vision_reference``: sliding
layers of window 16 and full layers, per-layer inputs, 55 to 64 soft tokens per image) served by
``LLMEngine``; greedy tokens must equal transformers' ``generate`` (whose mask lets an image's soft
tokens see each other on sliding layers, ``mm_token_type_ids``).
"""

from __future__ import annotations

import pytest

from pagoda.engine.config import EngineConfig
from pagoda.engine.llm_engine import LLMEngine
from pagoda.engine.sampling_params import SamplingParams

from tests.engine.gemma4_vision_reference import BOI, EOI, IMAGE, HFGemma4, save_gemma4
from tests.engine.vision_reference import random_image, run_image_requests

MAX_NEW = 5
BLOCK = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory, smollm2_path):
    """(folder, transformers' reference, the tokenizer's ids of a long shared text)."""
    folder = save_gemma4(tmp_path_factory.mktemp("gemma4-vl"), smollm2_path)
    engine = LLMEngine(EngineConfig(model=str(folder), enable_prefix_caching=False))
    shared = engine.tokenizer.encode("In a quiet village by the sea, an old lighthouse keeper kept a journal of "
                                     "every ship that passed, noting the weather and the hour of the tide.")
    return folder, HFGemma4(folder), shared


def _run(engine: LLMEngine, requests: list[tuple[list[int], list]], prefix: str = "r") -> list[list[int]]:
    return run_image_requests(engine, requests, GREEDY, prefix)


def test_one_and_two_images_equal_transformers_and_an_image_is_encoded_once(gemma):
    folder, hf, _ = gemma
    engine = LLMEngine(EngineConfig(model=str(folder), enable_prefix_caching=False))
    one, two, text = [1, 504, IMAGE, 2226, 314], [1, 504, IMAGE, 3375, IMAGE, 2226], [1, 504, 3375, 2226, 314]
    a, b, wide = random_image(1), random_image(2), random_image(3, 96, 48)
    got = _run(engine, [(one, [a]), (one, [b]), (text, []), (two, [a, wide])])
    assert got == [hf.generate(one, [a], MAX_NEW), hf.generate(one, [b], MAX_NEW), hf.generate(text, [], MAX_NEW),
                   hf.generate(two, [a, wide], MAX_NEW)]
    assert got[0] != got[1], "the tiny model's greedy output must depend on the image"
    assert hf.expand(two, [a, wide]).count(IMAGE) == 64 + 55, "the two images take different token counts"
    stats = engine.get_stats()
    assert stats.mm_encoder_runs == 3 and stats.mm_encoder_cache_hits == 1  # a: encoded once, read again
    assert stats.num_free_blocks == stats.num_blocks


def test_a_small_token_budget_never_splits_an_image_and_preemption_keeps_tokens(gemma):
    """A 70-token budget (an image is 55 to 64) and a cache so small that requests are preempted,
    scheduled asynchronously: no chunk ends inside an image, and the tokens equal transformers'."""
    folder, hf, shared = gemma
    engine = LLMEngine(EngineConfig(model=str(folder), block_size=BLOCK, max_num_batched_tokens=70,
                                    num_gpu_blocks_override=18, async_scheduling=True))
    prompts = [shared[:18] + [IMAGE, 2226, 314], [1, 504, IMAGE, 3375, IMAGE, 2226], shared[:18] + [IMAGE, 2226]]
    images = [[random_image(11)], [random_image(12, 96, 64), random_image(13, 32, 64)], [random_image(11)]]
    assert _run(engine, list(zip(prompts, images))) == [hf.generate(p, i, MAX_NEW) for p, i in zip(prompts, images)]
    stats = engine.get_stats()
    assert stats.num_preemptions > 0, "the tiny cache should have preempted"
    assert stats.num_free_blocks == stats.num_blocks


def test_chunks_stop_before_an_image(gemma):
    folder, hf, shared = gemma
    engine = LLMEngine(EngineConfig(model=str(folder), enable_prefix_caching=False, max_num_batched_tokens=70))
    prompt = shared[:30] + [IMAGE, 2226, IMAGE, 314]
    images = [random_image(4), random_image(5, 48, 64)]
    engine.add_request("c", {"prompt_token_ids": prompt, "multi_modal_data": {"image": images}}, GREEDY)
    engine.step()
    (request,) = engine.scheduler.running
    spans = [(f.offset, f.end) for f in request.mm_features]
    ends = [request.num_computed_tokens]
    while request.num_computed_tokens < request.num_prompt_tokens:
        engine.step()
        ends.append(request.num_computed_tokens)
    from tests.engine.driving import drain

    drain(engine)
    assert all(not start < end < stop for end in ends for start, stop in spans), (ends, spans)
    assert any(end == spans[0][0] for end in ends), "a chunk must have stopped right before the first image"
    assert request.output_token_ids == hf.generate(prompt, images, MAX_NEW)


def test_prefix_cache_is_keyed_by_image_content(gemma):
    folder, hf, shared = gemma
    engine = LLMEngine(EngineConfig(model=str(folder), block_size=BLOCK))
    prompt = shared + [IMAGE, 2226, 314, 3375]
    first, same, other = random_image(6), random_image(6), random_image(7)
    assert _run(engine, [(prompt, [first])], "a") == [hf.generate(prompt, [first], MAX_NEW)]
    runs, hits = engine.get_stats().mm_encoder_runs, engine.get_stats().prefix_cache_hits
    expanded = hf.expand(prompt, [first])

    assert _run(engine, [(prompt, [same])], "b") == [hf.generate(prompt, [same], MAX_NEW)]
    after_same = engine.get_stats()
    assert after_same.prefix_cache_hits - hits == (len(expanded) - 1) // BLOCK * BLOCK
    assert after_same.mm_encoder_runs == runs, "a prefix hit over the whole image needs no encoder"

    assert _run(engine, [(prompt, [other])], "c") == [hf.generate(prompt, [other], MAX_NEW)]
    image_offset = expanded.index(IMAGE)
    after_other = engine.get_stats()
    assert after_other.prefix_cache_hits - after_same.prefix_cache_hits == image_offset // BLOCK * BLOCK
    assert after_other.mm_encoder_runs == runs + 1
    assert after_other.num_free_blocks == after_other.num_blocks


def test_a_prefix_hit_ending_inside_an_image_gives_transformers_tokens(gemma):
    """The first request's prompt ends with the image, so its blocks after the image hold its own
    output; the second's prompt goes on. The hit ends inside the image: the rest of the image is
    prefilled against cached keys computed with the whole image in view (on the sliding layers)."""
    folder, hf, shared = gemma
    engine = LLMEngine(EngineConfig(model=str(folder), block_size=BLOCK))
    image = random_image(8)
    short, long = shared[:20] + [IMAGE], shared[:20] + [IMAGE, 2226, 314, 3375, 504]
    offset = hf.expand(short, [image]).index(IMAGE)
    assert _run(engine, [(short, [image])], "s") == [hf.generate(short, [image], MAX_NEW)]
    hits = engine.get_stats().prefix_cache_hits
    assert _run(engine, [(long, [image])], "l") == [hf.generate(long, [image], MAX_NEW)]
    hit = engine.get_stats().prefix_cache_hits - hits
    assert offset < hit < offset + 64, f"the hit ({hit}) must end inside the image at {offset}"
    assert engine.get_stats().num_free_blocks == engine.get_stats().num_blocks


def test_bad_inputs_are_refused_naming_the_field(gemma):
    folder, _, _ = gemma
    engine = LLMEngine(EngineConfig(model=str(folder), max_num_batched_tokens=40, limit_images_per_prompt=2))
    with pytest.raises(ValueError, match=r"image\[0\]: 64 placeholder tokens .* at most 40 tokens per step"):
        engine.add_request("big", {"prompt_token_ids": [1, IMAGE], "multi_modal_data": {"image": random_image(1)}},
                           GREEDY)
    with pytest.raises(ValueError, match=r"multi_modal_data.image: 3 images; at most 2 per prompt"):
        engine.add_request("many", {"prompt_token_ids": [1, IMAGE, IMAGE, IMAGE], "multi_modal_data": {
            "image": [random_image(i) for i in range(3)]}}, GREEDY)
    with pytest.raises(ValueError, match=rf"prompt: 2 image placeholders \(token id {IMAGE}\) for 1 images"):
        engine.add_request("count", {"prompt_token_ids": [1, IMAGE, IMAGE], "multi_modal_data": {
            "image": [random_image(1)]}}, GREEDY)
    with pytest.raises(ValueError, match=rf"prompt: holds the image placeholder token {IMAGE} but multi_modal_data"):
        engine.add_request("none", [1, IMAGE, 2], GREEDY)
    with pytest.raises(ValueError, match=r"multi_modal_data: only the 'image' modality is served, got \['audio'\]"):
        engine.add_request("audio", {"prompt_token_ids": [1, 2], "multi_modal_data": {"audio": b"RIFF"}}, GREEDY)
    with pytest.raises(ValueError, match=r"multi_modal_data.image\[0\]: not an image"):
        engine.add_request("junk", {"prompt_token_ids": [1, IMAGE], "multi_modal_data": {"image": b"not a png"}},
                           GREEDY)
    assert not engine.has_unfinished_requests()
    assert len(_run(engine, [([1, 504, 2226], [])])[0]) == MAX_NEW, "the engine keeps serving"
    assert engine.get_stats().num_free_blocks == engine.get_stats().num_blocks


def test_expansion_and_the_routers_view_agree(gemma):
    """``<|image|>`` becomes ``<|image>``, the processor's count of soft tokens, ``<image|>`` (no newlines,
    whatever its neighbours); ``spans`` (the router's view) places each image where ``process`` does."""
    from pagoda.engine.image_inputs import make_image_inputs
    from pagoda.engine.multimodal import MultiModalConfig
    from pagoda.models.registry import config_from_pretrained

    folder, hf, _ = gemma
    inputs = make_image_inputs(config_from_pretrained(folder), str(folder), MultiModalConfig())
    newline = inputs.newline_runs[1]
    prompt = [1, 504, newline, IMAGE, newline, 2226, IMAGE, 314]
    images = [random_image(9), random_image(10, 64, 32)]
    ids, features = inputs.process(prompt, images)
    assert ids == hf.expand(prompt, images)
    assert ids[:5] == [1, 504, newline, BOI, IMAGE] and ids[4 + 64] == EOI
    assert [(f.offset, f.length) for f in features] == [(4, 64), (4 + 64 + 4, 55)]
    assert all(f.is_bidirectional for f in features)
    assert inputs.spans(prompt, images) == (len(ids), [(f.mm_hash, f.offset, f.length) for f in features])
