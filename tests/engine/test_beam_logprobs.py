"""Per-token log-probabilities of beams equal Hugging Face's ``compute_transition_scores``.

``SamplingParams(use_beam_search=True, logprobs=N)``: each returned beam's ``logprobs`` hold,
per token, the chosen token's log-probability, its rank and the top ``N``, read from the
step's scores of the beam that chose it. The reference is ``generate(num_beams=k,
output_scores=True, return_dict_in_generate=True)``: its ``scores`` are each beam row's
``log_softmax`` (grammar-masked under ``prefix_allowed_tokens_fn``) and ``beam_indices``
name the row each returned token came from. Values must agree within the one-term bound
``tests/engine/test_beam_search.py`` derives; ``N <= 2k`` and ``N > 2k`` both run, with a
stop token that ends some beams early, and a guided group whose top lists leave out what
its grammar forbids.
"""

from __future__ import annotations

import json

import pytest
import torch

from pagoda.engine.config import EngineConfig
from pagoda.engine.llm_engine import LLMEngine
from pagoda.engine.sampling_params import SamplingParams

from tests.engine.hf_reference import make_random_model
from tests.engine.test_beam_search import MAX_NEW, _assert_no_leak, _grammar_oracle, _hf, _run, _score_bound


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory, smollm2_path):
    return str(make_random_model(tmp_path_factory.mktemp("beam_logprobs") / "llama", "llama-gqa3-hd64", smollm2_path))


def _hf_rows(model, prompt, k, n, stop_ids, allowed=None):
    """HF's n best beams: (tokens, per token the score row of the beam that chose it)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), num_beams=k, num_return_sequences=n, max_new_tokens=MAX_NEW,
                             do_sample=False, eos_token_id=sorted(stop_ids) or None, pad_token_id=0,
                             prefix_allowed_tokens_fn=allowed, output_scores=True, return_dict_in_generate=True)
    chosen = model.compute_transition_scores(out.sequences, out.scores, out.beam_indices, normalize_logits=False)
    beams = []
    for b in range(n):
        tokens = out.sequences[b, len(prompt):].tolist()
        length = int((out.beam_indices[b] >= 0).sum())  # HF pads a beam that ended early
        rows = [out.scores[t][out.beam_indices[b, t]] for t in range(length)]
        beams.append((tokens[:length], chosen[b, :length].tolist(), rows))
    return beams


def _check(out, expected, num_top, bound):
    assert [c.token_ids for c in out.outputs] == [tokens for tokens, _, _ in expected], "beams differ from HF"
    for c, (tokens, hf_chosen, rows) in zip(out.outputs, expected):
        assert [lp.token_id for lp in c.logprobs] == tokens
        assert c.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in c.logprobs), abs=1e-9)
        for lp, theirs, row in zip(c.logprobs, hf_chosen, rows):
            assert abs(lp.logprob - theirs) <= bound, f"{lp.logprob} vs HF {theirs} (bound {bound:.3g})"
            allowed = int(torch.isfinite(row).sum())
            assert len(lp.top) == min(num_top, allowed), "top N, of the tokens the beam could choose"
            values = [v for _, v in lp.top]
            assert values == sorted(values, reverse=True)
            for token, value in lp.top:  # HF's value of each reported token, within the bound
                assert abs(value - row[token].item()) <= bound, (token, value, row[token].item())
            if lp.top:  # and nothing HF ranks clearly above the last one is missing
                assert (row > values[-1] + 2 * bound).sum().item() <= len(lp.top) - 1
            # rank: 1 + the tokens above it (exact in ours; HF's count within the bound)
            assert lp.rank == 1 + sum(v > lp.logprob for v in values) or lp.rank > num_top
            assert (row > theirs + 2 * bound).sum().item() <= lp.rank - 1 <= (row > theirs - 2 * bound).sum().item()


@pytest.mark.parametrize("k,n,num_top", [(4, 2, 3), (2, 2, 6)], ids=["N<=2k", "N>2k"])
def test_beam_logprobs_equal_hf_transition_scores(tiny_path, k, n, num_top):
    model = _hf(tiny_path)
    engine = LLMEngine(EngineConfig(model=tiny_path))
    prompt = engine.tokenizer.encode("Once upon a time, in a land far away,")
    greedy = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=3, pad_token_id=0)
    stop = {int(greedy[0, len(prompt) + 2])}  # a token beams do reach: some end early
    params = SamplingParams(use_beam_search=True, beam_width=k, n=n, temperature=0.0, max_tokens=MAX_NEW,
                            ignore_eos=True, stop_token_ids=sorted(stop), logprobs=num_top)
    plain = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=1)  # shares the batch
    done = _run(engine, {"b": (prompt, params), "plain": (prompt[:4], plain)})
    bound = _score_bound(model, prompt, 1, 1.0, 0.0)  # one term
    _check(done["b"], _hf_rows(model, prompt, k, n, stop), num_top, bound)
    assert len(done["plain"].outputs[0].logprobs) == 4
    _assert_no_leak(engine)


def test_guided_beam_logprobs_leave_out_forbidden_tokens(tiny_path):
    """Under structured output a beam reports what it ranks by: raw values of the tokens its
    grammar allows (HF's ``prefix_allowed_tokens_fn`` scores: -inf elsewhere)."""
    model = _hf(tiny_path)
    engine = LLMEngine(EngineConfig(model=tiny_path))
    eos = set(engine.tokenizer.eos_token_ids)
    prompt = engine.tokenizer.encode("Answer:")
    spec = '["yes", "no", "maybe"]'
    params = SamplingParams(use_beam_search=True, beam_width=2, n=2, temperature=0.0, max_tokens=MAX_NEW,
                            guided_decoding={"choice": json.loads(spec)}, logprobs=5)
    out = _run(engine, {"g": (prompt, params)})["g"]
    expected = _hf_rows(model, prompt, 2, 2, eos, _grammar_oracle(engine, "choice", spec, len(prompt)))
    _check(out, expected, 5, _score_bound(model, prompt, 1, 1.0, 0.0))
    assert any(len(lp.top) < 5 for c in out.outputs for lp in c.logprobs), "the grammar should narrow some steps"
    _assert_no_leak(engine)
