"""The prefix index in a real Redis: longest-prefix match vs a brute-force model, round
trips, the stream, and the follower's replay and resync."""

import random

import pytest

from pagoda.contracts.block_hash import hash_prompt_blocks
from pagoda.contracts.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from pagoda.contracts import redis_keys as keys
from pagoda.fleet.index.mirror import IndexFollower, LocalIndex
from pagoda.fleet.index.prefix_index import PrefixIndex
from pagoda.fleet.routing.router import Router

from .conftest import count_round_trips

pytestmark = pytest.mark.redis
MODEL = "m"
BS = 4


def make_chains(rng, num_chains=4, length=10):
    """Prompts that share prefixes pairwise (like tenants with common preambles)."""
    base = [rng.randrange(1000) for _ in range(length * BS)]
    chains = []
    for c in range(num_chains):
        tokens = list(base)
        fork = rng.randrange(length) * BS
        tokens[fork:] = [rng.randrange(1000) for _ in range(len(tokens) - fork)]
        chains.append([h.hex() for h in hash_prompt_blocks(tokens, BS, "model")])
    return chains


def brute_force(model, block_hashes):
    result = {}
    for rid, held in model.items():
        n = 0
        while n < len(block_hashes) and block_hashes[n] in held:
            n += 1
        if n:
            result[rid] = n
    return result


def random_events(rng, chains, held):
    events = []
    for _ in range(rng.randrange(1, 4)):
        roll = rng.random()
        if roll < 0.6:
            chain = rng.choice(chains)
            start = rng.randrange(len(chain))
            stop = rng.randrange(start + 1, len(chain) + 1)
            hashes = chain[start:stop]
            events.append(BlockStored(hashes, chain[start - 1] if start else None, [0] * (BS * len(hashes)), BS))
            held |= set(hashes)
        elif roll < 0.95 and held:
            gone = rng.sample(sorted(held), rng.randrange(1, min(4, len(held)) + 1))
            events.append(BlockRemoved(gone))
            held -= set(gone)
        else:
            events.append(AllBlocksCleared())
            held.clear()
    return events


def test_match_equals_brute_force_on_random_event_sequences(redis_client):
    rng = random.Random(5)
    chains = make_chains(rng)
    index, local = PrefixIndex(redis_client, MODEL), LocalIndex()
    follower = IndexFollower(redis_client, MODEL)
    follower.sync()
    model = {f"r{i}": set() for i in range(4)}
    seqs = {rid: 0 for rid in model}
    for step in range(150):
        rid = rng.choice(sorted(model))
        events = random_events(rng, chains, model[rid])
        wrapped = [KVEvent(seqs[rid] + i, 0.0, e) for i, e in enumerate(events)]
        seqs[rid] += len(events)
        index.apply(rid, wrapped, epoch="e")
        local.apply(rid, wrapped)
        follower.poll()
        chain = rng.choice(chains)
        query = chain[: rng.randrange(1, len(chain) + 1)]
        expected = brute_force(model, query)
        assert index.match(query) == expected, step
        assert local.match(query) == expected, step
        assert follower.match(query) == expected, step
    for rid, held in model.items():
        assert {h.decode() for h in redis_client.smembers(keys.replica_blocks_key(MODEL, rid))} == held
        assert redis_client.get(keys.replica_seq_key(MODEL, rid)).decode() == f"e:{seqs[rid] - 1}"
    # both sides of the index agree
    for chain in chains:
        for h in chain:
            owners = {r.decode() for r in redis_client.smembers(keys.block_owners_key(MODEL, h))}
            assert owners == {rid for rid, held in model.items() if h in held}


def test_match_is_at_most_two_round_trips_even_after_script_flush(redis_client):
    chain = [h.hex() for h in hash_prompt_blocks(list(range(1024)), 16, "model")]  # 64 blocks
    index = PrefixIndex(count_round_trips(redis_client), MODEL)
    index.apply("a", [BlockStored(chain[:40], None, [], 16)])
    index.apply("b", [BlockStored(chain[:64], None, [], 16)])
    redis_client.script_flush()
    for expect in (2, 1):  # NOSCRIPT -> EVAL the first time, EVALSHA after
        redis_client.round_trips = 0
        assert index.match(chain) == {"a": 40, "b": 64}
        assert redis_client.round_trips == expect
    assert index.match([]) == {}
    assert index.match([bytes.fromhex(chain[0])]) == {"a": 1, "b": 1}  # bytes hashes work too


