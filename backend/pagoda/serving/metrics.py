"""Engine and request metrics on Triton's metrics port, under vLLM's names (contract 5).

Created through ``pb_utils.MetricFamily`` (Triton 2.51's Python backend supports
COUNTER, GAUGE and HISTOGRAM; all three are used). Names are those vLLM's server exposes,
so KEDA triggers, the Gateway API Inference Extension and vLLM dashboards work unchanged;
counters carry the ``_total`` suffix that vLLM's Prometheus client adds to its counters
(``vllm:prompt_tokens`` is exposed as ``vllm:prompt_tokens_total``), because Triton's
Prometheus registry does not add one. Labels: ``model_name`` (vLLM's), plus Triton's
``model`` and ``version``.

| name                                   | kind      | source                                   |
|----------------------------------------|-----------|------------------------------------------|
| vllm:num_requests_waiting              | gauge     | EngineStats.num_waiting                  |
| vllm:num_requests_running              | gauge     | EngineStats.num_running                  |
| vllm:kv_cache_usage_perc               | gauge     | EngineStats.kv_cache_usage (0..1)        |
| vllm:prefix_cache_queries_total        | counter   | EngineStats.prefix_cache_queries (tokens)|
| vllm:prefix_cache_hits_total           | counter   | EngineStats.prefix_cache_hits (tokens)   |
| vllm:num_preemptions_total             | counter   | EngineStats.num_preemptions              |
| vllm:prompt_tokens_total               | counter   | EngineStats.num_prompt_tokens            |
| vllm:generation_tokens_total           | counter   | EngineStats.num_generation_tokens        |
| vllm:request_success_total             | counter   | finished requests (any finish reason)    |
| vllm:time_to_first_token_seconds       | histogram | RequestMetrics.time_to_first_token       |
| vllm:inter_token_latency_seconds       | histogram | RequestMetrics.inter_token_latencies     |
| vllm:e2e_request_latency_seconds       | histogram | RequestMetrics.e2e_latency               |
| vllm:time_per_output_token_seconds     | histogram | RequestMetrics.inter_token_latencies (a) |
| vllm:request_prompt_tokens             | histogram | a finished request's prompt tokens       |
| vllm:request_generation_tokens         | histogram | a finished request's generated tokens (all n completions) |
| vllm:request_params_n                  | histogram | a finished request's n                   |
| pagoda:engine_steps_total              | counter   | EngineStats.num_steps                    |
| pagoda:batched_decode_steps_total      | counter   | steps that decoded >= 2 sequences at once|
| pagoda:max_num_running_seen            | gauge     | EngineStats.max_num_running_seen         |
| pagoda:kv_cache_num_blocks             | gauge     | EngineStats.num_blocks                   |
| pagoda:kv_cache_num_free_blocks        | gauge     | EngineStats.num_free_blocks              |
| vllm:spec_decode_num_drafts_total      | counter   | EngineStats.spec_num_drafts              |
| vllm:spec_decode_num_draft_tokens_total| counter   | EngineStats.spec_num_draft_tokens        |
| vllm:spec_decode_num_accepted_tokens_total | counter | EngineStats.spec_num_accepted_tokens   |
| pagoda:kv_swapped_out_total            | counter   | EngineStats.num_swapped_out (preemptions)|
| pagoda:kv_swapped_in_total             | counter   | EngineStats.num_swapped_in               |
| pagoda:recomputed_preemptions_total    | counter   | EngineStats.num_recomputed_preemptions   |
| pagoda:prefix_cache_hits_host_total    | counter   | EngineStats.prefix_cache_hits_host (b)   |
| pagoda:prefix_cache_hits_disk_total    | counter   | EngineStats.prefix_cache_hits_disk (f)   |
| pagoda:prefix_cache_hits_shared_total  | counter   | EngineStats.prefix_cache_hits_shared (f) |
| pagoda:kv_block_files_rejected_total   | counter   | EngineStats.num_rejected_block_files     |
| pagoda:prompts_tokenized_total         | counter   | EngineStats.num_prompts_tokenized (e)    |
| vllm:cache_config_info                 | gauge     | value 1; labels: the cache configuration (c) |
| vllm:lora_requests_info                | gauge     | the time (s) the adapter set was last seen (d) |

(a) the same gaps as ``inter_token_latency``, under vLLM's older name, which the vLLM backend reports.
(b) tokens, CPU tier; part of ``vllm:prefix_cache_hits_total``.
(f) tokens loaded from the disk / shared file tier into the CPU tier (then part of (b)).
(c) as strings, as vLLM: block_size, num_gpu_blocks, cache_dtype, enable_prefix_caching,
gpu_memory_utilization, num_cpu_blocks; set once, at the first engine update.
(d) labels running_lora_adapters, waiting_lora_adapters (comma-separated), max_lora; as vLLM (LoRA
engines only).
(e) text prompts encoded here; a router's token ids are not.

The three ``vllm:request_*`` histograms use the vLLM backend's buckets (1-2-5 steps up to
``max_model_len``; n: 1, 2, 5, 10, 20). For ``n > 1`` pagoda observes one request (its
prompt once, its completions' tokens summed, its n); vLLM v1 observes each child.

``report_vllm=False`` (the vLLM backend's ``REPORT_CUSTOM_METRICS`` model parameter set to
false; ``pagoda serve --no-vllm-metrics``) creates none of the ``vllm:`` families: only the
``pagoda:`` series are reported.

``pagoda:batched_decode_steps_total`` is the continuous-batching witness: it grows only
when one engine step advanced two or more requests' decodes together.

Engine counters are cumulative inside the engine; Triton counters only ``increment``, so
this class remembers the last value seen and adds the difference. Only the engine-loop
thread calls it (no lock needed; see ``EngineLoop``).
"""

