"""TensorRT-LLM dialect translation without a server (``pagoda.serving.dialects.trtllm`` / ``.llmapi``):
its inputs read into a ``WireRequest``, pagoda's responses turned into its outputs."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pagoda.serving.dialects import trtllm as dialect
from pagoda.serving.trtllm_front import configure_fronts
from pagoda.serving.wire import WireRequest


def item(**values):
    arrays = {"text_input": np.array([b"hi"], dtype=np.object_)}
    for name, value in values.items():
        arrays[name] = np.array(value if isinstance(value, list) else [value])
    return arrays


def test_split_batch_gives_rows_and_refuses_a_mismatched_batch():
    inputs = {"text_input": np.array([[b"a"], [b"b"]], dtype=np.object_),
              "stop_words": np.array([[b"x", b""], [b"y", b"z"]], dtype=np.object_)}
    items = dialect.split_batch(inputs)
    assert [i["text_input"].tolist() for i in items] == [[b"a"], [b"b"]]
    assert items[1]["stop_words"].tolist() == [b"y", b"z"]
    with pytest.raises(ValueError, match="^max_tokens: batch dimension is 1, text_input's is 2"):
        dialect.split_batch({**inputs, "max_tokens": np.array([[3]], dtype=np.int32)})


def sampling_values(item):
    """What one item asks of pagoda: its sampling values and request options in one dict."""
    read = dialect.read_item(item, decoupled=False)
    return {**read.options, **read.sampling}


def to_pagoda_inputs(item, decoupled, options=None):
    """The front's BLS request for one item: the checked ``WireRequest``'s canonical tensors."""
    return WireRequest.from_dialect(dialect.read_item(item, decoupled)).with_options(**(options or {})) \
        .to_triton_inputs()


def test_sampling_values_map_every_applied_input():
    values = sampling_values(item(
        max_tokens=np.int32(5), min_length=np.int32(2), num_return_sequences=np.int32(2), random_seed=np.uint64(7),
        top_p=np.float32(0), stop_words=[b"\n", b""], end_id=np.int32(3), pad_id=np.int32(0),
        lora_task_id=np.uint64(12), return_log_probs=True, guided_decoding_guide_type=b"json",
        bad_words=[b"darn", b""]))
    assert values == {"output_dialect": "pagoda", "max_tokens": 5, "min_tokens": 2, "n": 2, "seed": 7,
                      "stop": ["\n"], "bad_words": ["darn"], "stop_token_ids": [3], "lora_name": "12", "logprobs": 0,
                      "guided_decoding": {"json_object": True}}


def test_embedding_bias_is_read_with_the_models_tokenizer_in_the_front():
    """The front reads the words with the served model's tokenizer (``encode``), so pagoda's
    model receives a ``logit_bias`` like any other request's."""
    words = np.array([b"cat", b"dog"], dtype=np.object_)
    read = dialect.read_item(item(embedding_bias_words=words, embedding_bias_weights=[np.float32(1), np.float32(2)]),
                             decoupled=False, encode={"cat": [5, 6], "dog": [6]}.__getitem__)
    assert read.sampling["logit_bias"] == {5: 1.0, 6: 3.0}
    inputs = WireRequest.from_dialect(read).to_triton_inputs()
    assert json.loads(inputs["sampling_parameters"][0])["logit_bias"] == {"5": 1.0, "6": 3.0}
    with pytest.raises(ValueError, match="^embedding_bias_words: this model has no tokenizer"):
        dialect.read_item(item(embedding_bias_words=words, embedding_bias_weights=[np.float32(1)] * 2), False)
    assert dialect.embedding_bias(["ab", "b"], [1.0, 2.0], {"ab": [1, 2], "b": [2]}.__getitem__) == {1: 1.0, 2: 3.0}
    with pytest.raises(ValueError, match="^embedding_bias_weights: 1 weights for 2 embedding_bias_words"):
        dialect.embedding_bias(["a", "b"], [1.0], {"a": [1], "b": [2]}.__getitem__)
    with pytest.raises(ValueError, match=r"^embedding_bias_weights: a token's summed bias must lie in \[-100, 100\]"):
        dialect.embedding_bias(["a", "a"], [60.0, 60.0], {"a": [1]}.__getitem__)


