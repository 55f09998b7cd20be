"""TensorRT-LLM's ``return_context_logits`` / ``return_generation_logits`` on the fronts and on
pagoda's own (decoupled) model, through tritonclient against the session's tritonserver
(tests/serving/conftest.py: ``ensemble`` non-decoupled, ``tensorrt_llm_bls`` decoupled) and, for the
decoupled ``ensemble``, the package's ``pagoda serve`` (``openai_serve``, run with
``--trtllm-decoupled true``: no server of its own), checked against a float64 transformers forward
of the served model, the default one (engine.logits_output says what the rows are;
tests/numerics.py bounds one float32 logit's error).

Shapes as TensorRT-LLM's backend sends them: FP32 ``context_logits`` ``[1, prompt tokens, vocab]``
and ``generation_logits`` ``[1, sequences, tokens, vocab]`` per item (the non-decoupled answer
stacks items on the first dimension); streamed (gRPC stream, decoupled), every response carries the
context logits and its own tokens' rows token-major, ``[1, tokens in this response, 1, vocab]``.
pagoda's own model streams ``[n, tokens in this response, vocab]`` and the context logits once.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.numerics import model_error_bound
from tests.serving.test_serving_trtllm_dialect import PROMPT, batch, grpc_infer, grpc_stream, trt_inputs

pytestmark = pytest.mark.server

MAX_TOKENS = 3
LOGITS = {"return_context_logits": (True, bool), "return_generation_logits": (True, bool),
          "return_num_input_tokens": (True, bool)}
OUTPUTS = ("text_output", "num_input_tokens", "context_logits", "generation_logits")


@pytest.fixture(scope="module")
def reference(smollm2_path):
    """Token ids and float64 logits of the served model (transformers), with the bound: the default
    model, which both servers serve (not ``triton_server.options.model``, so a test on the other
    server does not start this one: tests/xdist_support.py groups tests by the server they use)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = smollm2_path
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()

    @torch.inference_mode()
    def logits(token_ids):
        out = model(torch.tensor([token_ids])).logits[0]
        return out, model_error_bound(model.config, len(token_ids), torch.float32, out.abs().max().item())

    return tokenizer, logits


def _within(got: np.ndarray, expected: torch.Tensor, bound: float) -> None:
    error = (torch.tensor(np.array(got, dtype=np.float64)) - expected[:, :got.shape[-1]]).abs().max().item()
    assert error <= bound, (error, bound)


def test_ensemble_logits_equal_transformers(triton_server, reference):
    """Unary ``ensemble``: context logits == transformers' prompt logits; generation row i ==
    transformers' logits predicting output token i (greedy: the text is the rows' argmaxes)."""
    tokenizer, logits = reference
    inputs = trt_inputs([PROMPT], max_tokens=MAX_TOKENS, exclude_input_in_output=(True, bool), **LOGITS)
    result = grpc_infer(triton_server, "ensemble", inputs, OUTPUTS)
    prompt = tokenizer.encode(PROMPT)
    context, generation = result.as_numpy("context_logits"), result.as_numpy("generation_logits")
    assert result.as_numpy("num_input_tokens")[0][0] == len(prompt)
    assert context.dtype == generation.dtype == np.float32
    assert context.shape[:2] == (1, len(prompt)) and generation.shape[:3] == (1, 1, MAX_TOKENS)
    tokens = generation[0, 0].argmax(axis=-1).tolist()
    assert tokenizer.decode(tokens) == result.as_numpy("text_output")[0].decode()
    expected, bound = logits(prompt + tokens)
    _within(context[0], expected[:len(prompt)], bound)
    _within(generation[0, 0], expected[len(prompt) - 1:len(prompt) - 1 + MAX_TOKENS], bound)
    # not asked: not computed, not sent
    plain = grpc_infer(triton_server, "ensemble", trt_inputs([PROMPT], max_tokens=MAX_TOKENS), OUTPUTS)
    assert plain.as_numpy("context_logits") is None and plain.as_numpy("generation_logits") is None


