"""Images through the whole engine (Qwen3-VL) vs transformers, and the caches keyed by content.

A tiny random float32 ``Qwen3VLForConditionalGeneration`` made here (``vision_reference``),
served by ``LLMEngine`` / ``LLM`` with images given as vLLM's offline API takes them
(``{"prompt_token_ids": ..., "multi_modal_data": {"image": ...}}``). Greedy tokens must equal
transformers' ``generate`` with one image, two images, an image split across prefill chunks,
and an image after a long shared text prefix served from the prefix cache. The prefix cache is
keyed by content: the same text with another image never hits the blocks that overlap the
image (and with the same image it does); the encoder runs once for an image sent twice.
"""

from __future__ import annotations

import io

import pytest

from pagoda.engine.config import EngineConfig
from pagoda.engine.llm_engine import LLMEngine
from pagoda.engine.sampling_params import SamplingParams

from tests.engine.driving import drain
from tests.engine.vision_reference import (IMAGE, VISION_END, VISION_START, HFVision, random_image, run_image_requests,
                                          save_qwen3_vl)

MAX_NEW = 6
BLOCK = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


@pytest.fixture(scope="module", params=["qwen3-vl", "qwen3.5"])
def vl(request, tmp_path_factory, smollm2_path):
    """(folder, transformers' reference, the tokenizer's ids of a long shared text)."""
    folder = save_qwen3_vl(tmp_path_factory.mktemp(request.param), smollm2_path, arch=request.param)
    engine = LLMEngine(EngineConfig(model=str(folder), enable_prefix_caching=False))
    shared = engine.tokenizer.encode("In a quiet village by the sea, an old lighthouse keeper kept a journal of "
                                     "every ship that passed, noting the weather and the hour of the tide.")
    return folder, HFVision(folder), shared


def _image_prompt(text_ids: list[int], tail: list[int], num_images: int = 1) -> list[int]:
    return text_ids + [VISION_START, IMAGE, VISION_END] * num_images + tail


def _run(engine: LLMEngine, requests: list[tuple[list[int], list]], prefix: str = "r") -> list[list[int]]:
    return run_image_requests(engine, requests, GREEDY, prefix)


def test_one_and_two_images_equal_transformers_and_depend_on_the_image(vl):
    folder, hf, _ = vl
    engine = LLMEngine(EngineConfig(model=str(folder), enable_prefix_caching=False))
    one = _image_prompt([1, 504, 3375], [2226, 314])
    two = _image_prompt([1, 504], [2226], num_images=2)
    a, b, wide = random_image(1), random_image(2), random_image(3, 96, 64)
    text = [1, 504, 3375, 2226, 314]
    got = _run(engine, [(one, [a]), (one, [b]), (text, []), (two, [a, wide])])  # a text-only request among them
    assert got == [hf.generate(one, [a], MAX_NEW), hf.generate(one, [b], MAX_NEW), hf.generate(text, [], MAX_NEW),
                   hf.generate(two, [a, wide], MAX_NEW)]
    assert got[0] != got[1], "the tiny model's greedy output must depend on the image"
    assert _run(engine, [(text, [])], "alone") == [got[2]], "a text request alone: as in a batch with images"
    stats = engine.get_stats()
    assert stats.mm_encoder_runs == 3 and stats.mm_encoder_cache_hits == 1  # a: encoded once, read again
    assert stats.num_free_blocks == stats.num_blocks


def test_image_split_across_prefill_chunks_equals_transformers(vl):
    folder, hf, _ = vl
    engine = LLMEngine(EngineConfig(model=str(folder), enable_prefix_caching=False, max_num_batched_tokens=5))
    prompt = _image_prompt([1, 504, 3375], [2226, 314], num_images=2)
    images = [random_image(4, 96, 64), random_image(5)]
    assert _run(engine, [(prompt, images)]) == [hf.generate(prompt, images, MAX_NEW)]
    assert engine.get_stats().mm_encoder_runs == 2, "each image encoded once, though its rows came in several chunks"


