"""The key layout: namespacing, the documented names, the operator's re-export."""

import re

import pytest

from pagoda.contracts import redis_keys as keys


def test_every_key_is_namespaced_by_model():
    builders = [
        keys.registry_key("m"), keys.heartbeat_key("m", "r1"), keys.drain_key("m", "r1"),
        keys.replica_blocks_key("m", "r1"), keys.replica_seq_key("m", "r1"),
        keys.block_owners_key("m", "ab" * 32), keys.events_stream_key("m"),
    ]
    assert all(k.startswith(keys.namespace("m") + ":") for k in builders)
    assert len(set(builders)) == len(builders)
    other = keys.heartbeat_key("m2", "r1")
    assert not other.startswith(keys.namespace("m") + ":")


def test_names_match_the_docstring():
    assert keys.registry_key("chat") == "pagoda:chat:replicas"
    assert keys.heartbeat_key("chat", "a") == "pagoda:chat:replica:a"
    assert keys.drain_key("chat", "a") == "pagoda:chat:drain:a"
    assert keys.replica_blocks_key("chat", "a") == "pagoda:chat:replica:a:blocks"
    assert keys.replica_seq_key("chat", "a") == "pagoda:chat:replica:a:seq"
    assert keys.block_owners_key("chat", "ff") == "pagoda:chat:block:ff"
    assert keys.block_owners_prefix("chat") + "ff" == keys.block_owners_key("chat", "ff")
    assert keys.events_stream_key("chat") == "pagoda:chat:events"
    doc = keys.__doc__
    for pattern in ("replicas", r"replica:\{replica_id\}", r"drain:\{replica_id\}", r":blocks", r":seq",
                    r"block:\{block_hash\}", "events"):
        assert re.search(pattern, doc), pattern
    for field in keys.HEARTBEAT_FIELDS:
        assert field in doc, field


def test_bad_ids_are_refused():
    with pytest.raises(ValueError, match="model"):
        keys.registry_key("")
    with pytest.raises(ValueError, match="replica_id"):
        keys.heartbeat_key("m", "a:blocks")  # would collide with replica a's blocks key
    with pytest.raises(ValueError, match="replica_id"):
        keys.drain_key("m", "")


def test_operator_uses_these_keys():
    from pagoda_operator import fleet_keys

    assert fleet_keys.heartbeat_key is keys.heartbeat_key
    assert fleet_keys.block_owners_key is keys.block_owners_key
    assert fleet_keys.replica_blocks_key is keys.replica_blocks_key
    assert {"waiting", "running", "kv_usage", "ttft_p90", "ts"} <= set(fleet_keys.HEARTBEAT_FIELDS)


def test_ttft_buckets_round_trip_and_malformed_fields():
    text = keys.encode_ttft_buckets([0.0005, 0.3, 0.3, 7.0, 5000.0])
    buckets = keys.decode_ttft_buckets(text)
    assert len(buckets) == len(keys.TTFT_BUCKETS) + 1
    assert (buckets[0.001], buckets[0.25], buckets[0.5], buckets[7.5], buckets[2560.0], buckets[float("inf")]) \
        == (1, 1, 3, 4, 4, 5)
    assert keys.encode_ttft_buckets([]) == ",".join(["0"] * (len(keys.TTFT_BUCKETS) + 1))
    for bad in ("", "1,2", "a," * 23, None):
        assert keys.decode_ttft_buckets(bad) == {}
