"""Tensor parallelism of mixture-of-experts blocks (``models.tensor_parallel``): TP=2 equals TP=1.

Every expert split by intermediate rows on two ranks (the router replicated), a shared expert
likewise, one all-reduce per block: greedy, seeded and prompt-log-probability requests through
the whole engine at TP=2 give TP=1's tokens and log-probabilities (within 1e-4), with chunked
prefill, prefix hits and preemption (``test_tensor_parallel._check_same``). One tiny random
float32 model per kind of block: Qwen3-MoE (``SparseMoE``, a dense first layer), GLM-4.5
(DeepSeek's grouped router with a shared expert, GLM's partial-rotary attention), Qwen3.5-MoE
(Gated DeltaNet layers; routed + sigmoid-gated shared expert), DeepSeek-V3 (latent attention split
by query heads, with and without a q rank). Refused, naming why: a moe
intermediate size the ranks cannot split, an FP8 slice that would cut a scale block. A DeepSeek-format
FP8 checkpoint kept as FP8 (block scales sliced with the weights) gives TP=1's outputs at TP=2.
"""

from __future__ import annotations

import pytest

from pagoda.models.tensor_parallel import check_divisible

from tests.engine.hf_reference import save_random_model
from tests.engine.test_tensor_parallel import _check_same, _config

# A Qwen3-MoE as small as the other families' random configs here (hidden 32, 8 experts of 16
# rows, a dense first layer), SmolLM2's vocabulary and tokenizer.
QWEN3_MOE = dict(vocab_size=49152, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                 norm_topk_prob=True, mlp_only_layers=[0], max_position_embeddings=512, initializer_range=0.2,
                 tie_word_embeddings=False)


def test_qwen3_moe_tp2_matches_tp1(tmp_path, smollm2_path):
    _check_same(str(save_random_model(tmp_path / "q3moe", smollm2_path, 0, "Qwen3MoeConfig", **QWEN3_MOE)), [{}])


def test_glm45_tp2_matches_tp1(tmp_path, smollm2_path):
    from tests.engine.test_glm4_moe_engine import SMALL, _move_constants

    folder = save_random_model(tmp_path / "glm45", smollm2_path, 0, "Glm4MoeConfig", edit_weights=_move_constants,
                               **SMALL)
    _check_same(str(folder), [{}])


def test_deepseek_latent_attention_tp2_matches_tp1(tmp_path, smollm2_path):
    """DeepSeek-V3's latent attention split by query heads (latent replicated, each rank its own
    latent cache), its MoE block as GLM's; with a q rank (q_b split) and without (q_proj's rows
    of the fused q/latent projection split)."""
    from tests.engine.test_deepseek_engine import SMALL, _move_constants

    for q_rank in (24, None):
        folder = save_random_model(tmp_path / f"ds{q_rank}", smollm2_path, 0, "DeepseekV3Config",
                                   edit_weights=_move_constants, **{**SMALL, "q_lora_rank": q_rank})
        _check_same(str(folder), [{}])


# FP8 with 128x128 block scales, shaped so that every rank's slice falls on whole blocks at TP 2:
# q_b rows 2 heads x 64, o_proj columns 2 x 64, dense and expert intermediate 256 / 2.
FP8_SHAPE = dict(vocab_size=49152, hidden_size=160, intermediate_size=256, moe_intermediate_size=256,
                 num_hidden_layers=2, num_attention_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_group=2,
                 topk_group=1, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=96, q_lora_rank=128,
                 qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=64, max_position_embeddings=256,
                 tie_word_embeddings=False)


def test_deepseek_fp8_block_checkpoint_kept_as_fp8_tp2_matches_tp1(tmp_path, smollm2_path, monkeypatch):
    """A DeepSeek-format FP8 folder served as FP8 (``PAGODA_KEEP_QUANTIZED``): each rank keeps its
    slices of the e4m3 weights and of their block scales (dense projections and expert stacks)."""
    from tests.models.test_quant_checkpoints import quantized_and_dequantized

    float_dir = save_random_model(tmp_path / "float", smollm2_path, 3, "DeepseekV3Config", **FP8_SHAPE)
    quantized, _ = quantized_and_dequantized("fp8-block", float_dir, tmp_path)
    monkeypatch.setenv("PAGODA_KEEP_QUANTIZED", "1")
    _check_same(str(quantized), [{}])


def test_an_fp8_slice_that_cuts_a_scale_block_is_refused():
    import torch

    from pagoda.models import tensor_parallel
    from pagoda.models.fp8 import Fp8BlockWeight

    weight = Fp8BlockWeight(torch.zeros(256, 160), torch.ones(2, 2), 128)
    tensor_parallel._rows(weight, torch.arange(128, 256))  # a whole block row
    assert weight.shape == (128, 160) and weight.scale.shape == (1, 2)
    tensor_parallel._cols(weight, 128, 160)  # the last, partial, block column
    assert weight.shape == (128, 32) and weight.scale.shape == (1, 1)
    with pytest.raises(ValueError, match="this rank's 64 rows of 256 do not fall on whole blocks"):
        tensor_parallel._rows(Fp8BlockWeight(torch.zeros(256, 160), torch.ones(2, 2), 128), torch.arange(64))


def test_hybrid_moe_tp2_matches_tp1(tmp_path, smollm2_path):
    from tests.engine.test_hybrid_engine import ARCHS, SMALL, _move_constants

    config_class, overrides = ARCHS["qwen3.5-moe"]
    folder = save_random_model(tmp_path / "q35moe", smollm2_path, 0, config_class, edit_weights=_move_constants,
                               **{**SMALL, **overrides})
    # (Its prompts share prefixes only as they arrive together: a hit needs a state checkpoint.)
    _check_same(str(folder), [dict(block_size=8)], expect_hits=False)


def test_expert_shapes_that_do_not_divide_are_refused():
    import dataclasses

    config = _config(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=10, shared_expert_intermediate_size=8)
    with pytest.raises(ValueError, match="moe_intermediate_size=10 must be divisible"):
        check_divisible(config, 4)
    check_divisible(config, 2)
    with pytest.raises(ValueError, match="shared_expert_intermediate_size=9 must be divisible"):
        check_divisible(dataclasses.replace(config, moe_intermediate_size=12, shared_expert_intermediate_size=9), 2)
