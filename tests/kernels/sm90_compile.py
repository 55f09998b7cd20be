"""Record every launch variant of the Triton kernels and compile them for sm_90 without a GPU.

Run as a script *without* ``TRITON_INTERPRET`` (the test runs it in a subprocess): the
kernels must be real ``JITFunction``s. ``JITFunction.run`` is replaced by a recorder, the
public wrappers are called on small CPU tensors for every shape family they serve, and
each recorded launch (the exact arguments the wrapper passes) becomes an ``ASTSource``
compiled with ``triton.compile(..., target=GPUTarget("cuda", 90, 32))``, with the
divisibility-by-16 hints a real launch gets (aligned pointers, integers % 16 == 0), so the
machine code (e.g. vectorised loads) is what the GPU would run. So the compiled variants
are the ones the wrappers really launch, not a hand-written list that can drift. Every
variant is reported; a covering subset of them is compiled (``sm90_cover.py``: every pair of
parameter values the wrappers launch together, and each kernel's largest launches), or all
of them with ``--all`` (``PAGODA_SM90_ALL=1`` in the tests).

Usage: python sm90_compile.py [--shard I/N] [--families rules|tuning|gdn|deepseek|gemma4] [--all]  -> one
JSON line per variant on stdout (``compiled`` false: recorded only, reported by shard 0). ``rules``: every
kernel through the shapes the built-in rules pick; ``tuning``: every attention launch shape
``pagoda bench kernels --tune`` may write; ``gdn``:
the Gated DeltaNet kernels (a family of their own: their chunked kernel is the slowest to compile);
``deepseek``: DeepSeek-V3's launches (the MLA latent write and split-K decode, block-scaled FP8
GEMMs and FP8 experts); ``gemma4``: Gemma 4's head sizes (256 on sliding layers, 512 on full
ones) through the attention, KV write and rotary kernels, and Gemma 3's image steps at 256.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

from pagoda.kernels import triton_attention, triton_conv1d, triton_gdn, triton_mla, triton_moe, triton_ops, triton_w4a16
from pagoda.kernels import triton_w8a16, tuning
from pagoda.kernels.metadata import AttentionMetadata

from tests.kernels.sm90_cover import covering

# A 16-byte asynchronous copy global -> shared: how the pipelined K/V tiles are loaded.
VECTOR_16B = re.compile(r"cp\.async\.cg\.shared\.global \[[^\]]*\], \[[^\]]*\], 0x10")
H100_SMS = 132
H100_MAX_SHARED = 227 * 1024
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
HEAD_DIMS = (64, 80, 128)
TORCH_TO_TRITON = {
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float32: "fp32",
    torch.int32: "i32",
    torch.int64: "i64",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.float8_e4m3fn: "fp8e4nv",
    torch.bool: "i1",
}
# Llama-3-8B's o_proj (N = K = 4096) at rows from batch-1 decode to a prefill chunk below
# w8a16.DEQUANT_ROWS: each tile family of the W8A16 kernel (16/32/64/128 rows), split-K
# (1..64 rows) and not (2047 rows). The split count is a run-time argument.
W8A16_SHAPES = ((4096, 4096),)
W8A16_ROWS = (1, 17, 64, 2047)


def record_launches(families: str = "rules") -> list[tuple[JITFunction, tuple, dict]]:
    """``rules``: every kernel with the built-in shapes; ``tuning``: the tunable shapes; ``gdn``:
    the Gated DeltaNet kernels."""
    launches: list[tuple[JITFunction, tuple, dict]] = []

    def recorder(self, *args, grid, warmup, **kwargs):
        launches.append((self, args, kwargs))

    JITFunction.run = recorder
    triton_attention._num_sms = lambda device: H100_SMS  # the wrapper chooses as on an H100
    if families == "tuning":
        _tuning_candidate_launches(torch.bfloat16)
        _tuning_candidate_launches(FP8, quick=True)
        return launches
    if families == "gdn":
        for dtype in DTYPES:
            _gated_deltanet_launches(dtype)
        return launches
    if families == "deepseek":
        _deepseek_launches()
        return launches
    if families == "gemma4":
        _gemma4_launches()
        return launches
    for dtype in DTYPES:
        for head_dim in HEAD_DIMS:
            _attention_launches(dtype, head_dim, dtype)
            _small_launches(dtype, head_dim, dtype)
            # The fp8 KV cache serves 16-bit models: bf16 at every head size, fp16 at 128.
            if dtype == torch.bfloat16 or (dtype == torch.float16 and head_dim == 128):
                _attention_launches(dtype, head_dim, FP8, head_groups=[(32, 8)])
                _small_launches(dtype, head_dim, FP8)
        _sink_launches(dtype)
        _key_limit_launches(dtype, 128, [(32, 16)])
        _lora_launches(dtype)
        _w8a16_launches(dtype)
        _w4a16_launches(dtype)
        _moe_launches(dtype)
    return launches


FP8 = torch.float8_e4m3fn
# (query lens, context lens) of the steps whose launches are recorded, each at 4k context:
# decode at batch 1 (split-K), decode at batch 64 (decode-only, unsplit), a mixed step of 63
# decodes and a 512-token chunk (two launches: a 128-row prefill tile split in 2, unsplit
# decode), and one decode beside a 64-token chunk (both launches split).
STEPS = {
    "decode_b1": ([1], [4096]),
    "decode_b64": ([1] * 64, [4096] * 64),
    "mixed_b64": ([1] * 63 + [512], [4096] * 64),
    "mixed_b2": ([1, 64], [4096, 4096]),
}


def _meta(query_lens: list[int], seq_lens: list[int]) -> AttentionMetadata:
    blocks = -(-max(seq_lens) // 16)
    return AttentionMetadata.build(query_lens, seq_lens, [[0] * blocks for _ in seq_lens], 16)


def _attention_launches(dtype: torch.dtype, head_dim: int, cache_dtype: torch.dtype, head_groups=None) -> None:
    """Each dtype x head size at GQA 4 (Llama-3-8B) through every step of ``STEPS``; GQA
    1/3/8 at bf16 x 128 and the fp8 cache through decode at batch 1 and the big mixed
    step. The public wrapper picks the configs as on an H100."""
    main = head_groups is None and cache_dtype == dtype
    head_groups = head_groups or ([(32, 8)] + ([(8, 8), (9, 3), (64, 8)] if (dtype, head_dim) == (
        torch.bfloat16, 128) else []))
    for num_heads, num_kv_heads in head_groups:
        steps = STEPS if main and num_heads == 4 * num_kv_heads else {k: STEPS[k] for k in ("decode_b1", "mixed_b64")}
        for query_lens, seq_lens in steps.values():
            q = torch.empty(sum(query_lens), num_heads, head_dim, dtype=dtype)
            cache = torch.empty(2, 16, num_kv_heads, head_dim, dtype=cache_dtype)
            triton_attention.paged_attention(q, cache, cache, _meta(query_lens, seq_lens), 0.1)
            if main and num_heads == 4 * num_kv_heads and dtype == torch.bfloat16:
                # a sliding window that is not a multiple of 16 (no divisibility hint)
                triton_attention.paged_attention(q, cache, cache, _meta(query_lens, seq_lens), 0.1, window=4095)


def _sink_launches(dtype: torch.dtype) -> None:
    """gpt-oss attention (64 heads over 8 KV heads, head_dim 64, per-head sinks) through every
    step of ``STEPS``: its 128-token sliding layers and its full layers."""
    sinks = torch.empty(64, dtype=torch.float32)
    for query_lens, seq_lens in STEPS.values():
        q = torch.empty(sum(query_lens), 64, 64, dtype=dtype)
        cache = torch.empty(2, 16, 8, 64, dtype=dtype)
        for window in (0, 128):
            triton_attention.paged_attention(q, cache, cache, _meta(query_lens, seq_lens), 0.1, window=window,
                                             sinks=sinks)


def _key_limit_launches(dtype: torch.dtype, head_dim: int, groups: list[tuple[int, int]],
                        cache_dtype: torch.dtype | None = None) -> None:
    """Gemma 3's image steps (its images' tokens see each other: per-query key limits) at the
    given heads, sliding (1024) and full layers: a decode beside a 64-token chunk and 63 decodes
    beside a 512-token chunk (both launches, split and not)."""
    for num_heads, num_kv_heads in groups:
        for query_lens, seq_lens in (STEPS["mixed_b2"], STEPS["mixed_b64"]):
            q = torch.empty(sum(query_lens), num_heads, head_dim, dtype=dtype)
            cache = torch.empty(2, 16, num_kv_heads, head_dim, dtype=cache_dtype or dtype)
            meta = _meta(query_lens, seq_lens)
            meta.set_key_limits(list(range(sum(query_lens))), "cpu")
            for window in (0, 1024):
                triton_attention.paged_attention(q, cache, cache, meta, 0.1, window=window)


def _tuning_candidate_launches(cache_dtype: torch.dtype, quick: bool = False) -> None:
    """Every launch shape ``pagoda bench kernels --tune`` may write (bf16, head_dim 128,
    GQA 4; the shapes do not depend on the group, and 128 is the largest head size)."""
    for phase, (query_lens, seq_lens) in (("decode", STEPS["decode_b1"]), ("prefill", ([2048], [2048]))):
        fam = tuning.Family(phase, "bf16", 128, 32, 8, 1, seq_lens[0])
        meta = _meta(query_lens, seq_lens)
        q = torch.empty(sum(query_lens), 32, 128, dtype=torch.bfloat16)
        cache = torch.empty(2, 16, 8, 128, dtype=cache_dtype)
        for entry in tuning.candidates(phase, quick):
            triton_attention.paged_attention(q, cache, cache, meta, 0.1, fam.config(entry, H100_SMS))


def _small_launches(dtype: torch.dtype, head_dim: int, cache_dtype: torch.dtype) -> None:
    kv = torch.empty(3, 8, head_dim, dtype=dtype)
    cache = torch.empty(2, 16, 8, head_dim, dtype=cache_dtype)
    triton_ops.write_kv(kv, kv, cache, cache, torch.zeros(3, dtype=torch.int64))
    if cache_dtype == FP8:
        return
    q = torch.empty(3, 32, head_dim, dtype=dtype)
    cos_sin = torch.empty(64, head_dim, dtype=torch.float32)
    triton_ops.apply_rotary(q, kv, torch.zeros(3, dtype=torch.int64), cos_sin)
    if head_dim == 128:  # norm variants depend on the hidden size, not the head size
        for hidden in (576, 4096):
            x = torch.empty(3, hidden, dtype=dtype)
            triton_ops.rms_norm(x, torch.empty(hidden, dtype=dtype), 1e-5)
            triton_ops.rms_norm(x, torch.empty(hidden, dtype=dtype), 1e-5, x)


def _lora_launches(dtype: torch.dtype) -> None:
    """Multi-LoRA shrink/expand at ranks 8 and 64 (x3 for the fused qkv), Llama-3-8B shapes."""
    x = torch.empty(3, 4096, dtype=dtype)
    slots = torch.zeros(3, dtype=torch.int64)
    for rank in (8, 64, 3 * 64):
        a = torch.empty(4, rank, 4096, dtype=dtype)
        b = torch.empty(4, 6144, rank, dtype=dtype)
        triton_ops.lora_apply(torch.empty(3, 6144, dtype=dtype), x, a, b, slots)


def _w8a16_launches(dtype: torch.dtype) -> None:
    """int8 and fp8 weights at each row count (the split-K reduction comes with the splits)."""
    for weight_dtype in (torch.int8, torch.float8_e4m3fn):
        for n, k in W8A16_SHAPES:
            qweight = torch.empty(n, k, dtype=weight_dtype)
            for rows in W8A16_ROWS:
                triton_w8a16.w8a16_linear(torch.empty(rows, k, dtype=dtype), qweight, torch.empty(n))


def _w4a16_launches(dtype: torch.dtype) -> None:
    """4-bit weights, group 128, with zero points and symmetric, at the W8A16 row counts."""
    for n, k in W8A16_SHAPES:
        qweight = torch.empty(n, k // 2, dtype=torch.uint8)
        scales = torch.empty(n, k // 128)
        for zeros in (torch.empty(n, k // 128), None):
            for rows in W8A16_ROWS:
                triton_w4a16.w4a16_linear(torch.empty(rows, k, dtype=dtype), qweight, scales, zeros, 128)


def _moe_launches(dtype: torch.dtype) -> None:
    """The fused MoE kernels at a Qwen3-30B-A3B layer (128 experts, top-8, hidden 2048,
    expert intermediate 768) for one decode token and a 512-token chunk. The expert stacks
    are one expert broadcast (stride 0: no 1.6 GB allocation; still divisible by 16)."""
    num_experts, top_k, hidden, inter = 128, 8, 2048, 768
    w13 = torch.empty(1, 2 * inter, hidden, dtype=dtype).expand(num_experts, -1, -1)
    w2 = torch.empty(1, hidden, inter, dtype=dtype).expand(num_experts, -1, -1)
    for tokens in (1, 512):
        order = torch.arange(tokens * top_k)
        offsets = torch.zeros(num_experts + 1, dtype=torch.int64)
        weights = torch.empty(tokens * top_k, dtype=dtype)
        triton_moe.moe_experts(torch.empty(tokens, hidden, dtype=dtype), order, weights, offsets, w13, w2, top_k)
    # gpt-oss-20b's experts (32, top-4, hidden = intermediate = 2880): biases, clamped SwiGLU
    num_experts, top_k, hidden = 32, 4, 2880
    w13 = torch.empty(1, 2 * hidden, hidden, dtype=dtype).expand(num_experts, -1, -1)
    w2 = torch.empty(1, hidden, hidden, dtype=dtype).expand(num_experts, -1, -1)
    b13, b2 = torch.empty(num_experts, 2 * hidden, dtype=dtype), torch.empty(num_experts, hidden, dtype=dtype)
    offsets = torch.zeros(num_experts + 1, dtype=torch.int64)
    triton_moe.moe_experts(torch.empty(1, hidden, dtype=dtype), torch.arange(top_k), torch.empty(top_k, dtype=dtype),
                           offsets, w13, w2, top_k, b13, b2, (1.702, 7.0))


# Gated DeltaNet at Qwen3-Next-80B's linear-attention layer (16 key heads, 32 value heads,
# head dims 128, conv kernel 4: conv_dim 8192) and, in bf16, at a TP=4 rank of Qwen3.5-27B's
# (4 key / 12 value heads: a gate stride not divisible by 16, another specialisation), through
# a decode step (recurrent kernel, conv update kernel), a prefill step (chunked kernel, varlen
# conv) and a mixed one (both, each skipping the other kind: one variant, ``only`` is not
# specialised).
GDN_SHAPES = ((16, 32, 128, 128), (4, 12, 128, 128))
GDN_STEPS = {"decode": [1] * 8, "prefill": [300], "mixed": [1] * 7 + [300]}
GDN_CHUNK_SIZES = (64,)  # the default chunk; the tests' 16 (they run under the interpreter) in float32 too


def _gated_deltanet_launches(dtype: torch.dtype) -> None:
    for num_k, num_v, dim_k, dim_v in GDN_SHAPES if dtype == torch.bfloat16 else GDN_SHAPES[:1]:
        for query_lens in GDN_STEPS.values():
            meta = AttentionMetadata.build(query_lens, query_lens, [[0] * 19] * len(query_lens), 16,
                                           state_indices=list(range(len(query_lens))))
            tokens = sum(query_lens)
            q = torch.empty(tokens, num_k, dim_k, dtype=dtype)
            v = torch.empty(tokens, num_v, dim_v, dtype=dtype)
            g, beta = torch.empty(tokens, num_v), torch.empty(tokens, num_v, dtype=dtype)
            states = torch.empty(8, num_v, dim_k, dim_v)
            for chunk in GDN_CHUNK_SIZES + ((16,) if dtype == torch.float32 else ()):
                triton_gdn.gated_delta_rule(q, q, v, g, beta, states, meta, chunk)
            conv_dim = 2 * num_k * dim_k + num_v * dim_v
            x = torch.empty(tokens, conv_dim + num_v * dim_v, dtype=dtype)[:, :conv_dim]  # a strided view
            triton_conv1d.causal_conv1d(x, torch.empty(conv_dim, 4, dtype=dtype), None,
                                        torch.empty(8, conv_dim, 3, dtype=dtype), meta)
        rows = torch.empty(5 * num_v, dim_v, dtype=dtype)
        triton_ops.gated_rms_norm(rows, rows, torch.empty(dim_v, dtype=dtype), 1e-6)


# DeepSeek-V3 at TP=1: 128 heads, latent rank 512, rope 64, 16-token pages; hidden 7168; its MoE layer's
# 256 experts (top-8) of intermediate 2048; o_proj 7168 x 16384 as the block-scaled GEMM's shape.
DS_HEADS, DS_RANK, DS_ROPE, DS_HIDDEN, DS_INTER, DS_EXPERTS = 128, 512, 64, 7168, 2048, 256


def _deepseek_launches() -> None:
    """The latent write and the split-K decode (and its combine) in bf16 (served) at decode batch 1
    (split) and 64 (one split: other strides' specialisation) and over an fp8 cache at batch 1;
    the block-scaled FP8 GEMM in bf16 at every tile family (16 rows split-K, 64, 128) and the fp8
    experts in bf16 (one variant per kernel whatever the tokens). Not fp32: a GPU serves DeepSeek in
    16 bits, the fp32 decode variant takes ~20 s to compile, and its numerics are the interpreter's."""
    for dtype, cache_dtype, keys in ((torch.bfloat16, torch.bfloat16, ("decode_b1", "decode_b64")),
                                     (torch.bfloat16, FP8, ("decode_b1",))):
        cache = torch.empty(2, 16, 1, DS_RANK + DS_ROPE, dtype=cache_dtype)
        for key in keys:
            query_lens, seq_lens = STEPS[key]
            rows = len(query_lens)
            triton_mla.mla_decode(torch.empty(rows, DS_HEADS, DS_RANK, dtype=dtype),
                                  torch.empty(rows, DS_HEADS, DS_ROPE, dtype=dtype), cache, _meta(query_lens, seq_lens),
                                  torch.zeros(rows, dtype=torch.int32), 0.1)
            triton_mla.write_latent(torch.empty(rows, DS_RANK + DS_ROPE, dtype=dtype), cache,
                                    torch.zeros(rows, dtype=torch.int64))
    qweight, scale = torch.empty(DS_HIDDEN, 16384, dtype=FP8), torch.empty(DS_HIDDEN // 128, 16384 // 128)
    for rows in (1, 64, 2047):
        triton_w8a16.w8a16_linear(torch.empty(rows, 16384, dtype=torch.bfloat16), qweight, scale, block=128)
    w13 = torch.empty(1, 2 * DS_INTER, DS_HIDDEN, dtype=FP8).expand(DS_EXPERTS, -1, -1)
    w2 = torch.empty(1, DS_HIDDEN, DS_INTER, dtype=FP8).expand(DS_EXPERTS, -1, -1)
    s13 = torch.empty(1, 2 * DS_INTER // 128, DS_HIDDEN // 128).expand(DS_EXPERTS, -1, -1)
    s2 = torch.empty(1, DS_HIDDEN // 128, DS_INTER // 128).expand(DS_EXPERTS, -1, -1)
    offsets = torch.zeros(DS_EXPERTS + 1, dtype=torch.int64)
    triton_moe.moe_experts(torch.empty(1, DS_HIDDEN, dtype=torch.bfloat16), torch.arange(8),
                           torch.empty(8, dtype=torch.bfloat16), offsets, w13, w2, 8, block_scales=(s13, s2, 128))


def _gemma4_launches() -> None:
    """Gemma 4-shaped attention in bf16 (shapes as recalled from the released configs): sliding
    layers 32 heads over 16 KV heads of 256 with a 1024-token window, full layers 32 over 4 of 512,
    and 8 over 1 at both sizes; the bf16 and fp8 caches; the KV write and the rotary at both sizes;
    the MoE block's GELU-tanh experts."""
    for head_dim, groups, window in ((256, [(32, 16), (8, 1)], 1024), (512, [(32, 4), (8, 1)], 0)):
        for cache_dtype in (torch.bfloat16, FP8):
            for num_heads, num_kv_heads in groups:
                for query_lens, seq_lens in (STEPS["decode_b1"], STEPS["mixed_b64"]):
                    q = torch.empty(sum(query_lens), num_heads, head_dim, dtype=torch.bfloat16)
                    cache = torch.empty(2, 16, num_kv_heads, head_dim, dtype=cache_dtype)
                    triton_attention.paged_attention(q, cache, cache, _meta(query_lens, seq_lens), 1.0,
                                                     window=window)
            _small_launches(torch.bfloat16, head_dim, cache_dtype)
    # Gemma 3 4B/12B's images (8 over 4 and 16 over 8 heads of 256; the bf16 and fp8 caches).
    for cache_dtype in (torch.bfloat16, FP8):
        _key_limit_launches(torch.bfloat16, 256, [(8, 4), (16, 8)], cache_dtype)
    # The MoE block's GELU-tanh experts (128 experts, top-8, hidden 2816, intermediate 704: as
    # recalled for the 26B-A4B), one decode token and a 512-token chunk; one expert broadcast.
    num_experts, top_k, hidden, inter = 128, 8, 2816, 704
    w13 = torch.empty(1, 2 * inter, hidden, dtype=torch.bfloat16).expand(num_experts, -1, -1)
    w2 = torch.empty(1, hidden, inter, dtype=torch.bfloat16).expand(num_experts, -1, -1)
    for tokens in (1, 512):
        offsets = torch.zeros(num_experts + 1, dtype=torch.int64)
        triton_moe.moe_experts(torch.empty(tokens, hidden, dtype=torch.bfloat16), torch.arange(tokens * top_k),
                               torch.empty(tokens * top_k, dtype=torch.bfloat16), offsets, w13, w2, top_k,
                               activation="gelu_tanh")


def _arg_type(value) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + TORCH_TO_TRITON[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"unexpected kernel argument {value!r}")


def to_source(fn: JITFunction, args: tuple, kwargs: dict) -> tuple[ASTSource, dict, dict]:
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
    values = dict(zip(fn.arg_names, args)) | kwargs
    signature, constexprs, attrs = {}, {}, {}
    for i, param in enumerate(fn.params):
        value = values[param.name]
        if param.is_constexpr:
            signature[param.name] = "constexpr"
            constexprs[param.name] = value
        else:
            signature[param.name] = _arg_type(value)
            if _divisible_by_16(value) and not param.do_not_specialize:  # as the JIT specialises a real launch
                attrs[(i,)] = [["tt.divisibility", 16]]
    desc = {**constexprs, "dtype": signature[fn.arg_names[0]], "cache": signature.get("k_cache_ptr", "")}
    return ASTSource(fn, signature, constexprs, attrs), options, desc


def _divisible_by_16(value) -> bool:
    """Triton's launch-time specialisation: 16-byte aligned pointers, integers % 16 == 0."""
    if isinstance(value, torch.Tensor):
        return value.data_ptr() % 16 == 0
    return isinstance(value, int) and not isinstance(value, bool) and value % 16 == 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shard", default="0/1")
    parser.add_argument("--families", choices=("rules", "tuning", "gdn", "deepseek", "gemma4"),
                        default="rules")
    parser.add_argument("--all", action="store_true", help="compile every variant, not the covering subset")
    parsed = parser.parse_args(argv)
    shard, num_shards = map(int, parsed.shard.split("/"))
    seen: set[str] = set()
    variants = []
    for fn, args, kwargs in record_launches(parsed.families):
        src, options, desc = to_source(fn, args, dict(kwargs))
        key = src.hash() + json.dumps(options, sort_keys=True)
        if key not in seen:
            seen.add(key)
            variants.append((fn, src, options, desc))
    if parsed.all:
        compiled = list(range(len(variants)))
    else:  # tests/kernels/sm90_cover.py
        compiled = covering([(fn.__name__, desc, options) for fn, _, options, desc in variants])
    position = {index: k for k, index in enumerate(compiled)}  # shards split what is compiled
    target = GPUTarget("cuda", 90, 32)
    for i, (fn, src, options, desc) in enumerate(variants):
        row = {"kernel": fn.__name__, "variant": {k: str(v) for k, v in desc.items()}, "options": options,
               "compiled": i in position}
        if i not in position:
            if shard == 0:  # recorded, not compiled: reported once
                print(json.dumps(row), flush=True)
            continue
        if position[i] % num_shards != shard:
            continue
        print(json.dumps(_compile(src, target, options, row)), flush=True)
    print(json.dumps({"total_variants": len(variants)}), flush=True)
    return 0


def _compile(src: ASTSource, target: GPUTarget, options: dict, row: dict) -> dict:
    """``row`` with the compile's result: ok, shared bytes, has_cubin, vector16, seconds (or the error)."""
    start = time.perf_counter()
    try:
        compiled = triton.compile(src, target=target, options=options)
        shared = compiled.metadata.shared
        row.update(ok=shared <= H100_MAX_SHARED, shared=shared, has_cubin="cubin" in compiled.asm,
                   vector16=bool(VECTOR_16B.search(compiled.asm.get("ptx", ""))))
        if shared > H100_MAX_SHARED:
            row["error"] = f"needs {shared} bytes of shared memory"
    except Exception as exc:  # reported per variant; the test fails on any
        row.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:2000])
    row["seconds"] = round(time.perf_counter() - start, 2)
    return row


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
