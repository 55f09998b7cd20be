"""Multi-head latent attention's decode kernel on a GPU: tests/kernels/test_mla_kernels.py's
float64 checks (NaN-poisoned cache slots and table padding, odd widths and split counts,
DeepSeek-V3's widths) with the kernel compiled for the device, then its time at DeepSeek-V3's
shape (128 heads, rank 512, rope 64, bf16 latent cache) against the bytes it must read.
Usage, from the repository root on a CUDA machine: ``PYTHONPATH=backend python3
examples/gpu_mla_check.py``."""

import dataclasses
import sys

import torch

sys.path.insert(0, ".")

import tests.kernels.test_mla_kernels as cases  # noqa: E402
from pagoda.kernels import triton_mla  # noqa: E402
from pagoda.kernels.metadata import AttentionMetadata  # noqa: E402


def on_cuda(meta):
    return dataclasses.replace(meta, **{f.name: getattr(meta, f.name).cuda() for f in dataclasses.fields(meta)
                                        if isinstance(getattr(meta, f.name), torch.Tensor)})


def check(rank, rope, heads, dtype, splits, block_size=4, seed=1):
    q_lat, q_pe, cache, meta, seq_ids = cases.make_case(rank, rope, heads, dtype, block_size=block_size, seed=seed)
    scale = (rank + rope) ** -0.5
    out = triton_mla.mla_decode(q_lat.cuda(), q_pe.cuda(), cache.cuda(), on_cuda(meta), seq_ids.cuda(), scale,
                                num_splits=splits).cpu()
    cases.check(out, cases.reference(q_lat, q_pe, cache, meta, scale), dtype,
                cases.decode_bound(q_lat, q_pe, cache, scale, splits or 1))


failed = 0
for args in [(24, 8, 6, torch.float32, None), (24, 8, 6, torch.float32, 3), (24, 8, 6, torch.bfloat16, 8),
             (24, 8, 6, torch.float16, None), (512, 64, 16, torch.float32, 4, 16, 2)]:
    try:
        check(*args)
        print("ok   ", args)
    except AssertionError as exc:
        failed += 1
        print("FAIL ", args, str(exc)[:300])
print(f"{5 - failed} of 5 MLA decode checks within their float64 bounds on {torch.cuda.get_device_name()}")

from triton.testing import do_bench  # noqa: E402

heads, rank, rope, block = 128, 512, 64, 16
for batch, context in ((1, 4096), (8, 4096), (64, 4096)):
    per_seq = context // block
    tables = [list(range(s * per_seq, (s + 1) * per_seq)) for s in range(batch)]
    meta = AttentionMetadata.build([1] * batch, [context] * batch, tables, block, device="cuda")
    cache = torch.randn(batch * per_seq, block, 1, rank + rope, device="cuda", dtype=torch.bfloat16)
    q_lat = torch.randn(batch, heads, rank, device="cuda", dtype=torch.bfloat16)
    q_pe = torch.randn(batch, heads, rope, device="cuda", dtype=torch.bfloat16)
    ids = torch.arange(batch, device="cuda", dtype=torch.int32)
    ms = do_bench(lambda: triton_mla.mla_decode(q_lat, q_pe, cache, meta, ids, (rank + rope) ** -0.5),
                  warmup=50, rep=200, return_mode="median")
    moved = cache.numel() * 2 + (q_lat.numel() * 2) * 2 + q_pe.numel() * 2
    print(f"decode batch {batch:3d} context {context}: {ms * 1e3:8.1f} us, {moved / 1e6:8.1f} MB read, "
          f"{moved / ms / 1e6:7.0f} GB/s")
