"""pagoda bench serve: the summary arithmetic, and one small run against the test server."""

import asyncio

import numpy as np

import pytest

from pagoda.bench.serve import RequestResult, run_workload, summarize


def test_summary_percentiles_throughput_and_goodput():
    results = [
        RequestResult(max_tokens=3, num_input_tokens=10, num_output_tokens=3, ttft_s=0.1, itl_s=[0.05, 0.05],
                      e2e_s=0.2),
        RequestResult(max_tokens=3, num_input_tokens=10, num_output_tokens=3, ttft_s=0.5, itl_s=[0.05, 0.05],
                      e2e_s=0.6),
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


def test_synthetic_lengths_follow_vllm_and_aiperf_rules():
    from pagoda.bench.serve import make_parser, workload_from_args
    from pagoda.bench.workload import make_random_workload

    # vllm bench serve --dataset-name random: uniform in [len*(1-r), len*(1+r)].
    items = make_random_workload(400, 0, input_len=100, output_len=20, range_ratio=0.5)
    assert {len(i.prompt_token_ids) for i in items} <= set(range(50, 151))
    assert {i.max_tokens for i in items} <= set(range(10, 31))
    assert min(len(i.prompt_token_ids) for i in items) < 60 and max(len(i.prompt_token_ids) for i in items) > 140
    fixed = make_random_workload(5, 1, input_len=64, output_len=7)
    assert [(len(i.prompt_token_ids), i.max_tokens) for i in fixed] == [(64, 7)] * 5
    assert make_random_workload(5, 1, 64, 7) == fixed  # seeded: the same load on every machine
    # AIPerf / genai-perf: normal lengths (mean, stddev), at least 1.
    items = make_random_workload(2000, 0, input_len=200, output_len=50, input_stddev=20, output_stddev=5)
    lengths = np.array([len(i.prompt_token_ids) for i in items])
    # The sample mean of 2000 draws is within 4 standard errors (20/sqrt(2000) = 0.45) of 200.
    assert abs(lengths.mean() - 200) < 4 * 20 / np.sqrt(2000) + 0.5
    assert 17 < lengths.std() < 23
    args = make_parser().parse_args(["--synthetic-input-tokens-mean", "30", "--output-tokens-mean", "4",
                                     "--num-requests", "3"])
    assert [i.max_tokens for i in workload_from_args(args)] == [4, 4, 4]
    with pytest.raises(ValueError, match="range ratio"):
        make_random_workload(1, 0, 10, 10, range_ratio=1.5)
    with pytest.raises(SystemExit, match="give one set"):
        workload_from_args(make_parser().parse_args(["--random-input-len", "8", "--output-tokens-mean", "4"]))


@pytest.mark.server
def test_bench_serve_draws_the_latency_cdfs(triton_server, tmp_path, capsys):
    """``pagoda bench serve --plot``: the report, and the TTFT / end-to-end CDF figure of the run."""
    pytest.importorskip("matplotlib")
    from matplotlib import image

    from pagoda.bench.serve import main

    figure = tmp_path / "latency.png"
    assert main(["--url", triton_server.grpc_url, "--num-requests", "3", "--concurrency", "2",
                 "--max-output-tokens", "3", "--plot", str(figure)]) == 0
    out = capsys.readouterr().out
    assert "goodput" in out and f"wrote {figure}" in out
    assert image.imread(str(figure)).std() > 0.05, "a blank figure"
