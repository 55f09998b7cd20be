"""GLM-4.5 (``Glm4MoeForCausalLM``: partial rotary, q/k norm, q/k/v bias, DeepSeek's group-limited
sigmoid router with a shared expert) through the whole engine vs transformers.

A tiny random float32 ``Glm4MoeConfig`` built by transformers here (SmolLM2's tokenizer, as
``tests/engine/hf_reference.py``; norms and the router's correction bias moved off their initial
constants). Its logits are checked step by step in ``tests/models/test_llama_vs_hf.py``; here
greedy tokens must equal transformers' ``generate``: each prompt alone; all prompts in one batch
(three share a 40-token prefix) with chunked prefill at a 7-token budget and a cache so small that
requests are preempted; then the same prompts again from prefix-cache hits. Seeded sampling gives a
request the same tokens alone and in a batch. The checkpoint's MTP block (DeepSeek's layout, random
weights: a GLM attention layer with a MoE block) drafts and verification keeps outputs exact. A
LoRA adapter on q/v equals transformers + PEFT (tensor parallelism: tests/engine/test_tensor_parallel_moe.py).
Refused, naming why: int8 at load (the experts), rope scaling, an adapter on the experts.
GLM-4.7-Flash (``Glm4MoeLiteForCausalLM``, latent attention: the DeepSeek-V3 model) equals
transformers through the engine too.
"""

from __future__ import annotations

import json
import pathlib
import shutil

import pytest
import torch

from pagoda.engine.config import EngineConfig
from pagoda.engine.llm_engine import LLMEngine
from pagoda.engine.sampling_params import SamplingParams
from pagoda.engine.spec_decode.random_heads import add_random_mtp_layers

from tests.engine.driving import check_seeded_alone_equals_batch, family_case, greedy_tokens
from tests.engine.hf_reference import HFGreedy, save_random_model

MAX_NEW = 8
SMALL = dict(vocab_size=49152, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, attention_bias=True, use_qk_norm=True,
             n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1,
             first_k_dense_replace=1, routed_scaling_factor=2.5, num_nextn_predict_layers=0,
             max_position_embeddings=512, initializer_range=0.2, tie_word_embeddings=False)


@torch.no_grad()
def _move_constants(model) -> None:
    """Norms off 1, biases off 0 and a correction bias that changes the routers' choices."""
    for name, param in model.named_parameters():
        if "norm" in name or name.endswith("bias"):
            param.add_(0.3 * torch.randn(param.shape))
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buffer.copy_(0.2 * torch.randn(buffer.shape))


@pytest.fixture(scope="module")
def glm(tmp_path_factory, smollm2_path):
    """(folder, prompts, HF's greedy tokens per prompt, an engine)."""
    folder = save_random_model(tmp_path_factory.mktemp("glm") / "glm45", smollm2_path, 0, "Glm4MoeConfig",
                               edit_weights=_move_constants, **SMALL)
    return family_case(folder, MAX_NEW)


def _run(engine: LLMEngine, prompts, params=None, prefix: str = "", lora_name=None) -> list[list[int]]:
    return greedy_tokens(engine, prompts, params, prefix, lora_name, max_tokens=MAX_NEW)


def test_each_prompt_alone_equals_transformers(glm):
    _, prompts, expected, engine = glm
    model = engine.executor.runner.model
    assert type(model).__name__ == "Glm4MoeForCausalLM" and model.config.rotary_dim == 8
    assert [g.spec.kind for g in engine.executor.kv_layout.groups] == ["full_attention"]
    for prompt, tokens in zip(prompts, expected):
        assert _run(engine, [prompt]) == [tokens]


def test_batched_chunked_preempted_then_served_from_prefix_hits(glm):
    folder, prompts, expected, _ = glm
    engine = LLMEngine(EngineConfig(model=folder, block_size=8, max_num_batched_tokens=7, num_gpu_blocks_override=10))
    assert _run(engine, prompts) == expected
    first = engine.get_stats()
    assert first.num_preemptions > 0, "the tiny cache should have preempted"
    assert _run(engine, prompts, prefix="again-") == expected
    second = engine.get_stats()
    assert second.prefix_cache_hits > first.prefix_cache_hits
    assert second.num_free_blocks == second.num_blocks


def test_seeded_sampling_is_the_same_alone_and_in_a_batch(glm):
    folder, prompts, _, engine = glm
    check_seeded_alone_equals_batch(folder, prompts, MAX_NEW, alone=engine)


