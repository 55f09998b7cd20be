"""The TCP connector's wire format: typed, length-prefixed frames (spec in docs/kv_transfer.md).

Every frame is ``type: u8 || length: u32le || body[length]``. Control frames (PULL, OFFER,
ACCEPT, REFUSE, DONE, ERROR, READY) carry a UTF-8 JSON object (READY: the NIXL connector's
"the needed blocks are pinned, read them; these are their SHA-256s"); END carries nothing; a CHUNK
carries ``block_index: u32le || offset: u32le || sha256(payload): 32 bytes || payload``.

Invariants:
- A reader never allocates more than ``max_body`` bytes for one frame: a longer length
  prefix is refused before anything is read (a peer cannot make us buffer at will).
- A chunk's payload is accepted only if its SHA-256 matches the digest sent with it;
  ``read_chunk`` raises ``WireError`` naming the block and offset otherwise.
- Pure Python (no torch): the bytes of a block come from ``block_io``.
"""

from __future__ import annotations

import enum
import hashlib
import json
import socket
import struct
from dataclasses import dataclass

PROTOCOL_VERSION = 1
_HEADER = struct.Struct("<BI")
_CHUNK_HEADER = struct.Struct("<II32s")
MAX_CONTROL_BYTES = 64 << 20  # an OFFER lists every block's hash and token ids


class FrameType(enum.IntEnum):
    OFFER = 1
    ACCEPT = 2
    REFUSE = 3
    CHUNK = 4
    END = 5
    DONE = 6
    ERROR = 7
    PULL = 8
    READY = 9


class WireError(Exception):
    """The peer broke the protocol (bad frame, checksum mismatch, closed early)."""


@dataclass(frozen=True)
class Chunk:
    block_index: int
    offset: int
    payload: bytes


def send_frame(sock: socket.socket, frame_type: FrameType, body: bytes = b"") -> None:
    sock.sendall(_HEADER.pack(int(frame_type), len(body)) + body)


def send_json(sock: socket.socket, frame_type: FrameType, obj: dict) -> None:
    send_frame(sock, frame_type, json.dumps(obj, separators=(",", ":")).encode("utf-8"))


def encode_chunk(block_index: int, offset: int, payload: bytes) -> bytes:
    """A CHUNK frame's body: block index, offset, the payload's SHA-256, the payload."""
    return _CHUNK_HEADER.pack(block_index, offset, hashlib.sha256(payload).digest()) + payload


def send_chunk(sock: socket.socket, block_index: int, offset: int, payload: bytes) -> None:
    head = _CHUNK_HEADER.pack(block_index, offset, hashlib.sha256(payload).digest())
    sock.sendall(_HEADER.pack(int(FrameType.CHUNK), len(head) + len(payload)) + head)
    sock.sendall(payload)


def recv_exact(sock: socket.socket, num_bytes: int) -> bytearray:
    buf = bytearray(num_bytes)
    view = memoryview(buf)
    got = 0
    while got < num_bytes:
        n = sock.recv_into(view[got:], num_bytes - got)
        if n == 0:
            raise WireError(f"peer closed the connection ({got} of {num_bytes} bytes read)")
        got += n
    return buf


def recv_frame(sock: socket.socket, max_body: int) -> tuple[FrameType, bytearray]:
    """Read one frame; raises WireError for an unknown type or a body over ``max_body``."""
    frame_type, length = _HEADER.unpack(recv_exact(sock, _HEADER.size))
    try:
        kind = FrameType(frame_type)
    except ValueError:
        raise WireError(f"unknown frame type {frame_type}") from None
    limit = max_body if kind == FrameType.CHUNK else MAX_CONTROL_BYTES
    if length > limit:
        raise WireError(f"{kind.name} frame of {length} bytes exceeds the limit of {limit}")
    return kind, recv_exact(sock, length)


def parse_json(kind: FrameType, body: bytes) -> dict:
    try:
        obj = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise WireError(f"{kind.name} frame is not UTF-8 JSON: {e}") from None
    if not isinstance(obj, dict):
        raise WireError(f"{kind.name} frame must hold a JSON object, got {type(obj).__name__}")
    return obj


def recv_json(sock: socket.socket, expected: tuple[FrameType, ...]) -> tuple[FrameType, dict]:
    kind, body = recv_frame(sock, 0)
    if kind not in expected:
        raise WireError(f"expected {'/'.join(e.name for e in expected)}, got {kind.name}")
    return kind, parse_json(kind, body)


def read_chunk(body: bytearray) -> Chunk:
    """Decode a CHUNK body, checking its SHA-256. Raises WireError on a mismatch."""
    if len(body) < _CHUNK_HEADER.size:
        raise WireError(f"CHUNK frame of {len(body)} bytes is shorter than its header")
    block_index, offset, digest = _CHUNK_HEADER.unpack_from(body)
    payload = bytes(memoryview(body)[_CHUNK_HEADER.size:])
    if hashlib.sha256(payload).digest() != digest:
        raise WireError(f"checksum mismatch in the chunk of block {block_index} at offset {offset}")
    return Chunk(block_index, offset, payload)


def chunk_frame_limit(chunk_bytes: int) -> int:
    return _CHUNK_HEADER.size + chunk_bytes
