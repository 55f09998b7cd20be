"""Gemma 4's model code with images (its vision tower, embedder, per-layer inputs at image rows,
bidirectional image attention on sliding layers only) against transformers, engine-free.

One prefill of a prompt with two images of different shapes (55 and 64 soft tokens: the
processor keeps each image's aspect ratio) on a paged KV cache (``models.testing``), the image
rows from ``encode_image`` and their key limits on the metadata (a soft token sees keys up to its
image's last position; the model keeps them on its sliding layers only): every position's
logits match ``Gemma4ForConditionalGeneration``'s; also with KV-shared layers and k=v full layers
(``VARIANTS``).

The bound is derived, not chosen: transformers' own float32 logits differ from its float64 ones by
``d``; two float32 computations of the same function differ from each other by at most about the
sum of their distances to the exact one, so ``4 * d`` (each side's error, with room for a different
summation order). The negative checks: without the key limits (plain causal over the images) the
logits move by more than 100 times that bound, and so they do with the limits on every layer
(Gemma 3's rule), so the bound would catch a missing mask or one on the wrong layers.
"""

from __future__ import annotations

import pytest
import torch

from pagoda.kernels import AttentionMetadata
from pagoda.models import load_model
from pagoda.models.multimodal import MultiModalBatch
from pagoda.models.testing import make_layer_caches

from tests.engine.gemma4_vision_reference import BOI, EOI, IMAGE, HFGemma4, save_gemma4
from tests.engine.vision_reference import random_image

PROMPT = [1, 504, IMAGE, 2226, 3375, 314, IMAGE, 504, 2226]
BLOCK = 16


# The released large models' k=v full layers and the small ones' KV-shared layers (not the MoE block:
# transformers' experts do not run in float64, which the bound needs; it does not touch the image path).
VARIANTS = {"base": {}, "shared-k-eq-v": dict(num_kv_shared_layers=2, use_double_wide_mlp=True, attention_k_eq_v=True,
                                              num_global_key_value_heads=1)}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory, smollm2_path):
    folder = save_gemma4(tmp_path_factory.mktemp("gemma4-vl-logits"), smollm2_path, seed=3, **VARIANTS[request.param])
    return load_model(str(folder), dtype=torch.float32), HFGemma4(folder)


def _image_limits(ids: list[int]) -> list[int]:
    """Each soft token's last visible key: its image's last soft token (others: their own position)."""
    limits = list(range(len(ids)))
    for i in reversed(range(len(ids) - 1)):
        if ids[i] == IMAGE and ids[i + 1] == IMAGE:
            limits[i] = limits[i + 1]
    return limits


