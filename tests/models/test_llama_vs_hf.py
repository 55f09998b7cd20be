"""Our paged models (every registered family) against Hugging Face transformers (fp32 logits).

Every case runs the same paged scenario: two sequences on a small cache with
non-contiguous block tables, stepped through a prefill, single-token decodes, a chunked
prefill that crosses a block boundary, and mixed batches of two sequences of different
lengths. Each step's logits must match transformers' logits for the same positions from
one full forward over the whole sequence.
"""

from __future__ import annotations

import random

import pytest
import torch

from pagoda.models import load_model
from pagoda.models.testing import StepInput, make_kv_caches, run_step

from tests.numerics import assert_within, model_error_bound

transformers = pytest.importorskip("transformers")

BLOCK_SIZE = 4
NUM_BLOCKS = 16
TABLE_A = [9, 2, 14, 5]  # 16 token slots, deliberately out of order
TABLE_B = [1, 12, 7]


def assert_logits_close(ours: torch.Tensor, ref: torch.Tensor, what: str, config) -> None:
    """Both sides are float32 forwards of the same weights, each within the derived rounding
    bound of the exact logits (tests/numerics.py), so they differ by at most twice that."""
    bound = 2 * model_error_bound(config, NUM_BLOCKS * BLOCK_SIZE, torch.float32, ref.abs().max().item())
    assert_within(ours, ref, bound, what)


def run_paged_scenario(model, reference, seq_a: list[int], seq_b: list[int]) -> None:
    """Step both sequences through the paged cache and compare with ``reference(ids) -> [len, V]``."""
    assert len(seq_a) == 11 and len(seq_b) == 7
    ref_a, ref_b = reference(seq_a), reference(seq_b)
    kv = make_kv_caches(model.config, NUM_BLOCKS, BLOCK_SIZE, dtype=model.dtype)

    def step(*seqs: StepInput) -> torch.Tensor:
        return run_step(model, kv, list(seqs), BLOCK_SIZE)

    def a(start: int, end: int) -> StepInput:
        return StepInput(seq_a[start:end], start, TABLE_A)

    def b(start: int, end: int) -> StepInput:
        return StepInput(seq_b[start:end], start, TABLE_B)

    assert_logits_close(step(a(0, 6)), ref_a[:6], "prefill A", model.config)
    assert_logits_close(step(a(6, 7)), ref_a[6:7], "decode A@6", model.config)
    assert_logits_close(step(a(7, 8)), ref_a[7:8], "decode A@7", model.config)
    out = step(a(8, 9), b(0, 3))  # a decode next to a first prefill chunk
    assert_logits_close(out[:1], ref_a[8:9], "mixed: decode A@8", model.config)
    assert_logits_close(out[1:], ref_b[:3], "mixed: prefill B[:3]", model.config)
    out = step(b(3, 6), a(9, 10))  # second chunk of B crosses a block boundary
    assert_logits_close(out[:3], ref_b[3:6], "mixed: chunk B[3:6]", model.config)
    assert_logits_close(out[3:], ref_a[9:10], "mixed: decode A@9", model.config)
    out = step(a(10, 11), b(6, 7))  # two decodes of different context lengths
    assert_logits_close(out[:1], ref_a[10:11], "batched decode A@10", model.config)
    assert_logits_close(out[1:], ref_b[6:7], "batched decode B@6", model.config)


def hf_reference(hf_model):
    @torch.no_grad()
    def reference(ids: list[int]) -> torch.Tensor:
        return hf_model(torch.tensor([ids])).logits[0].float()

    return reference


# ---- random-weight models built with transformers ----------------------------------

