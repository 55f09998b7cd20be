"""Request migration without servers (``fleet.api.migration``, ``api.upstream``, ``api.http_relay``):
the journal, the plan (restart, resume, or why not), the continuation's ``resume``, the
upstream client's loop over scripted replicas that fail mid-stream, the HTTP relay's cut of
the token ids, and the options' wire forms. The fleet of real processes is
``test_migration_e2e.py``'s."""

from __future__ import annotations

import asyncio
import json
import struct
from types import SimpleNamespace

import grpc
import pytest
from tritonclient.grpc import service_pb2

from pagoda.contracts.errors import DRAINING_MESSAGE, SHUTDOWN_MESSAGE, is_replica_fault
from pagoda.contracts.request_options import RequestOptions, Resume
from pagoda.engine.sampling_params import SamplingParams
from pagoda.fleet.api.http_relay import _TOKEN_IDS
from pagoda.fleet.api.migration import (LIMIT_REACHED, NOT_RESUMABLE, OPTED_OUT, RESTARTED, RESUMED,
                                        TOKEN_IDS_OUTPUT, Migrations, why_not_resumable)
from pagoda.fleet.api.routed_request import RoutedRequest
from pagoda.fleet.api.tracing import RouteSpan
from pagoda.fleet.api.upstream import GrpcUpstream, ReplicaFailed
from pagoda.serving.wire import OutputOptions, WireRequest


def wire(stream=True, asked=False, options=None, **sampling):
    return WireRequest(prompt_token_ids=(1, 2, 3), params=SamplingParams(**sampling),
                       options=RequestOptions(**(options or {})),
                       output=OutputOptions(stream=stream, return_cumulative_logprob=True,
                                            return_output_token_ids=asked))


def test_which_requests_are_journaled_and_resumable():
    journal = Migrations().journal(wire(seed=3, temperature=0.8))
    assert journal.is_journaled and journal.wire.output.return_output_token_ids and journal.hides_token_ids
    asked = Migrations().journal(wire(asked=True))
    assert asked.is_journaled and not asked.hides_token_ids and asked.wire is asked.original
    assert why_not_resumable(wire(n=2)).startswith("several completions")
    assert why_not_resumable(wire(use_beam_search=True, best_of=2, temperature=0)).startswith("several completions")
    assert why_not_resumable(None).startswith("a TensorRT-LLM front model's request")
    assert why_not_resumable(wire(stream=False)).startswith("not streaming")
    assert why_not_resumable(wire(options={"kv_transfer_params": {"do_remote_decode": True}})).startswith(
        "a prefill stage")
    for flag in ("return_context_logits", "return_generation_logits"):  # asked as a sampling field or an output
        assert why_not_resumable(wire(**{flag: True})).startswith(f"raw logits ({flag})")
        as_output = WireRequest(prompt_token_ids=(1, 2, 3), output=OutputOptions(stream=True, **{flag: True}))
        assert why_not_resumable(as_output).startswith(f"raw logits ({flag})")
    front = Migrations().journal(None)  # a front model's request: restarted as it came, never resumed
    assert front.plan("r0").migrates and front.plan("r1").wire is None
    for unjournaled in (Migrations().journal(wire(n=2)), Migrations(0).journal(wire()),
                        Migrations().journal(wire(options={"allow_migration": False})), Migrations().journal(None)):
        assert not unjournaled.is_journaled and not unjournaled.hides_token_ids
        assert unjournaled.wire is unjournaled.original  # sent as the client built it


def test_restart_while_nothing_was_sent_then_resume_with_what_the_client_has():
    journal = Migrations().journal(wire(max_tokens=9, prompt_logprobs=1,
                                        options={"kv_transfer_params": {"do_remote_prefill": True,
                                                                        "remote_host": "h", "remote_port": 1}}))
    first = journal.plan("r0")
    assert first.outcome == RESTARTED and first.wire is journal.wire
    journal.observe("Hel", "[7, 8]", -1.5)
    journal.observe("", "[9]", -2.25)  # text held back by the replica: the client has 3 characters
    second = journal.plan("r1", extra_chars=2)
    assert second.outcome == RESUMED and journal.failed_replicas == ["r0", "r1"]
    resumed = second.wire
    assert resumed.options.resume == Resume((7, 8, 9), 5, -2.25)
    assert resumed.params.prompt_logprobs is None and resumed.params.max_tokens == 9  # the engine counts the 3
    assert resumed.options.kv_transfer_params is None and resumed.prompt_token_ids == (1, 2, 3)
    assert resumed.output.return_output_token_ids
    journal.observe("lo", "[10]", -3.0)
    assert journal.plan("r2").wire.options.resume == Resume((7, 8, 9, 10), 5, -3.0)  # no extra: the splice is gone
    fourth = journal.plan("r3")
    assert fourth.outcome == LIMIT_REACHED and fourth.wire is None and "--migration-limit 3" in fourth.detail


