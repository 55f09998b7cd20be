"""The fleet dashboard: ``pagoda router``s and the replicas as they see them (the router's ``/metrics``).

Rows: traffic (decisions, per-replica in-flight and routed requests, replica health, 429s and
other refusals), routing (prefix-match tokens by kind, load-only decisions, decision time,
pending affinity entries), KV movement (peer prefix pulls, two-stage prefill/decode), failures
(migrations by outcome, replicas' metrics scrape failures), tenant queues (flow control:
depth, wait p99, released, released behind their band (ranked after the band's others at the
replica) and refused per tenant; series only on a router started with
``--queue-size-per-tenant``), and Redis (availability, the index mirror's sync, resyncs,
reaped replicas). The replicas' ``vllm:`` series the router
re-exports are left to the replica dashboard (the chart's router ServiceMonitor drops them).
"""

from __future__ import annotations

from pagoda_operator.dashboards.panels import JOB, RATE, Board, Graph, Query, Row

SEL = f'job=~"{JOB}"'


def _rate(metric: str, by: str = "job", where: str = "") -> str:
    return f"sum by ({by}) (rate({metric}{{{SEL}{where}}}[{RATE}]))"


TRAFFIC = Row("Traffic", (
    Graph("Routing decisions", "pagoda_router_decisions_total per second.",
          (Query(_rate("pagoda_router_decisions_total"), "{{job}}"),), "reqps"),
    Graph("In flight per replica", "Requests each router has open on each replica (the load it balances).",
          (Query(f"sum by (replica_id) (pagoda_router_replica_in_flight{{{SEL}}})", "{{replica_id}}"),)),
    Graph("Routed per replica", "pagoda_router_replica_requests_total per second, by replica.",
          (Query(_rate("pagoda_router_replica_requests_total", "replica_id"), "{{replica_id}}"),), "reqps"),
    Graph("Replica health", "1 while a router considers a replica routable (PagodaReplicaNotReady fires on 0).",
          (Query(f"min by (replica_id) (pagoda_router_replica_healthy{{{SEL}}})", "{{replica_id}}"),)),
    Graph("Refusals by reason", "pagoda_router_refused_total: 429 overloaded (every replica full), rate "
          "limits (per tenant bucket), unauthenticated, invalid input, bodies too large.",
          (Query(_rate("pagoda_router_refused_total", "reason"), "{{reason}}"),), "reqps"),
))

ROUTING = Row("Routing", (
    Graph("Prefix tokens matched", "Prompt tokens the chosen replica already held: from the index (exact) or "
          "from recent decisions not yet confirmed by KV events (pending).",
          (Query(_rate("pagoda:router_prefix_match_tokens", "kind"), "{{kind}}"),)),
    Graph("Load-only decisions", "Share of decisions made by load alone (Redis or the index unavailable).",
          (Query(f"{_rate('pagoda_router_load_only_decisions_total')} / {_rate('pagoda_router_decisions_total')}",
                 "{{job}}"),), "percentunit"),
    Graph("Decision time", "pagoda_router_decision_seconds quantiles (the router's own summary).",
          (Query(f"max by (quantile) (pagoda_router_decision_seconds{{{SEL}}})", "p{{quantile}}"),), "s"),
    Graph("Pending affinity entries", "Decisions remembered until the replicas' KV events confirm them.",
          (Query(f"sum by (instance) (pagoda:router_pending_entries{{{SEL}}})", "{{instance}}"),)),
))

