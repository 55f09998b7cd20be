"""The replica-side publisher against a real Redis: batching, heartbeats and their TTL,
Redis outages (non-blocking, bounded, resync), and the real scheduler's events end to end."""

import time

import pytest

from pagoda.contracts.block_hash import hash_prompt_blocks
from pagoda.contracts.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from pagoda.engine.request import Request
from pagoda.engine.sampling_params import SamplingParams
from pagoda.engine.runner.runner_output import ModelRunnerOutput
from pagoda.engine.core.sched.scheduler import Scheduler, SchedulerConfig
from pagoda.contracts import redis_keys as keys
from pagoda.fleet.index.mirror import IndexFollower
from pagoda.fleet.index.prefix_index import PrefixIndex
from pagoda.fleet.index.publisher import Publisher, publisher_from_env
from pagoda.fleet.index.registry import ReplicaRegistry

from .conftest import count_round_trips

pytestmark = pytest.mark.redis
MODEL = "chat"
ENDPOINTS = {"grpc": "10.0.0.1:8001", "http": "10.0.0.1:8000", "metrics": "10.0.0.1:8002"}


class Clock:
    def __init__(self, now=1000.0):
        self.now = now

    def __call__(self):
        return self.now


class Stats:
    num_waiting, num_running, kv_cache_usage = 3, 2, 0.25
    num_blocks, prefix_cache_queries, prefix_cache_hits = 100, 40, 10
    ttft_p90, recent_ttfts = 0.8, (0.1, 0.8, 0.2)


def chain(n, salt=0):
    return [h.hex() for h in hash_prompt_blocks([salt * 1000 + i for i in range(4 * n)], 4, "m")]


def wrap(events, first_seq=0):
    return [KVEvent(first_seq + i, 0.0, e) for i, e in enumerate(events)]


def make_publisher(client, clock=None, **kwargs):
    return Publisher("unused", MODEL, "r1", ENDPOINTS, heartbeat_interval_s=1.0, ttl_s=5.0,
                     clock=clock or Clock(), redis_client=client, block_size=4, **kwargs)


def test_batches_events_and_heartbeat_in_one_round_trip(redis_client):
    clock = Clock()
    pub = make_publisher(count_round_trips(redis_client), clock)
    assert pub.flush()  # start: resync (empty) + heartbeat
    redis_client.round_trips = 0
    hashes = chain(6)
    pub.submit_events(wrap([BlockStored(hashes[:3], None, list(range(12)), 4)]))
    pub.submit_events(wrap([BlockStored(hashes[3:], hashes[2], list(range(12, 24)), 4),
                            BlockRemoved(hashes[5:])], first_seq=1))
    pub.submit_stats(Stats())
    assert pub.flush() and redis_client.round_trips == 1  # 3 events, not yet a heartbeat
    assert not pub.flush() and redis_client.round_trips == 1  # nothing due: no traffic
    clock.now += 1.0
    assert pub.flush() and redis_client.round_trips == 2  # heartbeat due
    assert PrefixIndex(redis_client, MODEL).match(hashes) == {"r1": 5}
    entries = PrefixIndex(redis_client, MODEL).read_events()
    assert [(e["first_seq"], e["last_seq"]) for _, e in entries] == [(0, 0), (1, 3)]
    assert entries[0][1]["events"] == [{"seq": 0, "type": "AllBlocksCleared"}]
    [info] = ReplicaRegistry(redis_client, MODEL).list_replicas()
    assert (info.replica_id, info.endpoints, info.waiting, info.running) == ("r1", ENDPOINTS, 3, 2)
    assert (info.kv_usage, info.prefix_hit_rate, info.num_blocks, info.block_size) == (0.25, 0.25, 100, 4)
    assert info.ts == 1001.0 and info.hash_model_id == MODEL and not info.draining
    heartbeat = redis_client.hgetall(keys.heartbeat_key(MODEL, "r1"))
    assert info.ttft_p90 == 0.8 and keys.decode_ttft_buckets(heartbeat[b"ttft_buckets"].decode())[0.25] == 2
    ttl_ms = redis_client.pttl(keys.heartbeat_key(MODEL, "r1"))
    assert 4000 < ttl_ms <= 5000


