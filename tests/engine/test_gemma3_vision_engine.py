"""Gemma 3 with images through the whole engine vs transformers: bidirectional image attention,
chunks that never split an image, and the prefix cache keyed by content (also when a hit ends
inside an image).

A tiny random float32 ``Gemma3ForConditionalGeneration`` (``gemma3_vision_reference``: one
sliding layer of window 8, one full layer, 4 soft tokens per image) served by ``LLMEngine``;
greedy tokens must equal transformers' ``generate`` (whose mask lets an image's soft tokens see
each other, ``token_type_ids``).
"""

from __future__ import annotations

import pytest

from pagoda.engine.config import EngineConfig
from pagoda.engine.llm_engine import LLMEngine
from pagoda.engine.sampling_params import SamplingParams

from tests.engine.driving import drain
from tests.engine.gemma3_vision_reference import BOI, EOI, SOFT, TOKENS_PER_IMAGE, HFGemma3, save_gemma3
from tests.engine.vision_reference import random_image, run_image_requests

MAX_NEW = 5
BLOCK = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory, smollm2_path):
    """(folder, transformers' reference, the tokenizer's ids of a long shared text)."""
    folder = save_gemma3(tmp_path_factory.mktemp("gemma3-vl"), smollm2_path)
    engine = LLMEngine(EngineConfig(model=str(folder), enable_prefix_caching=False))
    shared = engine.tokenizer.encode("In a quiet village by the sea, an old lighthouse keeper kept a journal of "
                                     "every ship that passed, noting the weather and the hour of the tide.")
    return folder, HFGemma3(folder), shared


def _run(engine: LLMEngine, requests: list[tuple[list[int], list]], prefix: str = "r") -> list[list[int]]:
    return run_image_requests(engine, requests, GREEDY, prefix)


def test_one_and_two_images_equal_transformers_and_an_image_is_encoded_once(gemma):
    folder, hf, _ = gemma
    engine = LLMEngine(EngineConfig(model=str(folder), enable_prefix_caching=False))
    one, two, text = [1, 504, BOI, 2226, 314], [1, 504, BOI, 3375, BOI, 2226], [1, 504, 3375, 2226, 314]
    a, b, wide = random_image(1), random_image(2), random_image(3, 96, 48)
    got = _run(engine, [(one, [a]), (one, [b]), (text, []), (two, [a, wide])])
    assert got == [hf.generate(one, [a], MAX_NEW), hf.generate(one, [b], MAX_NEW), hf.generate(text, [], MAX_NEW),
                   hf.generate(two, [a, wide], MAX_NEW)]
    assert got[0] != got[1], "the tiny model's greedy output must depend on the image"
    stats = engine.get_stats()
    assert stats.mm_encoder_runs == 3 and stats.mm_encoder_cache_hits == 1  # a: encoded once, read again
    assert stats.num_free_blocks == stats.num_blocks


def test_a_small_token_budget_never_splits_an_image(gemma):
    """A 5-token budget: the chunk that would end inside an image ends before it, the next takes
    the whole image (4 soft tokens); the tokens equal transformers'."""
    folder, hf, shared = gemma
    engine = LLMEngine(EngineConfig(model=str(folder), enable_prefix_caching=False, max_num_batched_tokens=5))
    prompt = shared[:7] + [BOI, 2226, BOI, 314]
    images = [random_image(4), random_image(5, 48, 64)]
    engine.add_request("c", {"prompt_token_ids": prompt, "multi_modal_data": {"image": images}}, GREEDY)
    engine.step()
    (request,) = engine.scheduler.running
    spans = [(f.offset, f.end) for f in request.mm_features]
    ends = [request.num_computed_tokens]
    while request.num_computed_tokens < request.num_prompt_tokens:
        engine.step()
        ends.append(request.num_computed_tokens)
    drain(engine)
    assert all(not start < end < stop for end in ends for start, stop in spans), (ends, spans)
    assert any(end == spans[0][0] for end in ends), "a chunk must have stopped right before the first image"
    assert request.output_token_ids == hf.generate(prompt, images, MAX_NEW)
    assert engine.get_stats().num_free_blocks == engine.get_stats().num_blocks


