"""The router hashes an image prompt as the replica does (``fleet.routing.image_routing``).

A tiny random Qwen3-VL folder and a Qwen3.5 one (``tests.engine.vision_reference``; Qwen3.5's
blocks live in KV cache groups, hashed alike); the router over it hashes a
prompt with an image; the engine serving the same folder stores the same prompt's blocks and
reports their hashes in its KV events. Same image: the router's hashes equal the events'
(every full block, the ones overlapping the image and after it included). Another image with
the same text: equal before the image, different from the first block that overlaps it.
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from pagoda.contracts.kv_events import BlockStored
from pagoda.engine.config import EngineConfig
from pagoda.engine.llm_engine import LLMEngine
from pagoda.engine.sampling_params import SamplingParams
from pagoda.fleet.routing.image_routing import RouterImages
from pagoda.fleet.routing.replicas import ReplicaSet
from pagoda.fleet.routing.router import Router
from pagoda.models.tokenizer import Tokenizer

from tests.engine.driving import drain
from tests.engine.vision_reference import IMAGE, VISION_END, VISION_START, random_image, save_qwen3_vl

BLOCK = 8
TEXT = [1, 504, 3375, 2226, 314, 1070, 281, 260, 1345, 3658, 28]  # 11 tokens: the image starts in block 1
PROMPT = TEXT + [VISION_START, IMAGE, VISION_END] + [2226, 314, 3375, 504, 281, 260, 1345, 28, 1070, 314]


@pytest.fixture(scope="module", params=["qwen3-vl", "qwen3.5"])
def folder(request, tmp_path_factory, smollm2_path):
    return str(save_qwen3_vl(tmp_path_factory.mktemp(request.param), smollm2_path, arch=request.param))


@pytest.fixture(scope="module")
def router(folder):
    replicas = ReplicaSet("static")
    replicas.set_members([("a", {"grpc": "a:1", "http": "a:2"})])
    images = RouterImages.from_model_dir(folder)
    assert images is not None
    model_id = Path(folder).name  # the replicas seed block hashes with their folder name
    return Router(replicas, Tokenizer.from_pretrained(folder), model_id, block_size=BLOCK, images=images)


def _png(image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def _engine_hashes(folder: str, images: list) -> list[str]:
    """The hashes of the blocks the engine stored for ``PROMPT`` with ``images`` (its KV events)."""
    engine = LLMEngine(EngineConfig(model=folder, block_size=BLOCK, max_model_len=256))
    engine.take_block_events()
    engine.add_request("r", {"prompt_token_ids": PROMPT, "multi_modal_data": {"image": images}},
                       SamplingParams(temperature=0.0, max_tokens=1))
    drain(engine)
    stored = [e.event for e in engine.take_block_events()]
    return [h for e in stored if isinstance(e, BlockStored) and e.group_idx == 0 for h in e.block_hashes]


@pytest.mark.parametrize("size", [(64, 64), (96, 64)])
def test_the_routers_hashes_of_an_image_prompt_equal_the_replicas_kv_events(folder, router, size):
    image = _png(random_image(7, *size))
    analysis = router.analyze(list(PROMPT), images=[image])
    engine = _engine_hashes(folder, [image])
    num_placeholders = size[0] * size[1] // (32 * 32)  # 16-pixel patches merged 2x2
    assert analysis.num_prompt_tokens == len(PROMPT) - 1 + num_placeholders
    assert len(analysis.block_hashes) == analysis.num_prompt_tokens // BLOCK
    assert analysis.block_hashes == engine[:len(analysis.block_hashes)] and len(engine) >= len(analysis.block_hashes)
    assert analysis.token_ids == PROMPT  # sent on as it came: the replica expands the placeholder


def test_the_same_text_with_another_image_routes_apart_after_the_image(router):
    a, b = _png(random_image(1)), _png(random_image(2))
    first, second = router.analyze(list(PROMPT), images=[a]), router.analyze(list(PROMPT), images=[b])
    again = router.analyze(list(PROMPT), images=[_png(random_image(1))])
    image_block = (len(TEXT) + 1) // BLOCK  # the block holding the first placeholder
    assert first.block_hashes[:image_block] == second.block_hashes[:image_block]
    assert all(x != y for x, y in zip(first.block_hashes[image_block:], second.block_hashes[image_block:]))
    assert again.block_hashes == first.block_hashes
    text_only = router.analyze(list(PROMPT))  # no images: the plain token hashes, as before
    assert text_only.block_hashes[:image_block] == first.block_hashes[:image_block]
    assert text_only.block_hashes[image_block] != first.block_hashes[image_block]


def test_images_the_replica_will_refuse_are_routed_by_the_text_before_them(router):
    good = router.analyze(list(PROMPT), images=[_png(random_image(1))])
    image_block = (len(TEXT) + 1) // BLOCK
    for images in ([b"not an image"], [_png(random_image(1))] * 2):
        analysis = router.analyze(list(PROMPT), images=images)
        assert analysis.block_hashes == good.block_hashes[:image_block]
        assert analysis.token_ids == PROMPT


def test_a_text_models_folder_has_no_image_rules(smollm2_path):
    assert RouterImages.from_model_dir(smollm2_path) is None


@pytest.mark.parametrize("family", ["gemma3", "gemma4"])
def test_gemma_wrapped_images_hash_as_the_replica_expands_them(family, tmp_path, smollm2_path):
    """Gemma 3 and 4 wrap an image's soft tokens (Gemma 3 in newlines and ``<start_of_image>`` /
    ``<end_of_image>``, Gemma 4 in ``<|image>`` / ``<image|>``; Gemma 4's count by its processor):
    the router's expanded prompt and hashes are the replica's (its KV events)."""
    from tests.engine.gemma3_vision_reference import save_gemma3
    from tests.engine.gemma4_vision_reference import save_gemma4

    folder = str((save_gemma3 if family == "gemma3" else save_gemma4)(tmp_path / family, smollm2_path))
    replicas = ReplicaSet("static")
    replicas.set_members([("a", {"grpc": "a:1", "http": "a:2"})])
    router = Router(replicas, Tokenizer.from_pretrained(folder), Path(folder).name, block_size=BLOCK,
                    images=RouterImages.from_model_dir(folder))
    image = _png(random_image(7, 96, 64))
    analysis = router.analyze(list(PROMPT), images=[image])
    engine = _engine_hashes(folder, [image])
    expanded, _ = RouterImages.from_model_dir(folder).expand(list(PROMPT), [image])
    assert analysis.num_prompt_tokens == len(expanded) > len(PROMPT) + 2
    assert len(analysis.block_hashes) == analysis.num_prompt_tokens // BLOCK
    assert analysis.block_hashes == engine[:len(analysis.block_hashes)]