def test_dead_replica_disappears_when_its_heartbeat_expires(redis_client):
    pub = Publisher("unused", MODEL, "r1", ENDPOINTS, heartbeat_interval_s=0.05, ttl_s=0.15,
                    clock=Clock(), redis_client=redis_client)
    pub.submit_events(wrap([BlockStored(chain(2), None, [0] * 8, 4)]))
    pub.flush()
    registry = ReplicaRegistry(redis_client, MODEL)
    assert [r.replica_id for r in registry.list_replicas()] == ["r1"]
    assert registry.reap_expired() == []
    time.sleep(0.2)  # the replica "dies": no more heartbeats; Redis's own clock expires it
    assert registry.list_replicas() == []
    assert registry.reap_expired() == ["r1"]
    assert PrefixIndex(redis_client, MODEL).match(chain(2)) == {}
    assert not redis_client.sismember(keys.registry_key(MODEL), "r1")


def test_redis_down_never_blocks_and_resyncs_when_back(redis_server, redis_client):
    pub = make_publisher(redis_server.client(), max_pending_events=10)
    pub.flush()
    hashes = chain(40)
    pub.submit_events(wrap([BlockStored(hashes[:2], None, [0] * 8, 4)]))
    assert pub.flush()
    redis_server.stop()
    start = time.perf_counter()
    for i in range(2, 40):  # 38 events while Redis is down: more than max_pending_events
        pub.submit_events(wrap([BlockStored([hashes[i]], hashes[i - 1], [0] * 4, 4)], first_seq=i - 1))
    pub.submit_events(wrap([BlockRemoved(hashes[30:])], first_seq=39))
    assert time.perf_counter() - start < 0.05  # submitting never touches the network
    assert not pub.flush() and not pub.is_connected
    assert pub.num_failed_flushes == 1 and pub.num_blocks_held == 30
    assert pub.num_dropped_events > 0  # pending events overflowed and were dropped, counted
    redis_server.start()  # an empty Redis: everything published before is gone
    client = redis_server.client()
    follower = IndexFollower(client, MODEL)
    follower.sync()
    assert pub.flush() and pub.is_connected and pub.num_resyncs == 2
    assert PrefixIndex(client, MODEL).match(hashes) == {"r1": 30}
    [(_, entry)] = PrefixIndex(client, MODEL).read_events()
    assert entry["events"][0]["type"] == "AllBlocksCleared" and len(entry["events"]) == 31
    follower.poll()
    assert follower.match(hashes) == {"r1": 30}


def test_redis_outage_backs_off_and_costs_one_resync(redis_server, redis_client):
    """15 s of (simulated) outage with the engine still producing events: a few PINGs
    spaced by exponential backoff, no resync built while Redis is away, exactly one resync
    when it returns, and seqs that grow by the work done, not by the attempts."""
    clock = Clock()
    pub = make_publisher(redis_server.client(), clock=clock, retry_initial_s=0.1, retry_max_s=5.0)
    hashes = chain(60)
    pub.submit_events(wrap([BlockStored(hashes[:20], None, [0] * 80, 4)]))
    assert pub.run_once() == pub.flush_interval_s and pub.num_resyncs == 1
    seq_before = pub._next_seq
    redis_server.stop()
    outage, attempts = 0.0, 0
    while outage < 15.0:
        i = 20 + attempts
        pub.submit_events(wrap([BlockStored([hashes[i]], hashes[i - 1], [0] * 4, 4)], first_seq=i - 19))
        delay = pub.run_once()
        clock.now += delay
        outage += delay
        attempts += 1
    assert 6 <= attempts <= 16, attempts  # every 20 ms it would have been 750
    assert pub.num_failed_flushes == attempts and pub.num_probes == attempts - 1
    assert pub.num_resyncs == 1 and pub._next_seq == seq_before + 1  # only the batch that failed
    redis_server.start()  # restarted empty
    assert pub.run_once() == pub.flush_interval_s and pub.is_connected
    assert pub.num_resyncs == 2 and pub._next_seq == seq_before + 1 + 1 + 20 + attempts
    assert PrefixIndex(redis_server.client(), MODEL).match(hashes) == {"r1": 20 + attempts}
    assert pub.run_once() == pub.flush_interval_s and pub.num_resyncs == 2  # one resync, not more