def test_images_batched_chunked_and_preempted_under_async_scheduling_equal_transformers(gemma):
    """Three image requests at a 6-token budget (an image is 4) in a cache so small that requests are
    preempted and readmitted (their prefix hits may end inside an image), scheduled asynchronously."""
    folder, hf, shared = gemma
    engine = LLMEngine(EngineConfig(model=str(folder), block_size=BLOCK, max_num_batched_tokens=6,
                                    num_gpu_blocks_override=10, async_scheduling=True))
    prompts = [shared[:18] + [BOI, 2226, 314], [1, 504, BOI, 3375, BOI, 2226], shared[:18] + [BOI, 2226]]
    images = [[random_image(11)], [random_image(12, 96, 64), random_image(13)], [random_image(11)]]
    assert _run(engine, list(zip(prompts, images))) == [hf.generate(p, i, MAX_NEW) for p, i in zip(prompts, images)]
    stats = engine.get_stats()
    assert stats.num_preemptions > 0, "the tiny cache should have preempted"
    assert stats.num_free_blocks == stats.num_blocks


def test_prefix_cache_is_keyed_by_image_content(gemma):
    folder, hf, shared = gemma
    engine = LLMEngine(EngineConfig(model=str(folder), block_size=BLOCK))
    prompt = shared + [BOI, 2226, 314, 3375]
    first, same, other = random_image(6), random_image(6), random_image(7)
    assert _run(engine, [(prompt, [first])], "a") == [hf.generate(prompt, [first], MAX_NEW)]
    runs, hits = engine.get_stats().mm_encoder_runs, engine.get_stats().prefix_cache_hits
    expanded = hf.expand(prompt)

    assert _run(engine, [(prompt, [same])], "b") == [hf.generate(prompt, [same], MAX_NEW)]
    after_same = engine.get_stats()
    assert after_same.prefix_cache_hits - hits == (len(expanded) - 1) // BLOCK * BLOCK
    assert after_same.mm_encoder_runs == runs, "a prefix hit over the whole image needs no encoder"

    assert _run(engine, [(prompt, [other])], "c") == [hf.generate(prompt, [other], MAX_NEW)]
    image_offset = expanded.index(SOFT)
    after_other = engine.get_stats()
    assert after_other.prefix_cache_hits - after_same.prefix_cache_hits == image_offset // BLOCK * BLOCK
    assert after_other.mm_encoder_runs == runs + 1
    assert after_other.num_free_blocks == after_other.num_blocks


def test_a_prefix_hit_ending_inside_an_image_gives_transformers_tokens(gemma):
    """The first request's prompt ends with the image, so its blocks after the image hold its own
    output; the second's prompt goes on. The hit ends inside the image (the block holding the
    image's last soft tokens differs by what follows): the rest of the image is prefilled against
    cached keys computed with the whole image in view."""
    folder, hf, shared = gemma
    engine = LLMEngine(EngineConfig(model=str(folder), block_size=BLOCK))
    head = shared[:20]  # then "\n\n", BOI: the soft tokens at 22..25, and a block ends at 24, inside them
    image = random_image(8)
    short, long = head + [BOI], head + [BOI, 2226, 314, 3375, 504]
    offset = hf.expand(short).index(SOFT)
    assert offset // BLOCK < (offset + TOKENS_PER_IMAGE - 1) // BLOCK, "a block boundary must lie inside the image"
    assert _run(engine, [(short, [image])], "s") == [hf.generate(short, [image], MAX_NEW)]
    hits = engine.get_stats().prefix_cache_hits
    assert _run(engine, [(long, [image])], "l") == [hf.generate(long, [image], MAX_NEW)]
    hit = engine.get_stats().prefix_cache_hits - hits
    assert offset < hit < offset + TOKENS_PER_IMAGE, f"the hit ({hit}) must end inside the image at {offset}"
    assert engine.get_stats().num_free_blocks == engine.get_stats().num_blocks


