"""Peer prefix pull (``fleet.routing.peer_pull``): the router's pull-or-recompute decision,
the holder it names, where connector addresses come from, and the handle on the wire."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

from tritonclient.grpc import service_pb2

from pagoda.fleet.api.upstream import GrpcUpstream
from pagoda.fleet.routing.peer_pull import PeerPull
from pagoda.fleet.routing.replicas import ReplicaSet, parse_replicas_spec
from pagoda.fleet.routing.cost_model import StepTimeModel, TransferModel

from tests.fleet.test_router_unit import FakeFleet, make_router


def test_pull_only_when_moving_the_blocks_beats_computing_them():
    # 1 ms per prefill token; 1 MB blocks at 100 MB/s (10 ms each): pulling 16-token blocks wins.
    pull = PeerPull(StepTimeModel(a=0.0, b=0.001, c=0.0), TransferModel(10**6, 100.0, 0.05), min_blocks=2)
    assert not pull.worth_it(1, 16)  # under min_blocks
    assert pull.worth_it(16, 16)  # 0.05 + 0.16 s < 0.256 s
    assert not pull.worth_it(4, 16)  # 0.05 + 0.04 s > 0.064 s: the latency dominates
    slow = PeerPull(StepTimeModel(a=0.0, b=0.001, c=0.0), TransferModel(10**6, 10.0, 0.0), min_blocks=1)
    assert not slow.worth_it(64, 16)  # 0.1 s per block against 0.016 s of compute


def _replicas(kv_a="a:7000", kv_b="b:7000"):
    replicas = ReplicaSet("static")
    spec = f"id=a,grpc=a:1,http=a:2{',kv=' + kv_a if kv_a else ''};id=b,grpc=b:1,http=b:2"
    replicas.set_members(parse_replicas_spec(spec))
    beat = SimpleNamespace(replica_id="b", endpoints={"grpc": "b:1", "kv": kv_b} if kv_b else {"grpc": "b:1"},
                           waiting=0, running=0, kv_usage=0.0, draining=False, ts=1.0)
    replicas.apply_heartbeats([beat])
    return replicas


def test_connector_addresses_from_the_spec_and_from_heartbeats():
    replicas = _replicas()
    assert replicas.get("a").kv_address == "a:7000"  # --replicas kv=
    assert replicas.get("b").kv_address == "b:7000"  # the heartbeat's endpoints
    assert _replicas(kv_a=None, kv_b=None).get("b").kv_address is None


def test_the_handle_names_the_holder_and_its_blocks():
    replicas = _replicas()
    decision = SimpleNamespace(replica=replicas.get("a"), peer="b", peer_blocks=40, matched_blocks=2)
    assert PeerPull().params(decision, replicas, 16) == {
        "do_remote_prefill": True, "remote_host": "b", "remote_port": 7000, "remote_block_count": 40}
    assert PeerPull(enabled=False).params(decision, replicas, 16) is None
    assert PeerPull().params(SimpleNamespace(**{**vars(decision), "peer": None}), replicas, 16) is None
    no_connector = _replicas(kv_a=None)  # the chosen replica cannot pull
    assert PeerPull().params(SimpleNamespace(**{**vars(decision), "replica": no_connector.get("a")}),
                             no_connector, 16) is None
    replicas.get("b").healthy = False
    assert PeerPull().params(decision, replicas, 16) is None


def test_the_router_names_the_best_other_holder():
    async def scenario():
        fleet = FakeFleet()
        router = make_router(fleet, policy="round_robin")
        analysis = router.analyze("x" * 64)
        fleet.owners[analysis.block_hashes[0]] = {"a": 3, "b": 12}
        first, second = await router.choose(analysis), await router.choose(analysis)
        chose_a = first if first.replica.replica_id == "a" else second
        chose_b = second if chose_a is first else first
        assert (chose_a.peer, chose_a.peer_blocks, chose_a.matched_blocks) == ("b", 12, 3)
        assert chose_b.peer is None  # nobody holds more than b itself

    asyncio.run(scenario())


def test_a_retry_elsewhere_decides_again_and_a_clients_own_handle_is_kept():
    from pagoda.engine.sampling_params import SamplingParams
    from pagoda.fleet.api.routed_request import RoutedRequest
    from pagoda.serving.wire import WireRequest

    replicas = _replicas()
    upstream = GrpcUpstream(SimpleNamespace(replicas=replicas, block_size=16, num_peer_pulls=0), gate=None)
    request = RoutedRequest("r", WireRequest(prompt="x", params=SamplingParams(max_tokens=4)))
    pulls = SimpleNamespace(replica=replicas.get("a"), peer="b", peer_blocks=40, matched_blocks=0)
    pulled = upstream._with_peer_pull(request, pulls)
    assert pulled.options.kv_transfer_params["remote_port"] == 7000 and pulled.params.max_tokens == 4
    assert request.wire.options.kv_transfer_params is None  # each attempt decides on the request as sent
    assert upstream._with_peer_pull(request, SimpleNamespace(replica=replicas.get("b"), peer=None, peer_blocks=0,
                                                             matched_blocks=40)) is None
    assert upstream.router.num_peer_pulls == 1


def test_the_publisher_advertises_its_connector_on_its_host():
    from pagoda.fleet.index.publisher import Publisher

    publisher = Publisher.__new__(Publisher)
    publisher.endpoints = {"grpc": "10.1.2.3:8001", "http": "10.1.2.3:8000"}
    publisher.advertise_kv("0.0.0.0:41234")
    assert publisher.endpoints["kv"] == "10.1.2.3:41234"
    assert json.loads(json.dumps(publisher.endpoints))["kv"] == "10.1.2.3:41234"


def test_the_router_flag_sets_the_threshold_and_zero_turns_pulls_off():
    from pagoda.fleet.router_cli import make_parser, options_from_args

    args = make_parser().parse_args(["--replicas", "id=a,grpc=a:1,http=a:2", "--peer-pull-min-blocks", "0"])
    assert options_from_args(args).peer_pull_min_blocks == 0
    assert options_from_args(make_parser().parse_args(["--replicas", "grpc=a:1,http=a:2"])).peer_pull_min_blocks == 4
    assert not GrpcUpstream(None, None, 2, 0).peer_pull.enabled
    assert GrpcUpstream(None, None, 2, 8).peer_pull.min_blocks == 8


def test_a_malformed_kv_address_in_the_spec_is_refused_naming_it():
    import pytest

    with pytest.raises(ValueError, match="kv must be host:port"):
        parse_replicas_spec("id=a,grpc=a:1,http=a:2,kv=nowhere")
