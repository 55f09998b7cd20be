"""A tiny random ``Gemma3ForConditionalGeneration`` checkpoint and transformers' greedy decoding
of a prompt with images (the reference for the Gemma 3 image tests).

The checkpoint is made by transformers here (float32, random weights, SmolLM2's tokenizer, a
``preprocessor_config.json`` from ``Gemma3ImageProcessorPil`` at the tower's 32x32 size): a
2-layer decoder (one sliding layer of window 8, one full layer), a 2-block SigLIP tower of 16
patches pooled to 4 soft tokens. The soft token's id is the vocabulary size (outside the table,
as in the released models). Prompts are token ids holding ``BOI`` once per image, as Gemma 3's
chat template writes ``<start_of_image>``; ``HFGemma3.expand`` writes what Gemma 3's processor
makes of that (``"\\n\\n" BOI SOFT * 4 EOI "\\n\\n"``, the newlines as the tokenizer encodes them),
independently of the engine's expansion, for prompts whose neighbours of ``BOI`` are not newlines.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.engine.hf_reference import TOKENIZER_FILES

VOCAB = 49152
SOFT, BOI, EOI = VOCAB, 49001, 49002
TOKENS_PER_IMAGE = 4
GEMMA3 = dict(
    text_config=dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, sliding_window=8,
                     layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=16,
                     initializer_range=0.25, tie_word_embeddings=False),
    vision_config=dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, image_size=32,
                       patch_size=8, vision_use_head=False),
    mm_tokens_per_image=TOKENS_PER_IMAGE, image_token_index=SOFT, boi_token_index=BOI, eoi_token_index=EOI,
    initializer_range=0.25, tie_word_embeddings=False)


def save_gemma3(out_dir: Path, tokenizer_dir: str, seed: int = 0) -> Path:
    """A random Gemma 3 vision folder (module docstring)."""
    import shutil

    import transformers

    config = transformers.Gemma3Config(**GEMMA3)
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # norms (Gemma's 1 + w) and the projection off their constants, so each counts
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.3 * torch.randn(param.shape))
            elif name.endswith("mm_input_projection_weight"):
                param.copy_(torch.randn(param.shape) * 0.5)
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    transformers.Gemma3ImageProcessorPil(size={"height": 32, "width": 32}).save_pretrained(out_dir)
    for name in TOKENIZER_FILES:
        if (Path(tokenizer_dir) / name).exists():
            shutil.copy(Path(tokenizer_dir) / name, out_dir / name)
    (out_dir / "generation_config.json").write_text('{"bos_token_id": 1, "eos_token_id": 2}')
    return out_dir


class HFGemma3:
    """transformers' greedy ``generate`` of a prompt with images (never stopping early)."""

    def __init__(self, path: Path) -> None:
        import transformers

        self.model = transformers.Gemma3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
        self.processor = transformers.Gemma3ImageProcessorPil.from_pretrained(path)
        self.newlines = transformers.AutoTokenizer.from_pretrained(path).encode("\n\n", add_special_tokens=False)

    def expand(self, token_ids: list[int]) -> list[int]:
        """Each ``BOI`` as Gemma 3's processor writes an image (module docstring)."""
        out: list[int] = []
        for t in token_ids:
            out += self.newlines + [BOI] + [SOFT] * TOKENS_PER_IMAGE + [EOI] + self.newlines if t == BOI else [t]
        return out

    def inputs(self, token_ids: list[int], images: list, bidirectional: bool = True) -> dict:
        """``forward`` / ``generate`` keyword arguments; ``bidirectional=False`` leaves out the token
        types, so transformers' mask is plain causal (the negative check)."""
        ids = torch.tensor([self.expand(token_ids)])
        kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids))
        if images:
            kwargs["pixel_values"] = self.processor(images=images, return_tensors="pt")["pixel_values"]
            if bidirectional:
                kwargs["token_type_ids"] = (ids == SOFT).long()
        return kwargs

    @torch.inference_mode()
    def logits(self, token_ids: list[int], images: list, bidirectional: bool = True) -> torch.Tensor:
        return self.model(**self.inputs(token_ids, images, bidirectional)).logits[0]  # [T, vocab]

    @torch.inference_mode()
    def generate(self, token_ids: list[int], images: list, max_new_tokens: int) -> list[int]:
        kwargs = self.inputs(token_ids, images)
        out = self.model.generate(**kwargs, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
                                  pad_token_id=0, temperature=None, top_p=None, top_k=None)
        return out[0, kwargs["input_ids"].shape[1]:].tolist()
