"""The encoder cache (``engine/runner/encoder_cache.py``): an LRU by content hash capped in bytes."""

from __future__ import annotations

import torch

from pagoda.engine.runner.encoder_cache import EncoderCache
from pagoda.models.multimodal import ImageEmbedding


def _encoder(rows: dict[str, int], calls: list[str]):
    def encode(name: str) -> ImageEmbedding:
        calls.append(name)
        return ImageEmbedding(torch.zeros(rows[name], 4), (torch.zeros(rows[name], 4),))  # 32 bytes per row
    return encode


def test_lru_order_byte_cap_and_counts():
    rows = {"a": 1, "b": 1, "c": 2, "huge": 10}
    calls: list[str] = []
    encode = _encoder(rows, calls)
    cache = EncoderCache(max_bytes=128)  # four rows
    for name in ("a", "b", "a", "c"):  # a, b kept (64 B); a read again (a most recent); c fills the cap
        cache.get_or_encode(name, name, encode)
    assert calls == ["a", "b", "c"] and cache.num_hits == 1 and cache.num_bytes == 128 and len(cache) == 3
    cache.get_or_encode("b", "b", encode)  # order now a, c, b
    cache.get_or_encode("a", "a", encode)  # order c, b, a
    rows["d"] = 2
    cache.get_or_encode("d", "d", encode)  # 64 more bytes: the least recent (c, 64 B) goes
    assert "c" not in cache and all(n in cache for n in "abd") and cache.num_bytes == 128 and cache.num_evicted == 1
    big = cache.get_or_encode("huge", "huge", encode)  # larger than the whole cache: used, not kept
    assert big.embeds.shape[0] == 10 and "huge" not in cache and cache.num_bytes == 128
    assert cache.num_encoded == len(calls) == 5
