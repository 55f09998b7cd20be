"""The Triton kernels' launch variants compile for sm_90 (H100) without a GPU.

The tests run under ``TRITON_INTERPRET=1``, where ``@triton.jit`` yields interpreter
functions that cannot be compiled, so ``sm90_compile.py`` runs in subprocesses without
that variable (two shards in parallel, one per core), in a fresh Triton cache, started in the
background at the lowest priority when the session begins (``sm90_runs.py``). It records
the launches the public wrappers make and compiles a covering subset of the distinct ones
(every pair of parameter values launched together, each kernel's largest launches:
``sm90_cover.py``), or each of them with ``PAGODA_SM90_ALL=1``; see its docstring. The
coverage assertions below read every recorded variant; the compile results, the compiled ones.
Covered: the W4A16 kernel (zero points and symmetric, split and not, every dtype); the fused MoE kernels in every
dtype at a Qwen3-30B-A3B layer and gpt-oss-20b's (biases, clamped SwiGLU); every dtype x head size x GQA family with
the shapes the built-in rules pick on an H100 (decode split and unsplit, mixed steps' two launches), gpt-oss attention
sinks, Gemma 3's image steps (per-query key limits), the fp8 KV cache, and every launch shape ``pagoda bench
kernels --tune`` may write to a configs JSON; and, a test of its own, the Gated DeltaNet kernels (chunked and
recurrent delta rule, varlen and update conv1d, gated RMSNorm) in every dtype at Qwen3-Next's layer, in bf16 also at
a TP=4 Qwen3.5 rank; and another, DeepSeek-V3's launches (the MLA latent write, split-K decode and combine;
block-scaled FP8 GEMMs and FP8 experts).
"""

from __future__ import annotations

import json

import pytest

KERNELS = {
    "_paged_attention_kernel",
    "_combine_splits_kernel",
    "_write_kv_kernel",
    "_rms_norm_kernel",
    "_rotary_kernel",
    "_lora_shrink_kernel",
    "_lora_expand_kernel",
    "_w8a16_kernel",
    "_w8a16_reduce_kernel",
    "_w4a16_kernel",
    "_w4a16_reduce_kernel",
    "_moe_gate_up_kernel",
    "_moe_down_kernel",
}
KERNELS_GDN = ("_gdn_chunk_kernel", "_gdn_recurrent_kernel", "_conv1d_kernel", "_conv1d_update_kernel",
               "_gated_rms_norm_kernel")
KERNELS_DEEPSEEK = {"_write_latent_kernel", "_mla_decode_kernel", "_mla_combine_kernel", "_w8a16_kernel",
                    "_w8a16_reduce_kernel", "_moe_gate_up_kernel", "_moe_down_kernel"}
# Each test's family of sm90_compile.py, in the order the tests run (tests/conftest.py starts
# the selected ones' runs in the background when the session begins: tests/kernels/sm90_runs.py).
FAMILIES = {"test_every_kernel_variant_compiles_for_sm90": "rules",
            "test_every_gated_deltanet_variant_compiles_for_sm90": "gdn",
            "test_every_tunable_launch_shape_compiles_for_sm90": "tuning",
            "test_deepseek_kernel_variants_compile_for_sm90": "deepseek",
            "test_gemma4_head_sizes_compile_for_sm90": "gemma4"}


def _sm90_api_missing() -> str | None:
    try:
        from triton.backends import backends
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.compiler import ASTSource  # noqa: F401
    except ImportError as exc:
        return f"triton has no ASTSource/GPUTarget compile API: {exc}"
    if "nvidia" not in backends:
        return "triton was installed without its NVIDIA backend"
    return None


def _compile_rows(family: str) -> list[dict]:
    """The family's recorded variants, from its run (started in the background when the session
    began, ``sm90_runs``; run here when this test runs alone); the ``compiled`` ones compiled
    without error, and they cover every pair of parameter values of their kernel's variants
    (``sm90_cover``; all of them with ``PAGODA_SM90_ALL=1``)."""
    from tests.kernels.sm90_runs import runs

    rows, totals = runs().rows(family)
    assert len(totals) == 1 and len(rows) == totals.pop(), "shards disagree on the variant list"
    compiled = [r for r in rows if r["compiled"]]
    failures = [r for r in compiled if not r["ok"]]
    assert not failures, "variants failed to compile for sm_90:\n" + "\n".join(json.dumps(r) for r in failures)
    assert all(r["has_cubin"] for r in compiled)
    for kernel in {r["kernel"] for r in rows}:
        assert uncovered_pairs([r for r in rows if r["kernel"] == kernel]) == set(), kernel
    return rows


def uncovered_pairs(rows: list[dict]) -> set:
    """The pairs of parameter values found in one of ``rows`` but in none of its compiled ones."""
    from tests.kernels.sm90_cover import features, pairs

    def of(r):
        return pairs(features(r["variant"], r["options"]))

    return set().union(*map(of, rows)) - set().union(*(of(r) for r in rows if r["compiled"]))


