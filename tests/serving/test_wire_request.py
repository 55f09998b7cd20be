"""``WireRequest``: one typed request from every door to the engine (no server).

Its forms must not lose or change anything: typed -> Triton tensors -> typed, typed -> JSON
(generate body) -> typed, and the engine's envelope it becomes."""

import base64
import json
import pathlib
import re

import numpy as np
import pytest

from pagoda.contracts.request_options import OPTION_NAMES, RequestOptions
from pagoda.engine.sampling_params import SamplingParams
from pagoda.serving.dialects import pagoda as pagoda_inputs
from pagoda.serving.dialects.vllm import request_parameter_vocabulary
from pagoda.serving.wire import FLAG_NAMES, OutputOptions, WireRequest

REPO = pathlib.Path(__file__).resolve().parents[2]

REQUESTS = [
    WireRequest(prompt="Hello"),
    WireRequest(prompt_token_ids=(5, 6, 7), params=SamplingParams(max_tokens=None, n=2, seed=3, temperature=0.5)),
    WireRequest(prompt="Hi there", prompt_token_ids=(1, 2), prompt_tokenizer="abc123",
                params=SamplingParams(temperature=0, stop=["\n", "END"], stop_token_ids=[2], logprobs=2,
                                      logit_bias={7: -1.5}, bad_words=["darn"], guided_decoding={"regex": "[ab]+"}),
                options=RequestOptions(priority=3, cache_salt="tenant-a", lora_name="sql", timeout=2.5,
                                       tenant="acme"),
                output=OutputOptions(stream=True, return_logprobs=True, return_finish_reason=True,
                                     output_dialect="vllm")),
    WireRequest(prompt="beams", params=SamplingParams(use_beam_search=True, best_of=4, n=2, temperature=0,
                                                      length_penalty=0.5, early_stopping="never"),
                options=RequestOptions(kv_transfer_params={"do_remote_decode": True}),
                output=OutputOptions(exclude_input_in_output=True, return_cumulative_logprob=True)),
    WireRequest(prompt="json", params=SamplingParams(guided_decoding={"json": {"type": "object"}}, min_tokens=2,
                                                     prompt_logprobs=1, truncate_prompt_tokens=-1)),
    WireRequest(prompt="<img> and <img>: which?", images=(b"\x89PNG first", b"second\x00\xff"),
                output=OutputOptions(stream=True)),
]


@pytest.mark.parametrize("wire", REQUESTS)
def test_triton_tensors_and_json_carry_the_request_unchanged(wire):
    tensors = wire.to_triton_inputs()
    assert WireRequest.from_triton_inputs(tensors.get) == wire
    body = wire.to_json()
    assert json.loads(json.dumps(body)) == body  # plain JSON
    assert WireRequest.from_json(body) == wire
    # Only what differs from the defaults travels.
    assert set(tensors) <= set(pagoda_inputs.INPUTS)
    assert all(tensors[name].tolist() == [True] for name in FLAG_NAMES if name in tensors)


def test_the_vocabularies_are_one_list_each():
    """Options, wire keys, sampling fields and the model's inputs are each written once: the
    request-parameter vocabulary is derived from them, and ``INPUTS`` is config.pbtxt's."""
    assert set(OPTION_NAMES) <= request_parameter_vocabulary()
    assert {"output_dialect", "prompt_tokenizer"} <= request_parameter_vocabulary()
    config = (REPO / "model_repository" / "pagoda" / "config.pbtxt").read_text()
    inputs_block = config[config.index("input ["):config.index("output [")]
    declared = set(re.findall(r'name: "(\w+)"', inputs_block))
    assert declared == set(pagoda_inputs.INPUTS)
    assert set(FLAG_NAMES) == set(pagoda_inputs.FLAG_INPUTS)


def test_images_travel_as_the_vllm_backends_base64_image_input_and_reach_the_engine():
    """The ``image`` input is one base64 string per image (the vLLM backend's); the engine gets
    the decoded bytes as ``multi_modal_data``; bad base64 is refused naming the element."""
    wire = REQUESTS[-1]
    assert wire.to_triton_inputs()["image"].tolist() == [base64.b64encode(b) for b in wire.images]
    assert wire.to_json()["image"] == [base64.b64encode(b).decode() for b in wire.images]
    assert "second" not in repr(wire)  # images are not logged with the request
    engine_request = wire.to_engine_request("r", None)
    assert engine_request.multi_modal_data == {"image": list(wire.images)}
    assert WireRequest(prompt="text").to_engine_request("r", None).multi_modal_data is None
    sent = {"text_input": np.array([b"x"], dtype=object),
            "image": np.array([base64.b64encode(b"one"), b" " + base64.b64encode(b"two") + b"\n"], dtype=object)}
    assert WireRequest.from_triton_inputs(sent.get).images == (b"one", b"two")
    for bad, where in ((b"not base64!", "image[0]"), (b"", "image[0]"), ("a\u00e9==", "image[0]")):
        with pytest.raises(ValueError, match=re.escape(where)):
            WireRequest.from_triton_inputs({**sent, "image": np.array([bad], dtype=object)}.get)
    with pytest.raises(ValueError, match=r"image\[1\]: not valid base64"):
        WireRequest.from_json({"text_input": "x", "image": [base64.b64encode(b"ok").decode(), "%%%"]})
    with pytest.raises(ValueError, match="image: each image must be its encoded bytes"):
        WireRequest(prompt="x", images=("text",))