@pytest.mark.parametrize("values, message", [
    ({"min_tokens": np.int32(2), "min_length": np.int32(3)}, "min_length: contradicts another input for min_tokens"),
    ({"guided_decoding_guide_type": b"regex"}, "guided_decoding_guide: required by guided_decoding_guide_type"),
    ({"guided_decoding_guide": b"x"}, "guided_decoding_guide: needs guided_decoding_guide_type"),
    ({"beam_width": np.int32(0)}, "beam_width: must be an integer >= 1"),
    ({"lora_weights": np.zeros((1, 1), dtype=np.float16)}, "lora_weights: not supported"),
])
def test_bad_inputs_are_refused_naming_them(values, message):
    with pytest.raises(ValueError, match="^" + message):
        sampling_values(item(**values))


def test_beam_width_is_beam_search_returning_every_beam_with_log_probs():
    values = sampling_values(item(beam_width=np.int32(4), length_penalty=np.float32(0.5),
                                  return_log_probs=np.bool_(True)))
    assert values["use_beam_search"] is True and values["beam_width"] == 4 and values["n"] == 4
    assert values["temperature"] == 0.0 and values["length_penalty"] == 0.5 and values["logprobs"] == 0
    assert sampling_values(item(beam_width=np.int32(4), num_return_sequences=np.int32(2)))["n"] == 2
    # at beam width 1 TensorRT-LLM accepts a length penalty and it changes nothing: so here
    assert "length_penalty" not in sampling_values(item(length_penalty=np.float32(0.5)))
    with pytest.raises(ValueError, match="^length_penalty: must be a number"):
        sampling_values(item(length_penalty=np.array([b"long"], dtype=np.object_)))
    assert "logprobs" not in sampling_values(item(beam_width=np.int32(4)))
    inputs = to_pagoda_inputs(item(beam_width=np.int32(2), return_log_probs=np.bool_(True)), decoupled=False)
    assert inputs["return_cumulative_logprob"].tolist() == [True] and inputs["return_logprobs"].tolist() == [True]
    tensors = {"text_output": np.array([b"a", b"b"], dtype=np.object_),
               "cumulative_logprob": np.array([-1.0, -2.0], dtype=np.float32),
               "logprobs": np.array([json.dumps([{"logprob": -0.25}, {"logprob": -0.75}]).encode(),
                                     json.dumps([{"logprob": -2.0}]).encode()], dtype=np.object_),
               "num_input_tokens": np.array([4], dtype=np.uint32), "num_output_tokens": np.array([2, 1], np.uint32)}
    asked = {"log_probs": True, "perf": False, "num_input_tokens": False, "num_output_tokens": False}
    out = dialect.to_trtllm_outputs(tensors, asked, batch_index=0, sequence=None)
    assert out["cum_log_probs"].tolist() == [[-1.0, -2.0]] and out["sequence_index"].tolist() == [[0, 1]]
    assert out["output_log_probs"].tolist() == [[[-0.25, -0.75], [-2.0, 0.0]]]  # [1, beams, tokens], padded
    one = dialect.to_trtllm_outputs(tensors, asked, batch_index=0, sequence=1)  # decoupled: one beam each
    assert one["output_log_probs"].tolist() == [[[-2.0]]] and one["cum_log_probs"].tolist() == [[-2.0]]


def test_request_parameters_are_refused_naming_them_but_cache_salt():
    assert dialect.read_request_parameters('{"id": "7"}') == {}
    with pytest.raises(ValueError, match="^foo: unknown input"):
        dialect.read_request_parameters(json.dumps({"foo": 1, "id": "x"}))
    options = dialect.read_request_parameters('{"cache_salt": "tenant-a"}')
    inputs = to_pagoda_inputs(item(), decoupled=False, options=options)
    assert json.loads(inputs["sampling_parameters"][0])["cache_salt"] == "tenant-a"
    with pytest.raises(ValueError, match="^cache_salt: must be a non-empty string"):
        to_pagoda_inputs(item(), False, dialect.read_request_parameters('{"cache_salt": ""}'))


