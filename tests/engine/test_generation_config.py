"""The model's own sampling defaults (``generation_config.json``) fill what a request leaves unset.

As vLLM's ``--generation-config auto``: a request without ``temperature`` samples at the
model's (here 0.6, Qwen3's), an explicit value wins even when it is SamplingParams' own default
(1.0), the offline API's ``params=None`` takes them, and ``generation_config="none"`` turns
them off. What a request "gave" survives the wire (``SamplingParams.given``)."""

from __future__ import annotations

import json

import pytest

from pagoda.engine.config import EngineConfig
from pagoda.engine.llm_engine import LLMEngine
from pagoda.engine.sampling_params import SamplingParams
from pagoda.models.generation_config import generation_defaults
from pagoda.serving.wire import WireRequest

from tests.engine.hf_reference import save_random_model

QWEN3_DEFAULTS = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "do_sample": True, "bos_token_id": 1}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, smollm2_path):
    path = save_random_model(tmp_path_factory.mktemp("genconf"), smollm2_path, seed=0, hidden_size=64,
                             intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                             num_key_value_heads=1, vocab_size=49152, max_position_embeddings=256)
    (path / "generation_config.json").write_text(json.dumps(QWEN3_DEFAULTS))
    return path


def _params_of(engine: LLMEngine, request_id: str) -> SamplingParams:
    return engine.scheduler.get_request(request_id).sampling_params


def test_the_models_defaults_fill_only_what_the_request_left_unset(model_dir):
    assert generation_defaults(model_dir) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    engine = LLMEngine(EngineConfig(model=str(model_dir)))
    engine.add_request("unset", [5, 6, 7], SamplingParams.from_dict({"max_tokens": 2}))
    engine.add_request("explicit", [5, 6, 7], SamplingParams.from_dict({"max_tokens": 2, "temperature": 1.0}))
    engine.add_request("python", [5, 6, 7], SamplingParams(max_tokens=2))  # built in Python: as written
    engine.add_request("none", [5, 6, 7])  # the offline API's params=None
    unset, explicit = _params_of(engine, "unset"), _params_of(engine, "explicit")
    assert (unset.temperature, unset.top_p, unset.top_k, unset.max_tokens) == (0.6, 0.95, 20, 2)
    assert (explicit.temperature, explicit.top_p, explicit.top_k) == (1.0, 0.95, 20)
    assert _params_of(engine, "python").temperature == 1.0 and _params_of(engine, "python").top_k == 0
    assert _params_of(engine, "none").temperature == 0.6
    # Through the wire: a Triton body without temperature, and one that says 1.0.
    for request_id, values, expected in (("wire-unset", {"max_tokens": 2}, 0.6),
                                         ("wire-explicit", {"max_tokens": 2, "temperature": 1.0}, 1.0)):
        wire = WireRequest.from_json({"text_input": "Hello", "sampling_parameters": json.dumps(values)})
        wire = WireRequest.from_triton_inputs(wire.to_triton_inputs().get)  # across a process boundary
        engine.add(wire.to_engine_request(request_id, None))
        assert _params_of(engine, request_id).temperature == expected, request_id
    engine.shutdown()


def test_generation_config_none_keeps_sampling_params_own_defaults(model_dir):
    engine = LLMEngine(EngineConfig(model=str(model_dir), generation_config="none"))
    engine.add_request("unset", [5, 6, 7], SamplingParams.from_dict({"max_tokens": 2}))
    assert _params_of(engine, "unset").temperature == 1.0 and _params_of(engine, "unset").top_k == 0
    engine.shutdown()
    with pytest.raises(ValueError, match="^generation_config: must be auto or none"):
        EngineConfig(generation_config="vllm")
