"""The operator's own series (``pagoda_operator.metrics``): text format, counting, the endpoint.

The counts against real decisions are in test_operator_kopf.py (scale up, drain, scale down);
this pins the format Prometheus reads and the HTTP endpoint `pagoda operator --metrics-port` serves.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from pagoda_operator.main import build_parser
from pagoda_operator.metrics import OperatorMetrics, PoolReport, bound_port, start_server


def test_series_start_at_zero_and_count_events_per_pool():
    metrics = OperatorMetrics()
    metrics.set_replicas("llm", "a", "replicas", 2, None)  # ready unknown: no sample yet
    metrics.record_tick("llm", "a", [PoolReport("decode", 3, 2, True, ["ScaledUp", "Draining"]),
                                     PoolReport("prefill", 1, 1)])
    metrics.record_tick("llm", "a", [], ok=False)
    lines = metrics.render().splitlines()
    assert 'pagoda_operator_replicas{namespace="llm",llmservice="a",pool="replicas",state="desired"} 2' in lines
    assert not any('pool="replicas",state="ready"' in line for line in lines)
    assert 'pagoda_operator_scaling_events_total{namespace="llm",llmservice="a",pool="decode",direction="up"} 1' \
        in lines
    assert 'pagoda_operator_scaling_events_total{namespace="llm",llmservice="a",pool="prefill",direction="down"} 0' \
        in lines
    assert 'pagoda_operator_drains_total{namespace="llm",llmservice="a",pool="decode"} 1' in lines
    assert 'pagoda_operator_draining{namespace="llm",llmservice="a",pool="decode"} 1' in lines
    assert 'pagoda_operator_autoscale_ticks_total{namespace="llm",llmservice="a",outcome="failed"} 1' in lines
    types = [line for line in lines if line.startswith("# TYPE")]
    assert len(types) == len(set(types)) == 5
    metrics.forget("llm", "a")
    assert metrics.render() == "\n"


def test_label_values_are_escaped():
    metrics = OperatorMetrics()
    metrics.set_replicas('n"s', "a\\b", "replicas", 1, 1)
    assert 'namespace="n\\"s",llmservice="a\\\\b"' in metrics.render()


def test_endpoint_serves_the_text():
    metrics = OperatorMetrics()
    metrics.set_replicas("llm", "a", "replicas", 1, 1)

    async def scenario():
        runner = await start_server(metrics, "127.0.0.1", 0)
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
                async with session.get(f"http://127.0.0.1:{bound_port(runner)}/metrics") as response:
                    return response.status, await response.text()
        finally:
            await runner.cleanup()

    status, text = asyncio.run(scenario())
    assert status == 200 and text == metrics.render()
    assert 'pagoda_operator_replicas{namespace="llm",llmservice="a",pool="replicas",state="ready"} 1' in text


def test_metrics_port_flag():
    assert build_parser().parse_args([]).metrics_port == 0
    assert build_parser().parse_args(["--metrics-port", "8081"]).metrics_port == 8081
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--metrics-port", "x"])
