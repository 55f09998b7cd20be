"""Disaggregated prefill/decode driven by the client through two serving loops
(``serving.kv_transfer_control``, vLLM's ``kv_transfer_params``): real engines, real TCP
connectors on loopback (TCP, and NIXL where the ``nixl`` package runs), the serving loop's
own threads.

The prefill replica answers ``do_remote_decode`` with a KV handle; the decode replica
pulls the prompt's blocks named by it before admitting the request. Outputs equal a
single replica's (greedy and seeded), the decode side's prefix-cache hits equal the pulled
blocks, a second request pulls nothing, a dead prefill replica costs only speed, and no
block leaks anywhere.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time

import pytest

from pagoda import SamplingParams
from pagoda.engine.config import EngineConfig
from pagoda.engine.kv_transfer.nixl_memory import nixl_unavailable_reason
from pagoda.engine.kv_transfer.registry import make_kv_connector
from pagoda.engine.llm_engine import LLMEngine
from pagoda.serving.commands import ServingRequest
from pagoda.serving.engine_loop import EngineLoop
from pagoda.contracts import json_input
from pagoda.contracts.request_options import check_kv_transfer_params
from pagoda.serving.response_sender import ResponseSender
from pagoda.contracts.request_options import RequestOptions
from pagoda.serving.wire import OutputOptions, WireRequest

from tests.engine.hf_reference import make_random_model

PROMPT = " ".join(f"tea leaf {i} steeped" for i in range(30))  # ~150 tokens: 9 full blocks of 16


class Replica:
    """One engine + its serving loop + a listening connector, and the responses it sent."""

    def __init__(self, model: str, listen: bool = True, backend: str = "tcp") -> None:
        self.engine = LLMEngine(EngineConfig(model=model))
        self.connector = make_kv_connector(backend, self.engine, listen="127.0.0.1:0") if listen else None
        self.responses: dict[str, list] = {}
        self.done = threading.Condition()
        self.sender = ResponseSender(self._deliver)
        self.loop = EngineLoop(self.engine, self.sender, idle_wait_s=0.05, kv_connector=self.connector)
        self.sender.start()
        self.loop.start()

    def _deliver(self, handle, response):
        with self.done:
            self.responses.setdefault(handle, []).append(response)
            self.done.notify_all()

    def run(self, rid: str, params: SamplingParams, kv=None, timeout: float = 60.0):
        wire = WireRequest(prompt=PROMPT, params=params, options=RequestOptions(kv_transfer_params=kv),
                           output=OutputOptions(exclude_input_in_output=True, return_num_cached_tokens=True))
        self.loop.submit(ServingRequest(rid, wire, handle=rid))
        deadline = time.monotonic() + timeout
        with self.done:
            while not any(r.is_final for r in self.responses.get(rid, [])):
                assert self.done.wait(deadline - time.monotonic()), f"no final response for {rid}"
        [final] = [r for r in self.responses[rid] if r.is_final]
        return final

    def stop(self):
        self.loop.stop()
        self.sender.stop()
        stats = self.engine.get_stats()
        assert stats.num_free_blocks == stats.num_blocks, "a KV block leaked"


def _text(response) -> str:
    value = response.tensors["text_output"][0]
    return value.decode() if isinstance(value, bytes) else str(value)


@pytest.fixture(scope="module")
def model(tmp_path_factory, smollm2_path):
    return str(make_random_model(tmp_path_factory.mktemp("kvx") / "llama", "llama-gqa3-hd64", smollm2_path))


NIXL_UNAVAILABLE = nixl_unavailable_reason()


@pytest.mark.parametrize("backend", ["tcp", pytest.param("nixl", marks=pytest.mark.skipif(
    NIXL_UNAVAILABLE is not None, reason=f"NIXL connector: {NIXL_UNAVAILABLE}"))])
@pytest.mark.parametrize("params", [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                                    SamplingParams(temperature=1.0, seed=11, max_tokens=8, ignore_eos=True)],
                         ids=["greedy", "seeded"])
def test_prefill_then_decode_equals_one_replica_and_hits_the_pulled_blocks(model, params, backend):
    prefill, decode = Replica(model, backend=backend), Replica(model, backend=backend)
    single = Replica(model, listen=False)
    try:
        expected = _text(single.run("one", params))
        first = prefill.run("p1", dataclasses.replace(params, max_tokens=1),
                            kv={"do_remote_decode": True})
        assert first.error is None
        handle = check_kv_transfer_params(json.loads(first.tensors["kv_transfer_params"][0].decode()))
        assert handle["do_remote_prefill"] and handle["remote_host"] == "127.0.0.1"
        blocks = handle["remote_block_count"]
        assert blocks >= 8
        answer = decode.run("d1", params, kv=handle)
        assert answer.error is None and _text(answer) == expected
        assert int(answer.tensors["num_cached_tokens"][0]) == blocks * 16  # every pulled block is a hit
        assert decode.loop._kv.num_pulled_blocks == blocks and decode.loop._kv.num_failed_pulls == 0
        if backend == "nixl":
            assert decode.connector.memory.num_bytes_read == blocks * decode.connector.block_io.block_bytes
        again = decode.run("d2", params, kv=handle)  # the prefix is here already: nothing moves
        assert _text(again) == expected and decode.loop._kv.num_pulled_blocks == blocks
    finally:
        for replica in (prefill, decode, single):
            replica.stop()


def test_a_dead_prefill_replica_costs_only_speed_and_bad_handles_are_refused(model):
    decode, bare = Replica(model), Replica(model, listen=False)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    try:
        expected = _text(bare.run("ref", params))
        gone = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 9}  # nobody listens
        answer = decode.run("orphan", params, kv=gone)
        assert answer.error is None and _text(answer) == expected
        assert int(answer.tensors["num_cached_tokens"][0]) == 0 and decode.loop._kv.num_failed_pulls == 1
        refused = bare.run("nokv", params, kv={"do_remote_decode": True})
        assert "--kv-transfer-listen" in refused.error
    finally:
        decode.stop()
        bare.stop()
    for bad, message in [({"do_remote_prefill": True}, "needs remote_host"),
                         ({"do_remote_decode": True, "do_remote_prefill": True, "remote_host": "h", "remote_port": 1},
                          "exclude each other"),
                         ({"remote_port": "80"}, "remote_port: must be an integer"),
                         ({"remote_engine": "x"}, "unknown key"),
                         ({"do_remote_prefill": True, "remote_host": "h", "remote_port": 70000}, "1-65535"),
                         ('{"do_remote_decode": NaN}', "NaN"), ([1], "JSON object")]:
        with pytest.raises(ValueError, match=message):
            check_kv_transfer_params(json_input.loads(bad, "kv_transfer_params") if isinstance(bad, str) else bad)


@pytest.mark.server
def test_two_tritonservers_prefill_then_decode_over_http(triton_server, tmp_path):
    """Through real tritonservers and Triton's HTTP generate door: the session server
    prefills (``do_remote_decode``, max_tokens 1) and answers the KV handle as its
    ``kv_transfer_params`` output; a second replica decodes with that handle, pulling the
    prompt's blocks, and answers what the session server answers alone."""
    from pagoda.serving.launch.launcher import TritonServer, find_free_port
    from pagoda.serving.launch.serve_options import ServeOptions

    from tests.serving.test_serving_triton_server import http_post

    prompt = "Disaggregated serving moves the prompt's KV cache from the prefill replica. " * 6
    greedy = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}
    path = "/v2/models/pagoda/generate"
    status, alone = http_post(triton_server, path, {"text_input": prompt, "sampling_parameters": json.dumps(greedy),
                                                    "exclude_input_in_output": True})
    assert status == 200, alone
    options = ServeOptions(http_port=find_free_port(), grpc_port=find_free_port(), metrics_port=find_free_port(),
                           max_model_len=1024, startup_timeout_s=600,
                           engine_args={"kv_transfer_listen": "127.0.0.1:0"})
    with TritonServer(options, log_path=str(tmp_path / "decode.log")) as decode:
        status, first = http_post(triton_server, path, {
            "text_input": prompt, "exclude_input_in_output": True,
            "sampling_parameters": json.dumps({**greedy, "max_tokens": 1,
                                               "kv_transfer_params": {"do_remote_decode": True}})})
        assert status == 200, first
        handle = json.loads(first["kv_transfer_params"])
        status, answer = http_post(decode, path, {
            "text_input": prompt, "exclude_input_in_output": True, "return_num_cached_tokens": True,
            "sampling_parameters": json.dumps({**greedy, "kv_transfer_params": handle})})
        assert status == 200, answer
        assert answer["text_output"] == alone["text_output"]
        assert answer["num_cached_tokens"] == handle["remote_block_count"] * 16 > 0
        status, refused = http_post(decode, path, {"text_input": prompt, "sampling_parameters": json.dumps(
            {**greedy, "kv_transfer_params": {"do_remote_prefill": True}})})
        assert status == 400 and "remote_host" in refused["error"]
