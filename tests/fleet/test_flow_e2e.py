"""Tenant-fair flow control end to end: one real tritonserver replica (default SmolLM2 on CPU,
``max_num_seqs=2``, chunked prefill at 64 tokens a step, 16 a request, ``--scheduling-policy priority``)
behind ``pagoda router`` with two tenants and flow control on (``--queue-size-per-tenant 16``,
``--max-in-flight-per-replica 2``).

Covers (docs/reliability.md, "Flow control"): a tenant flooding the fleet with long prompts
through every door (OpenAI, Triton HTTP generate, gRPC stream) waits at the router while a
quiet tenant's requests are never refused, never wait at the router, and keep their time to
first token near their run alone (measured in the same test); the same flood behind a router
without flow control gets the quiet tenant refused. A higher priority band is released
before a lower one queued earlier; a request whose timeout passes while it waits is refused
429 naming it. Every client call has a timeout.

Why 64 tokens a step, and at most 16 a request (``long_prefill_token_threshold``): a CPU
step's time grows with its tokens, so a quiet request's prefill in the same step as a flood
request's 300-token prefill takes that prefill's time, and without the cap a flood request's
chunk takes the step's whole budget while the quiet request waits for its last chunk. Why the
priority policy: the router ranks the flooder's requests (released while it had more waiting) after
the quiet tenant's, and the replica then holds the flood's prefill chunk out of the quiet prompt's
step (docs/reliability.md, "Flow control", rule 7): the quiet prompt's step is as short as alone.
"""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time
import urllib.error
import urllib.request

import pytest

from pagoda.fleet.gate.flow_control import WAIT_BUCKETS_S, FlowOptions
from pagoda.serving.launch.launcher import TritonServer, find_free_port
from pagoda.serving.launch.serve_options import ServeOptions

from tests.fleet.test_admission_e2e import _idle, post
from tests.fleet.test_router_e2e import grpc_generate

pytestmark = [pytest.mark.server]

FLOOD, QUIET = "sk-flood-tenant-11aa", "sk-quiet-tenant-22bb"


def long_prompt(i: int) -> str:
    """About 300 tokens, distinct from its first block (no prefix-cache hit makes it cheap)."""
    return f"Flood request {i}. " + " ".join(f"rule {i}.{k}: steep leaf {k} for {k % 7} minutes." for k in range(16))


