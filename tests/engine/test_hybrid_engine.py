"""Hybrid models (Gated DeltaNet + full attention) through the whole engine vs transformers.

Qwen3-Next, Qwen3.5 and Qwen3.5-MoE, each a tiny random float32 config built by
transformers here (SmolLM2's tokenizer, as ``tests/engine/hf_reference.py``), served by
``LLMEngine`` with KV cache groups (``engine.kv.layout``: a full-attention group and a
recurrent-state group, ``engine.kv.state_manager``). Greedy tokens must equal transformers'
``generate``:

- each prompt alone;
- all prompts in one batch (three share a 40-token prefix), with chunked prefill at an odd
  budget (7 tokens) and a cache so small that requests are preempted (by recompute, and by
  swap to the CPU tier, which moves the state slot too); then
- the same prompts again: served from prefix-cache hits, the recurrent state *restored*
  from a checkpoint rather than recomputed (``num_state_restores`` counts it).

Seeded sampling gives a request the same tokens alone and in a batch. What does not combine
yet is refused naming why: speculative decoding, beam search, the NIXL connector. The TCP
connector moves a prompt's blocks and its state checkpoint to a peer (sent and pulled), and the
peer's request hits in both groups. A prefix evicted from the device to the CPU tier (blocks and
state checkpoint) comes back from it.
"""

from __future__ import annotations

import pytest
import torch

from pagoda.engine.config import EngineConfig
from pagoda.engine.llm_engine import LLMEngine
from pagoda.engine.sampling_params import SamplingParams

from tests.engine.driving import check_seeded_alone_equals_batch, family_case, greedy_tokens
from tests.engine.hf_reference import save_random_model

MAX_NEW = 8
SMALL = dict(vocab_size=49152, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
             max_position_embeddings=512, initializer_range=0.2, tie_word_embeddings=False)
L, F = "linear_attention", "full_attention"
ARCHS = {
    "qwen3-next": ("Qwen3NextConfig", dict(num_hidden_layers=4, layer_types=[L, F, L, F], intermediate_size=40,
                                           num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                                           shared_expert_intermediate_size=20)),
    "qwen3.5": ("Qwen3_5TextConfig", dict(num_hidden_layers=4, intermediate_size=48, linear_conv_kernel_dim=3)),
    "qwen3.5-moe": ("Qwen3_5MoeTextConfig", dict(num_hidden_layers=4, num_experts=4, num_experts_per_tok=2,
                                                 moe_intermediate_size=24, shared_expert_intermediate_size=20)),
}


@torch.no_grad()
def _move_constants(model) -> None:
    """Norms and dt_bias off their initial constants, so every offset and gate counts."""
    for name, param in model.named_parameters():
        if "norm" in name or name.endswith("dt_bias"):
            param.add_(0.3 * torch.randn(param.shape))


@pytest.fixture(scope="module", params=sorted(ARCHS))
def hybrid(request, tmp_path_factory, smollm2_path):
    """(folder, prompts, HF's greedy tokens per prompt) for one architecture."""
    config_class, overrides = ARCHS[request.param]
    folder = save_random_model(tmp_path_factory.mktemp(request.param), smollm2_path, 0, config_class,
                               edit_weights=_move_constants, **{**SMALL, **overrides})
    return family_case(folder, MAX_NEW)


def _run(engine: LLMEngine, prompts, params=None, prefix: str = "") -> list[list[int]]:
    return greedy_tokens(engine, prompts, params, prefix, max_tokens=MAX_NEW)


def test_each_prompt_alone_equals_transformers(hybrid):
    _, prompts, expected, engine = hybrid
    kinds = [g.spec.kind for g in engine.executor.kv_layout.groups]
    assert kinds == ["full_attention", "mamba"]
    for prompt, tokens in zip(prompts, expected):
        assert _run(engine, [prompt]) == [tokens]


@pytest.mark.parametrize("mode", ["recompute", "swap", "async"])
def test_batched_chunked_preempted_then_served_from_state_checkpoints(hybrid, mode):
    folder, prompts, expected, _ = hybrid
    extra = dict(cpu_offload_bytes=8 << 20, preemption_mode="swap") if mode == "swap" else \
        dict(async_scheduling=True) if mode == "async" else {}
    engine = LLMEngine(EngineConfig(model=folder, block_size=8, max_num_batched_tokens=7,
                                    num_gpu_blocks_override=12, **extra))
    assert _run(engine, prompts) == expected
    first = engine.get_stats()
    assert first.num_preemptions > 0, "the tiny cache should have preempted"
    if mode == "swap":
        assert first.num_swapped_out > 0 and first.num_swapped_in > 0
    assert first.num_state_checkpoints > 0
    assert _run(engine, prompts, prefix="again-") == expected
    second = engine.get_stats()
    assert second.num_state_restores > first.num_state_restores, "the second pass resumed checkpoints"
    assert second.prefix_cache_hits > first.prefix_cache_hits
    assert second.num_free_blocks == second.num_blocks and second.num_free_state_slots == second.num_state_slots


def test_seeded_sampling_is_the_same_alone_and_in_a_batch(hybrid):
    folder, prompts, _, _ = hybrid
    check_seeded_alone_equals_batch(folder, prompts, MAX_NEW)


