"""The disaggregated fleet simulator (``pagoda.fleet.sim.disagg``): the two stages happen as
pagoda's router runs them, on the real scheduler, and nothing leaks."""

from __future__ import annotations

import pytest

from pagoda.fleet.routing.policy import make_policy
from pagoda.fleet.sim.disagg import DisaggSimulator, Slo, TransferModel, goodput
from pagoda.fleet.sim.simulator import WorkloadConfig, make_workload

WORKLOAD = WorkloadConfig(num_tenants=30, system_prompt_tokens=200, min_user_tokens=10, max_user_tokens=20,
                          output_tokens=8, arrival_rate=4.0, num_requests=30, zipf_s=0.0)


def _free_everywhere(sim):
    return all(r.scheduler.block_pool.num_free_blocks == r.scheduler.block_pool.num_blocks - 1
               for r in sim._replicas.values())


def test_decode_replicas_hit_every_transferred_block_and_compute_only_the_tail():
    requests = make_workload(WORKLOAD)
    sim = DisaggSimulator(2, 2, make_policy("prefix_aware"))
    result = sim.run(requests)
    assert all(t.finished is not None and t.first_token is not None for t in result.tracks)
    assert {t.decode_id[0] for t in result.tracks} == {"d"}
    decode = [r.scheduler for name, r in sim._replicas.items() if name.startswith("d")]
    prefill = [r.scheduler for name, r in sim._replicas.items() if name.startswith("p")]
    full_blocks = sum(len(r.token_ids) // 16 for r in requests)
    assert sum(s.prefix_cache_hits for s in decode) >= full_blocks * 16 * 0.9  # shared tenants may hit more
    assert all(s.prefix_cache_queries for s in prefill)
    assert _free_everywhere(sim)


def test_colocated_and_split_runs_end_with_every_request_and_goodput_is_the_top_good_rate():
    requests = make_workload(WORKLOAD)
    colocated = DisaggSimulator(0, 4, make_policy("prefix_aware"))
    result = colocated.run(requests)
    assert len([t for t in result.tracks if t.finished]) == len(requests) and _free_everywhere(colocated)
    assert result.attainment(Slo(1e9, 1e9)) == 1.0 and result.attainment(Slo(0.0, 0.0)) == 0.0
    # the transfer delays the decode stage: TTFT can only grow with a slower link
    fast = DisaggSimulator(2, 2, make_policy("prefix_aware"), transfer=TransferModel(mb_per_s=1e9)).run(requests)
    slow = DisaggSimulator(2, 2, make_policy("prefix_aware"), transfer=TransferModel(mb_per_s=1.0)).run(requests)
    ttft = lambda r: sum(t.first_token - t.arrival for t in r.tracks)  # noqa: E731
    assert ttft(slow) > ttft(fast)
    assert goodput({1.0: 0.95, 2.0: 0.91, 3.0: 0.5}) == 2.0 and goodput({1.0: 0.1}) == 0.0
    assert TransferModel(block_bytes=1_000_000, mb_per_s=100, latency_s=0.01).seconds(10) == pytest.approx(0.11)


def test_pagoda_bench_disagg_prints_the_goodput_table(capsys):
    from pagoda.bench.disagg import main

    assert main(["--devices", "4", "--rates-per-device", "0.05,0.1", "--num-requests", "24", "--prompt-tokens", "256",
                 "--output-tokens", "8", "--splits", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "| 4 | 0.20 |" in out and "| 4 | 0.40 |" in out and "(2P+2D)" in out
    assert "goodput at 4 devices" in out and "SLO: TTFT <=" in out