def test_outputs_per_sequence_and_stacked():
    tensors = {"text_output": np.array([b"ab", b"c"], dtype=np.object_),
               "cumulative_logprob": np.array([-1.0, -2.0], dtype=np.float32),
               "logprobs": np.array([json.dumps([{"logprob": -0.5}, {"logprob": -0.5}]).encode(),
                                     json.dumps([{"logprob": -2.0}]).encode()], dtype=np.object_),
               "num_input_tokens": np.array([4], dtype=np.uint32), "num_output_tokens": np.array([2, 1], np.uint32)}
    asked = {"log_probs": True, "perf": False, "num_input_tokens": True, "num_output_tokens": False}
    one = dialect.to_trtllm_outputs(tensors, asked, batch_index=3, sequence=1)
    assert one["text_output"].tolist() == [b"c"] and one["sequence_index"].tolist() == [[1]]
    assert one["batch_index"].tolist() == [[3]] and one["output_log_probs"].tolist() == [[[-2.0]]]
    both = dialect.to_trtllm_outputs(tensors, asked, batch_index=0, sequence=None)
    assert both["output_log_probs"].tolist() == [[[-0.5, -0.5], [-2.0, 0.0]]]
    stacked = dialect.stack_items([both, dialect.to_trtllm_outputs({**tensors, "logprobs": tensors["logprobs"][::-1]},
                                                                   asked, 1, None)])
    assert stacked["text_output"].tolist() == [b"ab", b"c", b"ab", b"c"]  # flat [B * n]
    assert stacked["output_log_probs"].tolist() == [[[-0.5, -0.5], [-2.0, 0.0]], [[-2.0, 0.0], [-0.5, -0.5]]]
    assert stacked["batch_index"].tolist() == [[0], [1]] and stacked["num_input_tokens"].tolist() == [[4], [4]]


def test_kv_cache_metrics_count_whole_blocks():
    assert dialect.kv_cache_metrics(40, 8, 32, block_size=16) == {
        "kv_cache_alloc_total_blocks": 3, "kv_cache_reused_blocks": 2, "kv_cache_alloc_new_blocks": 1,
        "kv_cache_hit_rate": pytest.approx(2 / 3)}


def test_configure_fronts_sets_decoupled_and_refuses_other_models(tmp_path):
    from pagoda.serving.launch.triton_install import default_model_repository
    import shutil

    repository = shutil.copytree(default_model_repository(), tmp_path / "repo")
    configure_fronts(repository, {"tensorrt_llm_bls": True})
    assert "decoupled: true" in (repository / "tensorrt_llm_bls" / "config.pbtxt").read_text()
    assert "decoupled: false" in (repository / "ensemble" / "config.pbtxt").read_text()
    with pytest.raises(ValueError, match="^trtllm_decoupled: 'pagoda' is not a TensorRT-LLM front"):
        configure_fronts(repository, {"pagoda": True})


def test_the_routers_http_door_knows_every_input_of_pagodas_model():
    """One vocabulary: a generate body the replica accepts, the router's HTTP door accepts
    (the embedding-bias inputs the TensorRT-LLM fronts forward included)."""
    import re

    from pagoda.fleet.gate.generate_body import GENERATE_INPUTS, validate_generate_body
    from pagoda.fleet.gate.limits import LimitError, RequestLimits
    from pagoda.serving.launch.triton_install import default_model_repository

    config = (default_model_repository() / "pagoda" / "config.pbtxt").read_text()
    assert set(re.findall(r'\{ name: "(\w+)"', config.split("output [")[0])) == set(GENERATE_INPUTS)
    body = {"text_input": "Hi", "bad_words": ["darn"], "embedding_bias_words": ["cat"], "embedding_bias_weights": [2]}
    assert validate_generate_body(json.dumps(body).encode(), RequestLimits())["embedding_bias_weights"] == [2]
    with pytest.raises(LimitError, match="^embedding_bias_weights: must be a number or a list of numbers"):
        validate_generate_body(json.dumps({**body, "embedding_bias_weights": ["x"]}).encode(), RequestLimits())