def test_decoupled_bls_streams_each_responses_rows(triton_server, reference):
    """``tensorrt_llm_bls`` (decoupled): without ``stream`` one response with both, as the unary
    ``ensemble``'s; streaming, each response carries ``[1, its tokens, 1, vocab]`` rows (as many as
    its ``num_output_tokens``) and the context logits; concatenated, the rows == the float64 forward
    and the unary answer's."""
    tokenizer, logits = reference
    inputs = trt_inputs([PROMPT], max_tokens=MAX_TOKENS, return_num_output_tokens=(True, bool), **LOGITS)
    names = (*OUTPUTS, "num_output_tokens", "batch_index", "sequence_index")
    unary = grpc_infer(triton_server, "ensemble", inputs, OUTPUTS)
    whole, errors = grpc_stream(triton_server, "tensorrt_llm_bls", {**inputs, "stream": batch([False], bool)}, names)
    assert not errors and len(whole) == 1, errors
    for name in ("context_logits", "generation_logits"):
        np.testing.assert_allclose(whole[0].as_numpy(name), unary.as_numpy(name), atol=1e-4)
    results, errors = grpc_stream(triton_server, "tensorrt_llm_bls", {**inputs, "stream": batch([True], bool)}, names)
    assert not errors and results, errors
    rows = []
    for result in results:
        generation = result.as_numpy("generation_logits")
        assert generation.shape[0] == 1 and generation.shape[2] == 1, generation.shape
        assert generation.shape[1] == result.as_numpy("num_output_tokens")[0][0]
        np.testing.assert_allclose(result.as_numpy("context_logits"), unary.as_numpy("context_logits"), atol=1e-4)
        rows.append(generation[0, :, 0])
    streamed = np.concatenate(rows)
    assert streamed.shape[0] == MAX_TOKENS
    np.testing.assert_allclose(streamed, unary.as_numpy("generation_logits")[0, 0], atol=1e-4)
    prompt = tokenizer.encode(PROMPT)
    tokens = streamed.argmax(axis=-1).tolist()
    expected, bound = logits(prompt + tokens)
    _within(streamed, expected[len(prompt) - 1:len(prompt) - 1 + MAX_TOKENS], bound)


def test_decoupled_ensemble_streams_each_responses_rows(openai_serve, reference):
    """``ensemble`` decoupled (``pagoda serve --trtllm-decoupled true``), as TensorRT-LLM's
    end_to_end_grpc_client.py streams it (``--streaming --return-generation-logits
    --return-context-logits``: outputs ``text_output``, ``context_logits``, ``generation_logits``,
    one stream): each response carries only its own tokens' rows ``[1, tokens, 1, vocab]`` and the
    context logits; the client's concatenation is the text and, within the bound, the float64
    forward; it equals the same server's one-response answer (``stream`` false)."""
    tokenizer, logits = reference
    server = SimpleNamespace(grpc_url=f"127.0.0.1:{openai_serve.ports[1]}")
    inputs = trt_inputs([PROMPT], max_tokens=MAX_TOKENS, exclude_input_in_output=(True, bool),
                        return_context_logits=(True, bool), return_generation_logits=(True, bool))
    names = ("text_output", "context_logits", "generation_logits")
    whole, errors = grpc_stream(server, "ensemble", {**inputs, "stream": batch([False], bool)}, names)
    assert not errors and len(whole) == 1, errors
    results, errors = grpc_stream(server, "ensemble", {**inputs, "stream": batch([True], bool)}, names)
    assert not errors and len(results) > 1, (errors, len(results))  # greedy, one token per step: streamed
    rows, text = [], ""
    for result in results:
        generation = result.as_numpy("generation_logits")
        assert generation.dtype == np.float32 and generation.shape[0] == 1 and generation.shape[2] == 1
        assert generation.shape[1] >= 1, generation.shape  # no response without a token of its own
        np.testing.assert_allclose(result.as_numpy("context_logits"), whole[0].as_numpy("context_logits"),
                                   atol=1e-4)
        rows.append(generation[0, :, 0])
        text += result.as_numpy("text_output")[0].decode()
    streamed = np.concatenate(rows)
    assert streamed.shape[0] == MAX_TOKENS
    assert whole[0].as_numpy("generation_logits").shape[:3] == (1, 1, MAX_TOKENS)
    np.testing.assert_allclose(streamed, whole[0].as_numpy("generation_logits")[0, 0], atol=1e-4)
    tokens = streamed.argmax(axis=-1).tolist()
    assert text == tokenizer.decode(tokens) == whole[0].as_numpy("text_output")[0].decode()
    prompt = tokenizer.encode(PROMPT)
    expected, bound = logits(prompt + tokens)
    _within(streamed, expected[len(prompt) - 1:len(prompt) - 1 + MAX_TOKENS], bound)
    _within(whole[0].as_numpy("context_logits")[0], expected[:len(prompt)], bound)


def test_bls_stream_with_two_sequences_sends_each_its_own_rows(triton_server):
    """``num_return_sequences`` 2 (seeded sampling), streamed: each sequence's responses carry its
    own tokens' rows; both start from the prompt (row 0 == the context logits' last row)."""
    inputs = trt_inputs([PROMPT], max_tokens=MAX_TOKENS, num_return_sequences=(2, np.int32), seed=(11, np.uint64),
                        temperature=(1.0, np.float32), stream=(True, bool), return_num_output_tokens=(True, bool),
                        **LOGITS)
    results, errors = grpc_stream(triton_server, "tensorrt_llm_bls", inputs,
                                  (*OUTPUTS, "num_output_tokens", "batch_index", "sequence_index"))
    assert not errors, errors
    rows: dict[int, list] = {0: [], 1: []}
    for result in results:
        generation = result.as_numpy("generation_logits")
        assert generation.shape[1] == result.as_numpy("num_output_tokens")[0][0]
        rows[int(result.as_numpy("sequence_index")[0][0])].append(generation[0, :, 0])
    context = results[0].as_numpy("context_logits")[0]
    for sequence in (0, 1):
        mine = np.concatenate(rows[sequence])
        assert 1 <= mine.shape[0] <= MAX_TOKENS  # sampled: an end token may come early
        np.testing.assert_allclose(mine[0], context[-1], atol=1e-4)


