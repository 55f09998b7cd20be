"""TensorRT-LLM's ``return_context_logits`` / ``return_generation_logits`` on the fronts, through
tritonclient against the session's tritonserver (tests/serving/conftest.py: ``ensemble``
non-decoupled, ``tensorrt_llm_bls`` decoupled), checked against a float64 transformers forward of
the served model (engine.logits_output says what the rows are; tests/numerics.py bounds one
float32 logit's error).

Shapes as TensorRT-LLM's backend sends them: FP32 ``context_logits`` ``[1, prompt tokens, vocab]``
and ``generation_logits`` ``[1, sequences, tokens, vocab]`` per item (the non-decoupled answer
stacks items on the first dimension).
"""

from __future__ import annotations

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
def reference(triton_server):
    """Token ids and float64 logits of the served model (transformers), with the bound."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = triton_server.options.model
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


def test_decoupled_bls_sends_the_same_logits_streaming_or_not(triton_server):
    """``tensorrt_llm_bls`` (decoupled): without ``stream`` one response with both; streaming, the
    last response of the item carries them; both equal the unary answer's."""
    inputs = trt_inputs([PROMPT], max_tokens=MAX_TOKENS, **LOGITS)
    unary = grpc_infer(triton_server, "ensemble", inputs, OUTPUTS)
    for stream in (False, True):
        results, errors = grpc_stream(triton_server, "tensorrt_llm_bls", {**inputs, "stream": batch([stream], bool)},
                                      (*OUTPUTS, "batch_index", "sequence_index"))
        assert not errors, errors
        last = [r for r in results if r.as_numpy("generation_logits") is not None]
        assert len(last) == 1, stream
        for name in ("context_logits", "generation_logits"):
            np.testing.assert_allclose(last[0].as_numpy(name), unary.as_numpy(name), atol=1e-4)


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


@pytest.mark.parametrize("extra, message", [
    ({"stop_words": (".", np.object_)}, "return_generation_logits: not supported with stop strings"),
    ({"beam_width": (2, np.int32)}, "return_context_logits: not supported with beam search"),
])
def test_refusals_name_the_field_and_the_server_keeps_serving(triton_server, extra, message):
    from tritonclient.utils import InferenceServerException

    with pytest.raises(InferenceServerException, match=message):
        grpc_infer(triton_server, "ensemble", trt_inputs([PROMPT], max_tokens=2, **LOGITS, **extra), OUTPUTS)
    ok = grpc_infer(triton_server, "ensemble", trt_inputs([PROMPT], max_tokens=2, **LOGITS), OUTPUTS)
    assert ok.as_numpy("generation_logits").shape[:3] == (1, 1, 2)
