"""A 4-bit checkpoint served by a real tritonserver answers like the offline engine.

A tiny random Llama (tests/models/test_quant_checkpoints.py's float model) saved as a
compressed-tensors W4A16 checkpoint (asymmetric, group 32, made with the library's own
compressor), served as ``pagoda serve --model DIR`` would, with the 4-bit weights kept
packed (``PAGODA_KEEP_QUANTIZED=1``, what a GPU replica does by default): three greedy
requests streamed concurrently over gRPC give the offline ``LLM``'s texts.
"""

from __future__ import annotations

import asyncio

import pytest

from pagoda.engine.llm import LLM
from pagoda.engine.sampling_params import SamplingParams
from pagoda.serving.launch.launcher import TritonServer, find_free_port
from pagoda.serving.launch.serve_options import ServeOptions
from tests.engine.hf_reference import save_random_model
from pagoda.models.quant_write import write_variant
from tests.models.test_quant_checkpoints import VARIANTS
from tests.serving.test_serving_moe import served_texts

pytestmark = pytest.mark.server

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time,"]
MAX_TOKENS = 8


def test_served_4bit_checkpoint_equals_offline(tmp_path, smollm2_path, monkeypatch):
    pytest.importorskip("compressed_tensors")
    float_dir = save_random_model(tmp_path / "float", smollm2_path, 3, "LlamaConfig", vocab_size=49152,
                                  hidden_size=256, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True)
    config, replace = VARIANTS["ct-w4a16-asym-g32"]()
    folder = tmp_path / "w4a16"
    write_variant(float_dir, folder, config, replace)
    monkeypatch.setenv("PAGODA_KEEP_QUANTIZED", "1")  # the replica inherits it (the launcher copies the environment)
    offline = LLM(model=str(folder), max_model_len=256)
    from pagoda.models.int4 import Int4Weight

    assert any(isinstance(m, Int4Weight) for m in offline.engine.runner.model.modules())
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    expected = [o.outputs[0].text for o in offline.generate(PROMPTS, greedy)]
    options = ServeOptions(model=str(folder), http_port=find_free_port(), grpc_port=find_free_port(),
                           metrics_port=find_free_port(), max_model_len=256, max_num_seqs=8, startup_timeout_s=600)

    with TritonServer(options, log_path=str(tmp_path / "server.log")) as server:
        served = asyncio.run(served_texts(server, PROMPTS, MAX_TOKENS))
    assert served == expected and all(expected)
