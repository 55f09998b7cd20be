"""ServingMetrics against a fake MetricFamily: names, kinds, counter deltas, histograms."""

from types import SimpleNamespace

from pagoda.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagoda.engine.llm_engine import EngineStats
from pagoda.serving.metrics import ServingMetrics


class FakeMetric:
    def __init__(self, family, labels, buckets):
        self.family, self.labels, self.buckets = family, labels, buckets
        self.value, self.observations = 0.0, []

    def increment(self, value):
        assert self.family.kind == "COUNTER" and value > 0
        self.value += value

    def set(self, value):
        assert self.family.kind == "GAUGE"
        self.value = value

    def observe(self, value):
        assert self.family.kind == "HISTOGRAM"
        self.observations.append(value)


class FakeMetricFamily:
    COUNTER, GAUGE, HISTOGRAM = "COUNTER", "GAUGE", "HISTOGRAM"
    created = {}

    def __init__(self, name, description, kind):
        self.name, self.kind = name, kind
        FakeMetricFamily.created[name] = self

    def Metric(self, labels, buckets=None):
        assert (buckets is not None) == (self.kind == "HISTOGRAM")
        self.metric = FakeMetric(self, labels, buckets)
        return self.metric


def stats(**changes):
    """A real EngineStats (so a new stats field the metrics read cannot be missed here)."""
    base = dict(num_waiting=1, num_running=2, kv_cache_usage=0.25, num_blocks=100, num_free_blocks=75,
                prefix_cache_queries=10, prefix_cache_hits=4, num_preemptions=0, num_prompt_tokens=10,
                num_generation_tokens=5, num_steps=3, max_num_running_seen=2, last_step_num_seqs=2,
                last_step_num_decode_seqs=2, last_step_num_prefill_seqs=0, last_step_num_tokens=2)
    base.update(changes)
    return EngineStats(**base)


def value(name):
    return FakeMetricFamily.created[name].metric.value


def test_names_kinds_and_labels():
    FakeMetricFamily.created = {}
    ServingMetrics(SimpleNamespace(MetricFamily=FakeMetricFamily), {"model_name": "pagoda"})
    kinds = {name: f.kind for name, f in FakeMetricFamily.created.items()}
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"):
        assert kinds[name] == "GAUGE"
    for name in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total"):
        assert kinds[name] == "COUNTER"
    for name in ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                 "vllm:e2e_request_latency_seconds"):
        assert kinds[name] == "HISTOGRAM"
    assert all(f.metric.labels == {"model_name": "pagoda"} for f in FakeMetricFamily.created.values())


def test_counters_follow_cumulative_stats_and_gauges_are_set():
    FakeMetricFamily.created = {}
    m = ServingMetrics(SimpleNamespace(MetricFamily=FakeMetricFamily), {})
    m.update_engine(stats())
    m.record_step(stats())
    m.update_engine(stats(num_generation_tokens=9, num_running=0, kv_cache_usage=0.0,
                          spec_num_accepted_tokens=7, num_swapped_out=2, prefix_cache_hits_disk=32,
                          prefix_cache_hits_shared=16, num_rejected_block_files=1))
    m.record_step(stats(num_steps=3))  # no new step: not counted again
    m.record_step(stats(num_steps=4, last_step_num_decode_seqs=1))
    assert value("vllm:generation_tokens_total") == 9
    assert value("vllm:prompt_tokens_total") == 10
    assert value("vllm:prefix_cache_hits_total") == 4
    assert value("vllm:num_requests_running") == 0 and value("vllm:kv_cache_usage_perc") == 0.0
    assert value("pagoda:batched_decode_steps_total") == 1
    assert value("vllm:spec_decode_num_accepted_tokens_total") == 7
    assert value("pagoda:kv_swapped_out_total") == 2
    assert value("pagoda:prefix_cache_hits_disk_total") == 32
    assert value("pagoda:prefix_cache_hits_shared_total") == 16
    assert value("pagoda:kv_block_files_rejected_total") == 1


