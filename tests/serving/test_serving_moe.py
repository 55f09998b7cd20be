"""A Mixture-of-Experts model served by a real tritonserver equals the offline engine.

A random tiny Qwen3-MoE folder (``tests/engine/hf_reference.py`` "qwen3-moe": 8 experts,
top-2, layer 0 dense) with SmolLM2's tokenizer, served as ``pagoda serve --model DIR``
would; three greedy requests streamed concurrently over gRPC (tritonclient) must give the
offline ``LLM``'s texts.
"""

from __future__ import annotations

import asyncio

import pytest

from pagoda.engine.llm import LLM
from pagoda.engine.sampling_params import SamplingParams
from pagoda.serving.launch.client import stream_generate
from pagoda.serving.launch.launcher import TritonServer, find_free_port
from pagoda.serving.launch.serve_options import ServeOptions
from tests.engine.hf_reference import make_random_model

pytestmark = pytest.mark.server

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory, smollm2_path):
    return str(make_random_model(tmp_path_factory.mktemp("moe") / "qwen3-moe", "qwen3-moe", smollm2_path))


async def served_texts(server, prompts: list[str], max_tokens: int) -> list[str]:
    """Greedy texts of ``prompts``, streamed concurrently over gRPC (tritonclient)."""
    from tritonclient.grpc import aio

    async def one(client, prompt):
        return "".join([out["text_output"] async for out in stream_generate(
            client, prompt, {"temperature": 0, "max_tokens": max_tokens})])

    client = aio.InferenceServerClient(server.grpc_url)
    try:
        return await asyncio.gather(*[one(client, p) for p in prompts])
    finally:
        await client.close()


def test_served_moe_model_equals_offline(moe_folder, tmp_path):
    offline = LLM(model=moe_folder, max_model_len=256)
    assert offline.engine.model_config.architecture == "Qwen3MoeForCausalLM"
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    expected = [o.outputs[0].text for o in offline.generate(PROMPTS, greedy)]
    options = ServeOptions(model=moe_folder, http_port=find_free_port(), grpc_port=find_free_port(),
                           metrics_port=find_free_port(), max_model_len=256, max_num_seqs=8, startup_timeout_s=600)

    with TritonServer(options, log_path=str(tmp_path / "server.log")) as server:
        served = asyncio.run(served_texts(server, PROMPTS, MAX_TOKENS))
    assert served == expected
    assert all(expected)
