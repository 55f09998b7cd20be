"""Launch shapes of the paged-attention kernel: built-in rules, overridable by tuned data.

``choose_config`` picks, per launch, the query-tile height, the key-tile width, warps,
pipeline stages and the split-K count. It first looks for a tuned entry in
``configs/<device name>.json`` (written by ``pagoda bench kernels --tune``, see
``tuning.py``), keyed by *shape family*:

* ``decode/<dtype>/d<head_dim>/g<group_pad>/b<batch bucket>`` for decode launches
  (``max_query_len == 1``), batch bucket = next power of two of the sequence count, at
  most 64. Entry: ``block_n``, ``num_warps``, ``num_stages`` and ``split_len`` (keys per
  split-K slice; 0 = never split).
* ``prefill/<dtype>/d<head_dim>/g<group_pad>`` for launches with prefill chunks. Entry:
  ``block_m`` (largest tile height in rows), ``block_n``, ``num_warps``, ``num_stages``;
  short chunks still shrink the tile to what they need, and split-K follows the rule.

``<dtype>`` is the query dtype (``bf16``, ``fp16``); the cache dtype does not enter the
key. Without a file or an entry, the built-in rules below apply (CPU: always the rules).
"""

from __future__ import annotations

import functools
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

logger = logging.getLogger(__name__)

CONFIG_DIR = Path(__file__).with_name("configs")
MAX_SPLITS = 64
MIN_SPLIT_LEN = 256  # keys per slice below which splitting a prefill tile costs more than it wins
DECODE_MIN_SPLIT_LEN = 128  # decode: more, cheaper slices (fixed work per program)
DTYPE_NAMES = {2: "bf16"}  # element size -> default name when the caller gives none


@dataclass(frozen=True)
class AttentionConfig:
    """Launch shape of one paged-attention call (all compile-time except num_splits)."""

    block_q: int  # query tokens per tile
    block_n: int  # keys per inner-loop step
    num_splits: int  # key-range slices (1: no split, no combine kernel)
    num_warps: int = 4
    num_stages: int = 2


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def group_pad(num_heads: int, num_kv_heads: int) -> int:
    return next_pow2(num_heads // num_kv_heads)


def family_key(phase: str, dtype_name: str, head_dim: int, gpad: int, num_seqs: int = 1) -> str:
    """The JSON key of a shape family (see the module docstring)."""
    key = f"{phase}/{dtype_name}/d{head_dim}/g{gpad}"
    return key + f"/b{min(64, next_pow2(num_seqs))}" if phase == "decode" else key


def device_file(device_name: str) -> Path:
    """``configs/<device name>.json``, non-alphanumerics replaced by ``_``."""
    return CONFIG_DIR / (re.sub(r"[^A-Za-z0-9]+", "_", device_name).strip("_") + ".json")


@functools.lru_cache(maxsize=None)
def load_table(device_name: str) -> dict:
    """The tuned families for a device ({} when no file); a broken file is logged, not fatal."""
    path = device_file(device_name)
    if not path.exists():
        return {}
    try:
        families = json.loads(path.read_text())["families"]
        assert isinstance(families, dict)
        return families
    except (OSError, ValueError, KeyError, AssertionError) as exc:
        logger.warning("ignoring tuned attention configs %s: %s", path, exc)
        return {}


def _split_count(tiles: int, max_seq_len: int, num_sms: int, decode: bool) -> int:
    """Built-in split-K rule: split while the tiles leave the GPU under-filled.

    Prefill / mixed: aim at 2 programs per SM with slices of >= 256 keys. Decode at small
    batch (fewer tiles than half the SMs): aim at 4 programs per SM with slices of >= 128
    keys, i.e. more and cheaper programs at fixed work per slice.
    """
    small = decode and tiles < num_sms // 2
    target = (4 if small else 2) * num_sms
    min_len = DECODE_MIN_SPLIT_LEN if small else MIN_SPLIT_LEN
    if tiles >= 2 * num_sms or max_seq_len < 2 * min_len:
        return 1
    want = next_pow2(cdiv(target, max(tiles, 1)))
    cap = max(1, max_seq_len // min_len)
    while want > 1 and (want > cap or want > MAX_SPLITS):
        want //= 2
    return want


def choose_config(
    num_tokens: int,
    num_seqs: int,
    num_heads: int,
    num_kv_heads: int,
    max_query_len: int,
    max_seq_len: int,
    num_sms: int,
    element_size: int = 2,
    *,
    head_dim: int = 128,
    dtype_name: Optional[str] = None,
    table: Optional[dict] = None,
) -> AttentionConfig:
    """Pick the launch shape of one launch (tuned entry first, else the built-in rules).

    Built-in rules: decode launches use the smallest tile that fills ``tl.dot``'s 16 rows,
    64-key steps; prefill launches use up to 128 rows with 8 warps and 3 stages once a
    chunk fills them (64 rows, 4 warps, 2 stages below that; fp32 inputs, whose tiles take
    twice the registers and shared memory, 32 rows and 32-key steps; heads wider than 256, Gemma 4's
512, at most 64 rows and 32-key steps, which keeps their shared memory under sm_90's). Split-K per
    ``_split_count``; the tile count is an upper bound, ``num_tokens / block_q + num_seqs``
    per KV head.
    """
    gpad = group_pad(num_heads, num_kv_heads)
    dtype_name = dtype_name or DTYPE_NAMES.get(element_size, "fp32")
    decode = max_query_len <= 1
    entry = (table or {}).get(family_key("decode" if decode else "prefill", dtype_name, head_dim, gpad, num_seqs))
    if decode:
        block_m = max(gpad, 16)
    else:
        max_block_m = 32 if element_size > 2 else (entry or {}).get("block_m", 64 if head_dim > 256 else 128)
        block_m = max(gpad, min(max_block_m, max(16, next_pow2(max_query_len) * gpad)))
    block_q = block_m // gpad
    tiles = min(num_tokens, num_tokens // block_q + num_seqs) * num_kv_heads
    if entry:
        num_splits = _split_count(tiles, max_seq_len, num_sms, decode)
        if decode:
            split_len = entry.get("split_len", 0)
            num_splits = 1 if split_len <= 0 else max(1, min(MAX_SPLITS, cdiv(max_seq_len, split_len)))
        return AttentionConfig(block_q, entry["block_n"], num_splits, entry["num_warps"], entry["num_stages"])
    num_splits = _split_count(tiles, max_seq_len, num_sms, decode)
    if element_size > 2 or head_dim > 256:  # Gemma 4's 512-wide heads: 128 x 64 tiles overflow sm_90's 227 KiB
        return AttentionConfig(block_q, 32, num_splits)
    if block_m >= 128:
        return AttentionConfig(block_q, 64, num_splits, num_warps=8, num_stages=3)
    return AttentionConfig(block_q, 64, num_splits)