def test_resync_after_failure_supersedes_a_batch_that_may_have_landed(redis_client):
    """A flush that fails after Redis applied it must not leave a follower skipping the
    resync batch as a duplicate: failed batches still consume their seqs."""
    pub = make_publisher(redis_client)
    pub.flush()
    follower = IndexFollower(redis_client, MODEL)
    follower.sync()
    hashes = chain(4)
    pub.submit_events(wrap([BlockStored(hashes, None, [0] * 16, 4)]))
    real_pipeline = redis_client.pipeline

    def landed_then_lost(*args, **kwargs):  # Redis applies the batch, the reply is lost
        pipe = real_pipeline(*args, **kwargs)
        execute = pipe.execute

        def fail():
            execute()
            raise ConnectionError("reply lost")
        pipe.execute = fail
        return pipe

    redis_client.pipeline = landed_then_lost
    assert not pub.flush()
    redis_client.pipeline = real_pipeline
    pub.submit_events(wrap([BlockRemoved(hashes[2:])], first_seq=1))
    assert pub.flush()
    follower.poll()
    assert follower.match(hashes) == PrefixIndex(redis_client, MODEL).match(hashes) == {"r1": 2}


def test_engine_seq_gap_triggers_resync(redis_client):
    pub = make_publisher(redis_client)
    pub.flush()
    hashes = chain(3)
    pub.submit_events(wrap([BlockStored(hashes[:1], None, [0] * 4, 4)]))
    pub.submit_events(wrap([BlockStored(hashes[1:], hashes[0], [0] * 8, 4)], first_seq=5))  # 1..4 lost
    assert pub.num_engine_gaps == 1
    pub.flush()
    [*_, (_, last)] = PrefixIndex(redis_client, MODEL).read_events()
    assert [e["type"] for e in last["events"]] == ["AllBlocksCleared"] + ["BlockStored"] * 3
    assert last["events"][2]["parent_block_hash"] == hashes[0]


def test_thread_publishes_and_deregisters_on_stop(redis_client):
    pub = Publisher("unused", MODEL, "r1", ENDPOINTS, redis_client=redis_client, flush_interval_s=0.005)
    pub.start()
    try:
        pub.submit_events(wrap([BlockStored(chain(2), None, [0] * 8, 4)]))
        deadline = time.monotonic() + 5
        while PrefixIndex(redis_client, MODEL).match(chain(2)) != {"r1": 2}:
            assert time.monotonic() < deadline
            time.sleep(0.005)
    finally:
        pub.stop()
    assert ReplicaRegistry(redis_client, MODEL).list_replicas() == []
    assert PrefixIndex(redis_client, MODEL).match(chain(2)) == {}


def test_real_scheduler_events_make_the_index_equal_its_block_pool(redis_client):
    """The engine's own hashes flow through; a router hashing the prompt with the shared
    function finds exactly the blocks the replica cached."""
    sched = Scheduler(SchedulerConfig(num_blocks=24, max_model_len=128, block_size=4, model_id="SmolLM2"))
    pub = make_publisher(redis_client)
    prompts = [[7] * 20 + [i] * 9 for i in range(5)]  # a shared 20-token prefix, then distinct
    for i, prompt in enumerate(prompts):
        sched.add_request(Request(f"q{i}", prompt, SamplingParams(max_tokens=6, ignore_eos=True)))
    while sched.has_unfinished_requests():
        out = sched.schedule()
        sampled = {s.request.request_id: [3] for s in out.scheduled if s.is_sampling}
        sched.update_from_output(ModelRunnerOutput.from_tokens(out.step_id, sampled))
        pub.submit_events(sched.take_events())
    pub.flush()
    held = {h.hex() for h in sched.block_pool.cached_block_hash_to_block}
    assert {h.decode() for h in redis_client.smembers(keys.replica_blocks_key(MODEL, "r1"))} == held
    index = PrefixIndex(redis_client, MODEL)
    for prompt in prompts:
        router_hashes = [h.hex() for h in hash_prompt_blocks(prompt, 4, "SmolLM2")]
        expected = 0
        while expected < len(router_hashes) and router_hashes[expected] in held:
            expected += 1
        assert index.match(router_hashes).get("r1", 0) == expected
    assert index.match([h.hex() for h in hash_prompt_blocks(prompts[0], 4, "SmolLM2")])["r1"] >= 5


