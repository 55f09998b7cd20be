"""Several texts per request on the TensorRT-LLM fronts without streaming (issue 43's residue):
``num_return_sequences`` 2, ``beam_width`` 2 and a batch of two prompts, read as TensorRT-LLM's
``end_to_end_grpc_client.py`` reads them.

That client parses every response of its gRPC stream the same way: ``text_output[0]`` goes to
slot ``(batch_index[0][0], sequence_index[0][0])`` (0 for an absent index). So it collects every
text only from a model that answers once per (item, sequence): the decoupled model, streaming or
not. A non-decoupled model answers a request exactly once (Triton's rule, TensorRT-LLM's
backend included), so pagoda puts every text in that one response (``text_output`` ``[B * n]``,
``batch_index`` ``[B, 1]``, ``sequence_index`` ``[B, n]``, log-probabilities ``[B, n(, tokens)]``):
the client's parse fills its first slot from it, a client that reads the whole tensor gets all.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.serving.test_serving_trtllm_dialect import PROMPT, batch, grpc_infer, grpc_stream, trt_inputs

pytestmark = pytest.mark.server

PROMPTS = [PROMPT, "Q: What is 2 + 2?\nA:"]
OUTPUTS = ("text_output", "batch_index", "sequence_index", "cum_log_probs", "output_log_probs")


def client_slots(results, batch_size, n):
    """end_to_end_grpc_client.py's parse of non-streaming results: slot (batch, sequence) -> text."""
    slots = [[""] * n for _ in range(batch_size)]
    for result in results:
        b = result.as_numpy("batch_index")
        s = result.as_numpy("sequence_index")
        slots[0 if b is None else b[0][0]][0 if s is None else s[0][0]] = result.as_numpy("text_output")[0].decode()
    return slots


def cases():
    """(name, inputs, batch size, texts per item): n=2 sampled, beam width 2, a batch of two with n=2."""
    sampled = {"num_return_sequences": (2, np.int32), "seed": (7, np.uint64), "return_log_probs": (True, bool)}
    one = trt_inputs([PROMPT], max_tokens=4, **sampled)
    one["temperature"] = batch([1.0], np.float32)
    beams = trt_inputs([PROMPT], max_tokens=4, beam_width=(2, np.int32), return_log_probs=(True, bool))
    two = trt_inputs(PROMPTS, max_tokens=4, **sampled)
    two["temperature"] = batch([1.0, 1.0], np.float32)
    return [("num_return_sequences=2", one, 1, 2), ("beam_width=2", beams, 1, 2), ("batch of 2, n=2", two, 2, 2)]


@pytest.mark.parametrize("name,inputs,batch_size,n", cases(), ids=[c[0] for c in cases()])
def test_non_decoupled_answer_holds_every_text_with_matching_shapes(triton_server, name, inputs, batch_size, n):
    result = grpc_infer(triton_server, "ensemble", inputs, OUTPUTS)
    texts = [t.decode() for t in result.as_numpy("text_output")]
    assert len(texts) == batch_size * n and all(t.startswith(PROMPTS[i // n]) and len(t) > len(PROMPTS[i // n])
                                                for i, t in enumerate(texts)), texts
    assert result.as_numpy("batch_index").tolist() == [[b] for b in range(batch_size)]
    assert result.as_numpy("sequence_index").tolist() == [list(range(n))] * batch_size
    per_token = result.as_numpy("output_log_probs")
    assert per_token.shape == (batch_size, n, 4) and (per_token < 0).all()
    assert result.as_numpy("cum_log_probs") == pytest.approx(per_token.sum(axis=2), abs=1e-3)
    # the client's own parse of that one response: its first slot (a non-decoupled model answers once)
    assert client_slots([result], batch_size, n)[0][0] == texts[0]


@pytest.mark.parametrize("name,inputs,batch_size,n", cases(), ids=[c[0] for c in cases()])
def test_decoupled_non_streaming_fills_every_client_slot(triton_server, name, inputs, batch_size, n):
    """The decoupled model without ``stream``: one whole answer per (item, sequence), each with
    ``[1, 1]`` indices, so the client's parse fills every slot; the same texts as the unary
    answer (greedy beams, seeded samples)."""
    unary = [t.decode() for t in grpc_infer(triton_server, "ensemble", inputs, OUTPUTS).as_numpy("text_output")]
    results, errors = grpc_stream(triton_server, "tensorrt_llm_bls", inputs, OUTPUTS)
    assert not errors, errors
    assert len(results) == batch_size * n
    for result in results:
        assert result.as_numpy("batch_index").shape == (1, 1) and result.as_numpy("sequence_index").shape == (1, 1)
        assert result.as_numpy("text_output").shape == (1,) and result.as_numpy("cum_log_probs").shape == (1, 1)
    slots = client_slots(results, batch_size, n)
    assert [text for row in slots for text in row] == unary
