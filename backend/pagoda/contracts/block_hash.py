"""Chained block hashes: the one definition shared by the engine, the Redis index and the router.

Only *full* blocks are hashed. For a request whose token ids are split into blocks of
``block_size`` tokens, the hash of block ``i`` is::

    hash_0_parent = root_hash(model_id)
    hash_i        = SHA-256( b"pagoda-block-v1"            # domain tag, 15 bytes
                             || parent_hash                # 32 bytes (hash_{i-1}, or the root)
                             || u32le(len(tokens))         # number of tokens in the block
                             || u32le(t) for t in tokens   # each token id, little-endian uint32
                             || u32le(len(extra))          # byte length of the extra-keys encoding
                             || extra )                    # canonical encoding of extra keys

    root_hash(model_id) = SHA-256( b"pagoda-root-v1" || utf8(model_id) )

``extra`` encodes the request's ``cache_salt`` (tenant isolation), adapter id and the images
whose placeholder tokens the block overlaps; it is empty when all are absent, otherwise
``utf8(json.dumps({"adapter": a, "mm": [[h, o], ...], "salt": s}, sort_keys=True,
separators=(",", ":")))`` with absent keys omitted. Every block of a salted request carries
the salt, so two tenants never share any block. ``mm`` (vLLM's ``mm_hash`` extra keys): for
each image overlapping the block, in prompt order, its content hash ``h`` (lowercase hex
SHA-256, made where the request is built: ``engine/image_inputs.py``) and ``o``, the index
of its first placeholder token in the request. Placeholder tokens are the same for every
image, so without ``mm`` two prompts with equal text and different images would share
blocks; with it they never do, and the same image at the same place hits.

Hashes are 32-byte ``bytes`` (``BlockHash``); ``hex()`` gives the form used in Redis and
block events. Python's ``hash()`` is never used: it is salted per process.
Known-answer vectors are pinned in ``tests/engine/test_block_hash.py``.
"""

from __future__ import annotations

import hashlib
import json
import struct
from typing import NewType, Optional, Sequence

BlockHash = NewType("BlockHash", bytes)

_BLOCK_TAG = b"pagoda-block-v1"
_ROOT_TAG = b"pagoda-root-v1"


def root_hash(model_id: str) -> BlockHash:
    """The parent hash of a request's first block, seeded from the model's identity."""
    return BlockHash(hashlib.sha256(_ROOT_TAG + model_id.encode("utf-8")).digest())


def encode_extra_keys(cache_salt: Optional[str] = None, adapter_id: Optional[str] = None,
                      mm_keys: Sequence[tuple[str, int]] = ()) -> bytes:
    """Canonical byte encoding of a block's extra keys (empty when there are none); ``mm_keys``:
    (content hash, first placeholder index) of each image the block overlaps."""
    keys: dict = {}
    if adapter_id is not None:
        keys["adapter"] = adapter_id
    if mm_keys:
        keys["mm"] = [[h, o] for h, o in mm_keys]
    if cache_salt is not None:
        keys["salt"] = cache_salt
    if not keys:
        return b""
    return json.dumps(keys, sort_keys=True, separators=(",", ":")).encode("utf-8")


def hash_block(parent: BlockHash, token_ids: Sequence[int], extra: bytes = b"") -> BlockHash:
    """Hash one full block given its parent's hash, its token ids and encoded extra keys."""
    h = hashlib.sha256()
    h.update(_BLOCK_TAG)
    h.update(parent)
    h.update(struct.pack("<I", len(token_ids)))
    h.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    h.update(struct.pack("<I", len(extra)))
    h.update(extra)
    return BlockHash(h.digest())


def hash_prompt_blocks(
    token_ids: Sequence[int],
    block_size: int,
    model_id: str,
    cache_salt: Optional[str] = None,
    adapter_id: Optional[str] = None,
    parent: Optional[BlockHash] = None,
    mm_spans: Sequence[tuple[str, int, int]] = (),
) -> list[BlockHash]:
    """Hashes of every full block of ``token_ids`` (a trailing partial block is not hashed).

    Args:
        token_ids: the tokens, starting at a block boundary.
        block_size: tokens per block.
        model_id: identity of the model (seeds the root hash) when ``parent`` is None.
        cache_salt / adapter_id: extra keys, see the module docstring.
        parent: hash of the block before ``token_ids[0]``, to continue a chain.
        mm_spans: (content hash, first placeholder index, number of placeholders) of each image
            of the (expanded) prompt, in prompt order, indices counted from ``token_ids[0]``;
            each block overlapping an image's placeholders carries its ``mm`` key.
    Returns:
        One hash per full block, in order.
    """
    extra = encode_extra_keys(cache_salt, adapter_id)
    prev = parent if parent is not None else root_hash(model_id)
    hashes: list[BlockHash] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        end = start + block_size
        mm_keys = [(h, o) for h, o, n in mm_spans if o < end and o + n > start]
        block_extra = encode_extra_keys(cache_salt, adapter_id, mm_keys) if mm_keys else extra
        prev = hash_block(prev, token_ids[start:end], block_extra)
        hashes.append(prev)
    return hashes