def test_remove_replica_drops_its_entries_and_tells_followers(redis_client):
    chain = make_chains(random.Random(1), 1)[0]
    index = PrefixIndex(redis_client, MODEL)
    index.apply("a", [BlockStored(chain, None, [], BS)])
    index.apply("b", [BlockStored(chain[:3], None, [], BS)])
    redis_client.sadd(keys.registry_key(MODEL), "a", "b")  # publishers register themselves
    follower = IndexFollower(redis_client, MODEL)
    follower.sync()
    index.remove_replica("a")
    assert index.match(chain) == {"b": 3}
    assert not redis_client.exists(keys.replica_blocks_key(MODEL, "a"), keys.replica_seq_key(MODEL, "a"))
    assert not redis_client.exists(keys.block_owners_key(MODEL, chain[5]))  # empty sets vanish
    follower.poll()
    assert follower.match(chain) == {"b": 3}


def test_stream_carries_contract3_events_with_seq(redis_client):
    index = PrefixIndex(redis_client, MODEL)
    index.apply("a", [BlockStored(["aa", "bb"], None, [1, 2, 3, 4], 2), BlockRemoved(["aa"])],
                epoch="e1", first_seq=7)
    [(entry_id, entry)] = index.read_events("0-0")
    assert entry["replica"] == "a" and entry["epoch"] == "e1"
    assert (entry["first_seq"], entry["last_seq"]) == (7, 8)
    assert entry["events"][0] == {"seq": 7, "type": "BlockStored", "block_hashes": ["aa", "bb"],
                                  "parent_block_hash": None, "token_ids": [1, 2, 3, 4], "block_size": 2,
                                  "lora_id": None, "medium": "GPU"}
    assert entry["events"][1]["type"] == "BlockRemoved" and entry["events"][1]["seq"] == 8
    assert index.last_stream_id() == entry_id
    assert index.read_events(entry_id) == []


def test_late_follower_replays_from_snapshot_plus_stream(redis_client):
    chains = make_chains(random.Random(2), 2)
    index = PrefixIndex(redis_client, MODEL)
    redis_client.sadd(keys.registry_key(MODEL), "a", "b")
    index.apply("a", [BlockStored(chains[0][:5], None, [], BS)], epoch="e", first_seq=0)
    follower = IndexFollower(redis_client, MODEL)  # starts after traffic began
    follower.sync()
    assert follower.is_synced and follower.match(chains[0]) == {"a": 5}
    index.apply("a", [BlockStored(chains[0][5:], chains[0][4], [], BS)], epoch="e", first_seq=1)
    index.apply("b", [BlockStored(chains[1], None, [], BS)], epoch="f", first_seq=0)
    assert follower.poll() == 2
    assert follower.match(chains[0]) == {"a": len(chains[0])} | ({"b": 1} if chains[0][0] == chains[1][0] else {})
    assert follower.num_replica_resyncs == 0


def test_follower_skips_entries_already_in_its_snapshot(redis_client):
    """Entries written between reading the stream position and the snapshot are in both."""
    chain = make_chains(random.Random(3), 1)[0]
    index = PrefixIndex(redis_client, MODEL)
    redis_client.sadd(keys.registry_key(MODEL), "a")
    follower = IndexFollower(redis_client, MODEL)
    follower.last_id = index.last_stream_id()  # position read...
    index.apply("a", [BlockStored(chain[:2], None, [], BS)], epoch="e", first_seq=0)
    index.apply("a", [BlockRemoved(chain[:1])], epoch="e", first_seq=1)
    last_id = follower.last_id
    follower.sync()  # ...snapshot taken after both entries
    follower.last_id = last_id
    assert follower.poll() == 0  # both skipped, not re-applied
    assert follower.local.get_blocks("a") == {chain[1]}


