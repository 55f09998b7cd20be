"""Speculative decoding through the whole engine, on tiny random models with SmolLM2's
tokenizer files and a 2048-token vocabulary (drafts: another random model, the target
itself, the target's first layer) and on SmolLM2 with the n-gram proposer.

Greedy and seeded outputs must equal the plain engine's token for token (alone and in
mixed batches with chunked prefill and non-speculating requests); unseeded sampling must
follow the target's distribution (chi-square against Hugging Face); rejected drafts must
never reach a cached block, and every block must be free at the end.
"""

from __future__ import annotations

import random

import pytest
import torch
from scipy.stats import chisquare

from pagoda.engine.config import EngineConfig
from pagoda.engine.llm_engine import LLMEngine
from pagoda.engine.sampling_params import SamplingParams

from tests.engine.hf_reference import save_random_model
from tests.numerics import assert_within, model_error_bound

BLOCKS = 192
VOCAB = 2048  # the first ids of SmolLM2's vocabulary: a small LM head keeps the tests fast


def make_small_model(out_dir, tokenizer_dir, seed):
    """A random 2-layer Llama over the first VOCAB token ids, saved with SmolLM2's tokenizer."""
    return str(save_random_model(out_dir, tokenizer_dir, seed, vocab_size=VOCAB, hidden_size=128,
                                 intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                                 tie_word_embeddings=True))


@pytest.fixture(scope="module")
def paths(tmp_path_factory, smollm2_path):
    root = tmp_path_factory.mktemp("spec")
    return {"target": make_small_model(root / "target", smollm2_path, seed=0),
            "other": make_small_model(root / "other", smollm2_path, seed=1)}


SPEC_CONFIGS = {
    "draft-other": dict(speculative_method="draft", speculative_model="other", spec_adaptive=False,
                        num_speculative_tokens=3),
    "draft-self": dict(speculative_method="draft", speculative_model="target", spec_adaptive=False),
    "draft-layer-skip": dict(speculative_method="draft", speculative_draft_num_layers=1, spec_adaptive=False),
    "ngram": dict(speculative_method="ngram", spec_adaptive=False),
}


def _engine(paths, name=None, **overrides) -> LLMEngine:
    spec = dict(SPEC_CONFIGS[name]) if name else {}
    if "speculative_model" in spec:
        spec["speculative_model"] = paths[spec["speculative_model"]]
    values = dict(model=paths["target"], num_gpu_blocks_override=BLOCKS, **spec)
    values.update(overrides)
    return LLMEngine(EngineConfig(**values))


def _run(engine, requests, record=None):
    """requests: (prompt, params) pairs; returns the final RequestOutputs in order."""
    ids = []
    for prompt, params in requests:
        ids.append(f"r{len(ids)}-{random.random()}")
        engine.add_request(ids[-1], prompt, params)
    done = {}
    schedule = engine.scheduler.schedule
    if record is not None:
        def recording(*args):
            out = schedule(*args)
            record.append([(len(s.spec_token_ids), s.is_sampling) for s in out.scheduled])
            return out
        engine.scheduler.schedule = recording
    try:
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
    finally:
        engine.scheduler.schedule = schedule
    stats = engine.get_stats()
    assert stats.num_free_blocks == stats.num_blocks, "every target block is free at the end"
    proposer = engine.speculator.proposer if engine.speculator else None
    if proposer is not None and proposer.num_free_blocks is not None:
        assert proposer.num_free_blocks == proposer.block_pool.num_usable_blocks, "every draft block is free"
    return [done[i] for i in ids]


def _prompts(n, seed=0, lengths=(7, 40, 23, 61)):
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(lengths[i % len(lengths)])] for i in range(n)]


def _tokens(outputs):
    return [[c.token_ids for c in out.outputs] for out in outputs]


GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def base(paths):
    return _engine(paths)


@pytest.fixture(scope="module")
def greedy_expected(base):
    prompts = _prompts(4)
    return prompts, _tokens(_run(base, [(p, GREEDY) for p in prompts]))


