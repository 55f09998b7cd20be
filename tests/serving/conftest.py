"""A real tritonserver serving the default model, started once per test session.

The server runs our model repository exactly as ``pagoda serve`` does (same launcher, here
with one LoRA adapter as ``--lora sql=PATH`` would add), on free ports, with a small ``max_model_len`` so over-long
prompts are cheap to produce. Its log goes to the session's temp dir and is printed into a failure's message.
"""

from __future__ import annotations

import json
import urllib.request

import pytest

from pagoda.serving.launch.launcher import TritonServer, find_free_port

from pagoda.serving.launch.serve_options import ServeOptions

MAX_MODEL_LEN = 1024


@pytest.fixture(scope="session")
def kv_events_ports():
    """The session server's vLLM-format KV-event sockets: ``(pub_port, replay_port)``."""
    return find_free_port(), find_free_port()


@pytest.fixture(scope="session")
def triton_server(tmp_path_factory, smollm2_lora, kv_events_ports):
    """Serves the default model with one LoRA adapter, ``sql`` (base requests name none),
    runtime LoRA updates allowed (``--allow-runtime-lora``), KV events on ZMQ
    (``--kv-events-config``, on ``kv_events_ports``) and the vLLM backend's output shapes
    (``--output-dialect vllm``: per-token logprobs objects, finish_reason "None"), a KV
    connector for disaggregated prefill (``--kv-transfer-listen``); of the
    TensorRT-LLM fronts, ``ensemble`` is unary (the shipped ``decoupled: false``) and
    ``tensorrt_llm_bls`` and the LLM-API model ``tensorrt_llm`` decoupled
    (``--trtllm-decoupled``), so both modes are served."""
    log_path = tmp_path_factory.mktemp("tritonserver") / "server.log"
    pub_port, replay_port = kv_events_ports
    kv_events = json.dumps({"enable_kv_cache_events": True, "endpoint": f"tcp://*:{pub_port}",
                            "replay_endpoint": f"tcp://*:{replay_port}", "topic": "kv@pagoda-test@smollm2"})
    options = ServeOptions(http_port=find_free_port(), grpc_port=find_free_port(), metrics_port=find_free_port(),
                           max_model_len=MAX_MODEL_LEN, max_num_seqs=16, startup_timeout_s=600,
                           engine_args={"enable_lora": "true", "lora_modules": f"sql={smollm2_lora}",
                                        "allow_runtime_lora": "true", "kv_events_config": kv_events,
                                        "output_dialect": "vllm", "kv_transfer_listen": "127.0.0.1:0"},
                           trtllm_decoupled={"tensorrt_llm_bls": True, "tensorrt_llm": True})
    with TritonServer(options, log_path=str(log_path)) as server:
        yield server
    assert server.process is None


@pytest.fixture
def read_metrics(triton_server):
    """A function returning the server's pagoda/vLLM metrics as ``{name: value}``.

    Labels are dropped (one model, one label set); histogram buckets are skipped, their
    ``_count`` and ``_sum`` kept.
    """

    def read() -> dict[str, float]:
        text = urllib.request.urlopen(triton_server.metrics_url, timeout=5).read().decode()
        values = {}
        for line in text.splitlines():
            if line.startswith("#") or not line.strip() or "_bucket{" in line:
                continue
            name_labels, value = line.rsplit(" ", 1)
            name = name_labels.split("{", 1)[0]
            if name.startswith(("vllm:", "pagoda:")):
                values[name] = float(value)
        return values

    return read


@pytest.fixture(scope="package")
def openai_serve():
    """``pagoda serve --openai-port`` (the replica and its OpenAI door, a ``pagoda router`` child)
    for ``test_openai_door`` and ``test_openai_door_agents``: the door reads Qwen3's ``<think>``
    and Hermes tool calls (``--reasoning-parser qwen3 --tool-call-parser hermes``) and keeps
    Responses API turns (``--response-store``). ``openai_port`` is the door's port. Its
    TensorRT-LLM fronts are decoupled (``--trtllm-decoupled true``), so the decoupled ``ensemble``
    is served too (``test_serving_trtllm_logits``), where ``triton_server`` keeps it unary: a
    model's transaction policy is one per server, and no client may reload a model."""
    from tests.serving.test_serving_lifecycle import ServeProcess

    port = find_free_port()
    process = ServeProcess("--openai-port", str(port), "--max-model-len", "512", "--reasoning-parser", "qwen3",
                           "--tool-call-parser", "hermes", "--response-store", "--trtllm-decoupled", "true")
    try:
        process.wait_serving()
        assert f"OpenAI  http://127.0.0.1:{port}/v1" in process.output
        assert "tensorrt_llm: decoupled (streaming)" in process.output
        process.openai_port = port
        yield process
    finally:
        process.stop()
