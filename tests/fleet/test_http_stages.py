"""The HTTP generate door's two stages (``fleet.api.http_stages``): when a body is staged,
and the bodies each stage sends (the request's wire, and its prefill stage's)."""

import json

from pagoda.fleet.api.first_token import prefill_stage
from pagoda.fleet.api.generate_request import GenerateRequest
from pagoda.fleet.api.http_stages import is_disaggregated
from pagoda.fleet.routing.replicas import ReplicaSet, parse_replicas_spec


def generate(document, model="pagoda"):
    return GenerateRequest.of_document(document, model, is_front=model != "pagoda")


def _router(roles):
    from types import SimpleNamespace

    replicas = ReplicaSet("static")
    replicas.set_members(parse_replicas_spec(";".join(f"id={rid},grpc={rid}:1,http={rid}:2,role={role}"
                                                      for rid, role in roles.items())))
    return SimpleNamespace(replicas=replicas)


def test_a_body_is_staged_only_with_both_roles_and_no_handle_of_its_own():
    staged = _router({"p": "prefill", "d": "decode"})
    assert is_disaggregated(staged, generate({"text_input": "x"}))
    assert is_disaggregated(staged, generate({"text_input": "x", "sampling_parameters": '{"temperature": 0}'}))
    assert not is_disaggregated(staged, generate({"text_input": "x", "sampling_parameters": json.dumps(
        {"kv_transfer_params": {"do_remote_decode": True}})}))  # a client driving the stages itself
    assert not is_disaggregated(staged, generate({"text_input": "x"}, model="ensemble"))  # a front's: as it came
    assert not is_disaggregated(_router({"a": "mixed", "b": "mixed"}), generate({"text_input": "x"}))


def test_each_stage_sends_one_canonical_body_whatever_channels_the_client_used():
    """Top-level inputs, ``parameters`` and ``sampling_parameters`` are read into one wire, so a
    stage's values cannot conflict with the client's: the body carries each value once."""
    request = generate({"text_input": "x", "max_tokens": 9, "stream": True, "id": "c1",
                        "parameters": {"temperature": "0"}, "sampling_parameters": '{"min_tokens": 3}'})
    body = request.body(traceparent="00-t")
    assert json.loads(body["sampling_parameters"]) == {"temperature": 0.0, "max_tokens": 9, "min_tokens": 3}
    assert {k: v for k, v in body.items() if k != "sampling_parameters"} == \
        {"text_input": "x", "stream": True, "id": "c1", "traceparent": "00-t"}
    late = request.body(wire=prefill_stage(request.wire, early=False))
    assert json.loads(late["sampling_parameters"]) == {"temperature": 0.0, "max_tokens": 1, "min_tokens": 0,
                                                       "kv_transfer_params": {"do_remote_decode": True}}
    assert "stream" not in late and late["id"] == "c1"
    early = request.body(wire=prefill_stage(request.wire, early=True))
    assert early["stream"] is True and json.loads(early["sampling_parameters"])["min_tokens"] == 2
    front = generate({"text_input": "x", "max_tokens": 9}, model="ensemble").salted("s")
    assert front.body() == {"text_input": "x", "max_tokens": 9, "parameters": {"cache_salt": "s"}}



