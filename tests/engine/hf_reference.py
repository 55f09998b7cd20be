"""Reference models for engine tests: random-weight Hugging Face checkpoints and HF greedy decoding.

Random models are tiny (2 layers) but use the real SmolLM2 tokenizer files, so the
engine loads them exactly as it loads a real model folder.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable, Optional

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")

# name -> (transformers config class name, config overrides)
RANDOM_CONFIGS = {
    "llama-gqa3-hd64": ("LlamaConfig", dict(hidden_size=384, num_attention_heads=6, num_key_value_heads=2,
                                            head_dim=64)),
    "llama-gqa4-hd80-untied": ("LlamaConfig", dict(hidden_size=320, num_attention_heads=4, num_key_value_heads=1,
                                                   head_dim=80, tie_word_embeddings=False)),
    "llama3-rope-scaling": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=1, head_dim=64,
                                                rope_theta=500000.0,
                                                rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                              "original_max_position_embeddings": 256})),
    "qwen2-qkv-bias": ("Qwen2Config", dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)),
    "mistral": ("MistralConfig", dict(num_attention_heads=4, num_key_value_heads=1, head_dim=64, sliding_window=None)),
    "qwen3-qk-norm": ("Qwen3Config", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=96)),
    # Sliding windows shorter than the prompts: every layer (Mistral), layer 1 only (Qwen3).
    "mistral-window16": ("MistralConfig", dict(num_attention_heads=4, num_key_value_heads=1, head_dim=64,
                                               sliding_window=16)),
    "qwen3-window12-layer1": ("Qwen3Config", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                                  use_sliding_window=True, sliding_window=12, max_window_layers=1)),
    "mixtral-moe": ("MixtralConfig", dict(num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                          num_experts_per_tok=2, sliding_window=None)),
    "qwen3-moe": ("Qwen3MoeConfig", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=8,
                                         num_experts_per_tok=2, moe_intermediate_size=128, norm_topk_prob=True,
                                         mlp_only_layers=[0])),
    # Gemma 3: an 8-token window on the local layer 0 (its own rope base, 100 so that it
    # matters within the prompts), global layer 1 (Gemma 3's 10^6 base).
    "gemma3-window8": ("Gemma3TextConfig", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                                query_pre_attn_scalar=48, sliding_window=8,
                                                layer_types=["sliding_attention", "full_attention"],
                                                rope_parameters={"sliding_attention": {"rope_type": "default",
                                                                                       "rope_theta": 100.0},
                                                                 "full_attention": {"rope_type": "default",
                                                                                    "rope_theta": 1e6}})),
    # gpt-oss: an 8-token window on layer 0, full layer 1, per-head sinks, YaRN (factor 4 over
    # 256 positions), 8 experts top-2 with biases and the clamped SwiGLU, untied head. Checked:
    # HF greedy changes for every prompt without the sinks, the window, the clamp or the biases.
    "gpt-oss-window8": ("GptOssConfig", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                             num_local_experts=8, num_experts_per_tok=2, sliding_window=8,
                                             tie_word_embeddings=False,
                                             rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0,
                                                              "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                                              "truncate": False,
                                                              "original_max_position_embeddings": 256})),
}


@torch.no_grad()
def _gpt_oss_weights(model) -> None:
    """transformers starts gpt-oss's biases at 0 and its sinks small: random biases (router,
    experts, attention) and sinks around the scores' size make them matter."""
    for name, param in model.named_parameters():
        if name.endswith("bias"):
            param.normal_(0.0, 0.3)
        elif name.endswith("sinks"):
            param.normal_(0.0, 2.0)


@torch.no_grad()
def _gemma_weights(model) -> None:
    """Gemma scales embeddings by sqrt(hidden) (16 here) and starts its norms at 0 (x1): the
    residual stream would be the token's own embedding and greedy would not depend on
    attention. Embeddings / 16 and norms at 1.5-2.5x make the window and local rope matter
    (checked: without the window, or with the global rope base on layer 0, every prompt's
    HF greedy tokens change)."""
    model.model.embed_tokens.weight.div_(model.config.hidden_size**0.5)
    for name, param in model.named_parameters():
        if "norm" in name:
            param.uniform_(0.5, 1.5)


# Applied to the transformers model before saving.
WEIGHT_EDITS = {"gemma3-window8": _gemma_weights, "gpt-oss-window8": _gpt_oss_weights}


def make_random_model(out_dir: Path, name: str, tokenizer_dir: str, seed: int = 0) -> Path:
    """Save a random-weight model ``name`` (see RANDOM_CONFIGS) with SmolLM2's tokenizer."""
    cls_name, overrides = RANDOM_CONFIGS[name]
    kwargs = dict(vocab_size=49152, hidden_size=256, intermediate_size=384, num_hidden_layers=2,
                  max_position_embeddings=1024, tie_word_embeddings=True)
    kwargs.update(overrides)
    return save_random_model(out_dir, tokenizer_dir, seed, cls_name, edit_weights=WEIGHT_EDITS.get(name), **kwargs)


def save_random_model(out_dir: Path, tokenizer_dir: str, seed: int, cls_name: str = "LlamaConfig",
                      edit_weights: Optional[Callable[[torch.nn.Module], None]] = None, **config_kwargs) -> Path:
    """Save a random-weight ``cls_name`` model built from ``config_kwargs``, with SmolLM2's tokenizer.

    ``initializer_range`` defaults to 0.3 (0.02 gives near-tied logits and fragile greedy
    comparisons); bos/eos are ids 1 and 2. ``edit_weights`` (drawing from the same seeded
    stream) may change the transformers model before it is saved.
    """
    import transformers

    kwargs = dict(initializer_range=0.3, bos_token_id=1, eos_token_id=2)
    kwargs.update(config_kwargs)
    config = getattr(transformers, cls_name)(**kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if edit_weights is not None:
        edit_weights(model)
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    for f in TOKENIZER_FILES:
        if (Path(tokenizer_dir) / f).exists():
            shutil.copy(Path(tokenizer_dir) / f, out_dir / f)
    # The copied generation_config names SmolLM2's eos; keep the random model's ids.
    (out_dir / "generation_config.json").write_text('{"bos_token_id": 1, "eos_token_id": 2}')
    return out_dir


class HFGreedy:
    """Greedy decoding with transformers ``generate`` that never stops early."""

    def __init__(self, path: str):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    @torch.inference_mode()
    def generate(self, prompt_token_ids: list[int], max_new_tokens: int) -> list[int]:
        ids = torch.tensor([prompt_token_ids])
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                  do_sample=False, eos_token_id=None, pad_token_id=0,
                                  temperature=None, top_p=None, top_k=None)
        return out[0, len(prompt_token_ids):].tolist()
