"""The operator's /metrics reader (``pagoda_operator.load.MetricsScraper``) on a real replica.

The autoscaler's inter-token-latency signal (``spec.autoscaling.itlSLOSeconds``, the decode
pool's with ``spec.disaggregation``) exists only on the replicas' Triton metrics port: the
Redis heartbeat has none. This checks, on the session's real tritonserver, that the scraper
finds the histograms it reads and that the deltas between two scrapes are one request's:
one TTFT and ``max_tokens - 1`` inter-token gaps, whose P90 is no longer than the request.
"""

from __future__ import annotations

import asyncio
import time
from urllib.parse import urlsplit

from pagoda_operator.load import MetricsScraper
from tests.serving.test_serving_triton_server import http_post

MAX_TOKENS = 12


def test_scraper_reads_one_requests_ttft_and_inter_token_gaps(triton_server):
    url = urlsplit(triton_server.metrics_url)
    scraper = MetricsScraper(port=url.port, timeout_s=5)
    pods = {"replica-0": url.hostname}
    asyncio.run(scraper.read_loads("pagoda", pods))  # the baseline the next scrape subtracts
    started = time.monotonic()
    status, body = http_post(triton_server, "/v2/models/pagoda/generate", {
        "text_input": "Count: one, two,",
        "sampling_parameters": f'{{"temperature": 0, "max_tokens": {MAX_TOKENS}, "ignore_eos": true}}'})
    wall_s = time.monotonic() - started
    assert status == 200, body

    deadline = time.monotonic() + 10  # the engine thread observes the last gap just after replying
    while True:
        load = asyncio.run(scraper.read_loads("pagoda", pods))["replica-0"]
        if (load.itl_buckets or {}).get(float("inf"), 0) >= MAX_TOKENS - 1 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert load.itl_buckets[float("inf")] == MAX_TOKENS - 1, load.itl_buckets
    assert load.ttft_buckets[float("inf")] == 1, load.ttft_buckets
    assert 0 < load.itl_p90 <= wall_s and 0 < load.ttft_p90 <= wall_s
