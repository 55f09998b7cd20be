"""Request migration: a request whose replica fails mid-request continues on another (docs/reliability.md).

Every door's request reaches a replica through an upstream client (``api.upstream``, shared
by the gRPC and OpenAI-shaped doors; ``api.http_migration`` for the Triton HTTP door). Both
keep a ``Journal`` of what their client has received, and ask it for a ``Plan`` when the
replica fails: the connection breaks, or the replica answers with an error that is its own
fault, not the request's (``contracts.errors.is_replica_fault``: shutting down, the drain's
deadline, its stub died). Pure bookkeeping: the upstream clients do the I/O.

The journal: the token ids the client has (the replica's ``output_token_ids`` output, asked
for with the ``return_output_token_ids`` flag the router adds to a streaming request it could
resume, and removed from what the client sees unless the client asked for it too), the
characters of text, the last ``cumulative_logprob``, the responses relayed.

The plan, on a failure (never to a replica that failed this request):

- **restart**: the client has nothing yet (a non-streaming request, or a stream before its
  first response): the request goes again, whole. Exact for greedy and seeded requests (the
  same tokens again); for others the client never saw the lost sample.
- **resume**: it streamed: the request goes again with ``RequestOptions.resume`` (the
  journal's tokens, characters and log-probability sum), which the replica continues as the
  request's own output (``engine.resume``): the seed's position, penalties,
  ``min_tokens``/``max_tokens``, stop strings across the seam and the grammar continue
  exactly, the text its first replica held back is sent, no token twice. ``prompt_logprobs``
  (sent with the first tokens) are not asked again; a pull handle (``do_remote_prefill``) is
  dropped (the new replica computes the prompt).
- **none**: the client gets the failure, as without migration, when the request opted out
  (``allow_migration`` false), ``--migration-limit`` migrations were spent, or it streamed
  and cannot be resumed (``why_not_resumable``: several completions, a front model's request
  the router forwards as it came, a prefill stage a client drives itself).

``Migrations`` holds the limit (``pagoda router --migration-limit``; ``DEFAULT_MIGRATION_LIMIT``
3, Dynamo's recommended value: a replica's death costs each of its requests one migration,
and three bound a request through cascading failures; 0 turns migration off and the router
asks for no token ids) and the counts behind ``pagoda_router_migrations_total{reason, outcome}``.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
from collections import Counter
from dataclasses import dataclass
from typing import Any, Optional

from pagoda.contracts.request_options import Resume
from pagoda.serving.wire import WireRequest

logger = logging.getLogger(__name__)

DEFAULT_MIGRATION_LIMIT = 3
TOKEN_IDS_OUTPUT = "output_token_ids"

# Outcomes (the metric's ``outcome`` label).
RESTARTED, RESUMED = "restarted", "resumed"
OPTED_OUT, LIMIT_REACHED, NOT_RESUMABLE, NO_REPLICA = "opted_out", "limit_reached", "not_resumable", "no_replica"
# Reasons (the metric's ``reason`` label): what failed.
CONNECTION_LOST, REPLICA_FAULT = "connection_lost", "replica_fault"
# Every (reason, outcome) row is on /metrics from the start (at 0): rate() and the alert need
# the series before the first failure.
REASONS = (CONNECTION_LOST, REPLICA_FAULT)
OUTCOMES = (RESTARTED, RESUMED, OPTED_OUT, LIMIT_REACHED, NOT_RESUMABLE, NO_REPLICA)


def why_not_resumable(wire: Optional[WireRequest]) -> Optional[str]:
    """Why a request that streamed cannot be resumed on another replica (``None``: it can)."""
    if wire is None:
        return ("a TensorRT-LLM front model's request (the router forwards it as it came and does not read its "
                "outputs)")
    params = wire.params
    if params.n > 1 or params.use_beam_search:
        return "several completions (n > 1 or beam search): a resumed request has one"
    for flag in ("return_context_logits", "return_generation_logits"):
        if getattr(params, flag) or getattr(wire.output, flag):  # a sampling field, or the Triton input
            return (f"raw logits ({flag}): each response carried its tokens' rows and the first the context "
                    f"logits; resuming them is not supported (the engine refuses a resume that asks for them)")
    if wire.options.kv_transfer_params and wire.options.kv_transfer_params.get("do_remote_decode"):
        return "a prefill stage (kv_transfer_params.do_remote_decode): its KV handle lives on the failed replica"
    if not wire.output.stream:
        return "not streaming (restarted only while nothing was sent)"
    return None


@dataclass(frozen=True)
class Plan:
    """What to do after a failure: ``outcome`` (restarted or resumed: it goes to another
    replica; else the client gets the failure); ``wire``: the request to send next (``None``
    for a front model's request: sent again as it came); ``detail``: why, for logs and the error."""

    outcome: str
    wire: Optional[WireRequest] = None
    detail: str = ""

    @property
    def migrates(self) -> bool:
        return self.outcome in (RESTARTED, RESUMED)


class Journal:
    """What one request's client has received, and the plan when its replica fails.

    Args:
        wire: the request as the door built it (``None``: a front model's, forwarded as it came).
        limit: migrations allowed (``Migrations.limit``).
    """

    def __init__(self, wire: Optional[WireRequest], limit: int) -> None:
        self.original = wire
        self.limit = limit
        self.is_journaled = limit > 0 and wire is not None and wire.options.allow_migration \
            and why_not_resumable(wire) is None
        self.asked_token_ids = wire is not None and wire.output.return_output_token_ids
        # The request as sent: with the token-id flag when the router may resume it.
        self.wire = wire
        if self.is_journaled and not self.asked_token_ids:
            self.wire = wire.replace(output=dataclasses.replace(wire.output, return_output_token_ids=True))
        self.token_ids: list[int] = []
        self.num_chars = 0
        self.cumulative_logprob: Optional[float] = None
        self.num_responses = 0
        self.has_token_ids = True  # every response relayed carried its token ids
        self.failed_replicas: list[str] = []
        self.num_migrations = 0

    @property
    def hides_token_ids(self) -> bool:
        """The router asked for ``output_token_ids`` and the client did not: remove them from its view."""
        return self.is_journaled and not self.asked_token_ids

    def observe(self, text: Optional[str], token_ids: Optional[str], cumulative_logprob: Optional[float]) -> None:
        """One response relayed to the client: its ``text_output``, ``output_token_ids`` (JSON
        text) and ``cumulative_logprob`` values (``None`` where it had none)."""
        self.num_responses += 1
        self.num_chars += len(text) if isinstance(text, str) else 0
        if not isinstance(token_ids, str):  # absent, or several completions' (not resumed)
            self.has_token_ids = False
        elif self.has_token_ids:
            self.token_ids += _token_ids(token_ids)
        if cumulative_logprob is not None:
            self.cumulative_logprob = float(cumulative_logprob)

    def plan(self, replica_id: str, extra_chars: int = 0) -> Plan:
        """After ``replica_id`` failed this request: restart, resume or not (module docstring).

        Args:
            extra_chars: characters the client has beyond the journal's (the P/D early first
                token not yet cut from the decode stream: ``upstream``).
        """
        self.failed_replicas.append(replica_id)
        wire = self.original
        if self.limit <= 0:
            return Plan(NOT_RESUMABLE, None, "migration is off (--migration-limit 0)")
        if wire is not None and not wire.options.allow_migration:
            return Plan(OPTED_OUT, None, "the request asked not to be migrated (allow_migration false)")
        if self.num_migrations >= self.limit:
            return Plan(LIMIT_REACHED, None, f"it was migrated {self.num_migrations} times already "
                                             f"(--migration-limit {self.limit})")
        if self.num_responses == 0:
            self.num_migrations += 1
            return Plan(RESTARTED, self.wire, "nothing was sent yet: sent again whole")
        why = None if self.is_journaled else why_not_resumable(wire) or "the router did not journal it"
        if why is None and (not self.has_token_ids or not self.token_ids):
            why = "the replica did not report its token ids (output_token_ids)"
        if why is not None:
            return Plan(NOT_RESUMABLE, None, f"it streamed and cannot be resumed: {why}")
        self.num_migrations += 1
        return Plan(RESUMED, self.continuation(extra_chars), f"resumed after {len(self.token_ids)} tokens")

    def continuation(self, extra_chars: int = 0) -> WireRequest:
        """The request that continues this one on another replica (``RequestOptions.resume``)."""
        wire = self.wire
        assert wire is not None and self.token_ids, "only a journaled request with tokens is continued"
        params = wire.params if wire.params.prompt_logprobs is None else wire.params.clone(prompt_logprobs=None)
        resume = Resume(tuple(self.token_ids), self.num_chars + extra_chars, self.cumulative_logprob)
        return wire.replace(params=params, options=wire.options.replace(resume=resume, kv_transfer_params=None))


class Migrations:
    """The router's migration limit and counts (one, shared by the doors' upstream clients).

    Args:
        limit: migrations per request (``pagoda router --migration-limit``); 0: off.

    Raises:
        ValueError: a negative limit.
    """

    def __init__(self, limit: int = DEFAULT_MIGRATION_LIMIT) -> None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise ValueError(f"migration_limit: must be an integer >= 0, got {limit!r}")
        self.limit = limit
        self.counts: Counter = Counter()  # (reason, outcome) -> count

    def journal(self, wire: Optional[WireRequest]) -> Journal:
        return Journal(wire, self.limit)

    def record(self, reason: str, plan: Plan, replica_id: str, span: Any = None, num_tokens: int = 0) -> None:
        """Count one failure's plan, log it, and add it to the request's span (a ``RouteSpan``)
        as a ``pagoda.migration`` event."""
        self.counts[(reason, plan.outcome)] += 1
        logger.info("replica %s failed a request (%s): %s, %s", replica_id, reason, plan.outcome, plan.detail)
        if span is not None:
            span.add_event("pagoda.migration", {"pagoda.replica_id": replica_id, "pagoda.migration.reason": reason,
                                                "pagoda.migration.outcome": plan.outcome,
                                                "pagoda.migration.num_tokens": num_tokens,
                                                "pagoda.migration.detail": plan.detail})

    def metric_lines(self) -> list[str]:
        """Prometheus lines for ``/metrics``: every (reason, outcome), zeros included."""
        return ["# HELP pagoda_router_migrations_total requests whose replica failed, by what failed and what "
                "the router did (restarted, resumed, or not migrated and why)",
                "# TYPE pagoda_router_migrations_total counter",
                *(f'pagoda_router_migrations_total{{reason="{r}",outcome="{o}"}} {self.counts[r, o]}'
                  for r, o in itertools.product(REASONS, OUTCOMES))]


def _token_ids(text: str) -> list[int]:
    """A response's ``output_token_ids`` (JSON text of one completion's list)."""
    value = json.loads(text)
    assert isinstance(value, list), f"output_token_ids must be a JSON list, got {text!r:.80}"
    return value
