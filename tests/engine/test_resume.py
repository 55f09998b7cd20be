"""A resumed request (``RequestOptions.resume``, ``engine.resume``) continues exactly where the
uninterrupted one would have gone.

For each case the request runs once uninterrupted, streaming (the reference: every step's
deltas). Then, for every cut point a router could have seen (after each streamed output),
the same request is sent again to a fresh engine with the tokens and characters streamed so
far as its ``resume``: what it streams must be exactly the reference's remainder: the same
token ids, the same text (what the first run held back included), the same finish. Covers
greedy, seeded sampling (the seed's position continues), penalties with ``min_tokens`` (the
earlier tokens count as output), stop strings across the seam, a grammar (its matcher replays
the earlier tokens) and log-probabilities. A tiny random Llama with the default model's
tokenizer: its random tokens are often pieces of multi-byte characters, so text is held back
at many cuts.
"""

from __future__ import annotations

import math

import pytest

from pagoda.contracts.request_options import RequestOptions, Resume
from pagoda.engine.config import EngineConfig
from pagoda.engine.guided import GuidedDecodingParams
from pagoda.engine.llm_engine import LLMEngine
from pagoda.engine.request import EngineRequest
from pagoda.engine.sampling_params import SamplingParams

PROMPT = [1, 504, 3458, 282, 253, 1345, 30, 2070, 338, 6254]


@pytest.fixture(scope="module")
def engine(model_path):
    return LLMEngine(EngineConfig(model=model_path, max_model_len=256))


def _stream_all(engine, requests):
    """Every output of each request (id -> (params, resume)), step by step (deltas), run together."""
    for request_id, (params, resume) in requests.items():
        engine.add(EngineRequest(request_id, list(PROMPT), params, RequestOptions(resume=resume)))
    outputs = {request_id: [] for request_id in requests}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id].append(out)
    return outputs


def _stream(engine, request_id, params, resume=None):
    return _stream_all(engine, {request_id: (params, resume)})[request_id]


def _deltas(outputs):
    """(token ids, text, logprobs) each output added, and the final completion."""
    steps = [(list(o.outputs[0].delta_token_ids), o.outputs[0].delta_text, o.outputs[0].delta_logprobs or [])
             for o in outputs]
    return steps, outputs[-1].outputs[0]


def _check_every_cut(engine, name, params):
    reference, final = _deltas(_stream(engine, f"{name}-whole", params))
    all_ids = [t for ids, _, _ in reference for t in ids]
    all_text = "".join(text for _, text, _ in reference)
    assert len(reference) > 3, "the case must stream several outputs"
    requests = {}
    for cut in range(1, len(reference) - 1):
        ids = [t for step_ids, _, _ in reference[:cut] for t in step_ids]
        sent = "".join(text for _, text, _ in reference[:cut])
        cumulative = sum(lp.logprob for _, _, lps in reference[:cut] for lp in lps) if params.logprobs is not None \
            else None
        requests[f"{name}-{cut}"] = (params, Resume(tuple(ids), len(sent), cumulative))
    streams = _stream_all(engine, requests)  # all cuts in one batch: the sampler is row-independent
    for cut in range(1, len(reference) - 1):
        ids = [t for step_ids, _, _ in reference[:cut] for t in step_ids]
        sent = "".join(text for _, text, _ in reference[:cut])
        resumed, resumed_final = _deltas(streams[f"{name}-{cut}"])
        assert ids + [t for step_ids, _, _ in resumed for t in step_ids] == all_ids, (name, cut)
        assert sent + "".join(text for _, text, _ in resumed) == all_text, (name, cut)
        assert (resumed_final.finish_reason, resumed_final.stop_reason) == (final.finish_reason, final.stop_reason)
        # The reference left its blocks in the prefix cache: a hit past the prompt is not reported as prompt.
        assert streams[f"{name}-{cut}"][-1].num_cached_tokens <= len(PROMPT)
        if params.logprobs is not None:
            before = [lp for _, _, lps in reference[:cut] for lp in lps]
            after = [lp for _, _, lps in resumed for lp in lps]
            expected = [lp for _, _, lps in reference for lp in lps]
            assert [lp.token_id for lp in before + after] == [lp.token_id for lp in expected]
            # The context is computed in one prefill instead of token by token: equal up to rounding.
            assert all(math.isclose(a.logprob, b.logprob, abs_tol=1e-4) for a, b in zip(before + after, expected))
            assert math.isclose(resumed_final.cumulative_logprob, final.cumulative_logprob, abs_tol=1e-3)
    return all_ids, all_text, final


