"""The encoder cache: each image's encoder output, kept on the device by its content hash.

An LRU map ``mm_hash -> ImageEmbedding`` (``models.multimodal``) capped at ``max_bytes``
(``EngineConfig.mm_encoder_cache_bytes``). The runner asks it for an image's embedding each
time a step's tokens overlap the image's placeholders (every prefill chunk that covers part
of an image): the first ask runs the encoder, later ones — the next chunk, or another
request with the same picture — read the kept rows, so an image sent twice is encoded once
while it stays cached (vLLM's encoder cache, keyed by ``mm_hash``).

Invariants: ``num_bytes`` is the sum of the kept entries' sizes and never exceeds
``max_bytes`` after an insert; an output larger than the whole cache is used once and not
kept; ``num_encoded`` counts encoder runs, ``num_hits`` asks answered from the cache.
Only the device worker's thread touches it.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable

from pagoda.models.multimodal import ImageEmbedding


class EncoderCache:
    """Args:
    max_bytes: the most bytes of embeddings kept (>= 0; 0 keeps nothing).
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, ImageEmbedding] = OrderedDict()
        self.num_bytes = 0
        self.num_encoded = 0
        self.num_hits = 0
        self.num_evicted = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, mm_hash: str) -> bool:
        return mm_hash in self._entries

    def get_or_encode(self, mm_hash: str, data: Any, encode: Callable[[Any], ImageEmbedding]) -> ImageEmbedding:
        """The embedding of the image ``mm_hash``: kept, or ``encode(data)`` (then kept if it fits)."""
        entry = self._entries.get(mm_hash)
        if entry is not None:
            self._entries.move_to_end(mm_hash)
            self.num_hits += 1
            return entry
        entry = encode(data)
        self.num_encoded += 1
        size = entry.num_bytes
        if size <= self.max_bytes:
            self._entries[mm_hash] = entry
            self.num_bytes += size
            while self.num_bytes > self.max_bytes:  # least recently used first
                _, old = self._entries.popitem(last=False)
                self.num_bytes -= old.num_bytes
                self.num_evicted += 1
        return entry
