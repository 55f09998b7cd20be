"""Gemma 4 text served by a real tritonserver equals the offline engine, through the vLLM dialect
(gRPC streaming, tritonclient) and the OpenAI door (the openai SDK).

The tiny random ``Gemma4TextConfig`` of ``tests/engine/test_gemma4_engine.py`` (every switch on:
padded sliding pages, KV-shared layers, per-layer inputs, the MoE block) with SmolLM2's
tokenizer, served as ``pagoda serve --model DIR --openai-port P`` (``test_serving_hybrid``'s
``assert_served_equals``: three greedy prompts streamed concurrently, then each through the
completions API).
"""

from __future__ import annotations

import pytest

from pagoda.engine.llm import LLM
from pagoda.engine.sampling_params import SamplingParams
from tests.engine.hf_reference import save_random_model
from tests.engine.test_gemma4_engine import SMALL, _move_constants
from tests.serving.test_serving_hybrid import MAX_TOKENS, PROMPTS, assert_served_equals

pytest.importorskip("openai")

pytestmark = pytest.mark.server


def test_served_gemma4_equals_offline_through_both_doors(tmp_path, smollm2_path):
    folder = str(save_random_model(tmp_path / "gemma4", smollm2_path, 0, "Gemma4TextConfig",
                                   edit_weights=_move_constants, **SMALL))
    offline = LLM(model=folder, max_model_len=256)
    assert offline.engine.model_config.architecture == "Gemma4ForCausalLM"
    expected = [o.outputs[0].text for o in offline.generate(PROMPTS, SamplingParams(temperature=0,
                                                                                     max_tokens=MAX_TOKENS))]
    assert all(expected)
    assert_served_equals(folder, expected)
