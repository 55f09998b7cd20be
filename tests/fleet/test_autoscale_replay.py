"""The operator's autoscaler (the real AutoscalerPolicy and drain functions) replayed on the
routing simulator: a burst scales the fleet up after the pods' startup time, the lull
drains replicas one at a time and deletes their index entries, nothing is lost."""

from pagoda.bench import autoscale
from pagoda.bench.autoscale_replay import AutoscaleReplay, ReplayConfig, make_trace, rate_at
from pagoda.fleet.sim.simulator import WorkloadConfig

CFG = ReplayConfig(trace="burst", base_rate=0.3, peak_rate=2.5, duration_s=300.0, burst_s=90.0, startup_s=20.0,
                   max_replicas=6, scale_down_stabilization_s=30, ttft_slo_s=4.0,
                   workload=WorkloadConfig(num_tenants=12, system_prompt_tokens=512))


def test_rates_of_the_traces():
    assert rate_at(CFG, 10) == 0.3 and rate_at(CFG, 100) == 2.5 and rate_at(CFG, 200) == 0.3
    ramp = ReplayConfig(trace="ramp", base_rate=1.0, peak_rate=3.0, duration_s=100.0)
    assert rate_at(ramp, 0) == 1.0 and rate_at(ramp, 20) == 2.0 and rate_at(ramp, 50) == 3.0
    assert make_trace(CFG) == make_trace(CFG)  # seeded


def test_burst_scales_up_then_drains_back():
    result = AutoscaleReplay(CFG).run()
    assert len(result.ttfts) == len(make_trace(CFG))  # every request served, none lost in a drain
    ups = [d for d in result.decisions if d[2] > d[1]]
    downs = [d for d in result.decisions if d[2] < d[1]]
    assert ups and ups[0][0] >= 0.3 * CFG.duration_s  # nothing to scale before the burst
    assert result.first_ready_s == result.first_scale_up_s + CFG.startup_s
    assert 1 < result.max_replicas_seen <= CFG.max_replicas
    assert downs and all(d[1] - d[2] == 1 for d in downs)  # one drained replica at a time
    assert len(downs) - 1 <= len(result.drains) <= len(downs)  # the last drain may still be running at the end
    assert result.drains and all(entries > 0 for _, entries in result.drains)
    static = AutoscaleReplay(ReplayConfig(**{**CFG.__dict__, "static_replicas": result.max_replicas_seen})).run()
    assert not static.drains and static.replica_hours > result.replica_hours
    assert "autoscaled" in autoscale.format_rows([("autoscaled", result), ("static", static)])