@pytest.fixture(scope="module")
def replica(tmp_path_factory, smollm2_path):
    options = ServeOptions(model=smollm2_path, http_port=find_free_port(), grpc_port=find_free_port(),
                           metrics_port=find_free_port(), max_model_len=512, max_num_seqs=2, startup_timeout_s=600,
                           engine_args={"max_waiting_requests": "4", "max_num_batched_tokens": "64",
                                        "long_prefill_token_threshold": "16",
                                        "scheduling_policy": "priority"})
    server = TritonServer(options, log_path=str(tmp_path_factory.mktemp("replica") / "replica.log"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys.txt"
    path.write_text(f"{FLOOD} flood\n{QUIET} quiet\n")
    return path


@pytest.fixture(scope="module")
def router(replica, keys, smollm2_path):
    from pagoda.fleet.service import BackgroundRouter

    with BackgroundRouter(router_options(replica, keys, smollm2_path, flow=FLOW)) as background:
        yield background


FLOW = FlowOptions(queue_size=16, max_wait_s=60.0, max_in_flight_per_replica=2)


def router_options(replica, keys, smollm2_path, flow=None):
    from pagoda.fleet.service import RouterOptions

    spec = f"id=r0,grpc={replica.grpc_url},http={replica.http_url}"
    return RouterOptions(model_dir=smollm2_path, model_name="smol", replicas=spec, host="127.0.0.1", http_port=0,
                         grpc_port=0, health_interval_s=0.5, api_keys_file=str(keys), flow=flow)


def first_token_s(url: str, key: str, prompt: str, max_tokens: int = 2, **extra) -> tuple[int, float]:
    """(status, seconds to the first streamed text) of an OpenAI streaming completion."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, **extra}
    request = urllib.request.Request(f"http://{url}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    start = time.perf_counter()
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            first = None
            for line in response:  # the first event carries the first token
                if first is None and line.startswith(b"data: {") and json.loads(line[6:])["choices"]:
                    first = time.perf_counter() - start
            return response.status, first
    except urllib.error.HTTPError as exc:
        return exc.code, float("nan")


def flood(router, stop: threading.Event, number: int, outcomes: list) -> None:
    """One flooding client: long prompts back to back, its door chosen by ``number``."""
    i = 0
    while not stop.is_set():
        prompt, i = long_prompt(number * 1000 + i), i + 1
        if number % 3 == 0:
            status = post(router.http_url, "/v1/completions", {"prompt": prompt, "max_tokens": 4}, FLOOD)[0]
        elif number % 3 == 1:
            status = post(router.http_url, "/v2/models/pagoda/generate",
                          {"text_input": prompt, "max_tokens": 4}, FLOOD)[0]
        else:
            _, errors = grpc_generate(router.grpc_url, [prompt], max_tokens=4,
                                      metadata={"authorization": f"Bearer {FLOOD}"})
            status = 429 if errors else 200
        outcomes.append(status)


def quiet_run(router, n: int, refused: list = None) -> list[float]:
    """The quiet tenant's requests one after another: their times to first token (each must pass,
    unless ``refused`` collects the refusals)."""
    times = []
    for i in range(n):
        status, seconds = first_token_s(router.http_url, QUIET, f"Quiet question {i}: name one green tea.")
        if refused is not None and status != 200:
            refused.append(status)
            continue
        assert status == 200, f"the quiet tenant was refused ({status})"
        times.append(seconds)
    return times


class Flood:
    """Six flooding clients (two per door) while the block runs."""

    def __init__(self, router) -> None:
        self.router, self.stop, self.outcomes = router, threading.Event(), []
        self.pool = concurrent.futures.ThreadPoolExecutor(6)

    def __enter__(self) -> "Flood":
        self.futures = [self.pool.submit(flood, self.router, self.stop, k, self.outcomes) for k in range(6)]
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for future in self.futures:
            future.result(timeout=180)
        self.pool.shutdown()


def test_a_flood_does_not_starve_or_slow_the_quiet_tenant(replica, router, keys, smollm2_path):
    from pagoda.fleet.service import BackgroundRouter

    flow = router.service.gate.flow
    quiet_run(router, 2)  # warm up
    solo = quiet_run(router, 10)
    depths = []
    with Flood(router) as flood_:
        deadline = time.monotonic() + 60
        while flow.queue.depth("flood") < 3:  # the flooder is queued at the router: the fleet is saturated
            assert time.monotonic() < deadline, "the flood never queued"
            time.sleep(0.05)
        # The flood's steady state: its requests that passed before it was backlogged (rank 0 at the
        # replica, as the quiet tenant's) have ended and two have left its queue ranked after the
        # quiet tenant's (docs/reliability.md, "Flow control", rule 7). The quiet tenant keeps
        # sending meanwhile (idle past --tenant-share-window, it would leave the flood every slot).
        passed, before_warmup = flow.released[("flood", 0)], list(flow.waits[("quiet", 0)])
        warmup = 0
        while flow.released[("flood", 0)] < passed + 2:
            assert time.monotonic() < deadline, "the flood never reached its steady state"
            warmup += len(quiet_run(router, 1))
        warmup_waits = [n - m for n, m in zip(flow.waits[("quiet", 0)], before_warmup)]
        flooded = []
        for _ in range(10):
            depths.append(flow.queue.depth("flood"))
            flooded += quiet_run(router, 1)
    _idle(replica)
    # the same flood behind a router without flow control: the replica's queue fills, the quiet tenant is refused
    refused_without: list = []
    with BackgroundRouter(router_options(replica, keys, smollm2_path)) as unfair, Flood(unfair):
        time.sleep(2.0)
        without = quiet_run(unfair, 10, refused_without)
    _idle(replica)
    p50, p99 = (lambda xs: sorted(xs)[len(xs) // 2]), max
    quiet_waits = [n - m for n, m in zip(flow.waits[("quiet", 0)], warmup_waits)]  # the 22 measured
    print(f"\nquiet TTFT solo p50 {p50(solo):.3f} p99 {p99(solo):.3f} s; with the flood p50 {p50(flooded):.3f} "
          f"p99 {p99(flooded):.3f} s (p99 ratio {p99(flooded) / p99(solo):.2f}, p50 ratio "
          f"{p50(flooded) / p50(solo):.2f}); its wait at the router: {quiet_waits[-2]:.3f} s over {quiet_waits[-1]} "
          f"requests (and {warmup_waits[-2]:.3f} s over {warmup} in the flood's warm-up); flood released ranked "
          f"after it {flow.released_backlogged[('flood', 0)]} of {flow.released[('flood', 0)]}; "
          f"flood queued {depths}, answered {sorted(set(flood_.outcomes))} x{len(flood_.outcomes)}; without flow "
          f"control: quiet refused {len(refused_without)} of 10, TTFT of the rest {[round(t, 2) for t in without]}")
    assert min(depths) >= 1, depths  # every quiet request was sent while the flooder had requests queued
    assert flood_.outcomes and set(flood_.outcomes) == {200}  # the flooder waited; nothing refused
    assert flow.released[("quiet", 0)] == 22 + warmup and flow.refused == {}
    assert not flow.released_backlogged[("quiet", 0)]  # never ranked after anyone; the flood's, after it:
    assert flow.released_backlogged[("flood", 0)] >= 2, flow.released_backlogged
    # The router's part of the quiet tenant's latency: each request under 0.1 s, most under 0.05 s.
    # (With the replica's chunk cap a flood request holds its slot longer; on a loaded box one or two
    # of the 22 were seen at 0.05-0.1 s, a few pump rounds, against 0.2-1.5 s less TTFT at p99.)
    assert quiet_waits[WAIT_BUCKETS_S.index(0.1)] == quiet_waits[-1], quiet_waits
    assert quiet_waits[WAIT_BUCKETS_S.index(0.05)] >= quiet_waits[-1] - 3, quiet_waits
    # End to end, on a shared 2-core CPU box (docs/reliability.md): with the rank and the priority
    # policy 1.1-2.1x at p50 and 1.1-2.0x at p99 (fcfs replica, same router: 2.5-3.7x, 2.5-3.4x); what is
    # left is mostly the flood's step already running when a quiet request arrives. A loaded CI box moves
    # the solo run too, so this bound keeps a margin; the printed ratios are the measurement.
    assert p50(flooded) <= 3 * p50(solo), (solo, flooded)
    # without flow control the same flood gets the quiet tenant refused (or stuck behind it)
    assert refused_without or p50(without) > 3 * p50(flooded), (refused_without, without)
    metrics = urllib.request.urlopen(f"http://{router.http_url}/metrics", timeout=10).read().decode()
    assert f'pagoda_router_queue_released_total{{tenant="quiet",priority="0"}} {22 + warmup}' in metrics
    assert 'pagoda_router_queue_wait_seconds_count{tenant="flood",priority="0"}' in metrics


def test_higher_bands_first_and_deadlines_kept(replica, router):
    flow = router.service.gate.flow
    low, high = [], []
    with concurrent.futures.ThreadPoolExecutor(10) as pool:
        lows = [pool.submit(lambda i=i: (first_token_s(router.http_url, FLOOD, long_prompt(50_000 + i), 4,
                                                       priority=5), time.perf_counter()))
                for i in range(8)]
        deadline = time.monotonic() + 60
        while flow.queue.depth("flood") < 5:
            assert time.monotonic() < deadline, "the low band never queued"
            time.sleep(0.02)
        highs = [pool.submit(lambda i=i: (first_token_s(router.http_url, FLOOD, long_prompt(60_000 + i), 4,
                                                        priority=0), time.perf_counter()))
                 for i in range(2)]
        # a request whose timeout passes while it waits is refused with 429 naming it
        status, headers, answer = post(router.http_url, "/v1/completions",
                                       {"prompt": "late", "max_tokens": 2, "timeout": 0.3, "priority": 9}, FLOOD)
        low = [f.result(timeout=180) for f in lows]
        high = [f.result(timeout=180) for f in highs]
    assert status == 429 and headers["Retry-After"] == "1", (status, answer)
    assert "its timeout (0.3 s) would pass before a replica had room" in answer["error"]["message"]
    assert all(s == 200 for (s, _), _ in low + high)
    high_done = max(t for _, t in high)
    # the low band's requests still queued when the high band came (>= 5) finish after both high ones
    # (two of them may hold the replica's slots when the high band arrives, a third may slip in)
    assert sum(t > high_done for _, t in low) >= 5, (high, low)
    assert flow.refused[("flood", 9, "timeout")] == 1
    _idle(replica)
