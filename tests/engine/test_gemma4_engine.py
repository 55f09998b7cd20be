"""Gemma 4 text (``Gemma4ForCausalLM``) through the whole engine vs transformers' ``generate``.

One tiny random float32 ``Gemma4TextConfig`` built by transformers here with every switch on
(SmolLM2's tokenizer, as ``tests/engine/hf_reference.py``; embeddings scaled down and norms,
router scales moved off their constants so attention matters, as for Gemma 3): six layers
``[S, S, F] x 2`` with an 8-token window, sliding layers 2 KV heads of 8, full layers 2 of 16
with ``attention_k_eq_v`` (so their pages are twice the sliding ones: the sliding groups are
padded, ``page_stride`` 2), the last two layers KV-shared (they read layers 3's and 2's blocks
and hold none) with the double-wide MLP, per-layer inputs and the MoE block (4 experts, top-2).

Greedy tokens must equal transformers' ``generate``:

- each prompt alone;
- all prompts in one batch (three share a 30-token prefix) with chunked prefill at a 7-token
  budget and a cache small enough to preempt (recompute, swap to the CPU tier, async
  scheduling; at 20 blocks a swapped request's swap-in does not fit even alone, and is
  recomputed instead: ``admit_waiting._recompute_swapped``); then the same prompts again from
  prefix-cache hits, every block free at the end.

Seeded sampling gives a request the same tokens alone and in a batch; beam search equals
transformers' beams; a choice grammar holds. An fp8 KV cache runs (greedy not compared: fp8
rounding). Refused, naming why: tensor and pipeline parallelism, speculative decoding, LoRA
adapters, int8 at load, a KV connector (the grouped layout). Served: tests/serving/test_serving_gemma4.py.
"""

from __future__ import annotations

import pytest
import torch

from pagoda.engine.config import EngineConfig
from pagoda.engine.llm_engine import LLMEngine
from pagoda.engine.runner.kv_allocation import unique_pairs

from tests.engine.driving import (check_beams_and_a_grammar, check_seeded_alone_equals_batch, family_case,
                                  greedy_tokens)
from tests.engine.hf_reference import save_random_model

MAX_NEW = 8
SMALL = dict(vocab_size=49152, hidden_size=32, intermediate_size=48, num_hidden_layers=6, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, global_head_dim=16, num_global_key_value_heads=2,
             attention_k_eq_v=True, sliding_window=8, max_position_embeddings=256,
             layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2, num_kv_shared_layers=2,
             use_double_wide_mlp=True, hidden_size_per_layer_input=8, vocab_size_per_layer_input=49152,
             enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=16,
             tie_word_embeddings=True)


@torch.no_grad()
def _move_constants(model) -> None:
    """Embeddings / sqrt(hidden) and norms, router scales at 0.5-1.5 (``hf_reference._gemma_weights``)."""
    model.model.embed_tokens.weight.div_(model.config.hidden_size**0.5)
    for name, param in model.named_parameters():
        if "norm" in name or "scale" in name:
            param.uniform_(0.5, 1.5)


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory, smollm2_path):
    """(folder, prompts, HF's greedy tokens per prompt, an engine)."""
    folder = save_random_model(tmp_path_factory.mktemp("gemma4") / "g4", smollm2_path, 0, "Gemma4TextConfig",
                               edit_weights=_move_constants, **SMALL)
    return family_case(folder, MAX_NEW)


def _run(engine: LLMEngine, prompts, prefix: str = "") -> list[list[int]]:
    return greedy_tokens(engine, prompts, prefix=prefix, max_tokens=MAX_NEW)


def test_each_prompt_alone_equals_transformers(gemma4):
    _, prompts, expected, engine = gemma4
    layout = engine.executor.kv_layout
    assert [(g.spec.kind, g.layer_ids, g.page_stride) for g in layout.groups] == [
        ("full_attention", (2,), 1), ("sliding_window", (0,), 2), ("sliding_window", (1,), 2),
        ("sliding_window", (3,), 2)]
    assert layout.layer_slots[4:] == layout.layer_slots[3:4] + layout.layer_slots[2:3]  # shared: their sources'
    assert layout.block_bytes == 2 * 16 * 2 * 16 * 4  # one position: K and V, 16 tokens x 2 heads x 16, fp32
    caches = engine.executor.runner.kv_caches
    assert caches[4][0].shape == (2 * layout.num_blocks, 16, 2, 8) and caches[2][0].shape == (layout.num_blocks,
                                                                                                16, 2, 16)
    assert [tuple(t.shape) for t in unique_pairs(caches)[0]] == [(layout.num_blocks, 16 * 2 * 16)] * 2
    for prompt, tokens in zip(prompts, expected):
        assert _run(engine, [prompt]) == [tokens]


