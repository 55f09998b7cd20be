"""One KV block as a file: the byte format of the disk and shared tiers, and the fingerprint.

Pure Python (no torch): the runner turns a block's tensors into ``payload`` bytes and back;
this module frames them so a reader can prove a file is whole, uncorrupted and written by
an engine whose cache has the same meaning.

Format (all integers little-endian)::

    magic      4 bytes  b"PGKV"
    version    u16      FORMAT_VERSION
    header_len u32      length of the JSON header that follows
    header     JSON     {"fingerprint": str, "block_hash": hex, "token_ids": [int],
                         "payload_len": int}  (sorted keys, no spaces)
    payload    bytes    payload_len bytes: the block's rows of every KV tensor, in the
                        runner's tensor order, each as its raw bytes
    crc32      u32      zlib.crc32 over every byte before it

A reader checks, in order: the length (shorter than the frame says: ``truncated``), the
CRC (``checksum``), the fingerprint (``fingerprint``: another model, dtype, block size or
cache layout wrote it), and that the block hash and token ids are the ones asked for
(``mismatch``: a file under the wrong name). CRC-32 detects storage corruption (torn
writes, bit rot, a truncated copy), not tampering: the tiers trust who can write the
directory, as vLLM's file-system offloading and SGLang's HiCache storage backends do.

The fingerprint (``make_fingerprint``) is 16 hex digits of SHA-256 over a canonical JSON of
what gives a block's bytes their meaning (model identity and config, weight files, dtypes,
block size, KV tensor shapes, KV cache groups, this format's version). Files live under a
directory named by it, so engines with different fingerprints never even list each
other's files; the header repeats it so a file moved by hand is still refused.
"""

from __future__ import annotations

import hashlib
import json
import struct
import zlib
from typing import Any, Sequence

MAGIC = b"PGKV"
FORMAT_VERSION = 1
_PREFIX = struct.Struct("<4sHI")  # magic, version, header length
_CRC = struct.Struct("<I")
SUFFIX = ".kvb"
REJECT_REASONS = ("truncated", "checksum", "fingerprint", "mismatch")


class BlockFileError(Exception):
    """A block file that must not be served; ``reason`` is one of ``REJECT_REASONS``."""

    def __init__(self, reason: str, detail: str) -> None:
        assert reason in REJECT_REASONS, f"unknown reason {reason!r}"
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def make_fingerprint(fields: dict[str, Any]) -> str:
    """16 hex digits naming what a block's bytes mean (see the module docstring).

    Args:
        fields: JSON-serialisable description of the model and the cache layout.

    Returns:
        The fingerprint; equal fields (in any key order) give equal fingerprints.
    """
    canonical = json.dumps({"format_version": FORMAT_VERSION, **fields}, sort_keys=True, separators=(",", ":"),
                           default=str)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:16]


def file_name(block_hash: bytes) -> str:
    """The file a block is stored in, inside its fingerprint's directory."""
    return block_hash.hex() + SUFFIX


def encode_block(fingerprint: str, block_hash: bytes, token_ids: Sequence[int], payload: bytes) -> bytes:
    """The file's bytes for one block (the format in the module docstring)."""
    header = json.dumps({"block_hash": block_hash.hex(), "fingerprint": fingerprint,
                         "payload_len": len(payload), "token_ids": list(token_ids)},
                        sort_keys=True, separators=(",", ":")).encode("utf-8")
    body = _PREFIX.pack(MAGIC, FORMAT_VERSION, len(header)) + header + payload
    return body + _CRC.pack(zlib.crc32(body))


def decode_block(data: bytes, fingerprint: str, block_hash: bytes, token_ids: Sequence[int]) -> bytes:
    """The payload of a block file, checked (see the module docstring for the order).

    Args:
        data: the whole file.
        fingerprint: this engine's fingerprint.
        block_hash, token_ids: the block the caller looked up.

    Returns:
        The payload bytes.

    Raises:
        BlockFileError: the file must not be served; its ``reason`` says why.
    """
    if len(data) < _PREFIX.size + _CRC.size:
        raise BlockFileError("truncated", f"{len(data)} bytes is shorter than the frame")
    magic, version, header_len = _PREFIX.unpack_from(data)
    if magic != MAGIC or version != FORMAT_VERSION:
        raise BlockFileError("fingerprint", f"magic {magic!r} version {version}: not this format")
    header_end = _PREFIX.size + header_len
    if len(data) < header_end + _CRC.size:
        raise BlockFileError("truncated", f"{len(data)} bytes, header says {header_len}")
    try:
        header = json.loads(data[_PREFIX.size:header_end])
        payload_len = int(header["payload_len"])
    except (ValueError, KeyError, TypeError) as exc:
        raise BlockFileError("checksum", f"unreadable header ({exc})") from None
    total = header_end + payload_len + _CRC.size
    if len(data) != total:
        reason = "truncated" if len(data) < total else "checksum"
        raise BlockFileError(reason, f"{len(data)} bytes, the frame says {total}")
    (crc,) = _CRC.unpack_from(data, total - _CRC.size)
    if zlib.crc32(memoryview(data)[:total - _CRC.size]) != crc:
        raise BlockFileError("checksum", "CRC-32 differs")
    if header.get("fingerprint") != fingerprint:
        raise BlockFileError("fingerprint", f"written by {header.get('fingerprint')!r}, this engine is {fingerprint!r}")
    if header.get("block_hash") != block_hash.hex() or header.get("token_ids") != list(token_ids):
        raise BlockFileError("mismatch", "the file holds another block")
    return bytes(memoryview(data)[header_end:header_end + payload_len])
