"""Beam search through a real tritonserver, in both dialects (issue 31).

vLLM's dialect (``sampling_parameters``: ``use_beam_search``, ``best_of``, ``n``,
``length_penalty``, ``early_stopping``) on pagoda's model, and TensorRT-LLM's ``beam_width``
on the ``ensemble`` (unary) and ``tensorrt_llm_bls`` (decoupled) fronts, return the same
``n`` best beams, best first, with their cumulative and per-token log-probabilities, as the
offline engine does for the same prompt (tests/engine/test_beam_search.py holds the engine to
Hugging Face's ``generate(num_beams=k)``).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.serving.test_serving_triton_server import http_post
from tests.serving.test_serving_trtllm_dialect import batch, grpc_infer, grpc_stream, trt_inputs

pytestmark = pytest.mark.server

PROMPT = "The capital of France is"
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def offline_beams(smollm2_path):
    """The offline engine's 2 best of 4 beams: (texts, cumulative log-probabilities, per beam
    its tokens' ``TokenLogprob`` entries with the top 2)."""
    from pagoda.engine.config import EngineConfig
    from pagoda.engine.llm_engine import LLMEngine
    from pagoda.engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model=smollm2_path))
    engine.add_request("r", PROMPT, SamplingParams(use_beam_search=True, best_of=4, n=2, temperature=0.0,
                                                   max_tokens=MAX_TOKENS, logprobs=2))
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out if out.finished else final
    engine.shutdown()
    return [c.text for c in final.outputs], [c.cumulative_logprob for c in final.outputs], \
        [c.logprobs for c in final.outputs]


def test_vllm_dialect_use_beam_search_returns_n_best_beams(triton_server, offline_beams):
    texts, cumulative, _ = offline_beams
    sampling = {"use_beam_search": True, "best_of": 4, "n": 2, "temperature": 0, "max_tokens": MAX_TOKENS,
                "length_penalty": 1.0, "early_stopping": False}
    status, body = http_post(triton_server, "/v2/models/pagoda/generate",
                             {"text_input": PROMPT, "exclude_input_in_output": True,
                              "return_cumulative_logprob": True, "sampling_parameters": json.dumps(sampling)})
    assert status == 200, body
    assert body["text_output"] == texts
    assert body["cumulative_logprob"] == pytest.approx(cumulative, abs=1e-3)
    # Refusals name the field: sampling with beam search, and a width past the limit.
    for bad, field in (({**sampling, "temperature": 0.8}, "temperature"), ({**sampling, "best_of": 64}, "best_of")):
        status, body = http_post(triton_server, "/v2/models/pagoda/generate",
                                 {"text_input": PROMPT, "sampling_parameters": json.dumps(bad)})
        assert status == 400 and field in body["error"], body


def test_trtllm_beam_width_on_both_fronts(triton_server, offline_beams):
    texts, cumulative, _ = offline_beams
    inputs = trt_inputs([PROMPT], max_tokens=MAX_TOKENS, beam_width=(4, np.int32), num_return_sequences=(2, np.int32),
                        return_log_probs=(True, bool), exclude_input_in_output=(True, bool))
    result = grpc_infer(triton_server, "ensemble", inputs, ("text_output", "cum_log_probs", "sequence_index"))
    assert [t.decode() for t in result.as_numpy("text_output")] == texts
    assert result.as_numpy("cum_log_probs")[0].tolist() == pytest.approx(cumulative, abs=1e-3)
    assert result.as_numpy("sequence_index").tolist() == [[0, 1]]
    streamed = {**inputs, "stream": batch([True], bool)}
    results, errors = grpc_stream(triton_server, "tensorrt_llm_bls", streamed)
    assert not errors, errors
    got = {0: "", 1: ""}
    for r in results:
        got[int(r.as_numpy("sequence_index")[0][0])] += r.as_numpy("text_output")[0].decode()
    assert [got[0], got[1]] == texts
    # Without num_return_sequences every beam comes back, as TensorRT-LLM returns them.
    result = grpc_infer(triton_server, "ensemble", trt_inputs([PROMPT], max_tokens=4, beam_width=(3, np.int32)),
                        ("text_output", "sequence_index"))
    assert result.as_numpy("sequence_index").tolist() == [[0, 1, 2]]


def test_per_token_logprobs_of_beams_in_both_dialects(triton_server, offline_beams):
    """``logprobs`` with beam search: vLLM's dialect gives each beam's per-token entries (the
    chosen token and the top 2), TensorRT-LLM's ``return_log_probs`` gives ``output_log_probs``
    ``[1, beams, tokens]``; both equal the offline engine's, and sum to ``cumulative_logprob``."""
    texts, cumulative, logprobs = offline_beams
    sampling = {"use_beam_search": True, "best_of": 4, "n": 2, "temperature": 0, "max_tokens": MAX_TOKENS,
                "logprobs": 2, "output_dialect": "vllm"}
    status, body = http_post(triton_server, "/v2/models/pagoda/generate",
                             {"text_input": PROMPT, "exclude_input_in_output": True, "return_logprobs": True,
                              "return_cumulative_logprob": True, "sampling_parameters": json.dumps(sampling)})
    assert status == 200, body
    assert body["text_output"] == texts
    for steps_json, expected, total in zip(body["logprobs"], logprobs, body["cumulative_logprob"]):
        steps = json.loads(steps_json)
        assert len(steps) == len(expected) > 0
        for step, lp in zip(steps, expected):
            assert set(step) == {str(lp.token_id)} | {str(t) for t, _ in lp.top}
            assert step[str(lp.token_id)]["logprob"] == pytest.approx(lp.logprob, abs=1e-4)
            assert step[str(lp.token_id)]["rank"] == lp.rank
        assert sum(s[str(lp.token_id)]["logprob"] for s, lp in zip(steps, expected)) == pytest.approx(total, abs=1e-3)
    inputs = trt_inputs([PROMPT], max_tokens=MAX_TOKENS, beam_width=(4, np.int32), num_return_sequences=(2, np.int32),
                        return_log_probs=(True, bool), exclude_input_in_output=(True, bool))
    result = grpc_infer(triton_server, "ensemble", inputs, ("output_log_probs", "cum_log_probs"))
    width = max(len(beam) for beam in logprobs)  # a shorter beam is padded with 0.0, as TensorRT-LLM's
    assert result.as_numpy("output_log_probs").shape == (1, 2, width)
    assert result.as_numpy("output_log_probs")[0].tolist() == \
        [pytest.approx([lp.logprob for lp in beam] + [0.0] * (width - len(beam)), abs=1e-4) for beam in logprobs]
    assert result.as_numpy("cum_log_probs")[0].tolist() == pytest.approx(cumulative, abs=1e-3)


def test_structured_output_per_beam_through_tritonserver(triton_server):
    """vLLM's ``structured_outputs`` with beam search: every returned beam is in the regex's
    language (each beam runs its own grammar matcher)."""
    import re

    pattern = "[0-9]{3}-[a-z]{2}"
    sampling = {"use_beam_search": True, "best_of": 3, "n": 3, "temperature": 0, "max_tokens": 12,
                "structured_outputs": {"regex": pattern}}
    status, body = http_post(triton_server, "/v2/models/pagoda/generate",
                             {"text_input": "Give a code:", "exclude_input_in_output": True,
                              "sampling_parameters": json.dumps(sampling)})
    assert status == 200, body
    assert len(body["text_output"]) == 3 and len(set(body["text_output"])) == 3
    assert all(re.fullmatch(pattern, text) for text in body["text_output"]), body["text_output"]