def test_gap_in_a_replicas_seq_resyncs_that_replica(redis_client):
    chain = make_chains(random.Random(4), 1)[0]
    index = PrefixIndex(redis_client, MODEL)
    redis_client.sadd(keys.registry_key(MODEL), "a")
    index.apply("a", [BlockStored(chain[:2], None, [], BS)], epoch="e", first_seq=0)
    follower = IndexFollower(redis_client, MODEL)
    follower.sync()
    # the follower misses seq 1..2 (e.g. it read past them); simulate by applying directly
    index.apply("a", [BlockStored(chain[2:4], chain[1], [], BS), BlockRemoved(chain[:1])], epoch="e", first_seq=1)
    follower.last_id = index.last_stream_id()
    index.apply("a", [BlockStored(chain[4:6], chain[3], [], BS)], epoch="e", first_seq=3)
    index.apply("a", [BlockStored(chain[6:7], chain[5], [], BS)], epoch="e", first_seq=4)
    follower.poll()
    assert follower.num_replica_resyncs == 1
    assert follower.local.get_blocks("a") == set(chain[1:7])


def test_trimmed_stream_forces_a_full_resync(redis_client):
    chain = make_chains(random.Random(6), 1)[0]
    index = PrefixIndex(redis_client, MODEL, stream_maxlen=1)
    redis_client.sadd(keys.registry_key(MODEL), "a")
    follower = IndexFollower(redis_client, MODEL)
    follower.sync()
    for i, h in enumerate(chain):
        index.apply("a", [BlockStored([h], chain[i - 1] if i else None, [], BS)], epoch="e", first_seq=i)
    redis_client.xtrim(keys.events_stream_key(MODEL), maxlen=1, approximate=False)
    follower.poll()
    assert follower.num_full_syncs == 2
    assert follower.match(chain) == {"a": len(chain)}


def test_new_epoch_replaces_the_old_state(redis_client):
    chain = make_chains(random.Random(7), 1)[0]
    index = PrefixIndex(redis_client, MODEL)
    follower = IndexFollower(redis_client, MODEL)
    follower.sync()
    index.apply("a", [BlockStored(chain, None, [], BS)], epoch="old", first_seq=0)
    index.apply("a", [AllBlocksCleared(), BlockStored(chain[:2], None, [], BS)], epoch="new", first_seq=0)
    follower.poll()
    assert follower.match(chain) == {"a": 2} == index.match(chain)
    assert follower.num_replica_resyncs == 0


def test_follower_thread_and_redis_outage(redis_server, redis_client):
    chain = make_chains(random.Random(8), 1)[0]
    index = PrefixIndex(redis_client, MODEL)
    follower = IndexFollower(redis_server.client(), MODEL, poll_block_ms=20, retry_interval_s=0.02)
    follower.start()
    try:
        index.apply("a", [BlockStored(chain[:3], None, [], BS)], epoch="e", first_seq=0)
        _wait(lambda: follower.match(chain) == {"a": 3})
        assert "pagoda:router_index_synced 1" in Router._index_lines(follower)  # the router's /metrics
        redis_server.stop()
        _wait(lambda: not follower.is_synced)
        assert follower.match(chain) == {"a": 3}  # stale mirror still answers; caller checks is_synced
        lines = Router._index_lines(follower)  # what PagodaIndexStale alerts on
        assert "pagoda:router_index_synced 0" in lines
        assert 'pagoda:router_index_resyncs_total{scope="full"} 1' in lines
        redis_server.start()  # empty: the data did not survive
        client = redis_server.client()
        PrefixIndex(client, MODEL).apply("b", [BlockStored(chain[:1], None, [], BS)], epoch="f", first_seq=0)
        client.sadd(keys.registry_key(MODEL), "b")
        _wait(lambda: follower.is_synced and follower.match(chain) == {"b": 1})
    finally:
        follower.stop()


def _wait(predicate, timeout_s=5.0):
    """Poll a condition driven by another thread (no fixed sleeps)."""
    import time

    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)