from __future__ import annotations

import time
from typing import Any, Optional

from pagoda.engine.outputs import RequestOutput
from pagoda.contracts import redis_keys as fleet_keys

# vLLM's buckets, so dashboards' quantile queries mean the same thing.
TTFT_BUCKETS = list(fleet_keys.TTFT_BUCKETS)  # the heartbeat reports the same buckets
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0]
E2E_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0]

GAUGES = {
    "vllm:num_requests_waiting": ("Number of requests waiting to be processed.", "num_waiting"),
    "vllm:num_requests_running": ("Number of requests in model execution batches.", "num_running"),
    "vllm:kv_cache_usage_perc": ("KV-cache usage. 1 means 100 percent usage.", "kv_cache_usage"),
    "pagoda:max_num_running_seen": ("Most requests advanced by one engine step so far.", "max_num_running_seen"),
    "pagoda:kv_cache_num_blocks": ("KV-cache blocks in the pool.", "num_blocks"),
    "pagoda:kv_cache_num_free_blocks": ("KV-cache blocks free (or evictable cached).", "num_free_blocks"),
}
COUNTERS = {
    "vllm:prefix_cache_queries_total": ("Prefix cache queries, in tokens.", "prefix_cache_queries"),
    "vllm:prefix_cache_hits_total": ("Prefix cache hits, in tokens.", "prefix_cache_hits"),
    "vllm:num_preemptions_total": ("Cumulative number of preemptions.", "num_preemptions"),
    "vllm:prompt_tokens_total": ("Number of prefill tokens processed.", "num_prompt_tokens"),
    "vllm:generation_tokens_total": ("Number of generation tokens processed.", "num_generation_tokens"),
    "pagoda:engine_steps_total": ("Engine steps run.", "num_steps"),
    "vllm:spec_decode_num_drafts_total": ("Speculative drafts verified.", "spec_num_drafts"),
    "vllm:spec_decode_num_draft_tokens_total": ("Drafted tokens verified.", "spec_num_draft_tokens"),
    "vllm:spec_decode_num_accepted_tokens_total": ("Drafted tokens accepted.", "spec_num_accepted_tokens"),
    "pagoda:kv_swapped_out_total": ("Preemptions that swapped KV blocks to the CPU tier.", "num_swapped_out"),
    "pagoda:kv_swapped_in_total": ("Swapped-out requests brought back from the CPU tier.", "num_swapped_in"),
    "pagoda:recomputed_preemptions_total": ("Preemptions resolved by recomputation.", "num_recomputed_preemptions"),
    "pagoda:prefix_cache_hits_host_total": ("Prefix cache hits served from the CPU tier, in tokens.",
                                            "prefix_cache_hits_host"),
    "pagoda:prefix_cache_hits_disk_total": ("Prefix blocks loaded from the disk tier, in tokens.",
                                            "prefix_cache_hits_disk"),
    "pagoda:prefix_cache_hits_shared_total": ("Prefix blocks loaded from the shared tier, in tokens.",
                                              "prefix_cache_hits_shared"),
    "pagoda:kv_block_files_rejected_total": ("Block files refused (truncated, corrupt, foreign) and recomputed.",
                                             "num_rejected_block_files"),
    "pagoda:prompts_tokenized_total": ("Text prompts this replica encoded (a router's token ids are used as sent).",
                                       "num_prompts_tokenized"),
    "pagoda:admission_refused_total": ("Requests refused at once: the waiting queue was full.",
                                       "num_admission_refused"),
    "pagoda:admission_displaced_total": ("Waiting requests ended by a more urgent one (overload error).",
                                         "num_admission_displaced"),
    "pagoda:deadline_expired_total": ("Requests ended by their timeout.", "num_deadline_expired"),
}
N_BUCKETS = [1, 2, 5, 10, 20]
HISTOGRAMS = {
    "vllm:time_to_first_token_seconds": ("Histogram of time to first token in seconds.", TTFT_BUCKETS),
    "vllm:inter_token_latency_seconds": ("Histogram of inter-token latency in seconds.", ITL_BUCKETS),
    "vllm:time_per_output_token_seconds": ("Histogram of time per output token in seconds.", ITL_BUCKETS),
    "vllm:e2e_request_latency_seconds": ("Histogram of end-to-end request latency in seconds.", E2E_BUCKETS),
}
# name -> (description, buckets or None: 1-2-5 steps up to max_model_len)
REQUEST_HISTOGRAMS = {
    "vllm:request_prompt_tokens": ("Number of prefill tokens processed.", None),
    "vllm:request_generation_tokens": ("Number of generation tokens processed.", None),
    "vllm:request_params_n": ("Histogram of the n request parameter.", N_BUCKETS),
}


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's bucket rule)."""
    buckets, exponent = [], 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return buckets
            buckets.append(value)
        exponent += 1