def test_llmapi_inputs_become_pagodas_and_refusals_name_the_input():
    from pagoda.serving.dialects import llmapi

    request = {"text_input": np.array([b"hi"], dtype=np.object_),
               "sampling_param_max_tokens": np.array([5], dtype=np.int32),
               "sampling_param_top_k": np.array([3], dtype=np.int32),
               "sampling_param_stop": np.array([b"\n", b""], dtype=np.object_),
               "lora_name": np.array([b"sql"], dtype=np.object_), "lora_id": np.array([9], dtype=np.uint64),
               "return_stop_reason": np.array([True])}
    inputs = WireRequest.from_dialect(llmapi.read_item(request, decoupled=False)).to_triton_inputs()
    assert json.loads(inputs["sampling_parameters"][0]) == {"max_tokens": 5, "top_k": 3, "stop": ["\n"],
                                                            "lora_name": "sql", "output_dialect": "vllm"}
    assert inputs["return_stop_reason"].tolist() == [True] and "exclude_input_in_output" not in inputs
    with pytest.raises(ValueError, match="^streaming: streaming needs the decoupled model"):
        llmapi.read_item({**request, "streaming": np.array([True])}, decoupled=False)
    with pytest.raises(ValueError, match="^lora_path: not supported"):
        llmapi.read_item({**request, "lora_path": np.array([b"/a"], dtype=np.object_)}, decoupled=True)
    assert llmapi.is_stop_request({"stop": np.array([True])}) and not llmapi.is_stop_request(request)
    assert llmapi.llmapi_kv_metrics(40, 8, 32, block_size=16) == {
        "kv_cache_alloc_total_blocks": 3, "kv_cache_alloc_new_blocks": 1, "kv_cache_hit_rate": pytest.approx(2 / 3),
        "kv_cache_reused_block": 2, "kv_cache_missed_block": 1}


def test_the_routers_http_door_checks_a_front_body_against_the_fronts_inputs():
    """A body for ``ensemble`` / ``tensorrt_llm_bls`` / ``tensorrt_llm`` passes the router's HTTP door
    when the replica's front would take it (TensorRT-LLM's names), with the router's limits applied."""
    from pagoda.fleet.gate.generate_body import validate_generate_body
    from pagoda.fleet.gate.limits import LimitError, RequestLimits

    body = {"text_input": "Hi", "max_tokens": 8, "min_length": 8, "num_return_sequences": 2, "id": "r1"}
    assert validate_generate_body(json.dumps(body).encode(), RequestLimits(), "ensemble")["min_length"] == 8
    with pytest.raises(LimitError, match="^min_length: unknown input or request parameter"):
        validate_generate_body(json.dumps(body).encode(), RequestLimits())  # pagoda's own model has no min_length
    with pytest.raises(LimitError, match="^beam_search_fancy: unknown input of TensorRT-LLM's tensorrt_llm_bls"):
        validate_generate_body(json.dumps({**body, "beam_search_fancy": 1}).encode(), RequestLimits(),
                               "tensorrt_llm_bls")
    with pytest.raises(LimitError, match="^n: 2 exceeds this server's limit of 1"):
        validate_generate_body(json.dumps(body).encode(), RequestLimits(max_n=1), "ensemble")
    llmapi_body = {"text_input": "Hi", "sampling_param_max_tokens": 99, "streaming": True}
    with pytest.raises(LimitError, match="^max_tokens: 99 exceeds"):
        validate_generate_body(json.dumps(llmapi_body).encode(), RequestLimits(max_tokens_limit=50), "tensorrt_llm")
    with pytest.raises(LimitError, match="^parameters: TensorRT-LLM's models read no request parameters"):
        validate_generate_body(json.dumps({**body, "parameters": {"temperature": 0}}).encode(), RequestLimits(),
                               "ensemble")


def test_the_router_salts_a_front_body_through_its_request_parameters():
    """Tenants' prefix-cache isolation reaches the fronts: the router's tenant salt goes in
    ``parameters.cache_salt``, which the front reads into pagoda's ``cache_salt``."""
    from pagoda.fleet.api.generate_request import GenerateRequest

    document = {"text_input": "Hi", "max_tokens": 4}
    body = GenerateRequest.of_document(document, "ensemble", is_front=True).salted("tenant-salt").body()
    assert body["parameters"] == {"cache_salt": "tenant-salt"} and "parameters" not in document
    options = dialect.read_request_parameters(json.dumps(body["parameters"]))
    assert options == {"cache_salt": "tenant-salt"}
    wire = WireRequest.from_dialect(dialect.read_item(item(), decoupled=False)).with_options(**options)
    assert wire.options.cache_salt == "tenant-salt"


