"""The HTTP generate door's two stages (``fleet.api.http_stages``): when a body is staged,
and how the handle and the prefill stage's values go into its ``sampling_parameters``."""

import json

from pagoda.fleet.api.http_stages import is_disaggregated, with_sampling
from pagoda.fleet.routing.replicas import ReplicaSet, parse_replicas_spec


def _router(roles):
    from types import SimpleNamespace

    replicas = ReplicaSet("static")
    replicas.set_members(parse_replicas_spec(";".join(f"id={rid},grpc={rid}:1,http={rid}:2,role={role}"
                                                      for rid, role in roles.items())))
    return SimpleNamespace(replicas=replicas)


def test_a_body_is_staged_only_with_both_roles_and_no_handle_of_its_own():
    staged = _router({"p": "prefill", "d": "decode"})
    assert is_disaggregated(staged, {"text_input": "x"})
    assert is_disaggregated(staged, {"text_input": "x", "sampling_parameters": '{"temperature": 0}'})
    assert not is_disaggregated(staged, {"text_input": "x", "sampling_parameters": json.dumps(
        {"kv_transfer_params": {"do_remote_decode": True}})})  # a client driving the stages itself
    assert not is_disaggregated(staged, {"text_input": "x", "sampling_parameters": "{not json"})  # the replica names it
    assert not is_disaggregated(_router({"a": "mixed", "b": "mixed"}), {"text_input": "x"})


def test_with_sampling_keeps_the_clients_values_and_adds_ours():
    body = {"text_input": "x", "sampling_parameters": '{"temperature": 0, "max_tokens": 9}'}
    staged = with_sampling(body, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    assert json.loads(staged["sampling_parameters"]) == {"temperature": 0, "max_tokens": 1,
                                                         "kv_transfer_params": {"do_remote_decode": True}}
    assert json.loads(body["sampling_parameters"])["max_tokens"] == 9  # the original is untouched
    assert json.loads(with_sampling({"text_input": "x"}, seed=3)["sampling_parameters"]) == {"seed": 3}


def test_the_first_stage_body_drops_what_would_override_its_values():
    """Top-level inputs and the same keys in ``parameters`` (the vLLM backend README's
    shape) go, so the stage's ``sampling_parameters`` rule: a replica refuses one key given
    two ways with different values."""
    from pagoda.fleet.api.http_stages import _first_body

    body = {"text_input": "x", "max_tokens": 9, "stream": True, "min_length": 3,
            "parameters": {"max_tokens": 9, "temperature": 0, "stream": True}}
    late = _first_body(body, {"min_tokens": 3}, early=False)
    assert {k: v for k, v in late.items() if k != "sampling_parameters"} == \
        {"text_input": "x", "parameters": {"temperature": 0}}
    assert json.loads(late["sampling_parameters"]) == {"max_tokens": 1, "min_tokens": 0,
                                                       "kv_transfer_params": {"do_remote_decode": True}}
    early = _first_body(body, {"min_tokens": 3}, early=True)
    assert early["stream"] is True and json.loads(early["sampling_parameters"])["min_tokens"] == 2
    assert body["parameters"]["max_tokens"] == 9  # the client's body is untouched
