"""Disaggregated prefill/decode through the router with real processes (issue 30, items 2 and 4).

Two real tritonserver replicas (``test_router_e2e``'s module fixture, started again for
this module: r0 the prefill replica, r1 the decode replica, both with a TCP KV connector)
and the router in this process; every door a client has: the tritonclient gRPC stream,
the ``openai`` SDK, Triton's HTTP ``generate``/``generate_stream``. The references are one
replica's own answers to the same requests.

Faults (item 4), last because they kill r0:
- r0 killed with SIGKILL after its prefill stages answered and before the decode side
  pulled (the kill point is made deterministic by holding the three doors' requests at the
  router between their two stages until all three have their KV handles): every door's
  client gets the full answer, with no error; r1 computed the prompts itself (0 cached).
- r0 back without a KV connector: its prefill stages answer an error (400 naming
  ``--kv-transfer-listen``); the router falls back to whole requests on r1, every door.
- after each, every replica alive reports all its KV blocks free and nothing running, and
  the router holds no in-flight request on any replica.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import signal
import threading
import time
import urllib.request

import pytest

from tests.fleet.test_router_e2e import (MODEL_NAME, _make_router, _replicas_spec, _start_replica, _wait,  # noqa: F401
                                         grpc_generate, otlp_receiver, read_metric, replicas)
from tests.serving.test_serving_triton_server import http_post

pytestmark = [pytest.mark.server, pytest.mark.redis]

ROLES = {"r0": "prefill", "r1": "decode"}
DOORS = ("grpc", "openai", "http")


def _disaggregated_spec(servers) -> str:
    return ";".join(f"{entry},role={ROLES[rid]}" for rid, entry in zip(servers, _replicas_spec(servers).split(";")))


def _prompt(door: str, what: str) -> str:
    return f"{what}: the {door} door's request is computed on one replica and decoded on another. " * 5


def _ask(router, door: str, prompt: str, max_tokens: int = 8) -> tuple[str, int]:
    """One greedy request on ``door``; (its text, the prompt tokens the answering replica had
    cached). Raises on any client-visible error."""
    if door == "grpc":
        texts, errors = grpc_generate(router.grpc_url, [prompt], max_tokens=max_tokens)
        assert not errors, errors
        return texts["0"], -1  # tritonclient's stream: the text only
    if door == "openai":
        import openai

        client = openai.OpenAI(base_url=f"http://{router.http_url}/v1", api_key="unused", max_retries=0)
        completion = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0)
        return completion.choices[0].text, completion.usage.prompt_tokens_details.cached_tokens
    status, answer = http_post(router, "/v2/models/pagoda/generate", {
        "text_input": prompt, "max_tokens": max_tokens, "exclude_input_in_output": True,
        "return_num_cached_tokens": True, "sampling_parameters": json.dumps({"temperature": 0})})
    assert status == 200, answer
    return answer["text_output"], answer["num_cached_tokens"]


def _ask_every_door(router, prompts: dict[str, str]) -> dict[str, tuple[str, int]]:
    """The three doors' requests at once (each from its own client thread)."""
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        futures = {door: pool.submit(_ask, router, door, prompt) for door, prompt in prompts.items()}
        return {door: future.result(timeout=300) for door, future in futures.items()}


def _references(server, prompts: dict[str, str]) -> dict[str, str]:
    texts, errors = grpc_generate(server.grpc_url, list(prompts.values()), max_tokens=8)
    assert not errors, errors
    return {door: texts[str(i)] for i, door in enumerate(prompts)}


def _assert_nothing_held(router, servers) -> None:
    """Every live replica: all KV blocks free (cached blocks count as free), nothing running
    or waiting; the router: no request in flight anywhere."""
    def settled(server) -> bool:
        return (read_metric(server, "pagoda:kv_cache_num_free_blocks") == read_metric(server, "pagoda:kv_cache_num_blocks")
                and read_metric(server, "vllm:num_requests_running") == 0
                and read_metric(server, "vllm:num_requests_waiting") == 0)

    for rid, server in servers.items():
        _wait(lambda: settled(server), f"{rid} reports every KV block free and no request", 30)
        assert read_metric(server, "pagoda:kv_cache_num_blocks") > 0
    in_flight = router.run(lambda: {r.replica_id: r.in_flight for r in router.service.router.replicas.all()})
    assert set(in_flight.values()) == {0}, in_flight


