"""DeepSeek-V3 (multi-head latent attention, group-limited MoE) through the whole engine vs transformers.

A tiny random float32 ``DeepseekV3Config`` built by transformers here (SmolLM2's tokenizer, as
``tests/engine/hf_reference.py``; the router's correction bias and the norms moved off their
initial constants), served by ``LLMEngine``: its KV cache is one group of ``mla_attention``
layers (``engine.kv.specs.MLALatentSpec``: one latent row per token and layer). Greedy tokens
must equal transformers' ``generate``:

- each prompt alone;
- all prompts in one batch (three share a 40-token prefix), with chunked prefill at an odd
  budget (7 tokens) and a cache so small that requests are preempted (by recompute, and by swap
  to the CPU tier, which moves latent blocks); then
- the same prompts again, served from prefix-cache hits (also with async scheduling).

Seeded sampling gives a request the same tokens alone and in a batch; beam search equals
transformers' beams; a choice grammar holds; a prompt's latent blocks move to a peer replica
(the TCP KV connector) and are hits there. The checkpoint's MTP
block (``num_nextn_predict_layers``, written here in DeepSeek's layout: an MLA layer with a MoE
block) drafts through the speculative-decoding registry, and verification keeps the outputs
exact, as do n-gram drafts and a draft model (the target's first layer). Two pipeline stages
equal one (TP=2 = TP=1: tests/engine/test_tensor_parallel_moe.py). What does not combine is
refused naming why: LoRA adapters, heads the tensor-parallel ranks cannot split, DeepSeek-V2's
routers, ``attention_bias``, int8/fp8 quantization at load.
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

from tests.engine.driving import (check_beams_and_a_grammar, check_seeded_alone_equals_batch, family_case,
                                  greedy_tokens)
from tests.engine.hf_reference import save_random_model

MAX_NEW = 8
SMALL = dict(vocab_size=49152, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
             num_attention_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
             n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=24,
             qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, max_position_embeddings=512,
             initializer_range=0.2, tie_word_embeddings=False)
HOT = [SamplingParams(temperature=50.0, seed=s, max_tokens=12, ignore_eos=True) for s in range(3)]


@torch.no_grad()
def _move_constants(model) -> None:
    """Norms off 1 and a correction bias that changes the routers' choices."""
    for name, param in model.named_parameters():
        if "norm" in name:
            param.add_(0.3 * torch.randn(param.shape))
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buffer.copy_(0.2 * torch.randn(buffer.shape))


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory, smollm2_path):
    """(folder, prompts, HF's greedy tokens per prompt, an engine)."""
    folder = save_random_model(tmp_path_factory.mktemp("deepseek") / "v3", smollm2_path, 0, "DeepseekV3Config",
                               edit_weights=_move_constants, **SMALL)
    return family_case(folder, MAX_NEW)


def _run(engine: LLMEngine, prompts, params=None, prefix: str = "") -> list[list[int]]:
    return greedy_tokens(engine, prompts, params, prefix, max_tokens=MAX_NEW)


def test_each_prompt_alone_equals_transformers(deepseek):
    _, prompts, expected, engine = deepseek
    layout = engine.executor.kv_layout
    assert [g.spec.kind for g in layout.groups] == ["mla_attention"]
    assert layout.block_bytes == 3 * 16 * (16 + 8) * 4  # 3 layers x 16 tokens x one latent row, fp32
    for prompt, tokens in zip(prompts, expected):
        assert _run(engine, [prompt]) == [tokens]


@pytest.mark.parametrize("mode", ["recompute", "swap", "async"])
def test_batched_chunked_preempted_then_served_from_prefix_hits(deepseek, mode):
    folder, prompts, expected, _ = deepseek
    extra = dict(cpu_offload_bytes=1 << 20, preemption_mode="swap") if mode == "swap" else \
        dict(async_scheduling=True) if mode == "async" else {}
    engine = LLMEngine(EngineConfig(model=folder, block_size=8, max_num_batched_tokens=7, num_gpu_blocks_override=10,
                                    **extra))
    assert _run(engine, prompts) == expected
    first = engine.get_stats()
    assert first.num_preemptions > 0, "the tiny cache should have preempted"
    if mode == "swap":
        assert first.num_swapped_out > 0 and first.num_swapped_in > 0
    assert _run(engine, prompts, prefix="again-") == expected
    second = engine.get_stats()
    assert second.prefix_cache_hits > first.prefix_cache_hits
    assert second.num_free_blocks == second.num_blocks


def test_seeded_sampling_is_the_same_alone_and_in_a_batch(deepseek):
    folder, prompts, _, _ = deepseek
    check_seeded_alone_equals_batch(folder, prompts, MAX_NEW)


