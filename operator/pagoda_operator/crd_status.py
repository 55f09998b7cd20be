"""The `LLMService` status schema: what the operator writes under `.status`.

Only the operator writes status (through the status subresource); kopf's own bookkeeping
goes to annotations (handlers.py), because this structural schema would prune
`status.kopf`. The decode pool's scaling state is at the top level, the prefill pool's
(spec.disaggregation) under `prefill`.
"""

from __future__ import annotations

from typing import Any

from pagoda_operator.schema_nodes import integer, number, obj, string

_CONDITION = obj(
    {
        "type": string("Condition type (Ready, SpecValid, Scaling)."),
        "status": string("True, False or Unknown.", enum=["True", "False", "Unknown"]),
        "reason": string("CamelCase reason."),
        "message": string("Human-readable detail; names the offending field when invalid."),
        "lastTransitionTime": string("When status last changed.", format="date-time"),
        "observedGeneration": {"type": "integer", "format": "int64",
                               "description": "Generation this condition is about."},
    },
    required=["type", "status"],
)

_OBSERVED_LOAD = obj({
    "source": string("Where the load came from.", enum=["redis", "metrics", "none"]),
    "numReplicas": integer("Replicas that reported."),
    "waiting": number("Waiting requests, summed over replicas."),
    "running": number("Running requests, summed over replicas."),
    "kvCacheUsage": number("Mean KV cache usage."),
    "ttftP90Seconds": number("P90 time to first token of all replicas' recent requests together."),
    "itlP90Seconds": number("P90 inter-token latency of all replicas' recent tokens together (from /metrics)."),
    "sampledAt": string("Sample time.", format="date-time"),
})
_LAST_DECISION = obj({
    "time": string("Decision time.", format="date-time"),
    "from": integer("Replicas before."),
    "to": integer("Replicas after."),
    "reason": string("Why."),
})
_DRAIN = obj({
    "replicaId": string("Replica being drained before removal."),
    "startedAt": string("Drain start.", format="date-time"),
    "targetReplicas": integer("Replica count once the drain completes."),
})
_REPLICAS = obj({"desired": integer("Replicas the operator asks for."), "ready": integer("Ready replicas.")})
STATUS_SCHEMA: dict[str, Any] = obj(
    {
        "observedGeneration": {"type": "integer", "format": "int64", "description": "Last generation reconciled."},
        "mode": string("Mode last rendered."),
        "replicas": _REPLICAS,
        "conditions": {"type": "array", "items": _CONDITION,
                       "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
        "observedLoad": _OBSERVED_LOAD,
        "lastDecision": _LAST_DECISION,
        "drain": _DRAIN,
        "prefill": obj({"replicas": _REPLICAS, "observedLoad": _OBSERVED_LOAD,
                         "lastDecision": _LAST_DECISION, "drain": _DRAIN},
                        description="spec.disaggregation: the prefill pool's own scaling state (the fields "
                                    "above are the decode pool's)."),
        "routerService": string("Service name of the router."),
    },
    description="Observed state, written by the operator.",
)
