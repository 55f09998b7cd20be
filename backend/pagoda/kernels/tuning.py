"""Tuned launch shapes as data: the sweep behind ``pagoda bench kernels --tune``.

For each *shape family* (``attention_config.family_key``) the sweep times every candidate
launch shape with a caller-supplied ``measure(family, entry) -> microseconds`` (on a GPU:
CUDA-graph timing of the real kernel; in tests: a fake timer), keeps the fastest, and
``write_table`` stores the winners in ``configs/<device name>.json``, merged into what the
file already holds. ``choose_config`` reads that file (per device, cached) and falls back
to its built-in rules for any family the file lacks.

Candidates (every one must compile for sm_90: ``tests/kernels/sm90_compile.py`` compiles
them all):

* decode: ``block_n`` 32/64/128 x ``num_warps`` 2/4/8 at 2 stages, plus 64- and 128-key
  tiles with 4 warps at 3 stages, each with ``split_len`` (keys per split-K slice) 0 (no
  split)/64/128/256/512 -- 55 shapes, 22 compiled variants; ``--quick``: 64 keys, 4
  warps, 2 stages, split_len 0/128/256/512.
* prefill: ``block_m`` 64/128 x ``block_n`` 32/64 x ``num_warps`` 4/8 x ``num_stages``
  2/3, plus 4 stages for (64 rows, 4 warps) and (128 rows, 8 warps) with 64 keys, and
  128-key tiles at 2 stages -- 20 shapes; ``--quick``: five of them.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from pagoda.kernels.attention_config import AttentionConfig, choose_config, device_file, family_key, load_table

DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 64)
QUICK_DECODE_BATCHES = (1, 4, 16, 64)


@dataclass(frozen=True)
class Family:
    """One shape family and the step the sweep times it on."""

    phase: str  # decode | prefill
    dtype_name: str  # bf16 | fp16
    head_dim: int
    num_heads: int
    num_kv_heads: int
    batch: int  # sequences (decode); 1 for prefill
    context: int  # keys per sequence (decode context, or the prefill length)

    @property
    def key(self) -> str:
        gpad = 1 << max(0, self.num_heads // self.num_kv_heads - 1).bit_length()
        return family_key(self.phase, self.dtype_name, self.head_dim, gpad, self.batch)

    def config(self, entry: dict, num_sms: int) -> AttentionConfig:
        """The launch shape ``choose_config`` derives from ``entry`` for this family's step."""
        query_len = 1 if self.phase == "decode" else self.context
        num_tokens = self.batch * query_len
        return choose_config(num_tokens, self.batch, self.num_heads, self.num_kv_heads, query_len, self.context,
                             num_sms, 2, head_dim=self.head_dim, dtype_name=self.dtype_name,
                             table={self.key: entry})


def candidates(phase: str, quick: bool) -> list[dict]:
    """The launch shapes swept for a phase (see the module docstring)."""
    if phase == "decode":
        tiles = [(64, 4, 2)] if quick else [*itertools.product((32, 64, 128), (2, 4, 8), (2,)), (64, 4, 3), (128, 4, 3)]
        splits = (0, 128, 256, 512) if quick else (0, 64, 128, 256, 512)
        return [dict(block_n=n, num_warps=w, num_stages=st, split_len=sl) for (n, w, st), sl in
                itertools.product(tiles, splits)]
    shapes = [*itertools.product((64, 128), (32, 64), (4, 8), (2, 3)), (64, 64, 4, 4), (128, 64, 8, 4),
              (64, 128, 4, 2), (128, 128, 8, 2)]
    if quick:
        shapes = [(64, 64, 4, 2), (128, 64, 4, 2), (128, 64, 8, 3), (128, 32, 8, 3), (128, 64, 8, 4)]
    return [dict(block_m=m, block_n=n, num_warps=w, num_stages=st) for m, n, w, st in shapes]


def default_families(dtype_name: str, num_heads: int, num_kv_heads: int, head_dim: int, context: int,
                     prefill_len: int, quick: bool) -> list[Family]:
    """Decode at each batch bucket at ``context`` keys, and one prefill of ``prefill_len``."""
    batches = QUICK_DECODE_BATCHES if quick else DECODE_BATCHES
    fams = [Family("decode", dtype_name, head_dim, num_heads, num_kv_heads, b, context) for b in batches]
    return fams + [Family("prefill", dtype_name, head_dim, num_heads, num_kv_heads, 1, prefill_len)]


def sweep(families: list[Family], measure: Callable[[Family, dict], float], quick: bool,
          log: Callable[[str], None] = print) -> dict[str, dict]:
    """Time every candidate of every family; the fastest per family, with its time.

    A candidate whose ``measure`` raises (e.g. out of shared memory) is logged and skipped.
    """
    winners: dict[str, dict] = {}
    for fam in families:
        timed = []
        for entry in candidates(fam.phase, quick):
            try:
                timed.append((float(measure(fam, entry)), entry))
            except Exception as exc:  # one bad shape must not end the sweep
                log(f"skipped {fam.key} {entry}: {type(exc).__name__}: {exc}")
        if not timed:
            log(f"no candidate ran for {fam.key}; it keeps the built-in rules")
            continue
        us, best = min(timed, key=lambda t: t[0])
        winners[fam.key] = {**best, "us": round(us, 3)}
        log(f"{fam.key}: {best} {us:.2f} us (of {len(timed)} shapes)")
    return winners


def write_table(device_name: str, winners: dict[str, dict], meta: dict, path: Optional[Path] = None) -> Path:
    """Merge ``winners`` into the device's JSON (other families kept); returns its path."""
    path = path or device_file(device_name)
    families: dict = {}
    if path.exists():
        try:
            families = json.loads(path.read_text()).get("families", {})
        except ValueError:
            families = {}
    families.update(winners)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"device": device_name, "meta": meta, "families": dict(sorted(families.items()))}
    path.write_text(json.dumps(data, indent=1) + "\n")
    load_table.cache_clear()
    return path
