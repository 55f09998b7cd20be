"""pagoda bench serve: the summary arithmetic, and one small run against the test server."""

import asyncio

import pytest

from pagoda.bench.serve import RequestResult, run_workload, summarize


def test_summary_percentiles_throughput_and_goodput():
    results = [
        RequestResult(max_tokens=3, num_input_tokens=10, num_output_tokens=3, ttft_s=0.1, itl_s=[0.05, 0.05], e2e_s=0.2),
        RequestResult(max_tokens=3, num_input_tokens=10, num_output_tokens=3, ttft_s=0.5, itl_s=[0.05, 0.05], e2e_s=0.6),
        RequestResult(max_tokens=3, num_input_tokens=10, num_output_tokens=3, ttft_s=0.1, itl_s=[0.4, 0.4], e2e_s=0.9),
        RequestResult(max_tokens=3, error="boom"),
    ]
    s = summarize(results, elapsed_s=2.0, ttft_slo_s=0.2, itl_slo_s=0.1)
    assert s["num_requests"] == 4 and s["num_failed"] == 1
    assert s["num_output_tokens"] == 9 and s["output_tokens_per_s"] == pytest.approx(4.5)
    assert s["ttft_ms"]["p50"] == pytest.approx(100.0)
    assert s["itl_ms"]["p50"] == pytest.approx(50.0)
    # Only the first request meets both objectives: the 2nd misses TTFT, the 3rd TPOT.
    assert s["goodput_fraction"] == pytest.approx(0.25)
    assert s["goodput_requests_per_s"] == pytest.approx(0.5)


@pytest.mark.server
def test_bench_drives_the_server(triton_server):
    prompts = [("Tell me about cats.", 4), ("Tell me about dogs.", 5), ("Name a fruit.", 3)]
    results, elapsed = asyncio.run(run_workload(triton_server.grpc_url, prompts, concurrency=2))
    assert [r.error for r in results] == [None] * 3
    assert [r.num_output_tokens for r in results] == [4, 5, 3]
    assert all(r.ttft_s > 0 and len(r.itl_s) == r.num_output_tokens - 1 for r in results)
    assert summarize(results, elapsed, 10.0, 10.0)["goodput_fraction"] == 1.0
