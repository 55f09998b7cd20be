"""A DeepSeek-V3 folder in DeepSeek's FP8 format, served by a real tritonserver, equals the offline
engine through the vLLM dialect (gRPC streaming, tritonclient) and the OpenAI door.

The tiny random ``DeepseekV3Config`` of ``tests/models/test_fp8_block_checkpoint.py`` written as
a 128 x 128 block-scaled FP8 checkpoint, served as ``pagoda serve --model DIR --openai-port P``
with ``PAGODA_KEEP_QUANTIZED=1`` (what a GPU does: the e4m3 weights and experts stay FP8): the
replica's KV cache is one group of latent rows (``mla_attention``). Three greedy prompts streamed
concurrently, then the same prompts through the OpenAI completions API (served from prefix-cache
hits the second time), must give the offline ``LLM``'s texts with the same setting. (The variable
reaches the Python backend's stub through the launcher's environment; on a CPU the kept-FP8 and
dequantized paths compute the same bits, so this checks the served path, not which of the two
the stub took: ``tests/models/test_fp8_block_checkpoint.py`` checks that.)
"""

from __future__ import annotations

import pytest

from pagoda.engine.llm import LLM
from pagoda.engine.sampling_params import SamplingParams
from pagoda.models.fp8 import Fp8BlockWeight
from tests.serving.test_serving_hybrid import MAX_TOKENS, PROMPTS, assert_served_equals

pytest.importorskip("openai")

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def fp8_folder(tmp_path_factory, smollm2_path):
    from tests.engine.hf_reference import save_random_model
    from tests.models.test_fp8_block_checkpoint import SHAPE
    from tests.models.test_quant_checkpoints import quantized_and_dequantized

    root = tmp_path_factory.mktemp("deepseek-fp8")
    float_dir = save_random_model(root / "float", smollm2_path, 3, "DeepseekV3Config", **SHAPE)
    return str(quantized_and_dequantized("fp8-block", float_dir, root)[0])


def test_served_deepseek_fp8_equals_offline_through_both_doors(fp8_folder, monkeypatch):
    monkeypatch.setenv("PAGODA_KEEP_QUANTIZED", "1")  # the server's process tree inherits it
    offline = LLM(model=fp8_folder, max_model_len=256)
    assert [g.spec.kind for g in offline.engine.executor.kv_layout.groups] == ["mla_attention"]
    assert isinstance(offline.engine.executor.runner.model.layers[0].attn.qkv_a_weight, Fp8BlockWeight)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    expected = [o.outputs[0].text for o in offline.generate(PROMPTS, greedy)]
    assert all(expected)

    assert_served_equals(fp8_folder, expected)
