"""``pagoda bench cpu-kernels``: pagoda's C++ CPU kernels against what they replace, alone.

Three measurements on the default model's shapes (9 query heads, 3 KV heads of 64; hidden
576), float32 unless ``--dtype bfloat16``, at ``--threads`` threads (bound to cores 0..N-1):

- **decode attention**: ``decode_attention`` on B sequences of C cached positions (blocks in a
  shuffled order, as after churn) vs the torch path it replaced (gather into padded buckets +
  SDPA, ``PAGODA_CPU_KERNELS=torch``; its step plan made once, as a model's 30 layers share
  it), with the K/V bytes it streams per second and, beside it, ``torch.sum`` over as many
  bytes (what this machine's memory gives one pass);
- **prefill attention**: ``prefill_attention`` on one prompt chunk of Q positions ending at
  S vs gather + SDPA (``is_causal`` for a first chunk, a mask after context), in GFLOP/s of
  the causal product;
- **matmul**: a step's matmuls over 30 layers of distinct weights (from memory, as in the
  model) at R rows, pagoda's packed tiles vs oneDNN's packed inner product.

Every row checks the kernel's output against the path it replaced (max abs difference
printed; float32 differences are summation order). Best of ``--repeats`` timed runs after a
warm-up. ``--small``: tiny shapes, a few seconds (the test runs it). Needs the C++ kernels
(``kernels.cpu_native``); the prefill row needs an AVX-512 build.
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from typing import Callable

import torch
import torch.nn.functional as F

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
LINEAR_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down


def best_time(fn: Callable[[], object], repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def paged_cache(seqs: int, length: int, dtype: torch.dtype, gen: torch.Generator):
    """K/V caches holding ``seqs`` contexts of ``length`` in shuffled blocks, and their tables."""
    per = -(-length // BLOCK)
    blocks = seqs * per + 1
    k = torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    v = torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    tables = torch.randperm(blocks, generator=gen)[:seqs * per].view(seqs, per).int().contiguous()
    return k, v, tables


def torch_path(fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """``fn`` run with the C++ kernels off (``PAGODA_CPU_KERNELS=torch``): the references' path."""
    from pagoda import kernels
    from pagoda.kernels import cpu_native

    def run() -> torch.Tensor:
        saved = os.environ.get(cpu_native.KERNELS_ENV)
        os.environ[cpu_native.KERNELS_ENV] = "torch"
        kernels.reload_settings()
        try:
            return fn()
        finally:
            os.environ.pop(cpu_native.KERNELS_ENV) if saved is None else os.environ.update(
                {cpu_native.KERNELS_ENV: saved})
            kernels.reload_settings()
    return run


def decode_row(seqs: int, length: int, dtype: torch.dtype, repeats: int, gen: torch.Generator) -> str:
    from pagoda.kernels import cpu_native, reference
    from pagoda.kernels.metadata import AttentionMetadata

    k, v, tables = paged_cache(seqs, length, dtype, gen)
    q = torch.randn(seqs, HEADS, HEAD_DIM, generator=gen).to(dtype)
    lens = torch.full((seqs,), length, dtype=torch.int32)
    out, scale = torch.empty_like(q), HEAD_DIM ** -0.5
    rows = torch.arange(seqs)
    ops = cpu_native.loaded_ops()
    native = best_time(lambda: ops.decode_attention(q, k, v, tables, lens, rows, rows, scale, 0, None, out), repeats)

    meta = AttentionMetadata.build([1] * seqs, [length] * seqs, tables.tolist(), BLOCK)

    def gathered() -> torch.Tensor:  # its gather plan is made on the first call, once a step as in the model
        return reference.paged_attention_torch(q, k, v, meta, scale)

    expected = torch_path(gathered)()
    torch_time = best_time(torch_path(gathered), repeats)
    nbytes = 2 * seqs * length * KV_HEADS * HEAD_DIM * k.element_size()
    flat = torch.cat([k.flatten(), v.flatten()])[:nbytes // k.element_size()]
    stream = best_time(flat.sum, repeats)
    diff = (out.float() - expected.float()).abs().max().item()
    return (f"| {seqs} x {length} | {native * 1e3:.2f} ({nbytes / native / 1e9:.1f} GB/s) | "
            f"{torch_time * 1e3:.2f} | {torch_time / native:.2f}x | {nbytes / stream / 1e9:.1f} GB/s | {diff:.1e} |")


def prefill_row(q_len: int, s_len: int, dtype: torch.dtype, repeats: int, gen: torch.Generator) -> str:
    from pagoda.kernels import cpu_native

    k, v, tables = paged_cache(1, s_len, dtype, gen)
    q = torch.randn(q_len, HEADS, HEAD_DIM, generator=gen).to(dtype)
    out, scale = torch.empty_like(q), HEAD_DIM ** -0.5
    slots = (tables[0].long().unsqueeze(1) * BLOCK + torch.arange(BLOCK)).flatten()[:s_len]
    mask = None if q_len == s_len else torch.ones(q_len, s_len, dtype=torch.bool).tril(diagonal=s_len - q_len)

    def gathered() -> torch.Tensor:  # the torch path's prompt chunk: gather its context, SDPA
        kh = k.flatten(0, 1).index_select(0, slots).transpose(0, 1).unsqueeze(0)
        vh = v.flatten(0, 1).index_select(0, slots).transpose(0, 1).unsqueeze(0)
        return F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), kh, vh, attn_mask=mask,
                                              is_causal=mask is None, scale=scale, enable_gqa=True)[0].transpose(0, 1)

    ops = cpu_native.loaded_ops()
    native = best_time(lambda: ops.prefill_attention(q, k, v, tables[0], s_len, scale, 0, None, out), repeats)
    torch_path = best_time(gathered, repeats)
    diff = (out.float() - gathered().float()).abs().max().item()
    flops = 4 * HEADS * HEAD_DIM * sum(s_len - q_len + i + 1 for i in range(q_len))
    return (f"| {q_len} ending at {s_len} | {native * 1e3:.1f} ({flops / native / 1e9:.0f} GFLOP/s) | "
            f"{torch_path * 1e3:.1f} ({flops / torch_path / 1e9:.0f}) | {torch_path / native:.2f}x | {diff:.1e} |")