def test_pagoda_model_streams_rows_with_their_tokens(triton_server, reference):
    """pagoda's own decoupled model (the ``tensorrt_llm`` model's place), gRPC stream, ``n`` 2:
    each response's ``generation_logits`` ``[2, tokens, vocab]`` holds each completion's rows of
    that response's tokens (``output_token_ids``), the context logits come once with the first;
    each completion's concatenated rows == the float64 forward of its own tokens."""
    tokenizer, logits = reference
    sampling = {"max_tokens": MAX_TOKENS, "n": 2, "seed": 5, "temperature": 1.0, "ignore_eos": True}
    inputs = {"text_input": np.array([PROMPT.encode()], np.object_), "stream": np.array([True]),
              "sampling_parameters": np.array([json.dumps(sampling).encode()], np.object_),
              **{flag: np.array([True]) for flag in ("return_context_logits", "return_generation_logits",
                                                      "return_output_token_ids")}}
    results, errors = grpc_stream(triton_server, "pagoda", inputs,
                                  ("text_output", "output_token_ids", "context_logits", "generation_logits"))
    assert not errors and results, errors
    rows, tokens = {0: [], 1: []}, {0: [], 1: []}
    contexts = [r.as_numpy("context_logits") for r in results]
    assert contexts[0] is not None and all(c is None for c in contexts[1:])
    for result in results:
        generation = result.as_numpy("generation_logits")
        for i, ids in enumerate(json.loads(text) for text in result.as_numpy("output_token_ids")):
            assert generation is not None or not ids
            rows[i] += list(generation[i, :len(ids)]) if ids else []
            tokens[i] += ids
            assert generation is None or not generation[i, len(ids):].any()  # padding, not rows
    prompt = tokenizer.encode(PROMPT)
    for i in (0, 1):
        assert len(rows[i]) == len(tokens[i]) == MAX_TOKENS
        expected, bound = logits(prompt + tokens[i])
        _within(np.array(rows[i]), expected[len(prompt) - 1:len(prompt) - 1 + MAX_TOKENS], bound)
        _within(contexts[0], expected[:len(prompt)], bound)


def test_batch_and_sequences_stack_on_the_first_dimensions(triton_server):
    """Two prompts, ``num_return_sequences`` 2, unary: ``[2, longest prompt, vocab]`` (a shorter
    prompt's rows padded with 0.0) and ``[2, 2, tokens, vocab]``."""
    prompts = [PROMPT, "Q: What is 2 + 2?\nA:"]
    inputs = trt_inputs(prompts, max_tokens=2, num_return_sequences=(2, np.int32), seed=(5, np.uint64), **LOGITS)
    result = grpc_infer(triton_server, "ensemble", inputs, OUTPUTS)
    lengths = [int(n) for n in result.as_numpy("num_input_tokens").reshape(-1)]
    context, generation = result.as_numpy("context_logits"), result.as_numpy("generation_logits")
    assert context.shape[:2] == (2, max(lengths)) and generation.shape[:3] == (2, 2, 2)
    shorter = int(np.argmin(lengths))
    assert not context[shorter, min(lengths):].any() and context[shorter, :min(lengths)].any()


def test_refusals_name_the_field_and_the_server_keeps_serving(triton_server):
    from tritonclient.utils import InferenceServerException

    with pytest.raises(InferenceServerException, match="return_context_logits: not supported with beam search"):
        grpc_infer(triton_server, "ensemble", trt_inputs([PROMPT], max_tokens=2, beam_width=(2, np.int32), **LOGITS),
                   OUTPUTS)
    ok = grpc_infer(triton_server, "ensemble", trt_inputs([PROMPT], max_tokens=2, **LOGITS), OUTPUTS)
    assert ok.as_numpy("generation_logits").shape[:3] == (1, 1, 2)
    # stop words combine now: the rows of the tokens the output keeps
    stopped = grpc_infer(triton_server, "ensemble", trt_inputs([PROMPT], max_tokens=2, stop_words=(".", np.object_),
                                                               return_num_output_tokens=(True, bool), **LOGITS),
                         (*OUTPUTS, "num_output_tokens"))
    assert stopped.as_numpy("generation_logits").shape[2] == stopped.as_numpy("num_output_tokens")[0][0]