@pytest.mark.parametrize("name", sorted(SPEC_CONFIGS))
def test_greedy_equals_plain_alone_and_in_mixed_batches(paths, greedy_expected, name):
    prompts, expected = greedy_expected
    engine = _engine(paths, name, max_num_batched_tokens=32)
    assert _tokens(_run(engine, [(prompts[1], GREEDY)])) == expected[1:2]
    # All at once under a small budget: prefill chunks, drafts and plain decodes share steps;
    # every other request opts out.
    steps = []
    mixed = [(p, GREEDY.clone(speculative=False) if i % 2 else GREEDY) for i, p in enumerate(prompts)]
    assert _tokens(_run(engine, mixed, record=steps)) == expected
    stats = engine.get_stats()
    assert stats.spec_num_drafts > 0 or name == "ngram"  # random models rarely repeat themselves
    if name == "draft-self":
        assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens  # the target drafting for itself
    if name != "ngram":
        assert any(any(n > 0 for n, _ in step) and any(not sampling for _, sampling in step) for step in steps), \
            "some step must verify drafts next to a prefill chunk"


@pytest.mark.parametrize("name", ["draft-other", "draft-self"])
def test_seeded_sampling_equals_plain(paths, base, name):
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=s, max_tokens=20, ignore_eos=True) for s in (1, 2)]
    params.append(SamplingParams(n=2, temperature=1.0, top_k=50, seed=3, max_tokens=12, ignore_eos=True))
    requests = list(zip(_prompts(3, seed=4), params))
    expected = _tokens(_run(base, requests))
    engine = _engine(paths, name)
    assert _tokens(_run(engine, requests)) == expected
    assert engine.get_stats().spec_num_drafts > 0


def test_logprobs_penalties_and_stop_strings_equal_plain(paths, base):
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=2, repetition_penalty=1.3,
                            frequency_penalty=0.4, presence_penalty=0.2)
    prompt = _prompts(1, seed=9)[0]
    (full,) = _run(base, [(prompt, params)])
    text = full.outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip()
    requests = [(prompt, params), (prompt, params.clone(stop=[stop], min_tokens=2))]
    expected = _run(base, requests)
    got = _run(_engine(paths, "draft-self"), requests)
    for e, g in zip(expected, got):
        e, g = e.outputs[0], g.outputs[0]
        assert (g.token_ids, g.text, g.finish_reason, g.stop_reason) == (e.token_ids, e.text, e.finish_reason,
                                                                        e.stop_reason)
        assert [lp.token_id for lp in g.logprobs] == [lp.token_id for lp in e.logprobs] == g.token_ids
        assert [lp.logprob for lp in g.logprobs] == pytest.approx([lp.logprob for lp in e.logprobs], abs=1e-3)
        assert g.cumulative_logprob == pytest.approx(e.cumulative_logprob, abs=1e-3)
    assert got[1].outputs[0].finish_reason == "stop" and len(got[1].outputs[0].token_ids) < 30


def test_rejected_drafts_never_reach_a_cached_block(paths, base):
    """A draft that disagrees often: every cached block holds the request's real tokens,
    and its KV equals the plain engine's KV for the same block hash."""
    prompts = _prompts(4, seed=5, lengths=(21, 37, 50, 8))
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    engine = _engine(paths, "draft-other", block_size=8)
    plain = _engine(paths, block_size=8)
    outs = _run(engine, [(p, params) for p in prompts])
    assert _tokens(outs) == _tokens(_run(plain, [(p, params) for p in prompts]))
    stats = engine.get_stats()
    assert stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens, "the draft must get rejected"
    sequences = {tuple(o.prompt_token_ids + o.outputs[0].token_ids) for o in outs}
    pool, plain_pool = engine.scheduler.block_pool, plain.scheduler.block_pool
    assert len(pool.cached_block_hash_to_block) > 0
    num_compared = 0
    for block_hash, block in pool.cached_block_hash_to_block.items():
        assert any(_holds(seq, block.token_ids) for seq in sequences)
        other = plain_pool.cached_block_hash_to_block.get(block_hash)
        if other is not None:
            for (k, v), (pk, pv) in zip(engine.runner.kv_caches, plain.runner.kv_caches):
                for ours, theirs in ((k[block.block_id], pk[other.block_id]), (v[block.block_id], pv[other.block_id])):
                    # Computed in different step compositions: equal up to float32 rounding.
                    bound = 2 * model_error_bound(engine.runner.model.config, 64, torch.float32,
                                                  theirs.abs().max().item())
                    assert_within(ours, theirs, bound, "KV of a block written with and without speculation")
            num_compared += 1
    assert num_compared == len(plain_pool.cached_block_hash_to_block) > 0


