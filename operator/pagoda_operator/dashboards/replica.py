"""The replica dashboard: one or many ``pagoda serve`` replicas, from their metrics port (8002).

Rows: requests (running / waiting, finished, refused at admission), latency (TTFT, inter-token,
end-to-end quantiles), throughput (tokens/s, engine steps, request sizes), KV cache (usage,
blocks, prefix-cache hit rate, preemptions, the CPU tier), speculative decoding (acceptance)
and LoRA (adapters running / waiting). Per-instance series where a sum would be wrong (gauges
such as KV usage), per-job sums elsewhere. Names: ``pagoda.serving.metrics``.
"""

from __future__ import annotations

from pagoda_operator.dashboards.panels import JOB, RATE, Board, Graph, Query, Row, quantiles

SEL = f'job=~"{JOB}"'


def _rate(metric: str, by: str = "job") -> str:
    return f"sum by ({by}) (rate({metric}{{{SEL}}}[{RATE}]))"


REQUESTS = Row("Requests", (
    Graph("Requests running and waiting", "vllm:num_requests_running / _waiting per replica: the batch and the "
          "queue in front of it.",
          (Query(f"sum by (instance) (vllm:num_requests_running{{{SEL}}})", "running {{instance}}"),
           Query(f"sum by (instance) (vllm:num_requests_waiting{{{SEL}}})", "waiting {{instance}}"))),
    Graph("Finished requests", "vllm:request_success_total: requests that finished, any finish reason.",
          (Query(_rate("vllm:request_success_total"), "{{job}}"),), "reqps"),
    Graph("Admission: refused, displaced, expired", "Refused at once (queue full), ended by a more urgent "
          "request, ended by their deadline (pagoda:admission_*, pagoda:deadline_expired_total).",
          (Query(_rate("pagoda:admission_refused_total"), "refused {{job}}"),
           Query(_rate("pagoda:admission_displaced_total"), "displaced {{job}}"),
           Query(_rate("pagoda:deadline_expired_total"), "deadline {{job}}")), "reqps"),
    Graph("Requests per completion count n", "vllm:request_params_n: median and p99 of n.",
          quantiles("vllm:request_params_n", SEL, (0.5, 0.99))),
))

LATENCY = Row("Latency", (
    Graph("Time to first token", "vllm:time_to_first_token_seconds quantiles (the TTFT SLO alert reads p99).",
          quantiles("vllm:time_to_first_token_seconds", SEL), "s"),
    Graph("Inter-token latency", "vllm:inter_token_latency_seconds quantiles (the autoscaler's ITL SLO reads p90).",
          quantiles("vllm:inter_token_latency_seconds", SEL), "s"),
    Graph("End-to-end request latency", "vllm:e2e_request_latency_seconds quantiles.",
          quantiles("vllm:e2e_request_latency_seconds", SEL), "s"),
    Graph("Time per output token", "vllm:time_per_output_token_seconds quantiles (vLLM's older name for the "
          "inter-token gaps).", quantiles("vllm:time_per_output_token_seconds", SEL, (0.5, 0.99)), "s"),
))

THROUGHPUT = Row("Throughput", (
    Graph("Tokens per second", "Prompt tokens prefilled and tokens generated (vllm:prompt_tokens_total, "
          "vllm:generation_tokens_total).",
          (Query(_rate("vllm:prompt_tokens_total"), "prompt {{job}}"),
           Query(_rate("vllm:generation_tokens_total"), "generation {{job}}"))),
    Graph("Engine steps", "Steps per second, and those that decoded two or more sequences together (the "
          "continuous-batching witness), with the largest batch seen.",
          (Query(_rate("pagoda:engine_steps_total"), "steps {{job}}"),
           Query(_rate("pagoda:batched_decode_steps_total"), "batched decode {{job}}"),
           Query(f"max by (job) (pagoda:max_num_running_seen{{{SEL}}})", "largest batch {{job}}"))),
    Graph("Request sizes", "vllm:request_prompt_tokens / vllm:request_generation_tokens medians and p99.",
          (*quantiles("vllm:request_prompt_tokens", SEL, (0.5, 0.99)),
           *quantiles("vllm:request_generation_tokens", SEL, (0.5, 0.99)))),
    Graph("Prompts tokenized here", "Text prompts this replica encoded; a router's token ids are used as sent "
          "(pagoda:prompts_tokenized_total).", (Query(_rate("pagoda:prompts_tokenized_total"), "{{job}}"),)),
))

KV_CACHE = Row("KV cache", (
    Graph("KV cache usage", "vllm:kv_cache_usage_perc per replica (0..1; the KV alert fires above its threshold).",
          (Query(f"max by (instance) (vllm:kv_cache_usage_perc{{{SEL}}})", "{{instance}}"),), "percentunit"),
    Graph("KV blocks", "Blocks in the pool and free (free includes evictable cached blocks).",
          (Query(f"sum by (instance) (pagoda:kv_cache_num_blocks{{{SEL}}})", "blocks {{instance}}"),
           Query(f"sum by (instance) (pagoda:kv_cache_num_free_blocks{{{SEL}}})", "free {{instance}}"))),
    Graph("Prefix cache hit rate", "Hit tokens over queried tokens (vllm:prefix_cache_hits_total / "
          "_queries_total), and the part served from the CPU tier.",
          (Query(f"{_rate('vllm:prefix_cache_hits_total')} / {_rate('vllm:prefix_cache_queries_total')}",
                 "hit rate {{job}}"),
           Query(f"{_rate('pagoda:prefix_cache_hits_host_total')} / {_rate('vllm:prefix_cache_queries_total')}",
                 "from CPU tier {{job}}")), "percentunit"),
    Graph("Preemptions", "vllm:num_preemptions_total, split by how they were resolved (recomputed, swapped "
          "to the CPU tier) and swapped requests brought back.",
          (Query(_rate("vllm:num_preemptions_total"), "preempted {{job}}"),
           Query(_rate("pagoda:recomputed_preemptions_total"), "recomputed {{job}}"),
           Query(_rate("pagoda:kv_swapped_out_total"), "swapped out {{job}}"),
           Query(_rate("pagoda:kv_swapped_in_total"), "swapped in {{job}}"))),
))

FEATURES = Row("Speculative decoding and LoRA", (
    Graph("Speculative decoding acceptance", "Accepted over drafted tokens, and drafts verified per second "
          "(vllm:spec_decode_*; flat at zero without a drafter).",
          (Query(f"{_rate('vllm:spec_decode_num_accepted_tokens_total')} / "
                 f"{_rate('vllm:spec_decode_num_draft_tokens_total')}", "acceptance {{job}}"),
           Query(_rate("vllm:spec_decode_num_drafts_total"), "drafts/s {{job}}"))),
    Graph("LoRA adapters", "vllm:lora_requests_info: the adapter sets running and waiting (LoRA engines only; "
          "the value is when the set was last seen).",
          (Query(f"count by (instance, running_lora_adapters, waiting_lora_adapters) "
                 f"(vllm:lora_requests_info{{{SEL}}})", "running [{{running_lora_adapters}}] "
                 "waiting [{{waiting_lora_adapters}}] {{instance}}"),)),
))


def board() -> Board:
    """The replica dashboard."""
    return Board(uid="pagoda-replica", title="pagoda / replica",
                 description="pagoda serve replicas: requests, latency, throughput, KV cache, speculative "
                             "decoding, LoRA (vLLM metric names; generated by pagoda_operator.dashboards).",
                 job_metric="vllm:num_requests_running",
                 rows=(REQUESTS, LATENCY, THROUGHPUT, KV_CACHE, FEATURES))