class _HoldBetweenStages:
    """Holds each request at the router between its two stages (after the prefill stage gave
    its KV handle, before the decode stage is sent) until ``count`` requests are there, then
    runs ``action`` once (on the router's loop, in a thread) and lets them all go on.

    Installed over the router's own stage functions (``GrpcUpstream._prefill`` for the gRPC
    and OpenAI doors, ``http_stages.prefill_handle`` for the HTTP door); it changes no
    result, only when the second stages start."""

    def __init__(self, count: int, action) -> None:
        self.count, self.action = count, action
        self.num_held = 0
        self.released: asyncio.Event | None = None

    def wrap(self, stage):
        async def held(*args, **kwargs):
            result = await stage(*args, **kwargs)
            if self.released is None:
                self.released = asyncio.Event()
            self.num_held += result is not None
            if self.num_held == self.count:
                await asyncio.to_thread(self.action)
                self.released.set()
            await asyncio.wait_for(self.released.wait(), 120)
            return result
        return held


def test_prefill_replica_killed_before_the_pull_costs_the_client_nothing(replicas, redis_server, smollm2_path,
                                                                          monkeypatch):
    from pagoda.fleet.api import http_stages

    prompts = {door: _prompt(door, "Killed prefill") for door in DOORS}
    references = _references(replicas["r0"], prompts)  # r0's own answers; r1 never sees these prompts alone
    victim = replicas["r0"]

    def kill_r0() -> None:
        os.killpg(victim.process.pid, signal.SIGKILL)
        victim.process.wait(30)

    with _make_router(replicas, redis_server, smollm2_path, replicas=_disaggregated_spec(replicas)) as router:
        hold = _HoldBetweenStages(len(DOORS), kill_r0)
        upstream = router.service.upstream
        monkeypatch.setattr(upstream, "_prefill", hold.wrap(upstream._prefill))
        monkeypatch.setattr(http_stages, "prefill_handle", hold.wrap(http_stages.prefill_handle))
        answers = _ask_every_door(router, prompts)
        assert hold.num_held == len(DOORS), "every door's prefill stage gave a KV handle before the kill"
        assert victim.process.poll() is not None
        for door in DOORS:
            text, cached = answers[door]
            assert text == references[door], door
            assert cached in (-1, 0), f"{door}: r1 could not pull from the dead r0, so it computed the prompt"
        assert router.run(lambda: router.service.router.num_two_stage) == len(DOORS)
        _assert_nothing_held(router, {"r1": replicas["r1"]})


def test_prefill_stage_answering_an_error_falls_back_to_the_decode_replica(replicas, redis_server, smollm2_path,
                                                                            otlp_receiver):
    """r0 restarted without a KV connector (a misconfigured prefill replica): every prefill
    stage it gets is refused (400 naming --kv-transfer-listen), and each door's request runs
    whole on r1 with the same answer."""
    victim = replicas["r0"]
    victim.stop()  # reaps the killed process (if the test above ran) or stops it
    _, env = _start_replica("r0", redis_server.url, otlp_receiver.endpoint, victim.log_path)
    victim.options.engine_args = {k: v for k, v in victim.options.engine_args.items() if k != "kv_transfer_listen"}
    saved = dict(os.environ)
    os.environ.update(env)
    starter = threading.Thread(target=victim.start, daemon=True)
    try:
        starter.start()
        while victim.process is None and starter.is_alive():
            time.sleep(0.01)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    starter.join(600)
    status, answer = http_post(victim, "/v2/models/pagoda/generate", {
        "text_input": "hello", "sampling_parameters": json.dumps({"kv_transfer_params": {"do_remote_decode": True}})})
    assert status == 400 and "--kv-transfer-listen" in answer["error"], answer

    prompts = {door: _prompt(door, "Refused prefill") for door in DOORS}
    references = _references(victim, prompts)
    with _make_router(replicas, redis_server, smollm2_path, replicas=_disaggregated_spec(replicas)) as router:
        core = router.service.router
        _wait(lambda: router.run(lambda: all(r.healthy for r in core.replicas.all())), "both replicas healthy")
        routed = router.run(lambda: core.replicas.get("r0").num_routed)
        for door in DOORS:
            text, _ = _ask(router, door, prompts[door])
            assert text == references[door], door
        assert router.run(lambda: core.replicas.get("r0").num_routed) == routed + len(DOORS), \
            "each door's prefill stage went to r0 (and was refused)"
        assert router.run(lambda: core.num_two_stage) == 0
        _assert_nothing_held(router, replicas)