class _Off:
    """A metric that is not reported (``report_vllm=False``)."""

    def set(self, value: float) -> None:
        pass

    def increment(self, value: float) -> None:
        pass

    def observe(self, value: float) -> None:
        pass


class ServingMetrics:
    """Owns the metric families and updates them from engine stats and outputs.

    Args:
        pb_utils: the ``triton_python_backend_utils`` module (or a fake with the same
            ``MetricFamily`` API: ``MetricFamily(name, description, kind)``,
            ``.Metric(labels, buckets=None)``, and ``COUNTER``/``GAUGE``/``HISTOGRAM``).
        labels: label set attached to every metric.
        max_model_len: the top of the token-count histograms' buckets.
        report_vllm: whether the ``vllm:`` series exist (``REPORT_CUSTOM_METRICS``).
    """

    def __init__(self, pb_utils: Any, labels: dict[str, str], max_model_len: int = 2048,
                 report_vllm: bool = True) -> None:
        mf = pb_utils.MetricFamily
        self._report_vllm = report_vllm
        self._families = []  # keep families alive for as long as their metrics
        self._gauges: dict[str, tuple[Any, str]] = {}
        self._counters: dict[str, tuple[Any, str]] = {}
        self._last: dict[str, float] = {}
        self._last_gauge: dict[str, float] = {}
        for name, (description, attr) in GAUGES.items():
            self._gauges[name] = (self._metric(mf, name, description, mf.GAUGE, labels), attr)
        for name, (description, attr) in COUNTERS.items():
            self._counters[name] = (self._metric(mf, name, description, mf.COUNTER, labels), attr)
            self._last[name] = 0
        self._batched_decode_steps = self._metric(
            mf, "pagoda:batched_decode_steps_total", "Engine steps that decoded two or more sequences together.",
            mf.COUNTER, labels)
        self._request_success = self._metric(
            mf, "vllm:request_success_total", "Count of finished requests.", mf.COUNTER, labels)
        self._histograms = {
            name: self._metric(mf, name, description, mf.HISTOGRAM, labels, buckets)
            for name, (description, buckets) in HISTOGRAMS.items()
        }
        for name, (description, buckets) in REQUEST_HISTOGRAMS.items():
            self._histograms[name] = self._metric(mf, name, description, mf.HISTOGRAM, labels,
                                                  buckets or build_1_2_5_buckets(max_model_len))
        self._lora_family = None
        self._lora_metrics: dict[tuple, Any] = {}  # one series per (running, waiting) set, as vLLM
        self._last_lora, self._last_lora_time = None, 0.0
        self._lora_labels = labels
        self._cache_info_metric = None
        self._mf = mf
        self._last_num_steps = 0
        # Inter-token latencies already observed, per request id.
        self._num_itl_seen: dict[str, int] = {}

    def _metric(self, mf: Any, name: str, description: str, kind: Any, labels: dict[str, str],
                buckets: Optional[list[float]] = None) -> Any:
        if name.startswith("vllm:") and not self._report_vllm:
            return _Off()
        family = mf(name=name, description=description, kind=kind)
        self._families.append(family)
        if buckets is not None:
            return family.Metric(labels=labels, buckets=buckets)
        return family.Metric(labels=labels)

    def update_engine(self, stats: Any) -> None:
        """Refresh gauges and counters from ``LLMEngine.get_stats()`` after a step."""
        for name, (metric, attr) in self._gauges.items():
            value = float(getattr(stats, attr))
            if self._last_gauge.get(name) != value:  # each set is an IPC round trip
                metric.set(value)
                self._last_gauge[name] = value
        for name, (metric, attr) in self._counters.items():
            value = getattr(stats, attr)
            if value > self._last[name]:
                metric.increment(value - self._last[name])
                self._last[name] = value
        if self._cache_info_metric is None and self._report_vllm and getattr(stats, "cache_config_info", ()):
            family = self._mf(name="vllm:cache_config_info", kind=self._mf.GAUGE,
                              description="Information of the LLMEngine CacheConfig")
            self._families.append(family)
            self._cache_info_metric = family.Metric(labels=dict(self._lora_labels, **dict(stats.cache_config_info)))
            self._cache_info_metric.set(1)

    def update_lora(self, stats: Any) -> None:
        """``vllm:lora_requests_info``: the series of the current adapter sets is set to now."""
        if not getattr(stats, "max_lora", 0) or not self._report_vllm:
            return
        key = (",".join(stats.running_lora_adapters), ",".join(stats.waiting_lora_adapters))
        now = time.time()
        if self._last_lora == key and now - self._last_lora_time < 1.0:
            return  # each set is an IPC round trip: at most one a second for an unchanged set
        self._last_lora, self._last_lora_time = key, now
        metric = self._lora_metrics.get(key)
        if metric is None:
            if self._lora_family is None:
                self._lora_family = self._mf(name="vllm:lora_requests_info", kind=self._mf.GAUGE,
                                             description="Running stats on lora requests.")
                self._families.append(self._lora_family)
            labels = dict(self._lora_labels, running_lora_adapters=key[0], waiting_lora_adapters=key[1],
                          max_lora=str(stats.max_lora))
            metric = self._lora_metrics[key] = self._lora_family.Metric(labels=labels)
        metric.set(now)

    def record_step(self, stats: Any) -> None:
        """Count the last step if it batched decodes (a ``step()`` that scheduled nothing
        leaves ``num_steps`` unchanged and is not counted again)."""
        if stats.num_steps > self._last_num_steps and stats.last_step_num_decode_seqs >= 2:
            self._batched_decode_steps.increment(1)
        self._last_num_steps = max(self._last_num_steps, stats.num_steps)

    def record_output(self, output: RequestOutput) -> None:
        """Observe TTFT, inter-token latencies and (when finished) e2e latency."""
        metrics = output.metrics
        request_id = output.request_id
        seen = self._num_itl_seen.get(request_id)
        if seen is None and metrics.first_token_time is not None:
            self._histograms["vllm:time_to_first_token_seconds"].observe(max(0.0, metrics.time_to_first_token))
            seen = 0
        if seen is not None:
            gaps = metrics.inter_token_latencies
            for gap in gaps[seen:]:
                self._histograms["vllm:inter_token_latency_seconds"].observe(max(0.0, gap))
                self._histograms["vllm:time_per_output_token_seconds"].observe(max(0.0, gap))
            self._num_itl_seen[request_id] = len(gaps)
        if output.finished:
            self._num_itl_seen.pop(request_id, None)
            self._request_success.increment(1)
            if metrics.e2e_latency is not None:
                self._histograms["vllm:e2e_request_latency_seconds"].observe(max(0.0, metrics.e2e_latency))
            self._histograms["vllm:request_prompt_tokens"].observe(len(output.prompt_token_ids or ()))
            self._histograms["vllm:request_generation_tokens"].observe(sum(len(c.token_ids) for c in output.outputs))
            self._histograms["vllm:request_params_n"].observe(len(output.outputs))
