"""KV file tiers served (issue 46): two replicas behind the router sharing a directory, and a
SIGKILLed replica's warm restart from its disk tier.

A tiny random Llama (2 layers, hidden 64; seeded dummy weights, SmolLM2's tokenizer) keeps
each tritonserver start short. Blocks reach the files when the device evicts them into the CPU
tier (write-through on entering it), so each replica has an 8-block device pool: after a 64-token
prompt ``A``, two other prompts evict A's four full blocks, which are then written to the files;
the shared-tier test instead runs ``kv_write_through`` (blocks written as their request ends).
Outputs are compared as text of greedy, ``ignore_eos`` continuations. A hit leaves the prompt's
last token to compute, so A's hit is its first 3 blocks (``HIT_TOKENS``).
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal

import pytest

from pagoda.serving.launch.launcher import TritonServer, find_free_port

from pagoda.serving.launch.serve_options import ServeOptions

from tests.fleet.test_router_e2e import _make_router, _wait, decisions, grpc_generate, read_metric

pytestmark = [pytest.mark.server, pytest.mark.redis]

MODEL_NAME = "kv-tiers"
PROMPT_A = " ".join(["apple", "orange", "pear", "plum"] * 16)  # 64 tokens: 4 full blocks of 16
EVICTORS = [" ".join(words * 16) for words in (["red", "green", "blue", "black"], ["one", "two", "three", "four"])]
HIT_TOKENS = 48  # (64 - 1) // 16 full blocks
TINY = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=49152, hidden_size=64,
            intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            hidden_act="silu", rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=512,
            tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2, torch_dtype="float32")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, smollm2_path):
    """A tiny random Llama with SmolLM2's tokenizer (weights: ``load_format=dummy``, seed 0)."""
    path = tmp_path_factory.mktemp("models") / "tiny-llama"
    path.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(os.path.join(smollm2_path, name), path / name)
    (path / "config.json").write_text(json.dumps(TINY))
    return str(path)


def options(model: str, tmp_path, replica_id: str, redis_url=None, **tiers) -> ServeOptions:
    engine_args = {"load_format": "dummy", "num_gpu_blocks_override": "8", "cpu_offload_bytes": str(4 << 20),
                   **{k: str(v) for k, v in tiers.items()}}
    return ServeOptions(model=model, http_port=find_free_port(), grpc_port=find_free_port(),
                        metrics_port=find_free_port(), block_size=16, max_model_len=96, max_num_seqs=4,
                        startup_timeout_s=300, redis_url=redis_url, replica_id=replica_id, fleet_model=MODEL_NAME,
                        engine_args=engine_args)


def generate(server_or_url, prompt: str) -> str:
    url = server_or_url if isinstance(server_or_url, str) else f"127.0.0.1:{server_or_url.options.grpc_port}"
    texts, errors = grpc_generate(url, [prompt], max_tokens=4, ignore_eos=True)
    assert not errors, [str(e) for e in errors]
    return texts["0"]


def serve_and_write(server: TritonServer, directory: str, evict: bool = True, num_files: int = 4) -> str:
    """Serve A, then (``evict``) the evictors (A's blocks leave the device into the CPU tier and are
    written; without, ``kv_write_through`` writes them as A ends); wait until ``directory`` holds
    at least ``num_files`` block files. Returns A's text."""
    text = generate(server, PROMPT_A)
    for prompt in EVICTORS if evict else ():
        generate(server, prompt)
    _wait(lambda: len(glob.glob(os.path.join(directory, "*", "*.kvb"))) >= num_files,
          f"{num_files} block files in {directory}", timeout_s=30)
    return text


def start(opts: ServeOptions, log_path) -> TritonServer:
    return TritonServer(opts, log_path=str(log_path)).start()


def test_second_replica_serves_the_first_ones_prefix_from_the_shared_tier(tiny_model, tmp_path, redis_server):
    """r1 serves A, and with ``kv_write_through`` A's blocks land on the shared tier as A ends
    (still cached on r1's device); the index credits them to every replica mounting it. r1 drains
    (a rolling upgrade); the router sends A to r2, which loads A's prefix from the shared tier
    (counted) and answers exactly as r1 did."""
    from pagoda.fleet.index.registry import ReplicaRegistry

    shared = str(tmp_path / "shared")
    servers = {rid: start(options(tiny_model, tmp_path, rid, redis_server.url, kv_shared_dir=shared,
                                  kv_write_through="true"),
                          tmp_path / f"{rid}.log") for rid in ("r1", "r2")}
    try:
        reference = serve_and_write(servers["r1"], shared, evict=False)  # write-through: A is still on r1's device
        registry = ReplicaRegistry(redis_server.client(), MODEL_NAME)
        tiers = {info.replica_id: info.extra.get("shared_tier") for info in registry.list_replicas()}
        assert tiers["r1"] and tiers["r1"] == tiers["r2"], tiers  # one volume, one fingerprint: one tier
        with _make_router(servers, redis_server, tiny_model, model_name=MODEL_NAME) as router:
            _wait(lambda: router.run(lambda: router.service.router.fleet.available), "router sees Redis")

            async def a_on_the_tier():
                service_router = router.service.router
                hashes = service_router.analyze(PROMPT_A).block_hashes
                return await service_router.fleet.match(hashes)
            _wait(lambda: f"~shared-{tiers['r1']}" in (router.call(a_on_the_tier()) or {}), "A indexed on the tier")
            registry.set_draining("r1", True)
            _wait(lambda: router.run(lambda: router.service.router.replicas.get("r1").draining), "r1 drained")
            before = read_metric(servers["r2"], "pagoda:prefix_cache_hits_shared_total")
            assert generate(router.grpc_url, PROMPT_A) == reference
            [decision] = decisions(router)
        assert decision["pagoda.replica_id"] == "r2" and decision["pagoda.match_kind"] == "shared"
        assert decision["pagoda.shared_blocks"] == 4
        assert read_metric(servers["r2"], "pagoda:prefix_cache_hits_shared_total") - before == HIT_TOKENS
    finally:
        for server in servers.values():
            server.stop(grace_s=0)


def test_sigkilled_replica_restarts_warm_from_its_disk_tier(tiny_model, tmp_path):
    """A replica with a disk tier serves A (its blocks reach the disk), is SIGKILLed with its whole
    process tree, and is started again on the same directory: A is a disk hit, same text."""
    disk = str(tmp_path / "disk")
    tiers = dict(kv_disk_dir=disk, kv_disk_bytes=16 << 20)
    server = start(options(tiny_model, tmp_path, "r1", **tiers), tmp_path / "first.log")
    try:
        reference = serve_and_write(server, disk)
    finally:
        os.killpg(server.process.pid, signal.SIGKILL)  # no drain, no finalize: queued writes are lost
        server.process.wait(30)
        server.stop(grace_s=0)
    restarted = start(options(tiny_model, tmp_path, "r1", **tiers), tmp_path / "second.log")
    try:
        assert read_metric(restarted, "pagoda:prefix_cache_hits_disk_total") == 0
        assert generate(restarted, PROMPT_A) == reference
        assert read_metric(restarted, "pagoda:prefix_cache_hits_disk_total") == HIT_TOKENS
        assert read_metric(restarted, "pagoda:kv_block_files_rejected_total") == 0
    finally:
        restarted.stop(grace_s=0)
