"""Prompt log-probabilities (``SamplingParams.prompt_logprobs``): what lm-eval's loglikelihood
tasks read, so every entry is checked against a float64 forward of the same weights.

The bound: the engine computes the logits in float32; ``model_error_bound`` bounds one
logit's rounding error (``tests/numerics.py``), and a log-probability ``z_t - logsumexp(z)``
moves by at most twice that (``logsumexp`` moves by at most the largest logit error), plus
the float32 rounding of the ``log_softmax`` itself (a length-vocab sum: ``gamma_V``).
"""

from __future__ import annotations

import math

import pytest
import torch

from pagoda.engine.config import EngineConfig
from pagoda.engine.llm_engine import LLMEngine
from pagoda.engine.sampling_params import SamplingParams

from tests.numerics import gamma, model_error_bound

TEXT = ("In a quiet village by the sea, an old lighthouse keeper kept a journal of every ship that passed, "
        "noting the weather and the hour of the tide.")


class Float64Reference:
    """log_softmax of a float64 Hugging Face forward of the model folder."""

    def __init__(self, path: str) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()

    @torch.inference_mode()
    def logprobs(self, token_ids: list[int], vocab_size: int) -> tuple[torch.Tensor, float]:
        """(``[len(token_ids), vocab]`` log-probabilities, row p the distribution of token p + 1;
        the largest logit magnitude, the bound's scale)."""
        logits = self.model(torch.tensor([token_ids])).logits[0, :, :vocab_size]
        return torch.log_softmax(logits, dim=-1), logits.abs().max().item()

    def bound(self, num_tokens: int, scale: float, vocab_size: int) -> float:
        return 2 * model_error_bound(self.model.config, num_tokens, torch.float32, scale) + \
            gamma(vocab_size, torch.float32) * (scale + math.log(vocab_size))


def _run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict:
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


def _check_against_reference(ref: Float64Reference, prompt: list[int], entries: list, num_top: int,
                             vocab_size: int) -> None:
    logprobs, scale = ref.logprobs(prompt, vocab_size)
    bound = ref.bound(len(prompt), scale, vocab_size)
    assert len(entries) == len(prompt) and entries[0] is None
    for q in range(1, len(prompt)):
        entry, expected = entries[q], logprobs[q - 1]
        assert entry.token_id == prompt[q]
        assert abs(entry.logprob - expected[prompt[q]].item()) <= bound, (q, entry.logprob, expected[prompt[q]])
        # The rank: 1 + tokens strictly above it, up to ties within the bound.
        above_surely = int((expected > expected[prompt[q]] + 2 * bound).sum())
        above_maybe = int((expected > expected[prompt[q]] - 2 * bound).sum()) - 1
        assert 1 + above_surely <= entry.rank <= 1 + above_maybe + 1, (q, entry.rank)
        assert len(entry.top) == num_top
        top_values = expected.topk(num_top).values
        for (token_id, value), expected_value in zip(entry.top, top_values):
            assert abs(value - expected[token_id].item()) <= bound
            assert abs(value - expected_value.item()) <= 2 * bound  # the k-th best, up to near-ties


def test_prompt_logprobs_equal_a_float64_forward_alone_and_chunked(model_path):
    """Every prompt position's log-prob, rank and top-3 within the derived bound of float64,
    whole prompt in one step, and in 8-token chunks beside an ordinary request."""
    ref = Float64Reference(model_path)
    whole = LLMEngine(EngineConfig(model=model_path))
    prompt = whole.tokenizer.encode(TEXT)
    assert len(prompt) > 20
    vocab = whole.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3)
    out = _run(whole, {"a": (prompt, params)})["a"]
    _check_against_reference(ref, prompt, out.prompt_logprobs, 3, vocab)

    chunked = LLMEngine(EngineConfig(model=model_path, max_num_batched_tokens=8))
    ordinary = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    other = prompt[:5] + prompt[3:15]
    outs = _run(chunked, {"asks": (prompt, params), "plain": (other, ordinary)})
    _check_against_reference(ref, prompt, outs["asks"].prompt_logprobs, 3, vocab)
    assert outs["asks"].outputs[0].token_ids == out.outputs[0].token_ids
    assert outs["plain"].prompt_logprobs is None
    alone = _run(LLMEngine(EngineConfig(model=model_path)), {"plain": (other, ordinary)})["plain"]
    assert outs["plain"].outputs[0].token_ids == alone.outputs[0].token_ids


def test_async_scheduling_gives_the_same_prompt_logprobs(model_path):
    """With the overlapped engine (chunks scheduled before the previous step is applied) the
    chunks' entries land in the same positions, with the same values."""
    prompt = list(range(40, 90))
    params = SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=1)
    outs = [_run(LLMEngine(EngineConfig(model=model_path, max_num_batched_tokens=8, async_scheduling=overlap)),
                 {"a": (prompt, params)})["a"] for overlap in (False, True)]
    sync, overlapped = ([(e.token_id, e.logprob, e.rank, e.top) for e in out.prompt_logprobs[1:]] for out in outs)
    assert outs[1].prompt_logprobs[0] is None and overlapped == sync
    assert [e[0] for e in sync] == prompt[1:]


