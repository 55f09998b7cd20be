"""The router's /metrics re-exposes each replica's vllm: families once, samples labelled by replica."""

from pagoda.fleet.api.fleet_metrics import merge_vllm_series

REPLICA = """# HELP vllm:num_requests_running Number of requests running
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m",model="pagoda",version="1"} {running}
# HELP vllm:e2e_request_latency_seconds End-to-end latency
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_count{model_name="m"} {count}
vllm:e2e_request_latency_seconds_sum{model_name="m"} 1.5
vllm:e2e_request_latency_seconds_bucket{model_name="m",le="+Inf"} {count}
# HELP pagoda:batched_decode_steps_total not a vllm series
# TYPE pagoda:batched_decode_steps_total counter
pagoda:batched_decode_steps_total 7
# TYPE vllm:bare gauge
vllm:bare 3
"""


def replica(running: int, count: int) -> str:
    return REPLICA.replace("{running}", str(running)).replace("{count}", str(count))


def test_each_family_once_with_every_replicas_samples_labelled():
    lines = merge_vllm_series([("r1", replica(2, 5)), ("r2", replica(0, 9))])
    assert lines == [
        "# HELP vllm:num_requests_running Number of requests running",
        "# TYPE vllm:num_requests_running gauge",
        'vllm:num_requests_running{replica_id="r1",model_name="m",model="pagoda",version="1"} 2',
        'vllm:num_requests_running{replica_id="r2",model_name="m",model="pagoda",version="1"} 0',
        "# HELP vllm:e2e_request_latency_seconds End-to-end latency",
        "# TYPE vllm:e2e_request_latency_seconds histogram",
        'vllm:e2e_request_latency_seconds_count{replica_id="r1",model_name="m"} 5',
        'vllm:e2e_request_latency_seconds_sum{replica_id="r1",model_name="m"} 1.5',
        'vllm:e2e_request_latency_seconds_bucket{replica_id="r1",model_name="m",le="+Inf"} 5',
        'vllm:e2e_request_latency_seconds_count{replica_id="r2",model_name="m"} 9',
        'vllm:e2e_request_latency_seconds_sum{replica_id="r2",model_name="m"} 1.5',
        'vllm:e2e_request_latency_seconds_bucket{replica_id="r2",model_name="m",le="+Inf"} 9',
        "# TYPE vllm:bare gauge",
        'vllm:bare{replica_id="r1"} 3',
        'vllm:bare{replica_id="r2"} 3',
    ]


def test_nothing_scraped_nothing_exposed():
    assert merge_vllm_series([]) == []
    assert merge_vllm_series([("r1", "# TYPE pagoda:x gauge\npagoda:x 1\n")]) == []