def _logits(model, ids: list[int], inputs: dict, limits: str = "sliding") -> torch.Tensor:
    rows = [i for i, t in enumerate(ids) if t == IMAGE]
    embeds = torch.cat([model.encode_image({"pixel_values": inputs["pixel_values"][j:j + 1],
                                            "image_position_ids": inputs["image_position_ids"][j:j + 1]}).embeds
                        for j in range(inputs["pixel_values"].shape[0])])
    blocks = -(-len(ids) // BLOCK)
    meta = AttentionMetadata.build([len(ids)], [len(ids)], [list(range(blocks))], BLOCK, "cpu")
    if limits != "causal":
        meta.set_key_limits(_image_limits(ids), "cpu")
    if limits == "every layer":  # Gemma 3's rule: the model would drop the limits on full layers; keep them
        model = _keeping_limits(model)
    batch = MultiModalBatch(torch.tensor(rows), embeds)
    hidden = model(torch.tensor(ids), torch.arange(len(ids)), make_layer_caches(model, blocks, BLOCK, 1), meta,
                   mm=batch)
    return model.compute_logits(hidden)


def _keeping_limits(model):
    """``model`` with no full-attention layers to strip the key limits from (a shallow copy)."""
    import copy

    clone = copy.copy(model)
    clone.full_layers = []
    return clone


def test_prefill_with_two_images_matches_transformers_and_needs_the_sliding_image_mask(pair):
    model, hf = pair
    images = [random_image(1, 64, 32), random_image(2)]
    inputs = hf.inputs(PROMPT, images)
    ids = inputs["input_ids"][0].tolist()
    assert ids.count(IMAGE) == 55 + 64 and ids[2] == BOI and ids[3 + 55] == EOI
    with torch.inference_mode():
        expected = hf.model(**inputs).logits[0]
        wide = hf.model.to(torch.float64)(**{k: v.double() if v.is_floating_point() else v
                                              for k, v in inputs.items()}).logits[0]
        hf.model.to(torch.float32)
    bound = 4 * (expected.double() - wide).abs().max().item()
    assert 0 < bound < 1e-2, f"transformers' own float32 error {bound / 4} is not float32 rounding"
    got = _logits(model, ids, inputs)
    print(f"bound {bound:.2e}, difference {(got - expected).abs().max().item():.2e}")
    assert (got - expected).abs().max().item() <= bound
    causal = _logits(model, ids, inputs, limits="causal")
    assert (causal - expected).abs().max().item() > 100 * bound, "the image mask must matter"
    unmasked = hf.logits(PROMPT, images, bidirectional=False)  # transformers agrees on what causal gives
    assert (causal - unmasked).abs().max().item() <= bound
    everywhere = _logits(model, ids, inputs, limits="every layer")
    assert (everywhere - expected).abs().max().item() > 100 * bound, "full layers must stay causal"


def test_text_only_prompts_read_no_image_state(pair):
    """A prompt without images runs Gemma 4's text path: logits equal transformers' (same bound rule)."""
    model, hf = pair
    ids = [1, 504, 2226, 3375, 314, 504, 2226, 3375]
    with torch.inference_mode():
        expected = hf.model(input_ids=torch.tensor([ids])).logits[0]
        wide = hf.model.to(torch.float64)(input_ids=torch.tensor([ids])).logits[0]
        hf.model.to(torch.float32)
    bound = 4 * (expected.double() - wide).abs().max().item()  # as the first test's
    meta = AttentionMetadata.build([len(ids)], [len(ids)], [[0]], BLOCK, "cpu")
    got = model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)), make_layer_caches(model, 1, BLOCK, 1),
                                     meta))
    assert (got - expected).abs().max().item() <= bound


def test_checkpoint_names_audio_ignored_and_refusals(pair, tmp_path):
    import json

    from pagoda.models.registry import build_model, config_from_dict, config_from_pretrained

    model, hf = pair
    names = model.expected_weight_names()
    assert "model.vision_tower.encoder.layers.1.mlp.down_proj.output_max" in names
    assert "model.vision_tower.std_scale" in names and "model.embed_vision.embedding_projection.weight" in names
    assert "model.language_model.embed_tokens_per_layer.weight" in names
    assert model.ignored_checkpoint_prefixes == ("model.audio_tower.", "model.embed_audio.")
    raw = json.loads(hf.model.config.to_json_string())
    raw["architectures"] = ["Gemma4ForConditionalGeneration"]
    spec = config_from_dict(raw).vision
    assert (spec.prompt_token_id, spec.begin_token_id, spec.end_token_id, spec.is_bidirectional) == (
        IMAGE, BOI, EOI, True)
    causal = {**raw, "text_config": {**raw["text_config"], "use_bidirectional_attention": None}}
    assert not config_from_dict(causal).vision.is_bidirectional  # the small Gemma 4s: causal images
    for broken, match in (({"vision_config": None}, "needs text_config and vision_config"),
                          ({"text_config": {**raw["text_config"], "use_bidirectional_attention": "all"}},
                           "use_bidirectional_attention='all' is not supported"),
                          ({"vision_config": {**raw["vision_config"], "hidden_activation": "silu"}},
                           "vision_config.hidden_activation")):
        folder = tmp_path / str(len(list(tmp_path.iterdir())))
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({**raw, **broken}))
        with pytest.raises(ValueError, match=match):
            build_model(config_from_pretrained(folder))


