"""A hybrid MoE model (Gated DeltaNet + full attention) served by a real tritonserver equals
the offline engine, through the vLLM dialect (gRPC streaming, tritonclient) and the OpenAI door.

A tiny random Qwen3.5-MoE folder (``tests/engine/test_hybrid_engine.py``'s config) with
SmolLM2's tokenizer, served as ``pagoda serve --model DIR --openai-port P``: the replica's
KV cache has a full-attention group and a recurrent-state group (``engine.kv.layout``).
Three greedy prompts streamed concurrently, then the same prompts through the OpenAI
completions API (the second time: served from prefix-cache hits that restore the state),
must give the offline ``LLM``'s texts.
"""

from __future__ import annotations

import asyncio

import pytest

from pagoda.engine.llm import LLM
from pagoda.engine.sampling_params import SamplingParams
from pagoda.serving.launch.client import stream_generate
from pagoda.serving.launch.launcher import find_free_port
from tests.engine.hf_reference import save_random_model
from tests.engine.test_hybrid_engine import ARCHS, SMALL, _move_constants
from tests.serving.test_serving_lifecycle import ServeProcess

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.server

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def hybrid_moe_folder(tmp_path_factory, smollm2_path):
    config_class, overrides = ARCHS["qwen3.5-moe"]
    return str(save_random_model(tmp_path_factory.mktemp("hybrid") / "qwen3.5-moe", smollm2_path, 0, config_class,
                                 edit_weights=_move_constants, **{**SMALL, **overrides}))


async def _grpc_texts(address: str, prompts: list[str]) -> list[str]:
    from tritonclient.grpc import aio

    async def one(client, prompt):
        return "".join([out["text_output"] async for out in stream_generate(
            client, prompt, {"temperature": 0, "max_tokens": MAX_TOKENS})])

    client = aio.InferenceServerClient(address)
    try:
        return await asyncio.wait_for(asyncio.gather(*[one(client, p) for p in prompts]), timeout=300)
    finally:
        await client.close()


def test_served_hybrid_moe_equals_offline_through_both_doors(hybrid_moe_folder):
    offline = LLM(model=hybrid_moe_folder, max_model_len=256)
    assert offline.engine.model_config.architecture == "Qwen3_5MoeForCausalLM"
    assert [g.spec.kind for g in offline.engine.executor.kv_layout.groups] == ["full_attention", "mamba"]
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    expected = [o.outputs[0].text for o in offline.generate(PROMPTS, greedy)]
    assert all(expected)

    assert_served_equals(hybrid_moe_folder, expected)


def assert_served_equals(folder: str, expected: list[str]) -> None:
    """``pagoda serve`` over ``folder`` answers ``PROMPTS`` (greedy, ``MAX_TOKENS``) with the
    ``expected`` texts through Triton's gRPC stream and the OpenAI door (the openai SDK)."""
    port = find_free_port()
    process = ServeProcess("--model", folder, "--openai-port", str(port), "--max-model-len", "256",
                           "--max-num-seqs", "8")
    try:
        process.wait_serving()
        assert asyncio.run(_grpc_texts(f"127.0.0.1:{process.ports[1]}", PROMPTS)) == expected
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=300)
        (card,) = client.models.list().data
        for prompt, text in zip(PROMPTS, expected):
            response = client.completions.create(model=card.id, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
            assert response.choices[0].text == text
    finally:
        process.stop()