def test_what_does_not_combine_with_recurrent_states_is_refused(hybrid):
    from pagoda.engine.kv_transfer.connector import check_layout

    folder, prompts, _, engine = hybrid
    with pytest.raises(ValueError, match="recurrent states.*rejected draft token"):
        LLMEngine(EngineConfig(model=folder, speculative_method="ngram"))
    with pytest.raises(ValueError, match="use_beam_search: this model keeps recurrent states"):
        engine.add_request("beam", prompts[0], SamplingParams(use_beam_search=True, n=2, temperature=0.0, max_tokens=4))
    with pytest.raises(ValueError, match="moves no recurrent-state checkpoint.*over the TCP connector"):
        check_layout(engine.runner.kv_layout, carries_states=False)  # the NIXL connector's check
    assert not engine.has_unfinished_requests()


def test_structured_output_constrains_a_hybrid_model(hybrid):
    """The grammar bitmask is orthogonal to the caches: every sampled answer is a choice."""
    from pagoda.engine.guided import GuidedDecodingParams

    folder, prompts, _, _ = hybrid
    engine = LLMEngine(EngineConfig(model=folder))
    choices = ["north", "south", "east", "west"]
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=6, guided_decoding=GuidedDecodingParams(choice=choices))
    outputs = _run(engine, prompts, params)
    assert all(engine.tokenizer.decode(tokens) in choices for tokens in outputs)


def test_parallel_samples_resume_the_first_ones_prompt_state(hybrid):
    """n > 1: the siblings wait for the first's prompt (the shared-prefix wait), then resume its
    state checkpoint at the prompt's last block boundary instead of recomputing the prompt."""
    folder, prompts, _, _ = hybrid
    engine = LLMEngine(EngineConfig(model=folder, block_size=8))
    engine.add_request("n", prompts[1], SamplingParams(n=3, temperature=0.8, seed=1, max_tokens=4))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.finished]
    assert len(outputs[0].outputs) == 3
    assert engine.get_stats().num_state_restores >= 2


def test_a_prefix_evicted_to_the_cpu_tier_comes_back_with_its_state(hybrid):
    """The device cache is forced to evict a prompt's blocks and its state checkpoint (a tiny
    block pool, few state slots, other prompts meanwhile); both go to the CPU tier, and the same
    prompt again resumes there (host blocks copied back, the host checkpoint restored into its
    working slot: counted as a CPU-tier hit, no device restore) with transformers' tokens. The
    default preemption_mode "auto" calibrates its cost model with a prefill through both groups."""
    folder, prompts, expected, _ = hybrid
    engine = LLMEngine(EngineConfig(model=folder, block_size=8, num_gpu_blocks_override=12, max_num_seqs=1,
                                    num_state_slots=3, cpu_offload_bytes=1 << 20))
    assert _run(engine, [prompts[1]]) == [expected[1]]
    for i in range(3):  # unrelated prompts: their blocks and checkpoints push prompt 1's out of the device
        _run(engine, [[1000 + 37 * i + j for j in range(40)]], prefix=f"filler{i}-")
    first = engine.get_stats()
    assert first.num_offloaded_states > 0 and first.num_offloaded_blocks > 0
    assert _run(engine, [prompts[1]], prefix="again-") == [expected[1]]
    second = engine.get_stats()
    assert second.num_host_state_restores == first.num_host_state_restores + 1
    assert second.num_state_restores == first.num_state_restores, "the checkpoint came from the host, not the device"
    boundary = (len(prompts[1]) - 1) // 8 * 8  # the prompt's last block boundary: its checkpoint
    assert second.prefix_cache_hits_host - first.prefix_cache_hits_host == boundary
    assert second.num_free_blocks == second.num_blocks and second.num_free_state_slots == second.num_state_slots
    assert second.num_free_host_blocks == second.num_host_blocks


def test_a_prefix_moves_between_replicas_with_its_state_checkpoint(hybrid):
    """P/D over TCP: A sends prompt 1's cached run (cut at its last state checkpoint) and B pulls
    prompt 2's from A; each offer carries the attention blocks and the state after the last one,
    and B's requests then hit in both groups (a state restore, no recompute of the prefix)."""
    from pagoda.contracts.block_hash import hash_prompt_blocks
    from pagoda.engine.kv_transfer.tcp import TcpKVConnector

    from tests.engine.test_kv_transfer import _wait

    folder, prompts, expected, _ = hybrid
    a, b = (LLMEngine(EngineConfig(model=folder, block_size=8)) for _ in range(2))
    ca, cb = TcpKVConnector(a, listen="127.0.0.1:0"), TcpKVConnector(b, listen="127.0.0.1:0")
    try:
        assert _run(a, [prompts[1], prompts[2]]) == [expected[1], expected[2]]
        block_bytes, state_bytes = cb.block_io.block_bytes, cb.state_io.slot_bytes
        for i, move in ((1, lambda h: ca.send(cb.address, h)), (2, lambda h: cb.pull(ca.address, h))):
            results = _wait([ca, cb], move(hash_prompt_blocks(prompts[i], 8, a.model_id)))
            sent, received = results["send"], results["receive"]
            assert sent.ok and received.ok and sent.num_blocks >= 1
            before = b.get_stats()
            assert _run(b, [prompts[i]], prefix=f"b{i}-") == [expected[i]]
            after = b.get_stats()
            # The run ends at A's checkpoint at the prompt's last block boundary; B lacked its state and
            # the blocks past the prefix it had (prompt 2 shares prompt 1's first blocks).
            assert after.prefix_cache_hits - before.prefix_cache_hits == (len(prompts[i]) - 1) // 8 * 8
            assert after.num_state_restores == before.num_state_restores + 1
            assert received.num_bytes == sent.num_bytes == sent.num_blocks * block_bytes + state_bytes
        assert ca.num_pinned_blocks == 0 and a.get_stats().num_free_state_slots == a.get_stats().num_state_slots
        assert b.get_stats().num_free_blocks == b.get_stats().num_blocks
    finally:
        ca.close()
        cb.close()
