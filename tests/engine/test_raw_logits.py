"""Raw logits (``return_context_logits`` / ``return_generation_logits``, engine.logits_output):
checked against a float64 Hugging Face forward of the same weights.

The bound: the engine computes the logits in float32; ``model_error_bound`` (tests/numerics.py)
bounds one logit's rounding error for the sequence length and the logits' scale.
"""

from __future__ import annotations

import pytest
import torch

from pagoda.engine.config import EngineConfig
from pagoda.engine.llm_engine import LLMEngine
from pagoda.engine.logits_output import MAX_LOGITS_VALUES, check_logits_size
from pagoda.engine.sampling_params import SamplingParams

from tests.engine.test_prompt_logprobs import TEXT, _run
from tests.numerics import model_error_bound


class Float64Logits:
    def __init__(self, path: str) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()

    @torch.inference_mode()
    def __call__(self, token_ids: list[int], vocab_size: int) -> tuple[torch.Tensor, float]:
        """(``[len(token_ids), vocab]`` logits, the bound of one float32 logit's error)."""
        logits = self.model(torch.tensor([token_ids])).logits[0, :, :vocab_size]
        scale = logits.abs().max().item()
        return logits, model_error_bound(self.model.config, len(token_ids), torch.float32, scale)


def _assert_close(got, expected: torch.Tensor, bound: float) -> None:
    got = torch.as_tensor(got, dtype=torch.float64)
    assert got.shape == expected.shape, (got.shape, expected.shape)
    error = (got - expected).abs().max().item()
    assert error <= bound, (error, bound)


def test_context_and_generation_logits_equal_a_float64_forward(model_path):
    """Context logits row q == the float64 logits after prompt[:q + 1] (whole prompt, and in
    8-token chunks beside an ordinary request); generation logits row i == the float64 logits
    that predict output token i (greedy: that token is their argmax up to the bound)."""
    ref = Float64Logits(model_path)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, return_context_logits=True,
                            return_generation_logits=True)
    for config in (EngineConfig(model=model_path), EngineConfig(model=model_path, max_num_batched_tokens=8),
                   EngineConfig(model=model_path, max_num_batched_tokens=8, async_scheduling=True)):
        engine = LLMEngine(config)
        vocab = engine.model_config.vocab_size
        prompt = engine.tokenizer.encode(TEXT)
        plain = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
        outs = _run(engine, {"asks": (prompt, params), "plain": (prompt[:9], plain)})
        out = outs["asks"]
        tokens = out.outputs[0].token_ids
        logits, bound = ref(prompt + tokens, vocab)
        _assert_close(out.context_logits, logits[:len(prompt)], bound)
        generation = out.outputs[0].generation_logits
        _assert_close(generation, logits[len(prompt) - 1:len(prompt) - 1 + len(tokens)], bound)
        for row, token in zip(torch.as_tensor(generation), tokens):
            assert row[token] >= row.max() - 2 * bound  # greedy
        assert generation.dtype == out.context_logits.dtype == "float32"
        # opt-in: the other request carries none
        assert outs["plain"].context_logits is None and outs["plain"].outputs[0].generation_logits is None


def test_context_logits_skip_the_prefix_cache_and_n_children_share_them(model_path):
    """A cached prompt has no logits: a repeated prompt asking for context logits computes them
    again, equal; with n=2 both completions carry generation logits of their own tokens."""
    engine = LLMEngine(EngineConfig(model=model_path, enable_prefix_caching=True))
    prompt = list(range(100, 140))
    first = _run(engine, {"a": (prompt, SamplingParams(temperature=0.0, max_tokens=1))})["a"]
    assert first.context_logits is None
    params = SamplingParams(temperature=0.0, max_tokens=2, return_context_logits=True)
    again = _run(engine, {"b": (prompt, params)})["b"]
    assert again.context_logits.shape == (len(prompt), engine.model_config.vocab_size)
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=3, ignore_eos=True, return_generation_logits=True)
    both = _run(engine, {"c": (prompt, params)})["c"]
    for completion in both.outputs:
        assert completion.generation_logits.shape == (3, engine.model_config.vocab_size)


def test_refusals_name_the_field(model_path):
    with pytest.raises(ValueError, match="return_generation_logits: not supported with stop strings"):
        SamplingParams(return_generation_logits=True, stop=["."])
    with pytest.raises(ValueError, match="return_context_logits: not supported with beam search"):
        SamplingParams(use_beam_search=True, n=2, temperature=0.0, return_context_logits=True)
    with pytest.raises(ValueError, match="return_generation_logits: must be a boolean"):
        SamplingParams(return_generation_logits=1)
    vocab = 49152
    check_logits_size(SamplingParams(return_context_logits=True), MAX_LOGITS_VALUES // vocab, 8192, vocab)
    with pytest.raises(ValueError, match="return_context_logits: .* over the limit"):
        check_logits_size(SamplingParams(return_context_logits=True), MAX_LOGITS_VALUES // vocab + 1, 8192, vocab)
    with pytest.raises(ValueError, match="return_generation_logits: max_tokens 1366 .* at most 1365"):
        check_logits_size(SamplingParams(return_generation_logits=True, max_tokens=1366), 10, 8192, vocab)
    with pytest.raises(ValueError, match="return_generation_logits: max_tokens 8182"):  # unset: what is left
        check_logits_size(SamplingParams(return_generation_logits=True, max_tokens=None), 10, 8192, vocab)
    # through the engine: refused before it runs, the engine keeps serving
    engine = LLMEngine(EngineConfig(model=model_path))
    too_many = MAX_LOGITS_VALUES // engine.model_config.vocab_size + 1
    with pytest.raises(ValueError, match="return_context_logits"):
        engine.add_request("x", list(range(5, 5 + too_many)), SamplingParams(return_context_logits=True, max_tokens=1))
    out = _run(engine, {"y": ([5, 6, 7], SamplingParams(max_tokens=2, return_context_logits=True))})["y"]
    assert out.context_logits.shape == (3, engine.model_config.vocab_size)


def test_generation_logits_with_speculative_decoding_keep_the_accepted_rows(model_path):
    """Self-drafting (every draft accepted, several tokens a step): one row per kept token, each
    the float64 logits predicting it, as without speculation."""
    ref = Float64Logits(model_path)
    engine = LLMEngine(EngineConfig(model=model_path, speculative_method="draft", speculative_model=model_path,
                                    spec_adaptive=False, num_speculative_tokens=3))
    prompt = list(range(300, 320))
    params = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True, return_generation_logits=True)
    out = _run(engine, {"s": (prompt, params)})["s"].outputs[0]
    stats = engine.get_stats()
    assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens > 0  # drafts were verified and kept
    logits, bound = ref(prompt + out.token_ids, engine.model_config.vocab_size)
    _assert_close(out.generation_logits, logits[len(prompt) - 1:len(prompt) - 1 + len(out.token_ids)], bound)
