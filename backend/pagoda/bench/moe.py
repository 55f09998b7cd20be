"""``pagoda bench moe``: one Mixture-of-Experts layer's experts at 1 to 512 tokens.

Random weights and random router logits (softmax, top-k, renormalised), grouped by
``models.moe.group_by_expert``; only the experts' computation is timed (the grouping is
the same for every path). Paths:

- ``sparse``: the experts-with-tokens loop (``kernels.reference_moe.moe_experts``), what CPUs
  run and the per-expert torch loop a GPU would run without the fused kernel;
- ``dense`` (CPU): every expert on every token, weighted by the routing mask (what a
  sparse block must never degenerate to);
- ``fused`` (CUDA): the OpenAI-Triton kernels (``kernels.triton_moe``), and its share of
  the HBM roofline: bytes of the experts actually touched (plus activations) over the
  time, divided by the device's measured copy bandwidth.

Printed: tokens/s per path and the ratio to ``sparse``. Defaults: on CUDA a
Qwen3-30B-A3B-shaped layer (128 experts, top-8, hidden 2048, expert intermediate 768,
bf16); on CPU a smaller one (16 experts, top-2, hidden 512, intermediate 256, fp32), since
the full layer's 2.4 GB of fp32 experts is a GPU's job.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Callable

import torch

from pagoda.bench.common import machine_line
from pagoda.kernels import reference_moe
from pagoda.models.moe import ExpertGroups, group_by_expert, route

GPU_SHAPE = dict(experts=128, top_k=8, hidden=2048, inter=768, dtype="bfloat16")
CPU_SHAPE = dict(experts=16, top_k=2, hidden=512, inter=256, dtype="float32")


def dense_all_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
                      w2: torch.Tensor) -> torch.Tensor:
    """Every expert on every token, masked by the routing: the baseline a sparse path must beat."""
    inter = w2.shape[2]
    out = torch.zeros_like(x)
    for e in range(w13.shape[0]):
        gate, up = torch.nn.functional.linear(x, w13[e]).split(inter, dim=-1)
        y = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, w2[e])
        out += (weights * (ids == e)).sum(dim=-1, keepdim=True) * y
    return out


def _time_s(call: Callable[[], object], repeats: int, cuda: bool) -> float:
    call()  # warm-up (and Triton compilation)
    best = float("inf")
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        call()
        if cuda:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def touched_bytes(groups: ExpertGroups, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> int:
    """Weights of the experts that received tokens, plus the tokens read and written."""
    active = int((groups.counts > 0).sum())
    per_expert = (w13[0].numel() + w2[0].numel()) * w13.element_size()
    return active * per_expert + 2 * x.numel() * x.element_size()


def measure(num_tokens: int, shape: dict, device: torch.device, repeats: int, peak_gbs: float | None) -> dict:
    dtype = getattr(torch, shape["dtype"])
    gen = torch.Generator(device=device).manual_seed(num_tokens)
    experts, hidden, inter, top_k = shape["experts"], shape["hidden"], shape["inter"], shape["top_k"]
    x = torch.randn(num_tokens, hidden, generator=gen, device=device).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen, device=device) / hidden**0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen, device=device) / inter**0.5).to(dtype)
    weights, ids = route(torch.randn(num_tokens, experts, generator=gen, device=device).to(dtype), top_k, True)
    groups = group_by_expert(ids, weights, experts)
    args = (x, groups.order, groups.weights, groups.offsets, w13, w2, top_k)
    cuda = device.type == "cuda"
    row = {"tokens": num_tokens, "active_experts": int((groups.counts > 0).sum())}
    row["sparse_tok_s"] = num_tokens / _time_s(lambda: reference_moe.moe_experts(*args), repeats, cuda)
    if cuda:
        from pagoda.kernels import triton_moe

        seconds = _time_s(lambda: triton_moe.moe_experts(*args), repeats, cuda)
        row["fused_tok_s"] = num_tokens / seconds
        if peak_gbs:
            row["fused_hbm_pct"] = 100 * touched_bytes(groups, x, w13, w2) / seconds / 1e9 / peak_gbs
    else:
        row["dense_tok_s"] = num_tokens / _time_s(lambda: dense_all_experts(x, ids, weights, w13, w2), repeats, cuda)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagoda bench moe", description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", default="1,8,64,512", help="comma-separated token counts")
    for key in ("experts", "top_k", "hidden", "inter"):
        parser.add_argument(f"--{key.replace('_', '-')}", type=int, default=None)
    parser.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per point; the fastest is kept")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    shape = dict(GPU_SHAPE if device.type == "cuda" else CPU_SHAPE)
    shape.update({k: v for k in shape if (v := getattr(args, k, None)) is not None})
    peak = None
    if device.type == "cuda":
        from pagoda.bench.gpu_timing import copy_bandwidth_gbs

        peak = copy_bandwidth_gbs(iters=10)
    rows = [measure(int(t), shape, device, args.repeats, peak) for t in args.tokens.split(",")]
    print(f"# {machine_line()}; layer {shape}" + (f"; copy bandwidth {peak:.0f} GB/s" if peak else ""))
    other = "fused" if device.type == "cuda" else "dense"
    print(f"| tokens | experts hit | sparse tok/s | {other} tok/s | {other} / sparse |"
          + (" fused % HBM roofline |" if peak else ""))
    for r in rows:
        line = (f"| {r['tokens']} | {r['active_experts']} | {r['sparse_tok_s']:.0f} | {r[other + '_tok_s']:.0f} | "
                f"{r[other + '_tok_s'] / r['sparse_tok_s']:.2f} |")
        print(line + (f" {r['fused_hbm_pct']:.0f} |" if peak else ""))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"machine": machine_line(), "shape": shape, "copy_gbs": peak, "rows": rows}, f, indent=1)
    return 0