def test_what_is_not_migrated_says_why():
    opted = Migrations().journal(wire(options={"allow_migration": False}))
    assert opted.plan("r0").outcome == OPTED_OUT  # even before anything was sent: the client's choice
    several = Migrations().journal(wire(n=2))
    assert several.plan("r0").outcome == RESTARTED  # nothing sent: restarting is exact
    several.observe("a", None, None)
    plan = several.plan("r1")
    assert plan.outcome == NOT_RESUMABLE and "several completions" in plan.detail
    silent = Migrations().journal(wire())
    silent.observe("a", None, None)  # a replica that does not report token ids
    assert "did not report its token ids" in silent.plan("r0").detail
    assert Migrations(0).journal(wire()).plan("r0").detail == "migration is off (--migration-limit 0)"
    with pytest.raises(ValueError, match="^migration_limit: must be an integer >= 0"):
        Migrations(-1)


def test_the_options_travel_on_the_wire():
    sent = wire(options={"allow_migration": False, "resume": Resume((4, 5), 2, -0.5)})
    for again in (WireRequest.from_triton_inputs(sent.to_triton_inputs().get),
                  WireRequest.from_json(sent.to_json())):
        assert again.options == sent.options and again.output.return_output_token_ids is False
    as_parameters = WireRequest.from_triton_inputs(
        wire().to_triton_inputs().get, {"allow_migration": "false", "resume": json.dumps({"output_token_ids": [4]})})
    assert not as_parameters.options.allow_migration and as_parameters.options.resume == Resume((4,))
    for bad, message in [({"output_token_ids": []}, "resume.output_token_ids: must be a non-empty list"),
                         ({"output_token_ids": [1, -2]}, "resume.output_token_ids: every token id"),
                         ({"output_token_ids": [1], "num_sent_chars": -1}, "resume.num_sent_chars"),
                         ({"output_token_ids": [1], "cumulative_logprob": float("nan")}, "resume.cumulative_logprob"),
                         ({"num_sent_chars": 1}, "resume.output_token_ids: required"),
                         ({"output_token_ids": [1], "extra": 1}, "resume: unknown key"),
                         ([1], "resume: must be a JSON object")]:
        with pytest.raises(ValueError, match="^" + message.replace("(", r"\(")):
            RequestOptions(resume=bad)
    with pytest.raises(ValueError, match="^allow_migration: must be a boolean"):
        RequestOptions(allow_migration="no")


def test_replica_faults_are_told_from_request_errors():
    assert is_replica_fault(SHUTDOWN_MESSAGE) and is_replica_fault(DRAINING_MESSAGE)
    assert is_replica_fault("Failed to process the request(s) for model 'pagoda_0_0', message: Stub process "
                            "'pagoda_0_0' is not healthy.")
    assert not is_replica_fault("engine error: boom") and not is_replica_fault("overloaded: queue full")
    assert not is_replica_fault("max_tokens: must be >= 1, got 0") and not is_replica_fault(None)


def test_the_http_relay_cuts_exactly_the_token_ids():
    event = b'data: {"model_name":"pagoda","model_version":"1","output_token_ids":"[12, 7]","text_output":" a"}\n\n'
    cut = b'data: {"model_name":"pagoda","model_version":"1","text_output":" a"}\n\n'
    assert _TOKEN_IDS.sub(b"", event, count=1) == cut
    last = b'data: {"model_name":"pagoda","text_output":" a","output_token_ids":"[3]"}\n\n'
    assert _TOKEN_IDS.sub(b"", last, count=1) == b'data: {"model_name":"pagoda","text_output":" a"}\n\n'


# ------------------------------------------------------------------ the upstream client's loop
def _response(text, ids, final=False):
    response = service_pb2.ModelStreamInferResponse()
    infer = response.infer_response
    for name, value in (("text_output", text), (TOKEN_IDS_OUTPUT, json.dumps(ids))):
        infer.outputs.add(name=name, datatype="BYTES", shape=[1])
        infer.raw_output_contents.append(struct.pack("<I", len(value.encode())) + value.encode())
    infer.parameters["triton_final_response"].bool_param = final
    return response


class ScriptedUpstream(GrpcUpstream):
    """Replicas r0, r1, r2 answer from a script (each an iterable of responses, or an exception)."""

    def __init__(self, scripts, limit=3):
        router = SimpleNamespace(replicas=SimpleNamespace(routable=lambda *a, **k: [], all=lambda: []))
        super().__init__(router, None, migrations=Migrations(limit), peer_pull_min_blocks=0)
        self.scripts, self.sent = dict(scripts), []

    async def _stream_on(self, analysis, request, span, skip, may_pull=False):
        replica_id = next(r for r in ("r0", "r1", "r2") if r not in skip)
        self.sent.append((replica_id, request, list(skip)))
        for item in self.scripts[replica_id]:
            if isinstance(item, Exception):
                raise item
            yield item