def _holds(sequence, block_tokens):
    n = len(block_tokens)
    return any(tuple(sequence[i : i + n]) == block_tokens for i in range(0, len(sequence) - n + 1, n))


def test_unseeded_sampling_follows_the_target_distribution(paths):
    """Tokens 1 and 2 of many unseeded requests (token 2 comes out of rejection sampling
    against a draft that disagrees often: the target's first layer and head), chi-square
    against HF's distribution."""
    from transformers import AutoModelForCausalLM

    prompt = _prompts(1, seed=11, lengths=(12,))[0]
    params = SamplingParams(temperature=4.0, top_k=3, max_tokens=3, ignore_eos=True)
    engine = _engine(paths, "draft-layer-skip", max_num_seqs=128, num_speculative_tokens=1, seed=5,
                     num_gpu_blocks_override=4 * 128)
    num_samples = 600
    outs = _run(engine, [(prompt, params)] * num_samples)
    stats = engine.get_stats()
    assert stats.spec_num_drafts == num_samples
    assert 0.05 < stats.spec_num_accepted_tokens / stats.spec_num_draft_tokens < 0.8
    pairs = [tuple(o.outputs[0].token_ids[:2]) for o in outs]

    hf = AutoModelForCausalLM.from_pretrained(paths["target"], dtype=torch.float32).eval()

    def top3(ids):
        with torch.inference_mode():
            logits = hf(torch.tensor([ids])).logits[0, -1].double()
        values, idx = logits.topk(3)
        return dict(zip(idx.tolist(), (values / params.temperature).softmax(-1).tolist()))

    expected = {}
    for t1, p1 in top3(prompt).items():
        for t2, p2 in top3(prompt + [t1]).items():
            expected[(t1, t2)] = p1 * p2
    assert set(pairs) <= set(expected)
    cells = sorted(expected)
    observed = [pairs.count(c) for c in cells]
    exp = [expected[c] * num_samples for c in cells]
    assert chisquare(observed, exp).pvalue > 1e-3


def test_ngram_on_smollm2_accepts_and_equals_plain(smollm2_path):
    """The real model continues a counting pattern that prompt lookup predicts, next to a
    request that opts out and a long prompt prefilled in chunks in the same steps; the
    same engine without speculation (every request opted out) gives the same tokens."""
    engine = LLMEngine(EngineConfig(model=smollm2_path, num_gpu_blocks_override=32, max_num_batched_tokens=32,
                                    enable_prefix_caching=False, speculative_method="ngram"))
    tok = engine.tokenizer
    counting = tok.encode("1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3,")
    other = tok.encode("The three primary colours are")
    story = tok.encode("Once upon a time, in a quiet village by the sea, an old lighthouse keeper kept a "
                       "journal of every ship that passed, noting the weather, the colour of the sails, the "
                       "hour of the tide and the names of the sailors who waved at him from the decks.")
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    off = params.clone(speculative=False)
    expected = _tokens(_run(engine, [(counting, off), (other, off.clone(max_tokens=6)), (story, off)]))
    assert engine.get_stats().spec_num_drafts == 0
    steps = []
    got = _tokens(_run(engine, [(counting, params), (other, off.clone(max_tokens=6)), (story, off)], record=steps))
    assert got == expected
    stats = engine.get_stats()
    assert stats.spec_num_accepted_tokens >= 8, stats
    assert any(any(n > 0 for n, _ in step) and any(not sampling for _, sampling in step) for step in steps)