def test_bad_inputs_are_refused_naming_the_field(gemma, model_path):
    folder, _, _ = gemma
    engine = LLMEngine(EngineConfig(model=str(folder), max_num_batched_tokens=3, limit_images_per_prompt=2))
    with pytest.raises(ValueError, match=r"image\[0\]: 4 placeholder tokens .* at most 3 tokens per step "
                                         r"\(max_num_batched_tokens"):
        engine.add_request("big", {"prompt_token_ids": [1, BOI], "multi_modal_data": {"image": random_image(1)}},
                           GREEDY)
    with pytest.raises(ValueError, match=r"multi_modal_data.image: 3 images; at most 2 per prompt"):
        engine.add_request("many", {"prompt_token_ids": [1, BOI, BOI, BOI], "multi_modal_data": {
            "image": [random_image(i) for i in range(3)]}}, GREEDY)
    with pytest.raises(ValueError, match=rf"prompt: holds the image placeholder token {BOI} but multi_modal_data"):
        engine.add_request("none", [1, BOI, 2], GREEDY)
    text_only = LLMEngine(EngineConfig(model=model_path))
    with pytest.raises(ValueError, match="multi_modal_data: this model takes text only"):
        text_only.add_request("t", {"prompt": "Hello", "multi_modal_data": {"image": random_image(1)}}, GREEDY)
    assert not engine.has_unfinished_requests() and not text_only.has_unfinished_requests()
    assert len(_run(engine, [([1, 504, 2226], [])])[0]) == MAX_NEW, "the engine keeps serving"
    assert engine.get_stats().num_free_blocks == engine.get_stats().num_blocks


def test_the_wrap_merges_with_neighbouring_newlines_and_the_routers_view_agrees(gemma, tmp_path):
    """A newline token beside ``<start_of_image>`` joins the wrap's ``"\\n\\n"`` into one run token (as
    vLLM's Gemma 3 merges them for Gemma's tokenizer, whose runs of newlines are single tokens);
    ``spans`` (the router's view) places the image where ``process`` does. Pan-and-scan is refused."""
    import json
    import shutil

    from pagoda.engine.image_inputs import make_image_inputs
    from pagoda.engine.multimodal import MultiModalConfig
    from pagoda.models.registry import config_from_pretrained

    folder, hf, _ = gemma
    config = config_from_pretrained(folder)
    inputs = make_image_inputs(config, str(folder), MultiModalConfig())
    runs = inputs.newline_runs  # SmolLM2's: "\n" * n for n = 1..4 are single tokens
    prompt = [1, 504, runs[1], BOI, runs[1], 2226, BOI, 314]
    image = random_image(9)
    ids, features = inputs.process(prompt, [image, image])
    soft = [SOFT] * TOKENS_PER_IMAGE
    assert ids == [1, 504, runs[3], BOI, *soft, EOI, runs[3], 2226, runs[2], BOI, *soft, EOI, runs[2], 314]
    assert [f.offset for f in features] == [4, 13] and all(f.is_bidirectional for f in features)
    assert inputs.spans(prompt, [image, image]) == (len(ids), [(f.mm_hash, f.offset, f.length) for f in features])
    panned = tmp_path / "panned"
    shutil.copytree(folder, panned)
    processor = json.loads((panned / "preprocessor_config.json").read_text())
    (panned / "preprocessor_config.json").write_text(json.dumps({**processor, "do_pan_and_scan": True}))
    with pytest.raises(ValueError, match="do_pan_and_scan"):
        make_image_inputs(config, str(panned), MultiModalConfig()).process([1, BOI], [image])
