"""``pagoda bench kernel-check``: every Triton kernel family against its float64 reference,
on the device you have (``pagoda bench gpu``'s kernel step).

The kernel tests build CPU tensors for the Triton interpreter; this runs the same
families on the device's own tensors — on a GPU, the compiled kernels with their real
launch shapes — and compares each with the torch reference (``pagoda.kernels.reference``,
``kernels.w8a16``) evaluated in float64 on the same inputs. One row per case: the largest
absolute error and the bound it must stay within. On a CPU it runs under
``TRITON_INTERPRET=1`` at ``--small`` shapes (a test of this module).

Families: paged attention (decode; a mixed step of decodes and prefill chunks, which takes
the two-launch path; an fp8 e4m3 cache with scales), the KV write (16-bit and fp8),
RMSNorm fused with the residual add, rotary, W8A16 (int8 and fp8 weights) and LoRA
shrink/expand. Bounds: a few units in the last place of the output dtype times the
output's scale (fp16 2^-11, bf16 2^-8; fp32 uses 1e-3, which allows TF32 dot products).
Not covered: FP8 ``_scaled_mm`` (torch's own kernel, measured by ``bench quant``).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from typing import Callable, Optional

import torch

UNIT = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8, torch.float32: 1e-3}


@dataclass
class CaseResult:
    family: str
    case: str
    max_abs_err: float
    bound: float

    @property
    def ok(self) -> bool:
        return self.max_abs_err <= self.bound


def _bound(expected: torch.Tensor, dtype: torch.dtype, ulps: float = 8.0) -> float:
    return ulps * UNIT[dtype] * max(1.0, float(expected.abs().max()))


def _attention_case(device, dtype, query_lens, seq_lens, fp8: bool, heads=(8, 2), head_dim=64, block_size=16):
    from pagoda.kernels.metadata import AttentionMetadata
    from pagoda.kernels.reference import quantize_fp8

    gen = torch.Generator().manual_seed(sum(seq_lens))
    num_heads, num_kv_heads = heads
    tables, next_block = [], 1
    for s_len in seq_lens:
        n = -(-s_len // block_size)
        tables.append(list(range(next_block, next_block + n))[::-1])  # non-contiguous, reversed
        next_block += n
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, block_size, device=device)
    shape = (next_block, block_size, num_kv_heads, head_dim)
    k = torch.randn(shape, generator=gen)
    v = torch.randn(shape, generator=gen)
    q = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen).to(device=device, dtype=dtype)
    k_scale = v_scale = 1.0
    if fp8:
        k_scale, v_scale = 0.05, 0.04
        k_cache, v_cache = quantize_fp8(k, k_scale).to(device), quantize_fp8(v, v_scale).to(device)
    else:
        k_cache, v_cache = k.to(device=device, dtype=dtype), v.to(device=device, dtype=dtype)
    return q, k_cache, v_cache, meta, head_dim**-0.5, k_scale, v_scale


def check_attention(device, dtype, small: bool) -> list[CaseResult]:
    from pagoda.kernels import triton_ops
    from pagoda.kernels.reference import paged_attention_ref

    long = 300 if small else 4096
    cases = {
        "decode": ([1, 1, 1], [17, long, 64]),
        "mixed decode + prefill chunks": ([1, 1, 7, 33], [40, long, 7, long // 2 + 33]),
        "prefill": ([long // 2], [long // 2]),
    }
    results = []
    for name, (query_lens, seq_lens) in cases.items():
        for fp8 in (False, True):
            q, kc, vc, meta, scale, ks, vs = _attention_case(device, dtype, query_lens, seq_lens, fp8)
            got = triton_ops.paged_attention(q, kc, vc, meta, scale, ks, vs)
            ref_meta = _host_meta(meta)
            want = paged_attention_ref(q.double().cpu(), _wide(kc), _wide(vc), ref_meta, scale, ks, vs)
            results.append(_compare("attention", f"{name}{' (fp8 cache)' if fp8 else ''}", got, want, dtype))
    return results


def _wide(cache: torch.Tensor) -> torch.Tensor:
    return cache.cpu() if cache.dtype == torch.float8_e4m3fn else cache.double().cpu()


def _host_meta(meta):
    from dataclasses import replace

    return replace(meta, slot_mapping=meta.slot_mapping.cpu(), query_start_loc=meta.query_start_loc.cpu(),
                   seq_lens=meta.seq_lens.cpu(), block_tables=meta.block_tables.cpu())


def _compare(family: str, case: str, got: torch.Tensor, want: torch.Tensor, dtype, ulps: float = 8.0) -> CaseResult:
    err = float((got.double().cpu() - want.double()).abs().max()) if got.numel() else 0.0
    return CaseResult(family, case, err, _bound(want, dtype, ulps))


def check_kv_write(device, dtype, small: bool) -> list[CaseResult]:
    from pagoda.kernels import reference, triton_ops

    results = []
    gen = torch.Generator().manual_seed(3)
    tokens = 37 if small else 1024
    k = torch.randn(tokens, 2, 64, generator=gen).to(device=device, dtype=dtype)
    v = torch.randn(tokens, 2, 64, generator=gen).to(device=device, dtype=dtype)
    slots = torch.randperm(8 * 16 * (tokens // 16 + 2), generator=gen)[:tokens].to(device)
    num_blocks = 8 * (tokens // 16 + 2)
    caches = [torch.zeros(num_blocks, 16, 2, 64, device=device, dtype=dtype) for _ in range(4)]
    triton_ops.write_kv(k, v, caches[0], caches[1], slots, 1.0, 1.0)
    reference.write_kv(k, v, caches[2], caches[3], slots, 1.0, 1.0)
    err = max(float((a.float() - b.float()).abs().max()) for a, b in ((caches[0], caches[2]), (caches[1], caches[3])))
    results.append(CaseResult("kv write", "16-bit cache", err, 0.0))  # a copy: bit-identical
    # fp8: stored * scale within e4m3's half step of the input (2^-4 relative; 2^-10 * scale
    # absolute below the normal range), plus the same again for a tie rounded the other way.
    for x, scale in ((k, 0.05), (v, 0.04)):
        cache = torch.zeros(num_blocks, 16, 2, 64, device=device, dtype=torch.float8_e4m3fn)
        triton_ops.write_kv(x, x, cache, cache.clone(), slots, scale, scale)
        stored = cache.view(-1, 2, 64)[slots].double().cpu() * scale
        want = x.double().cpu().clamp(-448 * scale, 448 * scale)
        excess = ((stored - want).abs() - 2 * (2.0**-4 * want.abs() + 2.0**-10 * scale)).max()
        results.append(CaseResult("kv write", f"fp8 cache (scale {scale}): error beyond e4m3 rounding",
                                  max(float(excess), 0.0), 0.0))
    return results


def check_norm_and_rotary(device, dtype, small: bool) -> list[CaseResult]:
    from pagoda.kernels import reference, triton_ops

    gen = torch.Generator().manual_seed(5)
    tokens, hidden = (9, 256) if small else (512, 4096)
    x, res = (torch.randn(tokens, hidden, generator=gen).to(device=device, dtype=dtype) for _ in range(2))
    weight = torch.randn(hidden, generator=gen).to(device=device, dtype=dtype)
    normed, new_res = triton_ops.rms_norm(x, weight, 1e-5, res.clone())
    want, want_res = reference.rms_norm(x.double().cpu(), weight.double().cpu(), 1e-5, res.double().cpu())
    results = [_compare("rms norm", "with residual", normed, want, dtype),
               _compare("rms norm", "residual sum", new_res, want_res, dtype, ulps=2.0)]
    head_dim, positions = 64, torch.randint(0, 4096, (tokens,), generator=gen)
    inv = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.arange(4096, dtype=torch.float64)[:, None] * inv[None, :]
    cos_sin = torch.cat((angles.cos(), angles.sin()), dim=-1)
    q = torch.randn(tokens, 8, head_dim, generator=gen).to(device=device, dtype=dtype)
    k = torch.randn(tokens, 2, head_dim, generator=gen).to(device=device, dtype=dtype)
    got_q, got_k = triton_ops.apply_rotary(q.clone(), k.clone(), positions.to(device), cos_sin.float().to(device))
    want_q, want_k = reference.apply_rotary(q.double().cpu(), k.double().cpu(), positions, cos_sin)
    results += [_compare("rotary", "q", got_q, want_q, dtype), _compare("rotary", "k", got_k, want_k, dtype)]
    return results


def check_w8a16(device, dtype, small: bool) -> list[CaseResult]:
    from pagoda.kernels import triton_w8a16, w8a16

    gen = torch.Generator().manual_seed(7)
    m, n, k = (5, 96, 256) if small else (16, 4096, 4096)
    x = torch.randn(m, k, generator=gen).to(device=device, dtype=dtype)
    results = []
    for name, qweight in (("int8", torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)),
                          ("fp8", (torch.randn(n, k, generator=gen) * 64).clamp(-448, 448).to(torch.float8_e4m3fn))):
        scale = (torch.rand(n, generator=gen) * 0.01 + 1e-3).float()
        got = triton_w8a16.w8a16_linear(x, qweight.to(device), scale.to(device))
        want = x.double().cpu() @ (w8a16.dequantize(qweight, scale, torch.float64)).T
        results.append(_compare("w8a16", f"{name} weights, {m}x{n}x{k}", got, want, dtype, ulps=16.0))
    return results


def check_lora(device, dtype, small: bool) -> list[CaseResult]:
    from pagoda.kernels import triton_lora

    gen = torch.Generator().manual_seed(11)
    tokens, d_in, d_out, rank, slots = (7, 64, 96, 8, 3) if small else (256, 4096, 4096, 16, 4)
    x = torch.randn(tokens, d_in, generator=gen).to(device=device, dtype=dtype)
    y = torch.randn(tokens, d_out, generator=gen).to(device=device, dtype=dtype)
    a = (torch.randn(slots, rank, d_in, generator=gen) * 0.1).to(device=device, dtype=dtype)
    b = (torch.randn(slots, d_out, rank, generator=gen) * 0.1).to(device=device, dtype=dtype)
    token_slots = torch.randint(-1, slots, (tokens,), generator=gen)
    got = triton_lora.lora_apply(y.clone(), x, a, b, token_slots.to(device))
    want = y.double().cpu().clone()
    for t, s in enumerate(token_slots.tolist()):
        if s >= 0:
            want[t] += b[s].double().cpu() @ (a[s].double().cpu() @ x[t].double().cpu())
    return [_compare("lora", f"shrink + expand, {slots} slots, rank {rank}", got, want, dtype, ulps=16.0)]


FAMILIES: dict[str, Callable[..., list[CaseResult]]] = {
    "attention": check_attention, "kv_write": check_kv_write, "norm_rotary": check_norm_and_rotary,
    "w8a16": check_w8a16, "lora": check_lora,
}


def run(device: str, dtype: torch.dtype, small: bool, families: Optional[list[str]] = None) -> list[CaseResult]:
    results: list[CaseResult] = []
    for name in families or list(FAMILIES):
        results += FAMILIES[name](torch.device(device), dtype, small)
    return results


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pagoda bench kernel-check", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    p.add_argument("--small", action="store_true", help="small shapes (the CPU interpreter)")
    p.add_argument("--families", default=",".join(FAMILIES), help=f"comma-separated subset of {','.join(FAMILIES)}")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    p = make_parser()
    args = p.parse_args(argv)
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        print("pagoda bench kernel-check: on a CPU, set TRITON_INTERPRET=1 (and use --small)", file=sys.stderr)
        return 2
    families = [f for f in args.families.split(",") if f]
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown:
        p.error(f"--families: unknown {', '.join(unknown)}; known: {', '.join(FAMILIES)}")
    results = run(args.device, getattr(torch, args.dtype), args.small, families)
    print(f"| family | case ({args.dtype}, {args.device}) | max abs error | bound | |\n|---|---|---|---|---|")
    for r in results:
        print(f"| {r.family} | {r.case} | {r.max_abs_err:.3g} | {r.bound:.3g} | {'ok' if r.ok else 'FAIL'} |")
    failed = [r for r in results if not r.ok]
    print(f"\n{len(results) - len(failed)} of {len(results)} cases within their bounds")
    return 1 if failed else 0
