"""Token ids travel: a request the router tokenized to route it is not tokenized again on the replica.

The whole way in one process, with the real pieces: the router's analysis (its ``Tokenizer``),
the gRPC message the upstream client sends (``RoutedRequest.infer_request``), the replica's one
reader (``WireRequest.from_triton_inputs``) and the engine loop over the default model. The
replica's tokenizer calls are counted (``InputProcessor.num_prompts_tokenized``); the served
twin (router + tritonservers, the replicas' ``pagoda:prompts_tokenized_total``) is in
tests/fleet/test_router_e2e.py."""

from __future__ import annotations

import queue

import pytest

from pagoda.engine.config import EngineConfig
from pagoda.engine.llm_engine import LLMEngine
from pagoda.engine.sampling_params import SamplingParams
from pagoda.fleet.api.routed_request import RoutedRequest, analyzed
from pagoda.fleet.routing.replicas import ReplicaSet
from pagoda.fleet.routing.router import Router
from pagoda.fleet.triton_wire import infer_inputs
from pagoda.serving.commands import ServingRequest
from pagoda.serving.engine_loop import EngineLoop
from pagoda.serving.response_sender import ResponseSender
from pagoda.serving.wire import OutputOptions, WireRequest

PROMPTS = ["The capital of France is", "List three colours of the rainbow:"]


@pytest.fixture(scope="module")
def replica(smollm2_path):
    engine = LLMEngine(EngineConfig(model=smollm2_path, max_num_seqs=4))
    finals: queue.Queue = queue.Queue()
    texts: dict[str, str] = {}

    def deliver(handle, response):
        texts[handle] = texts.get(handle, "") + "".join(t.decode() for t in response.tensors.get("text_output", []))
        if response.is_final:
            finals.put((handle, response.error))

    sender = ResponseSender(deliver)
    loop = EngineLoop(engine, sender, tokenizer=engine.tokenizer.fingerprint)
    sender.start()
    loop.start()
    yield engine, loop, finals, texts
    loop.stop()
    sender.stop()
    engine.shutdown()


def _serve(replica, request_id: str, message) -> str:
    """What the replica does with a gRPC message: read it once, then the engine loop."""
    engine, loop, finals, texts = replica
    wire = WireRequest.from_triton_inputs(infer_inputs(message).get)
    loop.submit(ServingRequest(request_id, wire, request_id))
    handle, error = finals.get(timeout=120)
    assert handle == request_id and error is None
    return texts.pop(request_id)


def test_a_routed_request_is_not_tokenized_on_the_replica_and_answers_the_same(replica, smollm2_path):
    engine = replica[0]
    router = Router(ReplicaSet("static"), engine.tokenizer, engine.model_id, "least_loaded")
    for n, prompt in enumerate(PROMPTS):
        wire = WireRequest(prompt=prompt, params=SamplingParams(temperature=0, max_tokens=8),
                           output=OutputOptions(stream=True, exclude_input_in_output=True))
        before = engine.input_processor.num_prompts_tokenized
        analysis, routed = analyzed(router, wire)
        assert routed.prompt_token_ids == tuple(engine.tokenizer.encode(prompt))
        assert routed.prompt_tokenizer == engine.tokenizer.fingerprint and analysis.tokenizer == routed.prompt_tokenizer
        via_router = _serve(replica, f"routed-{n}", RoutedRequest(f"routed-{n}", routed).infer_request())
        assert engine.input_processor.num_prompts_tokenized == before  # the ids were used as sent
        as_text = _serve(replica, f"text-{n}", RoutedRequest(f"text-{n}", wire).infer_request())
        assert engine.input_processor.num_prompts_tokenized == before + 1  # text alone: encoded here
        assert via_router == as_text and via_router  # token for token the same answer
        other = routed.with_prompt_token_ids(list(routed.prompt_token_ids), tokenizer="another-tokenizer")
        assert _serve(replica, f"other-{n}", RoutedRequest(f"other-{n}", other).infer_request()) == as_text
        assert engine.input_processor.num_prompts_tokenized == before + 2  # not its tokenizer: encoded again