def test_uniform_layout_keeps_every_block_and_the_same_tokens(gemma4):
    """``kv_cache_layout="uniform"``: the sliding layers keep every block (full-attention specs of
    their own shape, still padded; group 0 is then a padded group, its ids scaled too)."""
    folder, prompts, expected, _ = gemma4
    engine = LLMEngine(EngineConfig(model=folder, kv_cache_layout="uniform"))
    layout = engine.executor.kv_layout
    assert {g.spec.kind for g in layout.groups} == {"full_attention"} and layout.groups[0].page_stride == 2
    assert _run(engine, prompts[:2]) == expected[:2]


@pytest.mark.parametrize("mode", ["recompute", "swap", "async"])
def test_batched_chunked_preempted_then_served_from_prefix_hits(gemma4, mode):
    folder, prompts, expected, _ = gemma4
    extra = dict(cpu_offload_bytes=1 << 20, preemption_mode="swap") if mode == "swap" else \
        dict(async_scheduling=True) if mode == "async" else {}
    engine = LLMEngine(EngineConfig(model=folder, block_size=8, max_num_batched_tokens=7, num_gpu_blocks_override=20,
                                    **extra))
    assert _run(engine, prompts) == expected
    first = engine.get_stats()
    assert first.num_preemptions > 0, "the tiny cache should have preempted"
    if mode == "swap":  # one swapped request could not come back even alone: recomputed instead
        assert 0 < first.num_swapped_in < first.num_swapped_out
    assert _run(engine, prompts, prefix="again-") == expected
    second = engine.get_stats()
    assert second.prefix_cache_hits > first.prefix_cache_hits
    assert second.num_free_blocks == second.num_blocks


@pytest.mark.parametrize("changes, message", [
    (dict(tensor_parallel_size=2), "tensor_parallel_size=2: Gemma4ForCausalLM's layers differ in KV shape"),
    (dict(pipeline_parallel_size=2), "pipeline_parallel_size=2: Gemma4ForCausalLM runs its own layer loop"),
    (dict(speculative_method="ngram", num_speculative_tokens=2), "speculative_method 'ngram'"),
    (dict(enable_lora=True), "LoRA adapters are not supported for Gemma4ForCausalLM"),
    (dict(quantization="int8"), "Gemma 4"),
])
def test_what_does_not_combine_is_refused_naming_why(gemma4, changes, message):
    folder = gemma4[0]
    with pytest.raises(ValueError, match=message):
        LLMEngine(EngineConfig(model=folder, **changes))


def test_fp8_kv_cache_runs_over_padded_pages(gemma4):
    """The padded views in float8_e4m3fn (the sliding layers' decode path dequantizes before masking)."""
    folder, prompts, _, _ = gemma4
    engine = LLMEngine(EngineConfig(model=folder, kv_cache_dtype="fp8_e4m3"))
    assert engine.executor.runner.kv_caches[0][0].dtype == torch.float8_e4m3fn
    tokens = _run(engine, prompts[:2])
    assert [len(t) for t in tokens] == [MAX_NEW, MAX_NEW]
    assert engine.get_stats().num_free_blocks == engine.get_stats().num_blocks


def test_seeded_sampling_is_the_same_alone_and_in_a_batch(gemma4):
    folder, prompts, _, _ = gemma4
    check_seeded_alone_equals_batch(folder, prompts, MAX_NEW)


def test_beam_search_equals_transformers_and_structured_output_holds(gemma4):
    """Beams fork every group's blocks (sliding groups padded, shared layers reading their
    sources): the two best of 2 beams equal HF's ``generate(num_beams=2)``; a choice grammar
    constrains every sampled answer."""
    folder, prompts, _, engine = gemma4
    check_beams_and_a_grammar(engine, folder, prompts)


def test_kv_transfer_refuses_the_grouped_layout_naming_why(gemma4):
    """A connector moves one group's blocks by hash; Gemma 4's cache has sliding and full groups."""
    from pagoda.engine.kv_transfer.connector import check_layout

    with pytest.raises(ValueError, match=r"KV transfer: the model's KV cache has 4 groups \(full_attention, "
                                         r"sliding_window\)"):
        check_layout(gemma4[3].executor.kv_layout)
