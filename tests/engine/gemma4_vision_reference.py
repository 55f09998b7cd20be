"""A tiny random ``Gemma4ForConditionalGeneration`` checkpoint and transformers' greedy decoding of a
prompt with images (the reference for the Gemma 4 image tests).

The checkpoint is made by transformers here (float32, random weights, SmolLM2's tokenizer, a
``preprocessor_config.json`` from ``Gemma4ImageProcessorPil`` with 4-pixel patches pooled 2x2,
at most 70 soft tokens, so a 64x64 image is 64 soft tokens and a 64x32 one 55): a 4-layer
decoder (sliding layers of window 16 and full layers alternating, per-layer inputs,
``use_bidirectional_attention="vision"``), a 2-block vision tower with clipped linears and
standardization, no audio tower. Prompts are token ids holding ``IMAGE`` once per image, as
Gemma 4's chat template writes ``<|image|>``; ``HFGemma4.expand`` writes what Gemma 4's processor
makes of that (``BOI IMAGE * n EOI``, ``n`` the processor's ``num_soft_tokens_per_image``),
independently of the engine's expansion.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.engine.hf_reference import TOKENIZER_FILES

VOCAB = 49152
IMAGE, BOI, EOI = 49000, 49001, 49002
PROCESSOR = dict(patch_size=4, pooling_kernel_size=2, max_soft_tokens=70)
TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, global_head_dim=32, sliding_window=16, max_position_embeddings=1024,
            layer_types=["sliding_attention", "full_attention"] * 2, hidden_size_per_layer_input=8,
            vocab_size_per_layer_input=VOCAB, use_bidirectional_attention="vision", initializer_range=0.25,
            pad_token_id=0, bos_token_id=1, eos_token_id=2)
VISION = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
              head_dim=16, patch_size=4, pooling_kernel_size=2, position_embedding_size=64, standardize=True,
              use_clipped_linears=True, initializer_range=0.25)
GEMMA4 = dict(text_config=TEXT, vision_config=VISION, audio_config=None, image_token_id=IMAGE, boi_token_id=BOI,
              eoi_token_id=EOI, video_token_id=49003, audio_token_id=49004, boa_token_id=49005,
              eoa_token_index=49006, initializer_range=0.25, tie_word_embeddings=True)


@torch.no_grad()
def _move_constants(model) -> None:
    """Norms, scalars, standardization and clip bounds off their constants, so each counts."""
    for name, param in model.named_parameters():
        if "norm" in name or name.endswith("layer_scalar"):
            param.add_(0.3 * torch.randn(param.shape))
        elif "position_embedding_table" in name:
            param.copy_(torch.randn(param.shape) * 0.5)
    for name, buffer in model.named_buffers():
        if name.endswith("std_bias"):
            buffer.copy_(0.1 * torch.randn(buffer.shape))
        elif name.endswith("std_scale"):
            buffer.copy_(1 + 0.3 * torch.randn(buffer.shape))
        elif name.endswith(("input_max", "output_max")):
            buffer.fill_(2.0)
        elif name.endswith(("input_min", "output_min")):
            buffer.fill_(-2.0)
        elif name.endswith("layer_scalar"):
            buffer.copy_(1 + 0.3 * torch.randn(buffer.shape))


def save_gemma4(out_dir: Path, tokenizer_dir: str, seed: int = 0, **text_changes) -> Path:
    """A random Gemma 4 vision folder (module docstring); ``text_changes`` override ``TEXT``."""
    import shutil

    import transformers

    config = transformers.Gemma4Config(**{**GEMMA4, "text_config": {**TEXT, **text_changes}})
    torch.manual_seed(seed)
    model = transformers.Gemma4ForConditionalGeneration(config).eval()
    _move_constants(model)
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    transformers.Gemma4ImageProcessorPil(**PROCESSOR).save_pretrained(out_dir)
    for name in TOKENIZER_FILES:
        if (Path(tokenizer_dir) / name).exists():
            shutil.copy(Path(tokenizer_dir) / name, out_dir / name)
    (out_dir / "generation_config.json").write_text('{"bos_token_id": 1, "eos_token_id": 2}')
    return out_dir


class HFGemma4:
    """transformers' greedy ``generate`` of a prompt with images (never stopping early)."""

    def __init__(self, path: Path) -> None:
        import transformers

        self.model = transformers.Gemma4ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
        self.processor = transformers.Gemma4ImageProcessorPil.from_pretrained(path)

    def inputs(self, token_ids: list[int], images: list, bidirectional: bool = True) -> dict:
        """``forward`` / ``generate`` keyword arguments; ``bidirectional=False`` leaves out the token
        types, so transformers' mask is plain causal (the negative check)."""
        kwargs: dict = {}
        counts: list[int] = []
        if images:
            out = self.processor(images=images, return_tensors="pt")
            kwargs.update(pixel_values=out["pixel_values"], image_position_ids=out["image_position_ids"])
            counts = out["num_soft_tokens_per_image"].tolist()
        expanded: list[int] = []
        soft = iter(counts)
        for t in token_ids:
            expanded += [BOI] + [IMAGE] * next(soft) + [EOI] if t == IMAGE else [t]
        ids = torch.tensor([expanded])
        kwargs.update(input_ids=ids, attention_mask=torch.ones_like(ids))
        if images and bidirectional:
            kwargs["mm_token_type_ids"] = (ids == IMAGE).long()
        return kwargs

    def expand(self, token_ids: list[int], images: list) -> list[int]:
        return self.inputs(token_ids, images)["input_ids"][0].tolist()

    @torch.inference_mode()
    def logits(self, token_ids: list[int], images: list, bidirectional: bool = True) -> torch.Tensor:
        return self.model(**self.inputs(token_ids, images, bidirectional)).logits[0]  # [T, vocab]

    @torch.inference_mode()
    def generate(self, token_ids: list[int], images: list, max_new_tokens: int) -> list[int]:
        kwargs = self.inputs(token_ids, images)
        out = self.model.generate(**kwargs, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
                                  pad_token_id=0, temperature=None, top_p=None, top_k=None)
        return out[0, kwargs["input_ids"].shape[1]:].tolist()