def test_a_preempted_request_keeps_its_prompt_logprobs(model_path):
    """A KV cache too small for both requests: preempted and recomputed, a request's prompt
    log-probabilities are the ones it gets alone."""
    prompts = {"a": list(range(100, 140)), "b": list(range(200, 240))}
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, prompt_logprobs=2)
    tight = LLMEngine(EngineConfig(model=model_path, block_size=16, num_gpu_blocks_override=6,
                                   max_num_batched_tokens=16, enable_prefix_caching=False))
    outs = _run(tight, {key: (prompt, params) for key, prompt in prompts.items()})
    assert tight.core.scheduler.num_preemptions_total > 0
    ref = Float64Reference(model_path)
    for key, prompt in prompts.items():
        alone = _run(LLMEngine(EngineConfig(model=model_path)), {key: (prompt, params)})[key]
        assert outs[key].outputs[0].token_ids == alone.outputs[0].token_ids
        _check_against_reference(ref, prompt, outs[key].prompt_logprobs, 2, tight.model_config.vocab_size)


def test_prompt_logprobs_skip_the_prefix_cache(model_path):
    """A cached prefix has no logits: a request asking for prompt logprobs computes its
    whole prompt (num_cached_tokens 0, every entry present), an ordinary one still hits."""
    engine = LLMEngine(EngineConfig(model=model_path, block_size=16))
    prompt = engine.tokenizer.encode(TEXT)
    plain = SamplingParams(temperature=0.0, max_tokens=1)
    _run(engine, {"warm": (prompt, plain)})
    outs = _run(engine, {"asks": (prompt, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)),
                         "hits": (prompt, plain)})
    assert outs["hits"].num_cached_tokens >= 16
    assert outs["asks"].num_cached_tokens == 0
    entries = outs["asks"].prompt_logprobs
    assert entries[0] is None and all(e is not None and e.top == [] for e in entries[1:])
    _check_against_reference(Float64Reference(model_path), prompt, entries, 0, engine.model_config.vocab_size)


def test_requests_that_do_not_ask_pay_nothing(model_path):
    """Without prompt_logprobs the LM head sees only the sampling rows (one per request per
    step); with it, the asking request's prompt rows are added and nothing else."""
    engine = LLMEngine(EngineConfig(model=model_path))
    model = engine.runner.model
    head_rows: list[int] = []
    original = model.compute_logits
    model.compute_logits = lambda hidden: head_rows.append(hidden.shape[0]) or original(hidden)
    prompt = engine.tokenizer.encode(TEXT)
    ordinary = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    _run(engine, {"a": (prompt, ordinary), "b": (prompt[:9], ordinary)})
    assert head_rows == [2, 2, 2]  # the prefill step samples both, then two decodes
    head_rows.clear()
    _run(engine, {"c": (prompt[:9], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)),
                  "d": (prompt[:7], ordinary)})
    assert head_rows[:2] == [8, 2] and head_rows[2:] == [1, 1]  # prompt rows 0..7 of "c"; then "d" decodes


def test_n_children_each_carry_the_prompt_logprobs(model_path):
    engine = LLMEngine(EngineConfig(model=model_path))
    prompt = engine.tokenizer.encode("The capital of France is")
    out = _run(engine, {"n": (prompt, SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=3,
                                                     prompt_logprobs=2))})["n"]
    assert len(out.outputs) == 2 and len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
    assert [e.token_id for e in out.prompt_logprobs[1:]] == prompt[1:]


@pytest.mark.parametrize("value", [-1, 21, 1.5, True, "2"])
def test_bad_prompt_logprobs_are_refused_naming_the_field(value):
    with pytest.raises(ValueError, match="^prompt_logprobs: "):
        SamplingParams(prompt_logprobs=value)


def test_max_tokens_zero_is_refused_as_vllm_does():
    """vLLM's engine needs max_tokens >= 1; its OpenAI echo with max_tokens=0 generates one
    token and drops it, and so does pagoda's door."""
    with pytest.raises(ValueError, match="^max_tokens: must be >= 1"):
        SamplingParams(max_tokens=0, prompt_logprobs=1)


def test_default_model_prompt_logprobs_equal_a_float64_forward(smollm2_path):
    """The default model (30 layers), fp32 engine against a float64 forward."""
    ref = Float64Reference(smollm2_path)
    engine = LLMEngine(EngineConfig(model=smollm2_path, max_num_batched_tokens=16))
    prompt = engine.tokenizer.encode("Question: What is the capital of France?\nAnswer: Paris")
    out = _run(engine, {"a": (prompt, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1))})["a"]
    _check_against_reference(ref, prompt, out.prompt_logprobs, 1, engine.model_config.vocab_size)