def test_publisher_from_env():
    class Engine:
        model_id = "SmolLM2-135M-Instruct"

        class config:
            block_size = 16

    assert publisher_from_env(Engine(), {}) is None
    pub = publisher_from_env(Engine(), {"PAGODA_REDIS_URL": "redis://127.0.0.1:1/0", "PAGODA_REPLICA_ID": "pod-7",
                                        "PAGODA_MODEL_NAME": "chat", "PAGODA_POD_IP": "10.1.2.3",
                                        "PAGODA_GRPC_PORT": "9001"})
    assert (pub.model_id, pub.replica_id, pub.hash_model_id, pub.block_size) == \
        ("chat", "pod-7", "SmolLM2-135M-Instruct", 16)
    assert pub.endpoints == {"grpc": "10.1.2.3:9001", "http": "10.1.2.3:8000", "metrics": "10.1.2.3:8002"}
    assert "shared_tier" not in pub.heartbeat_fields(pub._stats, 0.0)

    class SharedTierEngine(Engine):  # an idle replica's first heartbeat already names its shared tier
        def get_stats(self):
            return type("Stats", (), {"kv_shared_tier_id": "0123abcd"})()

    pub = publisher_from_env(SharedTierEngine(), {"PAGODA_REDIS_URL": "redis://127.0.0.1:1/0"})
    assert pub.heartbeat_fields(pub._stats, 0.0)["shared_tier"] == "0123abcd"
    with pytest.raises(ValueError):
        Publisher("redis://x", "m", "a:b", {}, redis_client=object())
    with pytest.raises(ValueError, match="ttl_s"):
        Publisher("redis://x", "m", "a", {}, heartbeat_interval_s=2, ttl_s=1, redis_client=object())


def test_index_lost_to_flushall_is_rebuilt_within_one_heartbeat(redis_client):
    """Redis flushed (or restarted empty) while it answers all along: no write fails, so only
    the heartbeat's check of the replica's seq key reveals it; the next flush resyncs."""
    clock = Clock()
    pub = make_publisher(redis_client, clock)
    assert pub.flush()  # start: resync + heartbeat
    hashes = chain(3)
    pub.submit_events(wrap([BlockStored(hashes, None, list(range(12)), 4)]))
    assert pub.flush()
    index = PrefixIndex(redis_client, MODEL)
    assert index.match(hashes) == {"r1": 3}
    redis_client.flushall()
    resyncs = pub.num_resyncs
    assert not pub.flush()  # nothing due yet
    clock.now += 1.0
    assert pub.flush() and pub.num_resyncs == resyncs  # the heartbeat notices the loss ...
    assert pub.flush() and pub.num_resyncs == resyncs + 1  # ... and the next flush resyncs
    assert index.match(hashes) == {"r1": 3}
    assert [info.replica_id for info in ReplicaRegistry(redis_client, MODEL).list_replicas()] == ["r1"]
    clock.now += 1.0
    assert pub.flush() and pub.num_resyncs == resyncs + 1  # state present: no further resync


def test_only_the_first_kv_cache_group_reaches_the_index(redis_client):
    """A hybrid model caches the same hashes once per KV cache group (engine.kv.layout); the
    index keys group 0's, so another group's stores and removals never touch it."""
    pub = make_publisher(redis_client)
    hashes = chain(2)
    pub.submit_events(wrap([BlockStored(hashes, None, list(range(8)), 4),
                            BlockStored(hashes, None, list(range(8)), 4, group_idx=1,
                                        kv_cache_spec_kind="sliding_window", sliding_window=8),
                            BlockRemoved(hashes, group_idx=1)]))
    assert pub.num_blocks_held == 2 and pub.num_engine_gaps == 0
    assert pub.flush() and PrefixIndex(redis_client, MODEL).match(hashes) == {"r1": 2}


def test_file_tier_blocks_never_reach_the_index(redis_client):
    """A block written to the disk or shared tier is not a device hit: the index keys the device tier."""
    pub = make_publisher(redis_client)
    hashes = chain(2)
    pub.submit_events(wrap([BlockStored(hashes, None, list(range(8)), 4, medium="DISK"),
                            BlockStored(hashes[:1], None, list(range(4)), 4, medium="SHARED"),
                            BlockRemoved(hashes, medium="DISK")]))
    assert pub.num_blocks_held == 0 and pub.num_engine_gaps == 0
    assert pub.flush() and PrefixIndex(redis_client, MODEL).match(hashes) == {}
