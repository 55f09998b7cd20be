"""Raw logits (``return_context_logits`` / ``return_generation_logits``, engine.logits_output):
checked against a float64 Hugging Face forward of the same weights, whole (``CUMULATIVE``) and
streamed step by step (``DELTA``: each output carries its own tokens' rows, nothing is kept).

The bound: the engine computes the logits in float32; ``model_error_bound`` (tests/numerics.py)
bounds one logit's rounding error for the sequence length and the logits' scale.
"""

from __future__ import annotations

import pytest
import torch

from pagoda.engine.config import EngineConfig
from pagoda.engine.llm_engine import LLMEngine
from pagoda.engine.logits_output import MAX_LOGITS_VALUES, check_logits_size
from pagoda.engine.sampling_params import RequestOutputKind, SamplingParams

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


def _stream(engine: LLMEngine, request_id: str, prompt: list[int], params: SamplingParams) -> list:
    """Every output of one request, step by step; with ``DELTA``, checks after each step that the
    output processor holds no rows (they left with the output)."""
    engine.add_request(request_id, prompt, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [out for out in engine.step() if out.request_id == request_id]
        for group in engine.output_processor._groups.values():
            if group.params.output_kind == RequestOutputKind.DELTA:
                assert all(not c.new_rows and c.all_rows is None for c in group.completions)
    return outputs


def test_streamed_rows_leave_with_each_output_under_async_speculation(model_path):
    """``DELTA`` with async scheduling and self-drafting (several tokens a step): each output's
    ``delta_generation_logits`` has one row per ``delta_token_ids`` token, their concatenation ==
    the float64 logits predicting each token; nothing is kept for the end (no ``generation_logits``,
    the output processor holds no rows once an output is made); context logits with the first tokens."""
    ref = Float64Logits(model_path)
    engine = LLMEngine(EngineConfig(model=model_path, speculative_method="draft", speculative_model=model_path,
                                    spec_adaptive=False, num_speculative_tokens=3, async_scheduling=True))
    prompt, vocab = list(range(300, 320)), engine.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True, return_generation_logits=True,
                            return_context_logits=True, output_kind=RequestOutputKind.DELTA)
    outputs = _stream(engine, "s", prompt, params)
    rows, tokens = [], []
    for out in outputs:
        completion = out.outputs[0]
        delta = completion.delta_generation_logits
        assert (0 if delta is None else len(delta)) == len(completion.delta_token_ids)
        assert completion.generation_logits is None  # DELTA: the finished output holds none either
        rows += [delta] if delta is not None else []
        tokens += completion.delta_token_ids
    assert max(len(r) for r in rows) > 1  # a step kept several drafted tokens: their rows came together
    assert outputs[-1].finished and tokens == outputs[-1].outputs[0].token_ids and len(tokens) == 9
    logits, bound = ref(prompt + tokens, vocab)
    _assert_close(torch.cat([torch.as_tensor(r) for r in rows]), logits[len(prompt) - 1:len(prompt) + 8], bound)
    first = next(out for out in outputs if out.outputs[0].delta_token_ids)
    _assert_close(first.context_logits, logits[:len(prompt)], bound)


def test_cumulative_keeps_every_row_and_delta_keeps_none(model_path):
    """The same request twice: ``CUMULATIVE`` (the default) gives the finished output all rows, the
    concatenated deltas of ``DELTA``; the output processor's completions keep rows only for it."""
    engine = LLMEngine(EngineConfig(model=model_path, max_num_batched_tokens=8))
    prompt = list(range(40, 52))
    base = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, return_generation_logits=True)
    engine.add_request("c", prompt, base)
    engine.add_request("d", prompt, base.clone(output_kind=RequestOutputKind.DELTA))
    kept = {c.request_id: c.all_rows for g in engine.output_processor._groups.values() for c in g.completions}
    assert kept == {"c": [], "d": None}
    deltas, final = [], {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == "d" and out.outputs[0].delta_generation_logits is not None:
                deltas.append(out.outputs[0].delta_generation_logits)
            final[out.request_id] = out
    whole = final["c"].outputs[0].generation_logits
    assert whole.shape == (5, engine.model_config.vocab_size) and final["d"].outputs[0].generation_logits is None
    # the same logits up to the batch's float32 summation order (the two share steps at other rows)
    torch.testing.assert_close(torch.as_tensor(whole), torch.cat([torch.as_tensor(r) for r in deltas]),
                               atol=1e-4, rtol=0)


def test_stop_strings_keep_the_rows_of_the_tokens_they_keep(model_path):
    """A stop string ends the output inside a step's tokens (self-drafting: several a step): the
    rows are those of the kept tokens, each == the float64 logits predicting it."""
    ref = Float64Logits(model_path)
    engine = LLMEngine(EngineConfig(model=model_path, speculative_method="draft", speculative_model=model_path,
                                    spec_adaptive=False, num_speculative_tokens=3))
    prompt, vocab = list(range(300, 320)), engine.model_config.vocab_size
    free = _stream(engine, "free", prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[-1]
    tokens = free.outputs[0].token_ids
    # the text of a token past the first step's: the stop falls inside a later step's tokens (or earlier)
    stop = next(piece for t in tokens[3:7] if (piece := engine.tokenizer.decode([t]).strip()))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, stop=[stop],
                            return_generation_logits=True)
    out = _stream(engine, "stopped", prompt, params)[-1].outputs[0]
    assert out.finish_reason == "stop" and len(out.token_ids) < 8
    rows = out.generation_logits
    assert len(rows) == len(out.token_ids)
    logits, bound = ref(prompt + out.token_ids, vocab)
    _assert_close(rows, logits[len(prompt) - 1:len(prompt) - 1 + len(out.token_ids)], bound)
