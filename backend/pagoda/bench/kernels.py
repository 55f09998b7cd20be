"""``pagoda bench kernels``: the Triton attention kernel against the GPU's own limits.

GPU only (exits 2 with a message elsewhere). Two measurements, printed as markdown with
the device name:

* **Decode attention** at a fixed context (default 4096) for batch sizes 1..64: one
  query token per sequence, K/V read through shuffled block tables. Achieved bandwidth is
  the bytes the kernel must move (all K and V of every context, plus q and the output)
  over its time, compared with the device's measured copy bandwidth (``dst.copy_(src)``
  of a 1 GiB buffer, read + write bytes). Each configuration is captured in a CUDA graph
  with several launches, so Python launch overhead is not timed, and the launches cycle
  over enough separate caches that small batches do not run out of L2.
* **Prefill attention**: one causal sequence of N tokens (no cached context) through the
  paged kernel vs ``torch.nn.functional.scaled_dot_product_attention`` on the same q/K/V
  laid out contiguously (K/V expanded to every query head, ``is_causal=True``).

Every configuration is also checked against a plain torch computation on the same data;
the table reports the largest absolute difference. A third table times decode over an fp8
(e4m3) copy of the same cache against the 16-bit one. Targets (issue 13): decode >= 70% of
copy bandwidth at batch 1 and >= 85% from batch 8 at 4k context; prefill within 1.2x of
SDPA from 1k tokens; fp8-cache decode >= 1.6x the 16-bit cache.

``--tune [--quick]`` instead sweeps launch shapes and writes the tuned-configs JSON
(``kernels_tune.py``); ``--kv-accuracy`` prints the fp8 KV cache accuracy report
(``kv_accuracy.py``, CPU or GPU).

Then the end-to-end section (``kernels_e2e.py``): the engine on a Llama-3-8B-shaped model
with random bf16 weights vs Hugging Face ``generate`` on the same weights (batch-1
decode against the roofline, the mixed workload of ``bench offline``, greedy agreement).
``--small --device cpu`` runs that section alone on a tiny model, as a test of its logic.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagoda.bench import kernels_e2e, kernels_tune
# Timing helpers; kernels_tune reads them off this module.
from pagoda.bench.gpu_timing import copy_bandwidth_gbs, time_eager_ms, time_graph_us  # noqa: F401
from pagoda.kernels.metadata import AttentionMetadata

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
L2_FLUSH_BYTES = 256 * 2**20  # cycle over caches until this many bytes separate reuses


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pagoda bench kernels", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: only the end-to-end section, with --small (a test of the bench's logic)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--num-heads", type=int, default=32, help="query heads (Llama-3-8B: 32)")
    p.add_argument("--num-kv-heads", type=int, default=8, help="KV heads (Llama-3-8B: 8)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--context", type=int, default=4096, help="decode context length")
    p.add_argument("--batch-sizes", default="1,2,4,8,16,32,64")
    p.add_argument("--prefill-lens", default="512,1024,2048,4096")
    p.add_argument("--iters", type=int, default=20, help="timed repetitions (median reported)")
    p.add_argument("--skip-kernels", action="store_true", help="skip the attention-kernel sections")
    p.add_argument("--skip-e2e", action="store_true", help="skip the end-to-end section")
    p.add_argument("--kv-accuracy", action="store_true",
                   help="only the fp8 KV cache accuracy report (logits error, greedy agreement); runs on CPU too")
    p.add_argument("--kv-accuracy-tokens", type=int, default=32, help="with --kv-accuracy: greedy tokens per prompt")
    kernels_e2e.add_arguments(p)
    kernels_tune.add_arguments(p)
    args = p.parse_args(argv)
    if args.dtype is None:
        args.dtype = "bfloat16" if args.device == "cuda" else "float32"
    return args


@dataclass
class PagedData:
    q: torch.Tensor  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    meta: AttentionMetadata


def make_paged_data(
    query_lens: list[int], seq_lens: list[int], args: argparse.Namespace, device: str, seed: int = 0
) -> PagedData:
    """Random q and a cache where each sequence owns shuffled blocks (unused blocks zero)."""
    dtype = DTYPES[args.dtype]
    gen = torch.Generator(device="cpu").manual_seed(seed)
    per_seq = [-(-s // args.block_size) for s in seq_lens]
    order = torch.randperm(sum(per_seq), generator=gen).tolist()
    tables, taken = [], 0
    for n in per_seq:
        tables.append(order[taken : taken + n])
        taken += n
    shape = (sum(per_seq), args.block_size, args.num_kv_heads, args.head_dim)
    torch.manual_seed(seed)  # generate on the device: the caches reach gigabytes
    k_cache = torch.randn(shape, device=device, dtype=dtype)
    v_cache = torch.randn(shape, device=device, dtype=dtype)
    q = torch.randn(sum(query_lens), args.num_heads, args.head_dim, device=device, dtype=dtype)
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, args.block_size, device=device)
    return PagedData(q, k_cache, v_cache, meta)


def contiguous_kv(data: PagedData, seq: int, num_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence ``seq``'s K and V as [1, num_heads, seq_len, head_dim], KV heads expanded."""
    seq_len = data.meta.seq_lens_host[seq]
    block_size = data.k_cache.shape[1]
    table = data.meta.block_tables[seq, : -(-seq_len // block_size)].long()
    group = num_heads // data.k_cache.shape[2]

    def layout(cache: torch.Tensor) -> torch.Tensor:
        rows = cache[table].flatten(0, 1)[:seq_len]  # [seq_len, num_kv_heads, head_dim]
        return rows.transpose(0, 1).repeat_interleave(group, dim=0).unsqueeze(0).contiguous()

    return layout(data.k_cache), layout(data.v_cache)


def sdpa_reference(data: PagedData, scale: float) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Attention per sequence with SDPA on contiguous copies (causal with the context offset)."""
    num_heads = data.q.shape[1]
    out = torch.empty_like(data.q)
    start = 0
    for seq, (q_len, s_len) in enumerate(zip(data.meta.query_lens_host, data.meta.seq_lens_host)):
        k, v = contiguous_kv(data, seq, num_heads)
        q = data.q[start : start + q_len].transpose(0, 1).unsqueeze(0)
        mask = torch.ones(q_len, s_len, dtype=torch.bool, device=q.device).tril(diagonal=s_len - q_len)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        out[start : start + q_len] = o[0].transpose(0, 1)
        start += q_len
    return out


def decode_rows(args: argparse.Namespace, copy_gbs: float, paged_attention, choose_config) -> list[str]:
    scale = args.head_dim**-0.5
    rows = []
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        data = make_paged_data([1] * batch, [args.context] * batch, args, "cuda", seed=batch)
        kv_bytes = 2 * data.k_cache.numel() * data.k_cache.element_size()
        moved = kv_bytes + 2 * data.q.numel() * data.q.element_size()
        # Separate caches (same tables) so consecutive launches do not hit in L2.
        num_copies = max(1, min(16, -(-L2_FLUSH_BYTES // kv_bytes)))
        caches = [(data.k_cache, data.v_cache)] + [
            (data.k_cache.clone(), data.v_cache.clone()) for _ in range(num_copies - 1)
        ]
        calls = [lambda k=k, v=v: paged_attention(data.q, k, v, data.meta, scale) for k, v in caches]
        try:
            us, how = time_graph_us(calls, args.iters), "graph"
        except RuntimeError as exc:  # capture unsupported: time eagerly (launch overhead included)
            print(f"<!-- CUDA graph capture failed ({exc}); timing eagerly -->", file=sys.stderr)
            us, how = 1000 * time_eager_ms(lambda: [c() for c in calls], args.iters) / len(calls), "eager"
        error = (paged_attention(data.q, data.k_cache, data.v_cache, data.meta, scale).float()
                 - sdpa_reference(data, scale).float()).abs().max().item()  # fmt: skip
        cfg = chosen_config(data, choose_config)
        gbs = moved / (us * 1e-6) / 1e9
        rows.append(
            f"| {batch} | {us:.1f} | {moved / 1e6:.1f} | {gbs:.0f} | {100 * gbs / copy_gbs:.0f}% "
            f"| {cfg.num_splits} | {how} | {error:.1e} |"
        )
        del data, caches, calls
        torch.cuda.empty_cache()
    return rows


def chosen_config(data: PagedData, choose_config):
    """The launch shape the wrapper picks for this data (tuned table included)."""
    from pagoda.kernels.triton_attention import DTYPE_NAMES, _tuned_table

    meta, q = data.meta, data.q
    return choose_config(q.shape[0], meta.num_seqs, q.shape[1], data.k_cache.shape[2], meta.max_query_len,
                         meta.max_seq_len, torch.cuda.get_device_properties(0).multi_processor_count,
                         q.element_size(), head_dim=q.shape[2], dtype_name=DTYPE_NAMES[q.dtype],
                         table=_tuned_table(q.device))  # fmt: skip


def fp8_decode_rows(args: argparse.Namespace, paged_attention) -> list[str]:
    """Decode with an fp8 (e4m3, scale 1) cache vs the same data in the model dtype."""
    from pagoda.kernels.reference import quantize_fp8

    scale = args.head_dim**-0.5
    rows = []
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        data = make_paged_data([1] * batch, [args.context] * batch, args, "cuda", seed=batch)
        fp8 = (quantize_fp8(data.k_cache, 1.0), quantize_fp8(data.v_cache, 1.0))
        times = []
        for k, v in ((data.k_cache, data.v_cache), fp8):
            kv_bytes = 2 * k.numel() * k.element_size()
            num_copies = max(1, min(16, -(-L2_FLUSH_BYTES // kv_bytes)))
            copies = [(k, v)] + [(k.clone(), v.clone()) for _ in range(num_copies - 1)]
            times.append(time_graph_us([lambda k=k, v=v: paged_attention(data.q, k, v, data.meta, scale)
                                        for k, v in copies], args.iters))
        deq = PagedData(data.q, fp8[0].to(data.q.dtype), fp8[1].to(data.q.dtype), data.meta)
        error = (paged_attention(data.q, *fp8, data.meta, scale).float()
                 - sdpa_reference(deq, scale).float()).abs().max().item()  # fmt: skip
        rows.append(f"| {batch} | {times[0]:.1f} | {times[1]:.1f} | {times[0] / times[1]:.2f}x | {error:.1e} |")
        del data, fp8, deq
        torch.cuda.empty_cache()
    return rows


def prefill_rows(args: argparse.Namespace, paged_attention) -> list[str]:
    scale = args.head_dim**-0.5
    rows = []
    for n in [int(x) for x in args.prefill_lens.split(",")]:
        data = make_paged_data([n], [n], args, "cuda", seed=n)
        q = data.q.transpose(0, 1).unsqueeze(0).contiguous()  # [1, num_heads, n, head_dim]
        k, v = contiguous_kv(data, 0, args.num_heads)
        ours_ms = time_eager_ms(lambda: paged_attention(data.q, data.k_cache, data.v_cache, data.meta, scale),
                                args.iters)
        sdpa = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)  # noqa: E731
        sdpa_ms = time_eager_ms(sdpa, args.iters)
        ours = paged_attention(data.q, data.k_cache, data.v_cache, data.meta, scale)
        error = (ours.float() - sdpa()[0].transpose(0, 1).float()).abs().max().item()
        flops = 4 * args.num_heads * args.head_dim * n * (n + 1) / 2  # QK^T and PV, causal half
        rows.append(
            f"| {n} | {ours_ms:.3f} | {sdpa_ms:.3f} | {ours_ms / sdpa_ms:.2f}x "
            f"| {flops / (ours_ms * 1e-3) / 1e12:.0f} | {error:.1e} |"
        )
        del data, q, k, v
        torch.cuda.empty_cache()
    return rows


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.kv_accuracy:
        from pagoda.bench import kv_accuracy

        _print_lines(kv_accuracy.run(args))
        return 0
    if args.tune and not torch.cuda.is_available():
        print("pagoda bench kernels --tune times launch shapes on a CUDA GPU and none is visible "
              "(torch.cuda.is_available() is False); nothing was written. Without a tuned file, "
              "choose_config uses its built-in rules.", file=sys.stderr)  # fmt: skip
        return 2
    if args.device == "cpu":
        if not args.small:
            print("--device cpu runs only the end-to-end section, on the tiny model: add --small", file=sys.stderr)
            return 2
        _print_lines([] if args.skip_e2e else kernels_e2e.run(args))
        return 0
    if not torch.cuda.is_available():
        print("pagoda bench kernels needs a CUDA GPU; none is visible (torch.cuda.is_available() is False). "
              "`--small --device cpu` exercises the end-to-end section on a CPU.", file=sys.stderr)  # fmt: skip
        return 2
    try:
        import triton

        from pagoda.kernels.triton_attention import choose_config, paged_attention
    except ImportError as exc:
        print(f"pagoda bench kernels needs OpenAI Triton: {exc}", file=sys.stderr)
        return 2
    if args.num_heads % args.num_kv_heads:
        print("--num-heads must be a multiple of --num-kv-heads", file=sys.stderr)
        return 2
    if args.tune:
        return kernels_tune.run(args, sys.modules[__name__], triton.__version__)
    if not args.skip_kernels:
        kernel_sections(args, triton.__version__, paged_attention, choose_config)
    if not args.skip_e2e:
        _print_lines(kernels_e2e.run(args))
    return 0


def kernel_sections(args: argparse.Namespace, triton_version: str, paged_attention, choose_config) -> None:
    props = torch.cuda.get_device_properties(0)
    copy_gbs = copy_bandwidth_gbs(args.iters)
    print(f"## pagoda bench kernels: {props.name}\n")
    print(f"torch {torch.__version__}, triton {triton_version}, {args.dtype}, {args.num_heads} query heads, "
          f"{args.num_kv_heads} KV heads, head_dim {args.head_dim}, block size {args.block_size}, "
          f"{props.multi_processor_count} SMs\n")  # fmt: skip
    print(f"Measured copy bandwidth (1 GiB `copy_`, read + write): **{copy_gbs:.0f} GB/s**\n")
    print(f"### Decode attention, {args.context}-token context "
          "(target: >= 70% of copy bandwidth at batch 1, >= 85% from batch 8)\n")
    print("| batch | time (us) | bytes moved (MB) | achieved GB/s | of copy bw | splits | timing "
          "| max abs err vs SDPA |")
    print("|---:|---:|---:|---:|---:|---:|---|---:|")
    for row in decode_rows(args, copy_gbs, paged_attention, choose_config):
        print(row, flush=True)
    print(f"\n### Decode attention with an fp8 (e4m3) KV cache, {args.context}-token context "
          "(target: >= 1.6x the 16-bit cache)\n")
    print(f"| batch | {args.dtype} cache (us) | fp8 cache (us) | speedup "
          "| max abs err vs SDPA on the dequantised cache |")
    print("|---:|---:|---:|---:|---:|")
    for row in fp8_decode_rows(args, paged_attention):
        print(row, flush=True)
    print("\n### Prefill attention, one causal sequence (target: within 1.2x of SDPA from 1k tokens)\n")
    print("| tokens | ours (ms) | SDPA (ms) | ours / SDPA | ours TFLOP/s | max abs err vs SDPA |")
    print("|---:|---:|---:|---:|---:|---:|")
    for row in prefill_rows(args, paged_attention):
        print(row, flush=True)
    print(flush=True)


def _print_lines(lines: list[str]) -> None:
    for line in lines:
        print(line, flush=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
