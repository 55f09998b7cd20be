"""Tiny random vision-language checkpoints for the engine's image tests, and transformers' greedy
decoding of a prompt with images (the reference).

A checkpoint is made by transformers here (float32, random weights, SmolLM2's tokenizer, a
``preprocessor_config.json`` from the model's own PIL image processor with small pixel bounds,
so a 64x64 image is 4 placeholder tokens). Prompts are token ids holding one ``IMAGE`` token
per image, as the model's chat template writes them; ``HFVision.generate`` expands them as
transformers' processor does and runs ``generate``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from tests.engine.hf_reference import TOKENIZER_FILES

IMAGE, VISION_START, VISION_END = 49000, 49001, 49002
PROCESSOR = dict(patch_size=16, merge_size=2, temporal_patch_size=2, min_pixels=32 * 32, max_pixels=128 * 128)
QWEN3_VL = dict(
    text_config=dict(vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, initializer_range=0.25,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
                     tie_word_embeddings=False),
    vision_config=dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64, patch_size=16,
                       spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16,
                       deepstack_visual_indexes=[0], initializer_range=0.25),
    image_token_id=IMAGE, vision_start_token_id=VISION_START, vision_end_token_id=VISION_END, video_token_id=49003,
    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
# Qwen3.5: the hybrid decoder (3 DeltaNet layers, 1 gated full-attention layer rotating half of
# each head: M-RoPE over 4 frequencies), the tower without DeepStack.
QWEN3_5_VL = dict(
    text_config=dict(vocab_size=49152, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                     linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                     max_position_embeddings=1024, initializer_range=0.25, num_hidden_layers=4, intermediate_size=48,
                     linear_conv_kernel_dim=3, tie_word_embeddings=False,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1],
                                      "partial_rotary_factor": 0.5, "mrope_interleaved": True}),
    vision_config=dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=32, patch_size=16,
                       spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16, initializer_range=0.25),
    image_token_id=IMAGE, vision_start_token_id=VISION_START, vision_end_token_id=VISION_END, video_token_id=49003,
    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
QWEN3_5_MOE_VL = {**QWEN3_5_VL, "text_config": {**QWEN3_5_VL["text_config"], "num_experts": 4, "num_experts_per_tok": 2,
                                                 "moe_intermediate_size": 24, "shared_expert_intermediate_size": 20}}
# Qwen3-VL-MoE: Qwen3-VL with 4 experts top-2 in every layer but the first (stacked in its checkpoint).
QWEN3_VL_MOE = {**QWEN3_VL, "text_config": {**QWEN3_VL["text_config"], "num_experts": 4, "num_experts_per_tok": 2,
                                             "moe_intermediate_size": 32, "mlp_only_layers": [0]}}
# name -> (transformers config class, model class, config)
ARCHS = {"qwen3-vl": ("Qwen3VLConfig", "Qwen3VLForConditionalGeneration", QWEN3_VL),
         "qwen3-vl-moe": ("Qwen3VLMoeConfig", "Qwen3VLMoeForConditionalGeneration", QWEN3_VL_MOE),
         "qwen3.5": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration", QWEN3_5_VL),
         "qwen3.5-moe": ("Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration", QWEN3_5_MOE_VL)}


def run_image_requests(engine, requests: list[tuple[list[int], list]], params, prefix: str = "r") -> list[list[int]]:
    """Each ``(token ids, images)`` as vLLM's prompt dict (no images: a text-only request) through
    ``engine`` to the end; their output token ids in order."""
    from tests.engine.driving import drain

    for i, (ids, images) in enumerate(requests):
        prompt = {"prompt_token_ids": ids, "multi_modal_data": {"image": images}} if images else ids
        engine.add_request(f"{prefix}{i}", prompt, params)
    finals = drain(engine)
    return [finals[f"{prefix}{i}"].outputs[0].token_ids for i in range(len(requests))]


def random_image(seed: int, width: int = 64, height: int = 64):
    """A PIL RGB image of smooth random colour blobs (so resizing keeps it distinct)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    small = (rng.random((4, 4, 3)) * 255).astype("uint8")
    return Image.fromarray(small).resize((width, height), Image.BILINEAR)


def save_qwen3_vl(out_dir: Path, tokenizer_dir: str, seed: int = 0, arch: str = "qwen3-vl") -> Path:
    """A random vision-language folder of ``ARCHS[arch]`` (see the module docstring)."""
    import shutil

    import transformers

    config_class, model_class, fields = ARCHS[arch]
    config = getattr(transformers, config_class)(**fields)
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(config).eval()
    with torch.no_grad():  # norms off their constants (Qwen3.5's are zero-centred), so every offset counts
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("dt_bias"):
                param.add_(0.3 * torch.randn(param.shape))
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    transformers.Qwen2VLImageProcessorPil(**PROCESSOR).save_pretrained(out_dir)
    for name in TOKENIZER_FILES:
        if (Path(tokenizer_dir) / name).exists():
            shutil.copy(Path(tokenizer_dir) / name, out_dir / name)
    (out_dir / "generation_config.json").write_text('{"bos_token_id": 1, "eos_token_id": 2}')
    return out_dir


class HFVision:
    """transformers' greedy ``generate`` of a prompt with images (never stopping early)."""

    def __init__(self, path: Path) -> None:
        import json

        import transformers

        model_class = json.loads((Path(path) / "config.json").read_text())["architectures"][0]
        self.model = getattr(transformers, model_class).from_pretrained(path, dtype=torch.float32).eval()
        self.processor = transformers.Qwen2VLImageProcessorPil.from_pretrained(path)

    def expand(self, token_ids: list[int], images: list) -> tuple[list[int], dict]:
        """The prompt with each ``IMAGE`` expanded, and the processor's tensors (none without images)."""
        if not images:
            return list(token_ids), {}
        out = self.processor(images=images, return_tensors="pt")
        counts = iter((out["image_grid_thw"].prod(-1) // 4).tolist())
        expanded: list[int] = []
        for t in token_ids:
            expanded += [IMAGE] * next(counts) if t == IMAGE else [t]
        return expanded, dict(out)

    @torch.inference_mode()
    def generate(self, token_ids: list[int], images: list, max_new_tokens: int) -> list[int]:
        expanded, tensors = self.expand(token_ids, images)
        ids = torch.tensor([expanded])
        out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                  mm_token_type_ids=(ids == IMAGE).int(), max_new_tokens=max_new_tokens,
                                  do_sample=False, eos_token_id=None, pad_token_id=0, temperature=None, top_p=None,
                                  top_k=None, **tensors)
        return out[0, len(expanded):].tolist()
