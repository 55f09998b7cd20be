"""Gemma 3's model code with images (SigLIP tower, projector, bidirectional image attention) against
transformers, engine-free.

One prefill of a prompt with two images on a paged KV cache (``models.testing``), the image rows
from ``encode_image`` and their key limits on the metadata (a soft token sees keys up to its
image's last position): every position's logits match ``Gemma3ForConditionalGeneration``'s.

The bound is derived, not chosen: transformers' own float32 logits differ from its float64 ones by
``d``; two float32 computations of the same function differ from each other by at most about the
sum of their distances to the exact one, so ``4 * d`` (each side's error, with room for a different
summation order). The negative check: without the key limits (plain causal over the images) the
logits move by more than 100 times that bound, so the bound would catch a missing mask.
"""

from __future__ import annotations

import pytest
import torch

from pagoda.kernels import AttentionMetadata
from pagoda.models import load_model
from pagoda.models.multimodal import MultiModalBatch
from pagoda.models.testing import make_kv_caches

from tests.engine.gemma3_vision_reference import BOI, SOFT, TOKENS_PER_IMAGE, HFGemma3, save_gemma3
from tests.engine.vision_reference import random_image

PROMPT = [1, 504, BOI, 2226, 3375, 314, BOI, 504, 2226]


@pytest.fixture(scope="module")
def pair(tmp_path_factory, smollm2_path):
    folder = save_gemma3(tmp_path_factory.mktemp("gemma3-vl-logits"), smollm2_path, seed=3)
    return load_model(str(folder), dtype=torch.float32), HFGemma3(folder)


def _logits(model, ids: list[int], pixel_values: torch.Tensor, bidirectional: bool = True) -> torch.Tensor:
    rows = [i for i, t in enumerate(ids) if t == SOFT]
    embeds = torch.cat([model.encode_image({"pixel_values": pixels[None]}).embeds for pixels in pixel_values])
    meta = AttentionMetadata.build([len(ids)], [len(ids)], [[0, 1, 2, 3]], 16, "cpu")
    if bidirectional:  # each soft token sees its image's last soft token
        meta.set_key_limits([rows[rows.index(i) // TOKENS_PER_IMAGE * TOKENS_PER_IMAGE + TOKENS_PER_IMAGE - 1]
                             if i in rows else i for i in range(len(ids))], "cpu")
    batch = MultiModalBatch(torch.tensor(rows), embeds)
    hidden = model(torch.tensor(ids), torch.arange(len(ids)), make_kv_caches(model.config, 4, 16), meta, mm=batch)
    return model.compute_logits(hidden)


def test_prefill_with_two_images_matches_transformers_and_needs_the_bidirectional_mask(pair):
    model, hf = pair
    images = [random_image(1, 48, 40), random_image(2)]
    inputs = hf.inputs(PROMPT, images)
    ids = inputs["input_ids"][0].tolist()
    assert ids.count(SOFT) == 2 * TOKENS_PER_IMAGE
    with torch.inference_mode():
        expected = hf.model(**inputs).logits[0]
        wide = hf.model.to(torch.float64)(**{k: v.double() if v.is_floating_point() else v
                                              for k, v in inputs.items()}).logits[0]
        hf.model.to(torch.float32)
    bound = 4 * (expected.double() - wide).abs().max().item()
    assert 0 < bound < 1e-3, f"transformers' own float32 error {bound / 4} is not float32 rounding"
    got = _logits(model, ids, inputs["pixel_values"])
    print(f"bound {bound:.2e}, difference {(got - expected).abs().max().item():.2e}")
    assert (got - expected).abs().max().item() <= bound
    causal = _logits(model, ids, inputs["pixel_values"], bidirectional=False)
    assert (causal - expected).abs().max().item() > 100 * bound, "the image mask must matter"
    unmasked = hf.logits(PROMPT, images, bidirectional=False)  # transformers agrees on what causal gives
    assert (causal - unmasked).abs().max().item() <= bound


def test_checkpoint_names_and_refusals(pair, tmp_path):
    import json

    from pagoda.models.registry import build_model, config_from_pretrained

    model, _ = pair
    names = model.expected_weight_names()
    assert "vision_tower.encoder.layers.1.mlp.fc2.bias" in names  # transformers 5's spelling
    assert "multi_modal_projector.mm_input_projection_weight" in names
    assert "language_model.model.layers.0.self_attn.q_norm.weight" in names
    model.match_checkpoint({"vision_tower.vision_model.embeddings.patch_embedding.weight", "lm_head.weight"})
    assert "vision_tower.vision_model.post_layernorm.weight" in model.expected_weight_names()  # released spelling
    model.match_checkpoint(names)
    raw = json.loads((pair[1].model.config.to_json_string()))
    raw["architectures"] = ["Gemma3ForConditionalGeneration"]
    for broken, match in (({"vision_config": None}, "needs text_config and vision_config"),
                          ({"mm_tokens_per_image": 3}, "mm_tokens_per_image 3 must be a square")):
        folder = tmp_path / match.split()[0]
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({**raw, **broken}))
        with pytest.raises(ValueError, match=match):
            build_model(config_from_pretrained(folder))


def test_a_released_config_is_completed_with_transformers_defaults():
    """google/gemma-3-4b-it's config.json (as recalled) names only what differs from the defaults."""
    from pagoda.models.gemma3_vl import parse_config

    raw = {"architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999, "eoi_token_index": 256000,
           "eos_token_id": [1, 106], "image_token_index": 262144, "mm_tokens_per_image": 256, "model_type": "gemma3",
           "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                           "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                           "sliding_window": 1024},
           "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                             "model_type": "siglip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 27,
                             "patch_size": 14, "vision_use_head": False}}
    config = parse_config(raw, "Gemma3ForConditionalGeneration")
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim, config.vocab_size) == (
        8, 4, 256, 262208)
    assert config.layer_types[:6] == ("sliding_attention",) * 5 + ("full_attention",)
    assert (config.rope_theta, config.local_rope_theta, config.rope_scaling["factor"]) == (1e6, 1e4, 8.0)
    assert config.query_pre_attn_scalar == 256 and config.tie_word_embeddings
    spec = config.vision
    assert (spec.tokens_per_image, spec.image_token_id, spec.prompt_token_id, spec.end_token_id) == (
        256, 262144, 255999, 256000)
    assert spec.vision_config["layer_norm_eps"] == 1e-6 and spec.processor_defaults["size"]["height"] == 896