def test_an_audio_tower_in_the_checkpoint_is_left_unread(tmp_path, smollm2_path):
    """Gemma 4 E2B/E4B carry an audio tower: the checkpoint loads (images served), its tensors unread."""
    import transformers

    from tests.engine.gemma4_vision_reference import GEMMA4

    audio = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, subsampling_conv_channels=[4, 4],
                 output_proj_dims=16)
    config = transformers.Gemma4Config(**{**GEMMA4, "audio_config": audio})
    torch.manual_seed(0)
    hf = transformers.Gemma4ForConditionalGeneration(config).eval()
    assert any(n.startswith("model.audio_tower.") for n in hf.state_dict())
    hf.save_pretrained(tmp_path)
    model = load_model(str(tmp_path), dtype=torch.float32)
    assert not any("audio" in n for n in model.expected_weight_names())


def test_a_sparse_config_is_completed_with_transformers_defaults():
    """A config.json that leaves most fields to transformers' defaults (as the released ones do)
    is completed as transformers reads it: Gemma4TextConfig's and Gemma4VisionConfig's defaults."""
    from pagoda.models.gemma4_vl import parse_config

    raw = {"architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4",
           "text_config": {"use_bidirectional_attention": "vision", "num_hidden_layers": 6},
           "vision_config": {"model_type": "gemma4_vision"}, "eos_token_id": [1, 106]}
    config = parse_config(raw, "Gemma4ForConditionalGeneration")
    assert (config.hidden_size, config.vocab_size, config.num_hidden_layers) == (2304, 262144, 6)
    assert config.layer_types == ("sliding_attention",) * 5 + ("full_attention",)
    assert config.gemma4.ple_dim == 256 and config.gemma4.media_token_ids == (258880, 258884, 258881)
    spec = config.vision
    assert (spec.prompt_token_id, spec.begin_token_id, spec.end_token_id) == (258880, 255999, 258882)
    assert spec.processor_defaults == {"patch_size": 16, "pooling_kernel_size": 3} and spec.counted_by_processor
    assert spec.vision_config["position_embedding_size"] == 10240 and spec.is_bidirectional


def test_the_tower_reads_nothing_back_from_its_device(pair):
    """On the meta device (where any read of a value raises) the tower and embedder run on the
    processor's host tensors: the real patches and pooling squares are chosen on the host."""
    from pagoda.models.gemma4_vision import Gemma4VisionEmbedder, Gemma4VisionTower

    model, hf = pair
    vision = model.config.vision.vision_config
    tower, embedder = Gemma4VisionTower(vision, torch.float32, "meta"), Gemma4VisionEmbedder(vision, 64, torch.float32,
                                                                                          "meta")
    inputs = hf.inputs([IMAGE], [random_image(1, 64, 32)])
    out = embedder(tower(inputs["pixel_values"], inputs["image_position_ids"]))
    assert out.device.type == "meta" and tuple(out.shape) == (55, 64)


def test_without_vision_bidirectional_attention_images_are_causal(tmp_path, smollm2_path):
    """``use_bidirectional_attention: null`` (the small Gemma 4s): transformers' mask is causal even
    with the image token types, and the spec asks for no key limits; the logits match causal ones."""
    folder = save_gemma4(tmp_path, smollm2_path, seed=5, use_bidirectional_attention=None)
    model, hf = load_model(str(folder), dtype=torch.float32), HFGemma4(folder)
    assert not model.config.vision.is_bidirectional
    inputs = hf.inputs(PROMPT, [random_image(1, 64, 32), random_image(2)])
    with torch.inference_mode():
        expected = hf.model(**inputs).logits[0]
        wide = hf.model.to(torch.float64)(**{k: v.double() if v.is_floating_point() else v
                                              for k, v in inputs.items()}).logits[0]
    bound = 4 * (expected.double() - wide).abs().max().item()  # as the first test's
    got = _logits(model, inputs["input_ids"][0].tolist(), inputs, limits="causal")
    assert (got - expected).abs().max().item() <= bound