def test_greedy_continues_exactly(engine):
    _check_every_cut(engine, "greedy", SamplingParams(max_tokens=14, temperature=0, ignore_eos=True))


def test_seeded_sampling_continues_at_its_position(engine):
    params = SamplingParams(max_tokens=14, temperature=1.0, top_k=50, seed=1234, ignore_eos=True, logprobs=2)
    ids, _, _ = _check_every_cut(engine, "seeded", params)
    unseeded_position = _stream(engine, "other-seed", params.clone(seed=99))[-1].outputs[0].token_ids
    assert ids != list(unseeded_position)  # the seed decides, so matching it means something


def test_penalties_and_min_tokens_count_the_earlier_output(engine):
    params = SamplingParams(max_tokens=14, temperature=0.8, seed=5, frequency_penalty=1.5, presence_penalty=0.5,
                            repetition_penalty=1.3, min_tokens=10)
    _check_every_cut(engine, "penalties", params)


def test_stop_string_matched_across_the_seam(engine):
    _, text, _ = _check_every_cut(engine, "nostop", SamplingParams(max_tokens=14, temperature=0, ignore_eos=True))
    stop = text[len(text) // 2: len(text) // 2 + 4]
    assert stop.strip(), text
    _, stopped, final = _check_every_cut(engine, "stop", SamplingParams(max_tokens=14, temperature=0,
                                                                         ignore_eos=True, stop=[stop]))
    assert final.finish_reason == "stop" and final.stop_reason == stop and stopped == text[:text.index(stop)]


def test_grammar_replays_the_earlier_tokens(engine):
    guided = GuidedDecodingParams(regex="[a-z]{3}( [a-z]{2,6}){2,5}")
    _, text, final = _check_every_cut(engine, "guided", SamplingParams(max_tokens=20, temperature=0.7, seed=3,
                                                                       guided_decoding=guided))
    assert final.finish_reason in ("stop", "length"), final


def test_resume_refusals_name_the_field(engine):
    def add(params, resume, request_id):
        engine.add(EngineRequest(request_id, list(PROMPT), params, RequestOptions(resume=resume)))

    with pytest.raises(ValueError, match="^resume: only a request with one completion"):
        add(SamplingParams(n=2, max_tokens=8), Resume((5,)), "n2")
    with pytest.raises(ValueError, match="^resume: prompt_logprobs"):
        add(SamplingParams(prompt_logprobs=1, max_tokens=8), Resume((5,)), "plp")
    for flag in ("return_context_logits", "return_generation_logits"):  # the earlier rows are not recomputed
        with pytest.raises(ValueError, match=f"^resume: {flag}"):
            add(SamplingParams(max_tokens=8, **{flag: True}), Resume((5,)), flag)
    with pytest.raises(ValueError, match="^resume.output_token_ids: 8 tokens leave nothing"):
        add(SamplingParams(max_tokens=8), Resume(tuple(range(8))), "full")
    with pytest.raises(ValueError, match="^resume.output_token_ids: token id 999999 is not in the vocabulary"):
        add(SamplingParams(max_tokens=8), Resume((999999,)), "vocab")
    with pytest.raises(ValueError, match="^resume.num_sent_chars: 500 characters sent"):
        add(SamplingParams(max_tokens=8), Resume((504, 3458), 500), "chars")
    with pytest.raises(ValueError, match="^resume.output_token_ids: must be a non-empty list"):
        Resume(())
    assert not engine.has_unfinished_requests()  # nothing was queued


def test_grammar_refusing_the_earlier_tokens_fails_only_that_request(engine):
    guided = GuidedDecodingParams(regex="[0-9]{4}")
    text_ids = engine.tokenizer.encode("hello", add_special_tokens=False)
    engine.add(EngineRequest("bad-grammar", list(PROMPT), SamplingParams(max_tokens=8, guided_decoding=guided),
                             RequestOptions(resume=Resume(tuple(text_ids)))))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert outputs[-1].finished and outputs[-1].error.startswith("resume.output_token_ids: token"), outputs[-1]
    assert engine.scheduler.block_pool.num_free_blocks == engine.scheduler.block_pool.num_usable_blocks
