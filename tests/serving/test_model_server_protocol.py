"""The Gateway API Inference Extension's model-server protocol, checked on a real replica.

The protocol (GIE docs/proposals/003-model-server-protocol, "Metrics Reporting" and
"LoRA Adapter Serving") names what an endpoint picker scrapes from a model server that
labels itself ``llm-d.ai/engine-type: vllm`` (pagoda's pods do: the operator puts the
label on them), with vLLM's metric names:

| protocol metric       | type  | vLLM name / label                                   |
|-----------------------|-------|-----------------------------------------------------|
| TotalQueuedRequests   | gauge | vllm:num_requests_waiting                           |
| TotalRunningRequests  | gauge | vllm:num_requests_running                           |
| KVCacheUtilization    | gauge | vllm:kv_cache_usage_perc                            |
| BlockSize (optional)  | gauge | vllm:cache_config_info, label block_size            |
| NumGPUBlocks (opt.)   | gauge | vllm:cache_config_info, label num_gpu_blocks        |
| LoRA                  | gauge | vllm:lora_requests_info (labels and value below)    |

LoRA's labels: max_lora, running_lora_adapters, waiting_lora_adapters; its value: the last
update's timestamp.

This test reads the replica's Prometheus text and checks each one: name, ``# TYPE``,
labels, and a value that means what the protocol says.
"""

from __future__ import annotations

import re
import time
import urllib.request

from pagoda.engine.config import EngineConfig
from tests.serving.test_serving_triton_server import http_post

SAMPLE = re.compile(r'^(?P<name>[^{\s]+)(?:\{(?P<labels>.*)\})? (?P<value>\S+)$')


def scrape(url: str) -> tuple[dict[str, str], list[tuple[str, dict[str, str], float]]]:
    """(``{name: type}``, [(name, labels, value)]) from Prometheus text."""
    types, samples = {}, []
    for line in urllib.request.urlopen(url, timeout=5).read().decode().splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            types[name] = kind
        elif line and not line.startswith("#"):
            match = SAMPLE.match(line)
            assert match, line
            labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', match["labels"] or ""))
            samples.append((match["name"], labels, float(match["value"])))
    return types, samples


def test_every_protocol_metric_has_its_type_labels_and_meaning(triton_server):
    # One request through the session's adapter, so the LoRA series exists.
    status, body = http_post(triton_server, "/v2/models/pagoda/generate", {
        "text_input": "Hello", "lora_name": "sql", "sampling_parameters": '{"temperature": 0, "max_tokens": 2}'})
    assert status == 200, body
    before = time.time()
    types, samples = scrape(triton_server.metrics_url)
    by_name = {}
    for name, labels, value in samples:
        by_name.setdefault(name, []).append((labels, value))

    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                 "vllm:cache_config_info", "vllm:lora_requests_info"):
        assert types.get(name) == "gauge", (name, types.get(name))
        assert by_name.get(name), f"{name}: no sample"
    assert all(v >= 0 and v == int(v) for _, v in by_name["vllm:num_requests_waiting"])
    assert all(v >= 0 and v == int(v) for _, v in by_name["vllm:num_requests_running"])
    assert all(0.0 <= v <= 1.0 for _, v in by_name["vllm:kv_cache_usage_perc"])  # a fraction, as vLLM

    [(cache, one)] = by_name["vllm:cache_config_info"]
    assert one == 1.0
    assert int(cache["block_size"]) == EngineConfig().block_size
    [(_, num_blocks)] = by_name["pagoda:kv_cache_num_blocks"]
    assert int(cache["num_gpu_blocks"]) == num_blocks > 0
    assert cache["enable_prefix_caching"] == "True" and cache["model_name"]

    lora = by_name["vllm:lora_requests_info"]
    assert all({"max_lora", "running_lora_adapters", "waiting_lora_adapters"} <= set(labels) for labels, _ in lora)
    assert all(int(labels["max_lora"]) >= 1 for labels, _ in lora)
    newest = max(lora, key=lambda item: item[1])
    # The value is a Unix timestamp (the EPP takes the newest series as the current set).
    assert before - 3600 < newest[1] <= before + 1
    assert any("sql" in labels["running_lora_adapters"].split(",") for labels, _ in lora)