class Span(RouteSpan):
    """A router span with tracing off that keeps its events (the migrations) for the test."""

    def __init__(self):
        super().__init__()
        self.events = []

    def add_event(self, name, attributes):
        self.events.append((name, attributes))


def _run(upstream, request):
    async def collect():
        span, out = Span(), []
        try:
            async for response in upstream.stream(None, request, span):
                out.append(response)
        except ReplicaFailed as exc:
            out.append(exc)
        return out, span
    return asyncio.run(collect())


def _dead(replica_id):
    return ReplicaFailed(f"replica {replica_id} failed while streaming this request", grpc.StatusCode.UNAVAILABLE,
                         replica_id, "connection_lost")


def test_a_stream_resumes_on_the_next_replica_with_no_token_lost_or_repeated():
    upstream = ScriptedUpstream({"r0": [_response("Once", [10]), _response(" up", [11]), _dead("r0")],
                                 "r1": [_response("on", [12]), _dead("r1")],
                                 "r2": [_response(" a time", [13, 14], final=True)]})
    out, span = _run(upstream, RoutedRequest("id", wire(max_tokens=8, seed=1, temperature=1.0)))
    from pagoda.fleet.triton_wire import output_text

    assert "".join(output_text(r.infer_response, "text_output") for r in out) == "Once upon a time"
    assert all(output_text(r.infer_response, TOKEN_IDS_OUTPUT) is None for r in out)  # the client did not ask
    (_, first, _), (_, second, skip1), (_, third, skip2) = upstream.sent
    assert first.wire.options.resume is None and first.wire.output.return_output_token_ids
    assert second.wire.options.resume == Resume((10, 11), 7) and skip1 == ["r0"]
    assert third.wire.options.resume == Resume((10, 11, 12), 9) and skip2 == ["r0", "r1"]
    assert dict(upstream.migrations.counts) == {("connection_lost", RESUMED): 2}
    assert [(e[1]["pagoda.replica_id"], e[1]["pagoda.migration.outcome"]) for e in span.events] == \
        [("r0", RESUMED), ("r1", RESUMED)]
    lines = upstream.migrations.metric_lines()
    assert 'pagoda_router_migrations_total{reason="connection_lost",outcome="resumed"} 2' in lines
    # Every row from the start, so rate() and PagodaMigrationsFailing see the series at 0.
    assert 'pagoda_router_migrations_total{reason="replica_fault",outcome="no_replica"} 0' in lines
    assert sum(line.startswith("pagoda_router_migrations_total{") for line in lines) == 2 * 6


def test_a_client_that_listed_its_outputs_gets_only_those():
    upstream = ScriptedUpstream({"r0": [_response("a", [1], final=True)]})
    out, _ = _run(upstream, RoutedRequest("id", wire(), outputs=("text_output",)))
    assert upstream.sent[0][1].outputs == ("text_output", TOKEN_IDS_OUTPUT)  # asked of the replica
    assert [o.name for o in out[0].infer_response.outputs] == ["text_output"]


def test_not_migrated_the_client_gets_the_failure_naming_why():
    upstream = ScriptedUpstream({"r0": [_response("a", [1]), _dead("r0")]})
    out, span = _run(upstream, RoutedRequest("id", wire(options={"allow_migration": False})))
    assert isinstance(out[-1], ReplicaFailed) and "replica r0 failed while streaming" in str(out[-1])
    assert "Not migrated: the request asked not to be migrated (allow_migration false)" in str(out[-1])
    assert len(upstream.sent) == 1 and dict(upstream.migrations.counts) == {("connection_lost", OPTED_OUT): 1}
    fault = service_pb2.ModelStreamInferResponse(error_message=SHUTDOWN_MESSAGE)
    own = ScriptedUpstream({"r0": [ReplicaFailed("r0 failed", replica_id="r0", reason="replica_fault",
                                                 response=fault)]}, limit=0)
    out, _ = _run(own, RoutedRequest("id", wire()))
    assert out == [fault]  # the replica's own error, as it sent it
    request_error = ScriptedUpstream({"r0": [ReplicaFailed("bad input", grpc.StatusCode.INVALID_ARGUMENT, "r0")]})
    out, _ = _run(request_error, RoutedRequest("id", wire()))
    assert str(out[-1]) == "bad input" and len(request_error.sent) == 1  # another replica would refuse it too