@pytest.mark.parametrize("mode", ["recompute", "async"])
def test_images_batched_chunked_and_preempted_equal_transformers(vl, mode):
    """Three image requests at a 7-token budget in a cache so small that requests are preempted:
    a readmitted request's image rows come back from the encoder cache, its positions recomputed."""
    folder, hf, shared = vl
    engine = LLMEngine(EngineConfig(model=str(folder), block_size=BLOCK, max_num_batched_tokens=7,
                                    num_gpu_blocks_override=8, async_scheduling=mode == "async"))
    prompts = [_image_prompt(shared[:20], [2226, 314]), _image_prompt([1, 504], [3375], num_images=2),
               _image_prompt(shared[:20], [2226])]
    images = [[random_image(11)], [random_image(12, 96, 64), random_image(13)], [random_image(11)]]
    assert _run(engine, list(zip(prompts, images))) == [hf.generate(p, i, MAX_NEW) for p, i in zip(prompts, images)]
    stats = engine.get_stats()
    assert stats.num_preemptions > 0, "the tiny cache should have preempted"
    assert stats.mm_encoder_runs == 3, "three distinct images, each encoded once across chunks and readmissions"
    assert stats.num_free_blocks == stats.num_blocks


def test_prefix_cache_is_keyed_by_image_content(vl):
    folder, hf, shared = vl
    engine = LLMEngine(EngineConfig(model=str(folder), block_size=BLOCK))
    prompt = _image_prompt(shared, [2226, 314, 3375])
    first, same, other = random_image(6), random_image(6), random_image(7)
    assert _run(engine, [(prompt, [first])], "a") == [hf.generate(prompt, [first], MAX_NEW)]
    runs, hits = engine.get_stats().mm_encoder_runs, engine.get_stats().prefix_cache_hits

    # The same picture (another object, same pixels) after the same text: every full block hits.
    assert _run(engine, [(prompt, [same])], "b") == [hf.generate(prompt, [same], MAX_NEW)]
    expanded = len(hf.expand(prompt, [same])[0])
    after_same = engine.get_stats()
    assert after_same.prefix_cache_hits - hits == (expanded - 1) // BLOCK * BLOCK
    assert after_same.mm_encoder_runs == runs, "a prefix hit over the whole image needs no encoder"

    # Another image, the same token ids: only the blocks that end before the image hit.
    assert _run(engine, [(prompt, [other])], "c") == [hf.generate(prompt, [other], MAX_NEW)]
    image_offset = len(shared) + 1
    after_other = engine.get_stats()
    assert after_other.prefix_cache_hits - after_same.prefix_cache_hits == image_offset // BLOCK * BLOCK
    assert after_other.mm_encoder_runs == runs + 1
    assert after_other.num_free_blocks == after_other.num_blocks


def test_the_same_image_as_bytes_hashes_the_same_and_is_not_encoded_again(vl):
    folder, hf, _ = vl
    engine = LLMEngine(EngineConfig(model=str(folder), enable_prefix_caching=False))
    image = random_image(8)
    png, jpeg_free = io.BytesIO(), io.BytesIO()
    image.save(png, format="PNG")
    image.save(jpeg_free, format="BMP")
    prompt = _image_prompt([1, 504], [2226])
    got = _run(engine, [(prompt, [image]), (prompt, [png.getvalue()]), (prompt, [jpeg_free.getvalue()])])
    assert got == [hf.generate(prompt, [image], MAX_NEW)] * 3
    assert engine.get_stats().mm_encoder_runs == 1