def test_request_latencies_observed_once_each():
    FakeMetricFamily.created = {}
    m = ServingMetrics(SimpleNamespace(MetricFamily=FakeMetricFamily), {})
    metrics = RequestMetrics(arrival_time=10.0)

    def out(finished):
        return RequestOutput(request_id="r", prompt="p", prompt_token_ids=[1], finished=finished, metrics=metrics,
                             outputs=[CompletionOutput(0, "", [], "", [])])

    metrics.first_token_time = 10.5
    m.record_output(out(False))
    metrics.inter_token_latencies += [0.1, 0.2]
    m.record_output(out(False))
    metrics.inter_token_latencies += [0.3]
    metrics.finished_time = 12.0
    m.record_output(out(True))
    hist = {name: FakeMetricFamily.created[name].metric.observations for name in (
        "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds", "vllm:e2e_request_latency_seconds")}
    assert hist["vllm:time_to_first_token_seconds"] == [0.5]
    assert hist["vllm:inter_token_latency_seconds"] == [0.1, 0.2, 0.3]
    assert hist["vllm:e2e_request_latency_seconds"] == [2.0]
    assert value("vllm:request_success_total") == 1


def test_lora_requests_info_like_vllm():
    """One series per (running, waiting) adapter set, its value the time it was last seen;
    nothing at all for an engine without LoRA."""
    FakeMetricFamily.created = {}
    metrics = ServingMetrics(SimpleNamespace(MetricFamily=FakeMetricFamily), {"model_name": "pagoda"})
    metrics.update_lora(stats())
    assert "vllm:lora_requests_info" not in FakeMetricFamily.created
    metrics.update_lora(stats(running_lora_adapters=("a", "b"), waiting_lora_adapters=("c",), max_lora=2))
    metric = FakeMetricFamily.created["vllm:lora_requests_info"].metric
    assert metric.labels == {"model_name": "pagoda", "running_lora_adapters": "a,b", "waiting_lora_adapters": "c",
                             "max_lora": "2"}
    assert metric.value > 1.7e9
    metrics.update_lora(stats(running_lora_adapters=("c",), max_lora=2))
    assert FakeMetricFamily.created["vllm:lora_requests_info"].metric.labels["running_lora_adapters"] == "c"


def test_vllm_request_histograms_and_the_switch_that_turns_vllm_series_off():
    FakeMetricFamily.created = {}
    ServingMetrics(SimpleNamespace(MetricFamily=FakeMetricFamily), {"model_name": "pagoda"}, max_model_len=1000)
    created = FakeMetricFamily.created
    assert created["vllm:request_prompt_tokens"].metric.buckets == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000]
    assert created["vllm:request_params_n"].metric.buckets == [1, 2, 5, 10, 20]
    assert created["vllm:time_per_output_token_seconds"].kind == "HISTOGRAM"
    FakeMetricFamily.created = {}
    metrics = ServingMetrics(SimpleNamespace(MetricFamily=FakeMetricFamily), {"model_name": "pagoda"},
                             report_vllm=False)
    assert FakeMetricFamily.created and not [name for name in FakeMetricFamily.created if name.startswith("vllm:")]
    metrics.update_engine(stats(num_prompt_tokens=20))  # the vllm: series are simply not there
    metrics.update_lora(SimpleNamespace(max_lora=1, running_lora_adapters=["a"], waiting_lora_adapters=[]))
    assert "vllm:lora_requests_info" not in FakeMetricFamily.created


def test_cache_config_info_set_once_with_vllm_labels_and_off_with_the_switch():
    FakeMetricFamily.created = {}
    metrics = ServingMetrics(SimpleNamespace(MetricFamily=FakeMetricFamily), {"model_name": "pagoda"})
    assert "vllm:cache_config_info" not in FakeMetricFamily.created  # no engine stats yet
    info = (("block_size", "16"), ("num_gpu_blocks", "100"))
    metrics.update_engine(stats(cache_config_info=info))
    family = FakeMetricFamily.created["vllm:cache_config_info"]
    assert family.kind == "GAUGE" and family.metric.value == 1
    assert family.metric.labels == {"model_name": "pagoda", "block_size": "16", "num_gpu_blocks": "100"}
    metrics.update_engine(stats(cache_config_info=(("block_size", "32"),)))
    assert FakeMetricFamily.created["vllm:cache_config_info"] is family and family.metric.labels["block_size"] == "16"
    FakeMetricFamily.created = {}
    off = ServingMetrics(SimpleNamespace(MetricFamily=FakeMetricFamily), {"model_name": "pagoda"}, report_vllm=False)
    off.update_engine(stats(cache_config_info=info))
    assert "vllm:cache_config_info" not in FakeMetricFamily.created
