"""Qwen3-VL's model code (vision tower, merger, DeepStack, M-RoPE) against transformers, engine-free.

One prefill of a prompt with two images of different grids (4 and 6 placeholder tokens), run
on a paged KV cache through ``models.testing``-style metadata with the step's
``MultiModalBatch``: every position's logits match ``Qwen3VLForConditionalGeneration``'s within
float32 rounding. Checked also that the bound is meaningful: without DeepStack, or with 1-D
positions instead of M-RoPE, the logits move by far more than the bound.
"""

from __future__ import annotations

import pytest
import torch

from pagoda.kernels import AttentionMetadata
from pagoda.models import load_model
from pagoda.models.multimodal import MultiModalBatch
from pagoda.models.testing import make_kv_caches

from tests.engine.vision_reference import IMAGE, VISION_END, VISION_START, HFVision, random_image, save_qwen3_vl

BOUND = 1e-4


class _Image:  # what the runner hands ``mrope_positions``: an offset and the processor's data
    def __init__(self, offset: int, grid: tuple) -> None:
        self.offset, self.data = offset, {"grid_thw": grid}


@pytest.fixture(scope="module")
def pair(tmp_path_factory, smollm2_path):
    folder = save_qwen3_vl(tmp_path_factory.mktemp("qwen3-vl-logits"), smollm2_path, seed=3)
    return load_model(str(folder), dtype=torch.float32), HFVision(folder)


def _logits(model, ids: list[int], tensors: dict, deepstack: bool = True, mrope: bool = True) -> torch.Tensor:
    grids = [tuple(g) for g in tensors["image_grid_thw"].tolist()]
    sizes = [t * h * w for t, h, w in grids]
    offsets = [i for i, t in enumerate(ids) if t == IMAGE and (i == 0 or ids[i - 1] != IMAGE)]
    embeds, deep = [], []
    for pixels, grid in zip(torch.split(tensors["pixel_values"], sizes), grids):
        image = model.encode_image({"pixel_values": pixels, "grid_thw": grid})
        embeds.append(image.embeds)
        deep.append(image.deepstack)
    positions, _ = model.mrope_positions(len(ids), [_Image(o, g) for o, g in zip(offsets, grids)])
    rows = torch.tensor([i for i, t in enumerate(ids) if t == IMAGE])
    batch = MultiModalBatch(rows, torch.cat(embeds), tuple(torch.cat(d) for d in zip(*deep)) if deepstack else (),
                            positions if mrope else None)
    meta = AttentionMetadata.build([len(ids)], [len(ids)], [[0, 1, 2, 3]], 16, "cpu")
    hidden = model(torch.tensor(ids), torch.arange(len(ids)), make_kv_caches(model.config, 4, 16), meta, mm=batch)
    return model.compute_logits(hidden)


def test_prefill_with_two_images_matches_transformers(pair):
    model, hf = pair
    prompt = [1, 504, VISION_START, IMAGE, VISION_END, 2226, VISION_START, IMAGE, VISION_END, 314, 3375]
    ids, tensors = hf.expand(prompt, [random_image(1), random_image(2, 96, 64)])
    x = torch.tensor([ids])
    with torch.inference_mode():
        expected = hf.model(input_ids=x, attention_mask=torch.ones_like(x), mm_token_type_ids=(x == IMAGE).int(),
                            **tensors).logits[0]
    assert (_logits(model, ids, tensors) - expected).abs().max().item() < BOUND
    assert (_logits(model, ids, tensors, deepstack=False) - expected).abs().max().item() > 100 * BOUND
    assert (_logits(model, ids, tensors, mrope=False) - expected).abs().max().item() > 100 * BOUND
