"""``pagoda bench kernels --tune [--quick]``: sweep attention launch shapes on this GPU.

The sweep logic (families, candidates, choosing, writing the JSON) is
``pagoda.kernels.tuning``; this module supplies the GPU timer: per family it builds the
bench's random paged data once (decode: ``--context`` keys per sequence at the family's
batch; prefill: one causal sequence of ``--tune-prefill-len`` tokens) and times the real
kernel with each candidate's launch shape (decode: CUDA-graph replays cycling over cache
copies, as the decode table does; prefill: CUDA events). Writes
``backend/pagoda/kernels/configs/<device name>.json`` (or ``--tune-out``) and prints the
winners. ``--quick`` sweeps a few shapes per phase (well under a minute on an H100); the
full sweep compiles 22 decode and 20 prefill variants and times 405 launch shapes (a few
minutes).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from pagoda.kernels import tuning


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("tuning (--tune)")
    g.add_argument("--tune", action="store_true", help="sweep launch shapes on this GPU and write the configs JSON")
    g.add_argument("--quick", action="store_true", help="with --tune: a few shapes per phase")
    g.add_argument("--tune-prefill-len", type=int, default=2048, help="prefill length the prefill family is timed at")
    g.add_argument("--tune-out", default=None, help="JSON path (default: kernels/configs/<device name>.json)")


class GpuTimer:
    """``measure(family, entry)`` in microseconds, with the family's data built once."""

    def __init__(self, args: argparse.Namespace, bench) -> None:
        self.args, self.bench = args, bench
        self.num_sms = torch.cuda.get_device_properties(0).multi_processor_count
        self._data: dict = {}

    def _family_data(self, fam: tuning.Family):
        if fam.key not in self._data:
            self._data.clear()
            torch.cuda.empty_cache()
            if fam.phase == "decode":
                data = self.bench.make_paged_data([1] * fam.batch, [fam.context] * fam.batch, self.args, "cuda", 1)
                kv_bytes = 2 * data.k_cache.numel() * data.k_cache.element_size()
                copies = max(1, min(16, -(-self.bench.L2_FLUSH_BYTES // kv_bytes)))
                caches = [(data.k_cache, data.v_cache)] + [
                    (data.k_cache.clone(), data.v_cache.clone()) for _ in range(copies - 1)]
            else:
                data = self.bench.make_paged_data([fam.context], [fam.context], self.args, "cuda", 1)
                caches = [(data.k_cache, data.v_cache)]
            self._data[fam.key] = (data, caches)
        return self._data[fam.key]

    def __call__(self, fam: tuning.Family, entry: dict) -> float:
        from pagoda.kernels.triton_attention import paged_attention

        data, caches = self._family_data(fam)
        cfg = fam.config(entry, self.num_sms)
        scale = fam.head_dim**-0.5

        def call(k, v):
            return paged_attention(data.q, k, v, data.meta, scale, cfg, decode_config=None)

        if fam.phase == "decode":
            return self.bench.time_graph_us([lambda k=k, v=v: call(k, v) for k, v in caches], self.args.iters)
        return 1000 * self.bench.time_eager_ms(lambda: call(*caches[0]), self.args.iters)


def run(args: argparse.Namespace, bench, triton_version: str) -> int:
    """Sweep, write the JSON, print the winners; returns the exit code."""
    if args.dtype not in ("bfloat16", "float16"):
        print("--tune covers 16-bit attention (bfloat16 or float16); fp32 keeps the built-in rules")
        return 2
    name = torch.cuda.get_device_name(0)
    dtype_name = {"bfloat16": "bf16", "float16": "fp16"}[args.dtype]
    families = tuning.default_families(dtype_name, args.num_heads, args.num_kv_heads, args.head_dim, args.context,
                                       args.tune_prefill_len, args.quick)
    print(f"## pagoda bench kernels --tune{' --quick' if args.quick else ''}: {name}\n", flush=True)
    winners = tuning.sweep(families, GpuTimer(args, bench), args.quick, log=lambda s: print(f"- {s}", flush=True))
    meta = {"torch": torch.__version__, "triton": triton_version, "quick": args.quick, "context": args.context,
            "prefill_len": args.tune_prefill_len, "block_size": args.block_size}
    path = tuning.write_table(name, winners, meta, Path(args.tune_out) if args.tune_out else None)
    print(f"\nwrote {len(winners)} families to {path}")
    return 0