def matmul_rows(rows_list: list[int], layers: int, dtype: torch.dtype, repeats: int, gen: torch.Generator) -> list[str]:
    from pagoda.models.cpu_gemm import PackedWeight

    weights = [[torch.randn(n, k, generator=gen).to(dtype) for n, k in LINEAR_SHAPES] for _ in range(layers)]
    packs = {kind: [[PackedWeight(w, kind) for w in layer] for layer in weights] for kind in ("pagoda", "onednn")}
    del weights
    lines = []
    for rows in rows_list:
        xs = [torch.randn(rows, k, generator=gen).to(dtype) for _, k in LINEAR_SHAPES]
        outs: dict[str, list[torch.Tensor]] = {}

        def step(kind: str) -> None:
            outs[kind] = [p.matmul(x) for layer in packs[kind] for p, x in zip(layer, xs)]

        ours, onednn = best_time(lambda: step("pagoda"), repeats), best_time(lambda: step("onednn"), repeats)
        diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(outs["pagoda"], outs["onednn"]))
        flops = 2 * rows * layers * sum(n * k for n, k in LINEAR_SHAPES)
        lines.append(f"| {rows} | {ours * 1e3:.2f} ({flops / ours / 1e9:.0f} GFLOP/s) | "
                     f"{onednn * 1e3:.2f} ({flops / onednn / 1e9:.0f}) | {onednn / ours:.2f}x | {diff:.1e} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagoda bench cpu-kernels", description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--small", action="store_true", help="tiny shapes, seconds (a check that it runs)")
    args = parser.parse_args(argv)
    from pagoda.kernels import cpu_native

    if cpu_native.loaded_ops() is None:
        print(f"pagoda bench cpu-kernels: skipped: {cpu_native.build() or cpu_native.KERNELS_ENV + '=torch'}")
        return 0
    torch.set_num_threads(args.threads)
    cpu_native.bind_threads(list(range(args.threads)))
    dtype, gen = getattr(torch, args.dtype), torch.Generator().manual_seed(0)
    decode = [(2, 100)] if args.small else [(1, 8100), (4, 8100), (32, 512)]
    prefill = [(40, 40), (40, 120)] if args.small else [(2048, 2048), (2048, 8100)]
    rows, layers = ([1, 9], 2) if args.small else ([1, 8, 32, 256, 2048], 30)
    print(f"machine: {platform.processor() or platform.machine()}, torch {torch.__version__}, {args.threads} "
          f"thread(s) bound, {args.dtype}, C++ kernels: {','.join(sorted(cpu_native.gemm_features())) or 'plain'}")
    print("\n| decode: sequences x context | pagoda ms (K/V read) | torch path ms | speedup | memory pass "
          "(torch.sum) | max diff |\n|---|---|---|---|---|---|")
    for seqs, length in decode:
        print(decode_row(seqs, length, dtype, args.repeats, gen), flush=True)
    if "avx512f" in cpu_native.gemm_features():
        print("\n| prefill: chunk | pagoda ms (GFLOP/s) | gather + SDPA ms (GFLOP/s) | speedup | max diff |"
              "\n|---|---|---|---|---|")
        for q_len, s_len in prefill:
            print(prefill_row(q_len, s_len, dtype, args.repeats, gen), flush=True)
    print(f"\n| matmul rows ({layers} layers' weights) | pagoda ms (GFLOP/s) | oneDNN ms (GFLOP/s) | speedup | "
          "max diff |\n|---|---|---|---|---|")
    for line in matmul_rows(rows, layers, dtype, args.repeats, gen):
        print(line, flush=True)
    return 0