TINY = dict(
    vocab_size=256, intermediate_size=192, num_hidden_layers=2, max_position_embeddings=128, initializer_range=0.3
)
RANDOM_CASES = {
    # GQA 3, explicit head_dim 64 != hidden / heads, Llama's q/k/v/o bias, untied head.
    "llama-gqa3-hd64-bias-untied": (
        "LlamaConfig",
        dict(hidden_size=192, num_attention_heads=6, num_key_value_heads=2, head_dim=64, attention_bias=True,
             tie_word_embeddings=False),
    ),
    # GQA 4, head_dim 80, tied embeddings, Llama 3.1 rope scaling active within 11 tokens.
    "llama-gqa4-hd80-llama3rope-tied": (
        "LlamaConfig",
        dict(hidden_size=160, num_attention_heads=8, num_key_value_heads=2, head_dim=80, tie_word_embeddings=True,
             rope_theta=500000.0,
             rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                               original_max_position_embeddings=8)),
    ),
    "qwen2-qkv-bias": (
        "Qwen2Config",
        dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
    ),
    # Multi-query attention (GQA 4 with one KV head), saved in several shards.
    "mistral-mqa-sharded": (
        "MistralConfig",
        dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=1, sliding_window=64,
             tie_word_embeddings=False),
    ),
    # A 4-token sliding window: the 11-token sequence's later steps see only part of it.
    "mistral-window4": (
        "MistralConfig",
        dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, sliding_window=4,
             tie_word_embeddings=False),
    ),
    # Per-head q/k RMSNorm before rotary; head_dim 48 with 4 heads != hidden 128.
    "qwen3-qk-norm-hd48": (
        "Qwen3Config",
        dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=48, tie_word_embeddings=False),
    ),
    # 4 experts, top-2, always renormalised; the mixed steps route tokens to several experts.
    "mixtral-moe": (
        "MixtralConfig",
        dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
             num_experts_per_tok=2, sliding_window=None),
    ),
    # Layer 0 dense (mlp_only_layers), layer 1 sparse: 8 experts, top-3, norm_topk_prob.
    "qwen3-moe-dense-then-sparse": (
        "Qwen3MoeConfig",
        dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8,
             num_experts_per_tok=3, moe_intermediate_size=64, norm_topk_prob=True, mlp_only_layers=[0],
             tie_word_embeddings=False),
    ),
    # decoder_sparse_step 2 (layer 1 sparse), top-k weights not renormalised.
    "qwen3-moe-step2-unnormalised": (
        "Qwen3MoeConfig",
        dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=4,
             num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=False, decoder_sparse_step=2,
             tie_word_embeddings=False),
    ),
    # Gemma 3: (1 + w) norms (random, four per layer and q/k), sqrt(hidden) embedding scale,
    # query_pre_attn_scalar, GELU-tanh, a 4-token window on the local layer 0 with its own
    # rope base, the global layer 1 with linear rope scaling; tied head.
    "gemma3-local-global-window4": (
        "Gemma3TextConfig",
        dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=48, query_pre_attn_scalar=40,
             sliding_window=4, layer_types=["sliding_attention", "full_attention"],
             rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                              "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}}),
    ),
    # Global first, then local; final logit soft-capping (Gemma 2's, None in Gemma 3) at 5.
    "gemma3-global-local-softcap": (
        "Gemma3TextConfig",
        dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=1, head_dim=32, sliding_window=5,
             layer_types=["full_attention", "sliding_attention"], final_logit_softcapping=5.0),
    ),
    # gpt-oss: a 4-token window on layer 0, full attention on layer 1, per-head sinks, YaRN
    # (factor 4 over 32 positions, untruncated), q/k/v/o biases, 4 experts top-2 with router
    # and expert biases and the clamped SwiGLU (|gate|, |up| > 7 occur at this init).
    "gpt-oss-window4-sinks-yarn": (
        "GptOssConfig",
        dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_local_experts=4,
             num_experts_per_tok=2, sliding_window=4,
             rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=4.0, beta_fast=32.0, beta_slow=1.0,
                                  truncate=False, original_max_position_embeddings=32)),
    ),
    # GLM-4.5: q/k/v bias, per-head q/k norm, rotary on half of each head (48 -> 24), layer 0
    # dense, layer 1 DeepSeek's router (8 experts in 4 groups, top-2 of 2 groups, a random
    # correction bias, renormalised x 2.5) with a shared expert.
    "glm4-moe-groups-qknorm-partial-rotary": (
        "Glm4MoeConfig",
        dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=48, attention_bias=True,
             use_qk_norm=True, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
             moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
             norm_topk_prob=True, num_nextn_predict_layers=0, tie_word_embeddings=False),
    ),
    # GLM-4.5-Air's switches: no q/k norm, no bias, one group, unnormalised, two shared experts,
    # every layer sparse, a quarter of each head rotated.
    "glm4-moe-air-no-norm-quarter-rotary": (
        "Glm4MoeConfig",
        dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=1, head_dim=32, n_routed_experts=4,
             num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=2, first_k_dense_replace=0,
             norm_topk_prob=False, partial_rotary_factor=0.25, num_nextn_predict_layers=0,
             tie_word_embeddings=False),
    ),
}