def test_the_offline_api_takes_vllms_prompt_dict(vl):
    from pagoda.engine.llm import LLM

    folder, hf, _ = vl
    llm = LLM(str(folder), enable_prefix_caching=False)
    prompt = _image_prompt([1, 504], [2226])
    image = random_image(9)
    out = llm.generate({"prompt_token_ids": prompt, "multi_modal_data": {"image": image}}, GREEDY, use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf.generate(prompt, [image], MAX_NEW)


@pytest.fixture(scope="module")
def strict_engine(vl):
    """One engine (per architecture) for every bad input: it must keep serving after each."""
    return LLMEngine(EngineConfig(model=str(vl[0]), max_image_pixels=500 * 500, max_image_bytes=50_000))


def _bomb() -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("L", (6000, 6000)).save(buffer, format="PNG")  # 36 M pixels in ~35 KB
    return buffer.getvalue()


def _truncated() -> bytes:
    buffer = io.BytesIO()
    random_image(10).save(buffer, format="PNG")
    return buffer.getvalue()[:200]


@pytest.mark.parametrize("images, prompt_images, match", [
    ([random_image(i) for i in range(5)], 5, r"multi_modal_data.image: 5 images; at most 4 per prompt"),
    ([random_image(0, 600, 600)], 1, r"multi_modal_data.image\[0\]: 600x600 = 360000 pixels; at most 250000"),
    ([b"not an image at all"], 1, r"multi_modal_data.image\[0\]: not an image"),
    ([None], 1, r"multi_modal_data.image\[0\]: must be a PIL image or its encoded bytes"),
    ([_truncated()], 1, r"multi_modal_data.image\[0\]: the image data is truncated or corrupt"),
    ([_bomb()], 1, r"multi_modal_data.image\[0\]: 6000x6000 = 36000000 pixels; at most 250000"),
    ([random_image(1)], 2, r"prompt: 2 image placeholders \(token id 49000\) for 1 images"),
    ([], 0, r"multi_modal_data.image: no image given"),
    ([bytes(60_000)], 1, r"multi_modal_data.image\[0\]: 60000 bytes; at most 50000"),
])
def test_bad_images_are_refused_naming_the_limit_and_nothing_leaks(strict_engine, images, prompt_images, match):
    engine = strict_engine
    prompt = _image_prompt([1, 504], [2226], num_images=prompt_images)
    with pytest.raises(ValueError, match=match):
        engine.add_request("bad", {"prompt_token_ids": prompt, "multi_modal_data": {"image": images}}, GREEDY)
    assert not engine.has_unfinished_requests()
    good = _image_prompt([1, 504], [2226])
    assert len(_run(engine, [(good, [random_image(1)])])[0]) == MAX_NEW, "the engine keeps serving"
    assert engine.get_stats().num_free_blocks == engine.get_stats().num_blocks


def test_a_placeholder_without_an_image_and_an_image_for_a_text_model_are_refused(vl, model_path):
    folder, _, _ = vl
    engine = LLMEngine(EngineConfig(model=str(folder)))
    with pytest.raises(ValueError, match="prompt: holds the image placeholder token 49000 but multi_modal_data"):
        engine.add_request("x", _image_prompt([1], [2]), GREEDY)
    with pytest.raises(ValueError, match="truncate_prompt_tokens: not supported with images"):
        engine.add_request("t", {"prompt_token_ids": _image_prompt([1], [2]), "multi_modal_data": {
            "image": random_image(1)}}, SamplingParams(max_tokens=2, truncate_prompt_tokens=4))
    with pytest.raises(ValueError, match="multi_modal_data: images are not served with .* beam search"):
        engine.add_request("b", {"prompt_token_ids": _image_prompt([1], [2]), "multi_modal_data": {
            "image": random_image(1)}}, SamplingParams(use_beam_search=True, n=2, temperature=0.0, max_tokens=2))
    if "qwen3.5" not in str(folder):  # a hybrid model refuses speculative decoding itself
        speculating = LLMEngine(EngineConfig(model=str(folder), speculative_method="ngram"))
        with pytest.raises(ValueError, match="multi_modal_data: images are not served with .* speculative decoding"):
            speculating.add_request("s", {"prompt_token_ids": _image_prompt([1], [2]), "multi_modal_data": {
                "image": random_image(1)}}, GREEDY)
    text_only = LLMEngine(EngineConfig(model=model_path))
    with pytest.raises(ValueError, match="multi_modal_data: this model takes text only"):
        text_only.add_request("y", {"prompt": "Hello", "multi_modal_data": {"image": random_image(1)}}, GREEDY)
    assert not engine.has_unfinished_requests() and not text_only.has_unfinished_requests()


def test_kv_events_carry_the_image_hashes_of_the_blocks_that_overlap_an_image(vl):
    from pagoda.contracts.kv_events import BlockStored
    from pagoda.contracts.vllm_kv_events import to_vllm_event
    from pagoda.engine.image_inputs import image_hash

    folder, _, shared = vl
    engine = LLMEngine(EngineConfig(model=str(folder), block_size=BLOCK))
    engine.take_block_events()
    image = random_image(6)
    _run(engine, [(_image_prompt(shared, [2226, 314, 3375]), [image])])
    events = [e.event for e in engine.take_block_events()]
    stored = [e for e in events if isinstance(e, BlockStored) and e.group_idx == 0]
    keys = [k for event in stored for k in to_vllm_event(event).extra_keys]
    start, end = len(shared) + 1, len(shared) + 1 + 4  # a 64x64 image: 4 placeholders
    assert len(keys) >= end // BLOCK + 1
    assert keys == [(image_hash(image),) if i * BLOCK < end and (i + 1) * BLOCK > start else None
                    for i in range(len(keys))]


@pytest.mark.parametrize("arch,seed", [("qwen3.5-moe", 14), ("qwen3-vl-moe", 16)])
def test_moe_decoders_with_images_equal_transformers(arch, seed, tmp_path_factory, smollm2_path):
    """The image path on MoE decoders: Qwen3.5-MoE's (4 experts top-2 and a shared expert per layer)
    and Qwen3-VL-MoE's (``Qwen3VLMoeForConditionalGeneration``: Qwen3-MoE's decoder, the checkpoint's
    stacked experts ``experts.gate_up_proj`` read as they are)."""
    folder = save_qwen3_vl(tmp_path_factory.mktemp(arch), smollm2_path, arch=arch)
    hf = HFVision(folder)
    engine = LLMEngine(EngineConfig(model=str(folder), max_num_batched_tokens=5))
    prompt = _image_prompt([1, 504], [2226], num_images=2)
    images = [random_image(seed), random_image(seed + 1, 96, 64)]
    got = _run(engine, [(prompt, images), (prompt, images[::-1])])
    assert got == [hf.generate(prompt, images, MAX_NEW), hf.generate(prompt, images[::-1], MAX_NEW)]
    assert got[0] != got[1], "the images' order must matter"


def test_a_step_encodes_images_within_the_encoder_budget(vl):
    """Two 4-token images and a 6-token one, an encoder budget of 8: the first step stops before
    the third image (its chunk ends at the image's first placeholder), the next step takes it."""
    folder, hf, _ = vl
    engine = LLMEngine(EngineConfig(model=str(folder), enable_prefix_caching=False, max_num_encoder_tokens=8))
    prompt = _image_prompt([1, 504], [2226], num_images=3)
    images = [random_image(16), random_image(17), random_image(18, 96, 64)]
    engine.add_request("e", {"prompt_token_ids": prompt, "multi_modal_data": {"image": images}}, GREEDY)
    engine.step()
    (request,) = engine.scheduler.running
    third = request.mm_features[2]
    assert request.num_computed_tokens == third.offset and engine.get_stats().mm_encoder_runs == 2
    finals = drain(engine)
    assert finals["e"].outputs[0].token_ids == hf.generate(prompt, images, MAX_NEW)
    assert engine.get_stats().mm_encoder_runs == 3