@pytest.mark.skipif(_sm90_api_missing() is not None, reason=str(_sm90_api_missing()))
def test_every_kernel_variant_compiles_for_sm90():
    rows = _compile_rows("rules")
    assert {r["kernel"] for r in rows} == KERNELS
    dtypes = {r["variant"]["dtype"] for r in rows if r["kernel"] == "_paged_attention_kernel"}
    head_dims = {r["variant"]["HEAD_DIM"] for r in rows if r["kernel"] == "_paged_attention_kernel"}
    groups = {r["variant"]["GROUP"] for r in rows if r["kernel"] == "_paged_attention_kernel"}
    splits = {r["variant"]["IS_SPLIT"] for r in rows if r["kernel"] == "_paged_attention_kernel"}
    assert dtypes == {"*fp16", "*bf16", "*fp32"}
    assert head_dims == {"64", "80", "128"}
    assert groups == {"1", "2", "3", "4", "8"}  # 2: the key-limit launches (32 query heads over 16 KV heads)
    assert splits == {"True", "False"}
    sinks = {(r["variant"]["dtype"], r["variant"]["IS_SPLIT"], r["variant"]["HAS_SINKS"]) for r in rows
             if r["kernel"] == "_paged_attention_kernel"}
    assert sinks >= {(d, split, "True") for d in ("*fp16", "*bf16", "*fp32") for split in ("True", "False")}
    assert {r["variant"]["HAS_SINKS"] for r in rows if r["kernel"] == "_combine_splits_kernel"} == {"True", "False"}
    limits = {(r["variant"]["dtype"], r["variant"]["IS_SPLIT"]) for r in rows
              if r["kernel"] == "_paged_attention_kernel" and r["variant"]["HAS_KEY_LIMITS"] == "True"}
    assert limits == {(d, split) for d in ("*fp16", "*bf16", "*fp32") for split in ("True", "False")}
    w8a16 = [r["variant"] for r in rows if r["kernel"] == "_w8a16_kernel"]
    assert {(v["dtype"], v["W_FP8"], v["IS_SPLIT"]) for v in w8a16} == {
        (d, fp8, split) for d in ("*fp16", "*bf16", "*fp32") for fp8 in ("True", "False") for split in ("True", "False")
    }
    assert {v["BLOCK_M"] for v in w8a16} == {"16", "32", "64", "128"}
    w4a16 = [r["variant"] for r in rows if r["kernel"] == "_w4a16_kernel"]
    assert {(v["dtype"], v["SYMMETRIC"], v["IS_SPLIT"]) for v in w4a16} == {
        (d, sym, split) for d in ("*fp16", "*bf16", "*fp32") for sym in ("True", "False")
        for split in ("True", "False")}
    moe = {(r["kernel"], r["variant"]["dtype"]) for r in rows if r["kernel"].startswith("_moe_")}
    assert moe == {(k, d) for k in ("_moe_gate_up_kernel", "_moe_down_kernel") for d in ("*fp16", "*bf16", "*fp32")}
    gpt_oss = {(r["variant"]["dtype"], r["variant"].get("CLAMPED", r["variant"].get("HAS_BIAS"))) for r in rows
               if r["kernel"].startswith("_moe_")}
    assert gpt_oss == {(d, flag) for d in ("*fp16", "*bf16", "*fp32") for flag in ("True", "False")}
    caches = {r["variant"]["cache"] for r in rows if r["kernel"] in ("_paged_attention_kernel", "_write_kv_kernel")}
    assert caches == {"*fp16", "*bf16", "*fp32", "*fp8e4nv"}
    # K/V tiles are copied 16 bytes at a time along head_dim (cp.async 0x10) in every variant.
    scalar = [r["variant"] for r in rows if r["kernel"] == "_paged_attention_kernel" and r["compiled"]
              and not r["vector16"]]
    assert not scalar, f"attention variants without 16-byte loads: {scalar[:3]}"
    # The decode-only, unsplit family (CUDA graphs at large batch) and the 128-row prefill tile.
    assert (16, 64, 4, 2, "False") in _shapes(rows, "*bf16")
    assert any(shape[:4] == (128, 64, 8, 3) for shape in _shapes(rows, "*bf16"))


@pytest.mark.skipif(_sm90_api_missing() is not None, reason=str(_sm90_api_missing()))
def test_every_gated_deltanet_variant_compiles_for_sm90():
    rows = _compile_rows("gdn")
    assert {r["kernel"] for r in rows} == set(KERNELS_GDN)
    gdn = {(r["kernel"], r["variant"]["dtype"]) for r in rows}
    assert gdn == {(k, d) for k in KERNELS_GDN for d in ("*fp16", "*bf16", "*fp32")}
    chunks = {(r["variant"]["dtype"], r["variant"]["BT"]) for r in rows if r["kernel"] == "_gdn_chunk_kernel"}
    assert chunks == {("*fp16", "64"), ("*bf16", "64"), ("*fp32", "64"), ("*fp32", "16")}
    # one chunked variant per dtype and chunk, whatever the step's mix (``only``) or head grouping,
    # but the TP=4 Qwen3.5 rank's gate stride (12) is its own specialisation
    assert sum(r["kernel"] == "_gdn_chunk_kernel" for r in rows) == 5