def test_logits_flags_reach_the_engine_and_come_back_in_trtllm_shapes():
    """``return_*_logits`` become the wire's output flags and the engine's params; pagoda's
    ``[L, V]`` / ``[n, T, V]`` come back as ``[1, L, V]`` / ``[1, n, T, V]`` (one sequence:
    ``[1, 1, T, V]``), items stacked with the shorter prompt's rows 0.0-padded."""
    wire = WireRequest.from_dialect(dialect.read_item(item(return_context_logits=True, return_generation_logits=True),
                                                      decoupled=False))
    assert wire.output.return_context_logits and wire.output.return_generation_logits
    params = wire.engine_params()
    assert params.return_context_logits and params.return_generation_logits
    assert set(wire.to_triton_inputs()) >= {"return_context_logits", "return_generation_logits"}
    plain = WireRequest.from_dialect(dialect.read_item(item(), decoupled=False)).engine_params()
    assert not plain.return_context_logits and not plain.return_generation_logits
    stopped = WireRequest.from_dialect(dialect.read_item(item(return_generation_logits=True, stop_words=[b"."]),
                                                         False)).engine_params()
    assert stopped.stop == ["."] and stopped.return_generation_logits  # the kept tokens' rows (engine test)
    asked = dialect.requested(item(return_context_logits=True, return_generation_logits=True))
    tensors = {"text_output": np.array([b"a", b"b"], dtype=np.object_),
               "num_input_tokens": np.array([3], dtype=np.uint32), "num_output_tokens": np.array([2, 2], np.uint32),
               "context_logits": np.ones((3, 5), np.float32), "generation_logits": np.ones((2, 2, 5), np.float32)}
    one = dialect.to_trtllm_outputs(tensors, asked, batch_index=0, sequence=1)
    assert one["context_logits"].shape == (1, 3, 5) and one["generation_logits"].shape == (1, 1, 2, 5)
    both = dialect.to_trtllm_outputs(tensors, asked, batch_index=0, sequence=None)
    assert both["generation_logits"].shape == (1, 2, 2, 5)
    shorter = {**tensors, "context_logits": np.ones((2, 5), np.float32)}
    stacked = dialect.stack_items([both, dialect.to_trtllm_outputs(shorter, asked, 1, None)])
    assert stacked["context_logits"].shape == (2, 3, 5) and not stacked["context_logits"][1, 2].any()
    assert stacked["generation_logits"].shape == (2, 2, 2, 5)


def test_streamed_logits_take_tensorrt_llms_streaming_shapes():
    """A stream asks the engine for ``DELTA`` (rows leave with each response; unary: ``CUMULATIVE``);
    a streamed pagoda response ``[n, T, V]`` becomes, for sequence s, its own ``num_output_tokens``
    rows token-major, ``[1, T_s, 1, V]`` (TensorRT-LLM's streaming layout); not streamed, ``[1, 1, T_s, V]``."""
    from pagoda.engine.sampling_params import RequestOutputKind

    streamed = WireRequest.from_dialect(dialect.read_item(item(stream=True, return_generation_logits=True), True))
    assert streamed.engine_params().output_kind == RequestOutputKind.DELTA
    unary = WireRequest.from_dialect(dialect.read_item(item(return_generation_logits=True), True))
    assert unary.engine_params().output_kind == RequestOutputKind.CUMULATIVE
    asked = dialect.requested(item(return_generation_logits=True))
    rows = np.arange(2 * 3 * 5, dtype=np.float32).reshape(2, 3, 5)  # sequence 1 has 1 token: its rows 1, 2 padding
    tensors = {"text_output": np.array([b"a", b"b"], dtype=np.object_), "num_input_tokens": np.array([3], np.uint32),
               "num_output_tokens": np.array([3, 1], np.uint32), "generation_logits": rows}
    for s, count in ((0, 3), (1, 1)):
        out = dialect.to_trtllm_outputs(tensors, asked, 0, s, stream=True)["generation_logits"]
        assert out.shape == (1, count, 1, 5) and np.array_equal(out[0, :, 0], rows[s, :count])
        out = dialect.to_trtllm_outputs(tensors, asked, 0, s)["generation_logits"]
        assert out.shape == (1, 1, count, 5) and np.array_equal(out[0, 0], rows[s, :count])