def test_mtp_block_drafts_and_verification_keeps_outputs_exact(glm, tmp_path):
    """The checkpoint's MTP block (DeepSeek's layout, as GLM-4.5 ships it; random weights):
    greedy outputs equal transformers', hot seeded ones the plain engine's (so that drafts are
    both accepted and rejected)."""
    folder, prompts, expected, plain = glm
    hot = [SamplingParams(temperature=50.0, seed=s, max_tokens=12, ignore_eos=True) for s in range(3)]
    mtp = add_random_mtp_layers(shutil.copytree(folder, tmp_path / "mtp"), seed=5)
    engine = LLMEngine(EngineConfig(model=str(mtp), speculative_method="mtp", num_speculative_tokens=2,
                                    spec_adaptive=False, max_num_batched_tokens=32))
    head = engine.executor.runner.speculator.proposer.head
    assert type(head.layer.attn).__name__ == "Glm4MoeAttention" and type(head.layer.mlp).__name__ == "DeepseekMoE"
    assert _run(engine, prompts) == expected
    assert _run(engine, prompts[:3], hot, prefix="hot") == _run(plain, prompts[:3], hot, prefix="hot")
    stats = engine.get_stats()
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens


def test_a_lora_adapter_on_attention_equals_transformers_peft(glm, tmp_path):
    from tests.engine.lora_reference import make_peft_adapter, peft_greedy, peft_model

    folder, prompts, _, _ = glm
    adapter = make_peft_adapter(folder, tmp_path, "attn-qv", seed=3)
    engine = LLMEngine(EngineConfig(model=folder, enable_lora=True, max_lora_rank=8,
                                    lora_modules={"qv": str(adapter)}))
    reference = peft_model(folder, str(adapter))
    assert _run(engine, prompts[:2], lora_name="qv") == [peft_greedy(reference, p, MAX_NEW) for p in prompts[:2]]


def test_glm_lite_latent_attention_through_the_engine_equals_transformers(glm, tmp_path, smollm2_path):
    """GLM-4.7-Flash (``Glm4MoeLiteForCausalLM``: DeepSeek-V3's latent attention and MoE, dense
    layers by ``mlp_layer_types``): batched, chunked at 7 tokens, greedy == ``generate``."""
    _, prompts, _, _ = glm
    lite = dict(vocab_size=49152, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
                num_attention_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
                mlp_layer_types=["sparse", "dense", "sparse"], max_position_embeddings=512, initializer_range=0.2)
    folder = str(save_random_model(tmp_path / "lite", smollm2_path, 0, "Glm4MoeLiteConfig",
                                   edit_weights=_move_constants, **lite))
    engine = LLMEngine(EngineConfig(model=folder, max_num_batched_tokens=7, block_size=8))
    assert [g.spec.kind for g in engine.executor.kv_layout.groups] == ["mla_attention"]
    hf = HFGreedy(folder)
    assert _run(engine, prompts[:2]) == [hf.generate(p, MAX_NEW) for p in prompts[:2]]


def test_what_does_not_combine_is_refused(glm, tmp_path):
    from pagoda.models.glm4_moe import parse_config
    from pagoda.models.lora import load_peft_adapter

    from tests.models.test_moe import write_adapter

    folder, _, _, engine = glm
    with pytest.raises(ValueError, match="quantization 'int8': MoE expert weights"):
        LLMEngine(EngineConfig(model=folder, quantization="int8"))
    config = engine.executor.runner.model.config
    expert = write_adapter(tmp_path / "e", ["model.layers.1.mlp.experts.0.gate_proj"])
    with pytest.raises(ValueError, match="LoRA on MoE expert or router weights"):
        load_peft_adapter("e", str(expert), config, 8)
    with pytest.raises(ValueError, match="unsupported LoRA target 'shared_experts'"):
        load_peft_adapter("s", str(write_adapter(tmp_path / "s", ["model.layers.2.mlp.shared_experts.gate_proj"])),
                          config, 8)
    raw = json.loads((pathlib.Path(folder) / "config.json").read_text())
    linear = {"rope_parameters": dict(rope_type="linear", factor=2.0, rope_theta=1e4)}
    with pytest.raises(ValueError, match="rope scaling .* is not supported"):
        parse_config(raw | linear, "Glm4MoeForCausalLM")
    # transformers 4's layout (GLM-4.5's released config.json): the factor and theta at top level.
    old = {k: v for k, v in raw.items() if k != "rope_parameters"} | {"partial_rotary_factor": 0.25, "rope_theta": 1e6}
    assert (parse_config(old, "Glm4MoeForCausalLM").rotary_dim, parse_config(old, "x").rope_theta) == (4, 1e6)