@pytest.mark.skipif(_sm90_api_missing() is not None, reason=str(_sm90_api_missing()))
def test_every_tunable_launch_shape_compiles_for_sm90():
    rows = _compile_rows("tuning")
    assert _shapes(rows, "*bf16") >= _candidate_shapes(quick=False), "a tunable launch shape was not recorded"
    assert _shapes(rows, "*fp8e4nv") >= _candidate_shapes(quick=True)


def _shapes(rows, cache: str) -> set[tuple]:
    """(tile rows, BLOCK_N, warps, stages, IS_SPLIT) of the bf16 / head 128 / GQA 4 variants."""
    return {(int(v["BLOCK_Q"]) * int(v["GROUP_PAD"]), int(v["BLOCK_N"]), r["options"]["num_warps"],
             r["options"]["num_stages"], v["IS_SPLIT"])
            for r in rows if r["kernel"] == "_paged_attention_kernel" and (v := r["variant"])["cache"] == cache
            and (v["dtype"], v["HEAD_DIM"], v["GROUP"]) == ("*bf16", "128", "4")}


def _candidate_shapes(quick: bool) -> set[tuple]:
    from pagoda.kernels import tuning

    shapes = set()
    for phase, context in (("decode", 4096), ("prefill", 2048)):
        fam = tuning.Family(phase, "bf16", 128, 32, 8, 1, context)
        for entry in tuning.candidates(phase, quick):
            cfg = fam.config(entry, 132)
            shapes.add((cfg.block_q * 4, cfg.block_n, cfg.num_warps, cfg.num_stages, str(cfg.num_splits > 1)))
    return shapes


@pytest.mark.skipif(_sm90_api_missing() is not None, reason=str(_sm90_api_missing()))
def test_deepseek_kernel_variants_compile_for_sm90():
    """DeepSeek-V3's shapes (128 heads, latent 512 + 64, 16-token pages; 7168 hidden, 256 experts of
    2048): the MLA decode in bf16 (split and not) and over an fp8 cache; block scales on every
    W8A16 tile family and on both MoE kernels."""
    rows = _compile_rows("deepseek")
    assert {r["kernel"] for r in rows} == KERNELS_DEEPSEEK
    decode = {(r["variant"]["dtype"], r["variant"]["KV_FP8"]) for r in rows if r["kernel"] == "_mla_decode_kernel"}
    assert decode == {("*bf16", "False"), ("*bf16", "True")}
    assert {r["variant"]["QUANTIZE"] for r in rows if r["kernel"] == "_write_latent_kernel"} == {"True", "False"}
    blocks = {r["variant"]["SCALE_BLOCK"] for r in rows if r["kernel"] in ("_w8a16_kernel", "_moe_gate_up_kernel",
                                                                          "_moe_down_kernel")}
    assert blocks == {"128"}
    assert {r["variant"]["BLOCK_M"] for r in rows if r["kernel"] == "_w8a16_kernel"} == {"16", "64", "128"}


@pytest.mark.skipif(_sm90_api_missing() is not None, reason=str(_sm90_api_missing()))
def test_gemma4_head_sizes_compile_for_sm90():
    """Gemma 4's heads (256 sliding, 512 full; GQA 2, 8 and 8 over 1), decode and a mixed step, bf16
    and fp8 caches, and its MoE block's GELU-tanh experts: the compiled variants compile, and the
    widest heads' largest attention launch fits sm_90's shared memory (the built-in rules give
    heads wider than 256 at most 64 rows and 32-key steps; 128 x 64 tiles needed 384 KiB)."""
    rows = _compile_rows("gemma4")
    attention = [r for r in rows if r["kernel"] == "_paged_attention_kernel"]
    assert {r["variant"]["HEAD_DIM"] for r in attention} == {"256", "512"}
    assert {r["kernel"] for r in rows} == {"_paged_attention_kernel", "_combine_splits_kernel", "_write_kv_kernel",
                                           "_rotary_kernel", "_moe_gate_up_kernel", "_moe_down_kernel"}
    assert max(r["shared"] for r in attention if r["variant"]["HEAD_DIM"] == "512" and r["compiled"]) <= 227 * 1024
    assert {r["variant"]["HEAD_DIM"] for r in attention if r["variant"]["HAS_KEY_LIMITS"] == "True"} == {"256"}
    assert any(r["variant"].get("GELU") in ("True", True) for r in rows if r["kernel"] == "_moe_gate_up_kernel")