def test_refused_and_invalid_combinations(paths, base):
    with pytest.raises(ValueError, match="speculative: this server has no speculative decoding"):
        base.add_request("x", [1, 2, 3], SamplingParams(speculative=True))
    with pytest.raises(ValueError, match="speculative: must be a boolean"):
        SamplingParams(speculative="yes")
    with pytest.raises(ValueError, match="speculative_method"):
        EngineConfig(speculative_method="medusa")
    with pytest.raises(ValueError, match="needs speculative_model"):
        EngineConfig(speculative_method="draft")
    with pytest.raises(ValueError, match="only used with speculative_method='draft'"):
        EngineConfig(speculative_method="ngram", speculative_draft_num_layers=2)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineConfig(speculative_method="ngram", num_speculative_tokens=0)
    with pytest.raises(ValueError, match="speculative_draft_num_layers: must be in"):
        _engine(paths, "draft-layer-skip", speculative_draft_num_layers=2)
    with pytest.raises(ValueError, match="no config.json"):
        _engine(paths, "draft-other", speculative_model=paths["target"] + "-missing")
    engine = _engine(paths, "ngram", speculative_by_default=False)
    assert not engine.speculator.wants(_make_request(SamplingParams()))
    assert engine.speculator.wants(_make_request(SamplingParams(speculative=True)))


def test_draft_with_another_vocabulary_is_refused(paths, base):
    import dataclasses

    from pagoda.engine.spec_decode.draft_model_proposer import DraftModelProposer
    from pagoda.models.llama import LlamaForCausalLM

    config = dataclasses.replace(base.model_config, vocab_size=base.model_config.vocab_size + 64)
    with pytest.raises(ValueError, match="must share the target's tokenizer"):
        DraftModelProposer(LlamaForCausalLM(config, device="meta"), base.model_config, 8, 16, base.sampler, 64, 128)


def _make_request(params):
    from pagoda.engine.request import Request

    return Request("x", [1, 2], params)


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_preemption_with_speculation_keeps_greedy_output(paths, base, preemption_mode):
    """A cache too small for all requests at once: requests are preempted (recomputed or
    swapped to the CPU tier) while others speculate; outputs stay those of the plain engine."""
    prompts = _prompts(3, seed=8, lengths=(40,))
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected = _tokens(_run(base, [(p, params) for p in prompts]))
    engine = _engine(paths, "draft-other", num_gpu_blocks_override=7, preemption_mode=preemption_mode,
                     cpu_offload_bytes=2**22, enable_prefix_caching=False)
    assert _tokens(_run(engine, [(p, params) for p in prompts])) == expected
    stats = engine.get_stats()
    assert stats.num_preemptions > 0 and stats.spec_num_drafts > 0


def test_every_speculative_method_has_one_registered_proposer():
    from pagoda.engine.config import SPECULATIVE_METHODS
    from pagoda.engine.spec_decode.registry import PROPOSERS

    assert sorted(PROPOSERS) == sorted(SPECULATIVE_METHODS)


SMALL = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, max_position_embeddings=512, tie_word_embeddings=True)
MOE_TARGETS = {  # every layer sparse: 8 experts, top-2
    "qwen3-moe": ("Qwen3MoeConfig", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                                         norm_topk_prob=True)),
    # also a sliding-window model: an 8-token window on layer 0 (the prompts run to 61 tokens),
    # sinks, YaRN, expert biases (random, as tests/engine/hf_reference.py does)
    "gpt-oss-window8": ("GptOssConfig", dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=64,
                                             sliding_window=8, tie_word_embeddings=False)),
}


@pytest.mark.parametrize("target", MOE_TARGETS)
@pytest.mark.parametrize("name", ["draft-self", "draft-layer-skip"])
def test_moe_target_greedy_equals_plain(tmp_path_factory, smollm2_path, name, target):
    """A MoE target (Qwen3-MoE; gpt-oss, also windowed): its own drafts (whole, and its first
    layer as a layer-skip draft) leave the greedy output unchanged."""
    from tests.engine.hf_reference import WEIGHT_EDITS

    folder = tmp_path_factory.mktemp("spec-moe") / "target"
    config_class, overrides = MOE_TARGETS[target]
    moe = {"target": str(save_random_model(folder, smollm2_path, 0, config_class,
                                           edit_weights=WEIGHT_EDITS.get(target), **{**SMALL, **overrides}))}
    prompts = _prompts(3, seed=1)
    expected = _tokens(_run(_engine(moe), [(p, GREEDY) for p in prompts]))
    engine = _engine(moe, name, max_num_batched_tokens=32)
    assert _tokens(_run(engine, [(p, GREEDY) for p in prompts])) == expected
    assert engine.get_stats().spec_num_drafts > 0