KV_MOVES = Row("KV movement and failures", (
    Graph("Peer pulls and two-stage requests", "Requests whose replica pulled its prefix from a peer, and "
          "requests run prefill replica -> decode replica.",
          (Query(_rate("pagoda:router_peer_pulls_total"), "peer pulls {{job}}"),
           Query(_rate("pagoda:router_two_stage_requests_total"), "two-stage {{job}}")), "reqps"),
    Graph("Migrations by outcome", "Requests of failed replicas: restarted or resumed elsewhere, or not "
          "migrated and why (PagodaMigrationsFailing).",
          (Query(_rate("pagoda_router_migrations_total", "reason, outcome"), "{{reason}} {{outcome}}"),), "reqps"),
    Graph("Replica metrics scrape failures", "Replicas that did not answer the router's /metrics fan-out.",
          (Query(_rate("pagoda_router_metrics_scrape_failures_total"), "{{job}}"),)),
))

QUEUES = Row("Tenant queues (flow control)", (
    Graph("Waiting at the router", "pagoda_router_queue_depth: requests each tenant has queued at the routers "
          "while the fleet is saturated (router --queue-size-per-tenant bounds it).",
          (Query(f"sum by (tenant) (pagoda_router_queue_depth{{{SEL}}})", "{{tenant}}"),)),
    Graph("Queue wait p99", "pagoda_router_queue_wait_seconds: the time a released request waited, per tenant "
          "(a quiet tenant's stays near zero while another floods).",
          (Query(f"histogram_quantile(0.99, sum by (tenant, le) "
                 f"(rate(pagoda_router_queue_wait_seconds_bucket{{{SEL}}}[{RATE}])))", "{{tenant}}"),), "s"),
    Graph("Released per tenant", "pagoda_router_queue_released_total per second: each tenant's share of the "
          "fleet, by priority band.",
          (Query(_rate("pagoda_router_queue_released_total", "tenant, priority"), "{{tenant}} p{{priority}}"),),
          "reqps"),
    Graph("Released behind their band", "pagoda_router_queue_released_backlogged_total per second: of the "
          "released requests, those whose tenant still had requests waiting in the band while another tenant "
          "was active, sent ranked after the band's others (replicas with --scheduling-policy priority run "
          "them after). Beside Released per tenant: near all of a flooder's, none of a quiet tenant's.",
          (Query(_rate("pagoda_router_queue_released_backlogged_total", "tenant, priority"),
                 "{{tenant}} p{{priority}}"),), "reqps"),
    Graph("Refused by the queue", "pagoda_router_queue_refused_total per second: 429s for a full tenant queue, "
          "the longest wait (--queue-max-wait) or the request's own timeout.",
          (Query(_rate("pagoda_router_queue_refused_total", "tenant, reason"), "{{tenant}} {{reason}}"),), "reqps"),
))

REDIS = Row("Redis and the prefix index", (
    Graph("Redis available", "1 while the router reaches Redis (PagodaRouterRedisUnreachable).",
          (Query(f"min by (instance) (pagoda_router_redis_available{{{SEL}}})", "{{instance}}"),)),
    Graph("Index mirror synced", "1 while the in-memory index follows the event stream (PagodaIndexStale).",
          (Query(f"min by (instance) (pagoda:router_index_synced{{{SEL}}})", "{{instance}}"),)),
    Graph("Index resyncs", "Snapshots taken again: full (Redis errors, trimmed stream) and per replica (missed "
          "or restarted event sequences).",
          (Query(f"sum by (scope) (increase(pagoda:router_index_resyncs_total{{{SEL}}}[{RATE}]))", "{{scope}}"),)),
    Graph("Reaped replicas", "Replicas whose heartbeat expired and whose index entries a router removed.",
          (Query(f"sum by (job) (increase(pagoda:router_reaped_replicas_total{{{SEL}}}[{RATE}]))", "{{job}}"),)),
))


def board() -> Board:
    """The fleet (router) dashboard."""
    return Board(uid="pagoda-fleet", title="pagoda / fleet",
                 description="pagoda routers: traffic, routing decisions and prefix hits, KV movement, migrations, "
                             "tenant queues, Redis and the prefix index (generated by pagoda_operator.dashboards).",
                 job_metric="pagoda_router_decisions_total",
                 rows=(TRAFFIC, ROUTING, KV_MOVES, QUEUES, REDIS))