def build_random_model(name: str, out_dir):
    config_class, kwargs = RANDOM_CASES[name]
    config = getattr(transformers, config_class)(**TINY, **kwargs)
    torch.manual_seed(sum(map(ord, name)))
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # transformers starts norms at 1 and biases at 0: make them matter
        for param_name, param in model.named_parameters():
            if param_name.endswith("bias"):
                param.normal_(0.0, 0.3)
            elif param_name.endswith("sinks"):  # gpt-oss: around the scores' size
                param.normal_(0.0, 2.0)
            elif "norm" in param_name:  # (Gemma scales by 1 + w: 1.5 to 2.5)
                param.uniform_(0.5, 1.5)
        for buffer_name, buffer in model.named_buffers():  # DeepSeek/GLM: a bias that changes choices
            if buffer_name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.2)
    shard = "60KB" if "sharded" in name else "1GB"
    model.save_pretrained(out_dir, max_shard_size=shard)
    return model


@pytest.mark.parametrize("name", list(RANDOM_CASES))
def test_random_model_matches_transformers(name, tmp_path):
    hf_model = build_random_model(name, tmp_path)
    if "sharded" in name:
        assert (tmp_path / "model.safetensors.index.json").exists()
    ours = load_model(tmp_path)
    assert ours.config.architecture == type(hf_model).__name__
    rng = random.Random(name)
    seq_a = [rng.randrange(256) for _ in range(11)]
    seq_b = [rng.randrange(256) for _ in range(7)]
    run_paged_scenario(ours, hf_reference(hf_model), seq_a, seq_b)


# ---- the default model ---------------------------------------------------------------

PROMPT_A = "The quick brown fox jumps over the lazy dog because it"
PROMPT_B = "def add(a, b):\n    return"


def prompts(tokenizer) -> tuple[list[int], list[int]]:
    a = tokenizer.encode(PROMPT_A)[:11]
    b = tokenizer.encode(PROMPT_B)[:7]
    assert len(a) == 11 and len(b) == 7
    return a, b


def test_smollm2_matches_transformers_on_gguf(smollm2, smollm2_tokenizer, hf_gguf_model):
    run_paged_scenario(smollm2, hf_reference(hf_gguf_model), *prompts(smollm2_tokenizer))


def test_smollm2_matches_transformers_on_imported_folder(smollm2, smollm2_dir, smollm2_tokenizer):
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    ids, _ = prompts(smollm2_tokenizer)
    kv = make_kv_caches(smollm2.config, NUM_BLOCKS, BLOCK_SIZE)
    ours = run_step(smollm2, kv, [StepInput(ids, 0, TABLE_A)], BLOCK_SIZE)
    assert_logits_close(ours, hf_reference(hf_model)(ids), "prefill on the imported folder", smollm2.config)


def test_smollm2_greedy_continuation_is_coherent(smollm2, smollm2_tokenizer):
    ids = smollm2_tokenizer.encode("The capital of France is")
    kv = make_kv_caches(smollm2.config, NUM_BLOCKS, BLOCK_SIZE)
    table = [3, 0, 8, 11, 6]
    logits = run_step(smollm2, kv, [StepInput(ids, 0, table)], BLOCK_SIZE)
    generated: list[int] = []
    for _ in range(8):
        generated.append(int(logits[-1].argmax()))
        context = len(ids) + len(generated) - 1
        logits = run_step(smollm2, kv, [StepInput(generated[-1:], context, table)], BLOCK_SIZE)
    text = smollm2_tokenizer.decode(generated)
    assert "Paris" in text, text