def test_mtp_block_drafts_and_verification_keeps_outputs_exact(deepseek, tmp_path):
    """The checkpoint's own MTP block (DeepSeek layout, random weights): greedy and hot seeded
    outputs equal the plain engine's, with drafts both accepted and rejected."""
    folder, prompts, expected, _ = deepseek
    mtp = add_random_mtp_layers(shutil.copytree(folder, tmp_path / "mtp"), seed=5)
    plain = LLMEngine(EngineConfig(model=str(mtp)))
    hot = _run(plain, prompts[:3], HOT)
    engine = LLMEngine(EngineConfig(model=str(mtp), speculative_method="mtp", num_speculative_tokens=2,
                                    spec_adaptive=False, max_num_batched_tokens=32))
    head = engine.executor.runner.speculator.proposer.head
    assert type(head.layer.attn).__name__ == "MLAttention" and type(head.layer.mlp).__name__ == "DeepseekMoE"
    assert _run(engine, prompts) == expected
    assert _run(engine, prompts[:3], HOT, prefix="hot") == hot
    stats = engine.get_stats()
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens


@pytest.mark.parametrize("method", [dict(speculative_method="ngram", num_speculative_tokens=3),
                                    dict(speculative_method="draft", speculative_draft_num_layers=1)])
def test_ngram_and_draft_model_drafts_keep_outputs_exact(deepseek, method):
    """The other proposers verify through the same latent cache: n-gram drafts (a prompt that
    repeats itself, so the n-grams match), and a draft model that is the target's first (dense,
    MLA) layer, with its own latent cache. Outputs equal the plain engine's (== transformers)."""
    folder, prompts, expected, plain = deepseek
    repeats = prompts[1] + expected[1] + prompts[1]
    engine = LLMEngine(EngineConfig(model=folder, spec_adaptive=False, **method))
    assert _run(engine, prompts + [repeats]) == expected + _run(plain, [repeats], prefix="r")
    assert engine.get_stats().spec_num_draft_tokens > 0


def test_beam_search_equals_transformers_and_structured_output_holds(deepseek):
    """Beams fork latent blocks (copy-on-write of the partial one): the two best of 2 beams equal
    HF's ``generate(num_beams=2)``; a choice grammar constrains every sampled answer."""
    folder, prompts, _, engine = deepseek
    check_beams_and_a_grammar(engine, folder, prompts)


def test_a_prefix_moves_between_replicas_as_latent_blocks(deepseek):
    """P/D: the TCP connector sends a prompt's full blocks (one latent tensor per layer) to a
    peer, whose request then hits them and generates the same tokens."""
    from pagoda.contracts.block_hash import hash_prompt_blocks
    from pagoda.engine.kv_transfer.tcp import TcpKVConnector

    from tests.engine.test_kv_transfer import _wait

    folder, prompts, expected, _ = deepseek
    a, b = LLMEngine(EngineConfig(model=folder)), LLMEngine(EngineConfig(model=folder))
    ca, cb = TcpKVConnector(a), TcpKVConnector(b, listen="127.0.0.1:0")
    try:
        assert _run(a, [prompts[2]]) == [expected[2]]
        hashes = hash_prompt_blocks(prompts[2], a.config.block_size, a.model_id)
        results = _wait([ca, cb], ca.send(cb.address, hashes))
        assert results["receive"].ok and results["receive"].num_bytes == len(hashes) * cb.block_io.block_bytes
        assert cb.block_io.block_bytes == 3 * 16 * (16 + 8) * 4
        hits = b.get_stats().prefix_cache_hits
        assert _run(b, [prompts[2]], prefix="b") == [expected[2]]
        assert b.get_stats().prefix_cache_hits - hits == len(hashes) * 16
    finally:
        ca.close()
        cb.close()


def test_two_pipeline_stages_equal_one(deepseek):
    folder, prompts, expected, _ = deepseek
    engine = LLMEngine(EngineConfig(model=folder, pipeline_parallel_size=2))
    try:
        assert _run(engine, prompts) == expected
    finally:
        engine.shutdown()


def test_what_does_not_combine_is_refused(deepseek):
    from pagoda.models.tensor_parallel import check_divisible

    folder, _, _, engine = deepseek
    with pytest.raises(ValueError, match="multi-head latent attention projections"):
        LLMEngine(EngineConfig(model=folder, enable_lora=True))
    with pytest.raises(ValueError, match="num_attention_heads=4 must be divisible by the tensor-parallel size"):
        check_divisible(engine.executor.runner.model.config, 8)  # TP itself: test_tensor_parallel_moe.py
    with pytest.raises(ValueError, match="quantization 'int8': MoE expert weights"):
        LLMEngine(EngineConfig(model=folder, quantization="int8"))
    from pagoda.models.deepseek_v3 import parse_config

    raw = json.loads((pathlib.Path(folder) / "config.json").read_text())
    for field, value in (("scoring_func", "softmax"), ("topk_method", "greedy"), ("moe_layer_freq", 2),
                         ("attention_bias", True)):
        with pytest.raises(ValueError, match=f"{field}=.* is not supported"):
            parse_config(raw | {field: value}, "DeepseekV3ForCausalLM")