def test_router_token_ids_are_used_only_with_the_engines_tokenizer():
    routed = WireRequest(prompt="Hello world").with_prompt_token_ids([9, 8, 7], tokenizer="T1")
    assert routed.uses_given_token_ids("T1") and not routed.uses_given_token_ids("T2")
    same = routed.to_engine_request("r", 1.0, tokenizer="T1")
    assert same.prompt == "Hello world" and same.prompt_token_ids == [9, 8, 7]
    other = routed.to_engine_request("r", 1.0, tokenizer="T2")
    assert other.prompt == "Hello world" and other.prompt_token_ids is None  # the engine encodes the text
    encoded = routed.to_engine_request("r", 1.0, tokenizer="T2", prompt_token_ids=[1, 2])
    assert encoded.prompt_token_ids == [1, 2]
    ids_only = WireRequest(prompt_token_ids=(4, 5)).to_engine_request("r", None)
    assert ids_only.prompt == [4, 5] and ids_only.prompt_token_ids is None


def test_the_engine_tracks_logprobs_an_output_flag_needs_without_reporting_them_asked():
    flags = WireRequest(prompt="x", output=OutputOptions(return_cumulative_logprob=True))
    assert flags.engine_params().logprobs == 0 and not flags.logprobs_asked and flags.params.logprobs is None
    beams = WireRequest(prompt="x", params=SamplingParams(use_beam_search=True, best_of=2, temperature=0),
                        output=OutputOptions(return_cumulative_logprob=True))
    assert beams.engine_params().logprobs is None  # beams carry their sums
    envelope = flags.to_engine_request("r", 5.0)
    assert envelope.params.logprobs == 0 and envelope.arrival_time == 5.0 and envelope.options == flags.options


@pytest.mark.parametrize("build, message", [
    (lambda: WireRequest(), "text_input: required input is missing"),
    (lambda: WireRequest(prompt=""), "text_input: must not be empty"),
    (lambda: WireRequest(prompt_token_ids=()), "input_ids: must be a non-empty list"),
    (lambda: WireRequest(prompt_token_ids=(1, -2)), "input_ids: must be a non-empty list"),
    (lambda: WireRequest(prompt="a", prompt_token_ids=(1,)), "input_ids: give the prompt as text_input or"),
    (lambda: WireRequest(prompt="a", output=OutputOptions(output_dialect="tgi")), "output_dialect: must be one of"),
    (lambda: WireRequest(prompt="a", output=OutputOptions(stream=1)), "stream: must be a boolean"),
    (lambda: WireRequest(prompt="a").with_options(priority="1"), "priority: must be an integer"),
    (lambda: WireRequest(prompt="a").with_options(cache_salt=""), "cache_salt: must be a non-empty string"),
    (lambda: WireRequest(prompt="a").with_options(timeout=float("inf")), "timeout: must be a number of seconds"),
    (lambda: WireRequest(prompt="a").with_options(kv_transfer_params={"do_remote_prefill": True}),
     "kv_transfer_params: do_remote_prefill needs remote_host"),
    (lambda: WireRequest(prompt="a").with_options(kv_transfer_params={"x": 1}), "kv_transfer_params: unknown key"),
    (lambda: RequestOptions.from_dict({"priorty": 1}), "unknown request option(s): priorty"),
    (lambda: WireRequest.from_json({"text_input": "a", "max_tokens": "many"}), "max_tokens: not a valid int"),
])
def test_a_wire_request_is_valid_once_built(build, message):
    with pytest.raises(ValueError) as info:
        build()
    assert str(info.value).startswith(message)


def test_options_are_immutable_and_replace_checks_again():
    options = RequestOptions(kv_transfer_params={"do_remote_decode": True})
    with pytest.raises(TypeError):
        options.kv_transfer_params["do_remote_decode"] = False
    assert options.replace(priority=2).priority == 2 and options.to_dict() == {
        "kv_transfer_params": {"do_remote_decode": True}}


def test_a_generate_body_reads_as_tritonserver_hands_it_over():
    """Top-level keys that are not inputs, and ``parameters``, are request parameters."""
    wire = WireRequest.from_json({"text_input": "Hi", "max_tokens": 4, "stream": True, "temperature": "0",
                                  "parameters": {"cache_salt": "t"}, "stop_words": ["END"]})
    assert (wire.params.max_tokens, wire.params.temperature, wire.params.stop) == (4, 0.0, ["END"])
    assert wire.output.stream and wire.options.cache_salt == "t"
    readme = WireRequest.from_json({"text_input": "Hi", "id": "curl-1", "ignore_eos": True,  # the vLLM backend's curl
                                    "parameters": {"stream": False, "temperature": 0, "max_tokens": 6}})
    assert (readme.params.temperature, readme.params.max_tokens, readme.params.ignore_eos) == (0.0, 6, True)
    assert not readme.output.stream  # a parameter that names an input is that input, as tritonserver makes it
    assert np.array_equal(WireRequest(prompt_token_ids=(3, 4)).to_triton_inputs()["input_ids"],
                          np.array([3, 4], dtype=np.int32))


def test_the_routers_generate_door_passes_images_on_unchanged():
    """A generate body's ``image`` list passes the router's gate and comes out in the body the
    router sends the replica, byte for byte (the router does not hash images yet)."""
    from pagoda.fleet.api.generate_request import GenerateRequest
    from pagoda.fleet.gate.generate_body import validate_generate_body
    from pagoda.fleet.gate.limits import RequestLimits

    images = [base64.b64encode(b"\x89PNG one").decode(), base64.b64encode(b"two").decode()]
    raw = json.dumps({"text_input": "<img><img>", "image": images, "max_tokens": 2}).encode()
    document = validate_generate_body(raw, RequestLimits())
    request = GenerateRequest.of_document(document, "pagoda", is_front=False)
    assert request.wire.images == (b"\x89PNG one", b"two")
    assert request.body()["image"] == images
    assert WireRequest.from_json(request.body()) == request.wire
