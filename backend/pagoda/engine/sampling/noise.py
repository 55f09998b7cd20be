"""Counter-based Exp(1) noise for the sampler, computed on the logits' device.

Every random draw the sampler makes is a pure function of a 32-bit row key and a vocabulary
index; there is no generator state anywhere. So a request's draws depend only on its seed
and how many tokens it has produced, never on the batch it shares or its place in it, and
any draw can be recomputed later (speculative decoding verifies drafted positions with
the draws plain sampling would have used there).

Specification (byte-exact; all arithmetic modulo 2**32 unless said otherwise):

* ``mix64(z)`` (mod 2**64, SplitMix64's finalizer):
  ``z ^= z >> 30; z *= 0xBF58476D1CE4E5B9; z ^= z >> 27; z *= 0x94D049BB133111EB; z ^= z >> 31``.
* Row key of stream ``seed`` (u64) at counter ``position`` (u64):
  ``key = mix64(mix64(seed ^ 0x5851F42D4C957F2D) + position * 0x9E3779B97F4A7C15) >> 32``.
  A seeded request uses ``(its seed, number of tokens it has generated)``; unseeded rows
  use the sampler's own stream with a counter advanced once per draw.
* ``hash32(x)``: ``x ^= x >> 16; x *= 0x21F0AAAD; x ^= x >> 15; x *= 0x735A2D97; x ^= x >> 15``
  (a low-bias 32-bit integer hash).
* Noise at column ``v``: ``bits = hash32(hash32(v ^ 0x9E3779B9) ^ key)``;
  ``u = ((bits >> 9) + 0.5) / 2**23`` (exact in float32 — ``top + 0.5`` needs 24
  significant bits — so ``2**-24 <= u <= 1 - 2**-24`` and no draw is 0 or infinite);
  ``noise = -log(u)`` in float32, an Exp(1) draw.

Device arithmetic uses int64 tensors holding values below 2**32 and multipliers below
2**31, so no product exceeds 2**63: the integer bits are identical on every device and
every torch backend. Only the final float32 ``log`` may differ by an ulp between devices.
Row keys are computed on the host with numpy's wrapping uint64 arithmetic, vectorised over
the batch; they travel to the device with the other per-row parameters.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

_MASK32 = 0xFFFFFFFF
_HASH_MULTIPLIERS = (0x21F0AAAD, 0x735A2D97)  # both < 2**31: products of u32 values fit in int64
_COLUMN_SALT = 0x9E3779B9
_STREAM_SALT = np.uint64(0x5851F42D4C957F2D)
_POSITION_STEP = np.uint64(0x9E3779B97F4A7C15)

_column_tables: dict[tuple[str, int], torch.Tensor] = {}


def _mix64(z: np.ndarray) -> np.ndarray:
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def row_keys(seeds: Sequence[int], positions: Sequence[int]) -> np.ndarray:
    """32-bit row keys (as int64) of streams ``seeds`` at counters ``positions``.

    Args:
        seeds: one u64 stream seed per row.
        positions: one u64 counter per row (for a seeded request: its output length).

    Returns:
        ``[len(seeds)]`` int64 array of values in ``[0, 2**32)``.
    """
    seed = np.array(seeds, dtype=np.uint64)
    position = np.array(positions, dtype=np.uint64)
    with np.errstate(over="ignore"):
        key = _mix64(_mix64(seed ^ _STREAM_SALT) + position * _POSITION_STEP)
    return (key >> np.uint64(32)).astype(np.int64)


def hash32_(x: torch.Tensor) -> torch.Tensor:
    """``hash32`` in place on an int64 tensor of values in ``[0, 2**32)``; returns ``x``."""
    first, second = _HASH_MULTIPLIERS
    x.bitwise_xor_(x >> 16).mul_(first).bitwise_and_(_MASK32)
    x.bitwise_xor_(x >> 15).mul_(second).bitwise_and_(_MASK32)
    return x.bitwise_xor_(x >> 15)


def _column_table(vocab_size: int, device: torch.device) -> torch.Tensor:
    """``hash32(v ^ salt)`` for every column, computed once per device and size."""
    cache_key = (str(device), vocab_size)
    table = _column_tables.get(cache_key)
    if table is None:
        table = hash32_(torch.arange(vocab_size, dtype=torch.int64, device=device).bitwise_xor_(_COLUMN_SALT))
        _column_tables[cache_key] = table
    return table


def exponential_noise(keys: torch.Tensor, vocab_size: int, columns: torch.Tensor | None = None) -> torch.Tensor:
    """Exp(1) noise of each row key at each column (see the module docstring).

    Args:
        keys: ``[R]`` int64 row keys on the target device.
        vocab_size: number of columns of the full vocabulary.
        columns: ``[R, K]`` int64 column ids to evaluate; ``None`` means all
            ``vocab_size`` columns. The value at a column is the same either way.

    Returns:
        ``[R, K]`` (or ``[R, vocab_size]``) float32 noise on ``keys.device``, all > 0.
    """
    if keys.device.type == "cpu":
        top_bits = _top_bits_numpy(keys.numpy(), vocab_size, None if columns is None else columns.numpy())
    else:
        top_bits = (_bits_torch(keys, vocab_size, columns) >> 9).to(torch.float32)
    return to_exponential_(top_bits)


def to_exponential_(top_bits: torch.Tensor) -> torch.Tensor:
    """``-log(u)`` with ``u = (top_bits + 0.5) / 2**23``, in place on float32 ``top_bits``
    (integers in ``[0, 2**23)``); every result is finite and > 0."""
    return top_bits.add_(0.5).mul_(2.0**-23).log_().neg_()


def _bits_torch(keys: torch.Tensor, vocab_size: int, columns: torch.Tensor | None) -> torch.Tensor:
    """The hash bits as int64 on any device (see the module docstring for why int64)."""
    table = _column_table(vocab_size, keys.device)  # [V]
    column_bits = table[None, :] if columns is None else table[columns]
    return hash32_(column_bits ^ keys[:, None])  # [R, K]


def _top_bits_numpy(keys: np.ndarray, vocab_size: int, columns: np.ndarray | None) -> torch.Tensor:
    """``bits >> 9`` as float32 (exact below 2**24), computed with numpy's wrapping uint32
    arithmetic: half the memory traffic of int64 on a CPU, bit for bit equal (tested)."""
    table = _column_table(vocab_size, torch.device("cpu")).numpy().astype(np.uint32)
    x = (table[None, :] if columns is None else table[columns]) ^ keys.astype(np.uint32)[:, None]
    first, second = (np.uint32(m) for m in _HASH_MULTIPLIERS)
    x ^= x >> np.uint32(16)
    x *= first
    x ^= x >> np.uint32(15)
    x *= second
    x ^= x >> np.uint32(15)
    x >>= np.uint32(9)
    return torch.from_numpy(x.astype(np.float32))
