"""Every launch variant of the Triton kernels compiles for sm_90 (H100) without a GPU.

The tests run under ``TRITON_INTERPRET=1``, where ``@triton.jit`` yields interpreter
functions that cannot be compiled, so ``sm90_compile.py`` runs in subprocesses without
that variable (two shards in parallel, one per core), in a fresh Triton cache. It records
the launches the public wrappers make and compiles each distinct one; see its docstring.
Covered: the W4A16 kernel (zero points and symmetric, split and not, every dtype); the fused MoE kernels in every
dtype at a Qwen3-30B-A3B layer and gpt-oss-20b's (biases, clamped SwiGLU); every dtype x head size x GQA family with
the shapes the built-in rules pick on an H100 (decode split and unsplit, mixed steps' two launches), gpt-oss attention
sinks, the fp8 KV cache, and every launch shape ``pagoda bench kernels --tune`` may write to a configs JSON; and,
a test of its own, the Gated DeltaNet kernels (chunked and recurrent delta rule, varlen and update conv1d, gated
RMSNorm) in every dtype at Qwen3-Next's layer, in bf16 also at a TP=4 Qwen3.5 rank.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("sm90_compile.py")
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
NUM_SHARDS = 2


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


def _compile_rows(tmp_path, families: str) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # the default; set to silence triton 3.9's warning
    repo_root = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(repo_root), env.get("PYTHONPATH")]))
    shards = [
        subprocess.Popen(
            [sys.executable, str(SCRIPT), "--shard", f"{i}/{NUM_SHARDS}", "--families", families],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(NUM_SHARDS)
    ]
    rows, totals = [], set()
    for proc in shards:
        stdout, stderr = proc.communicate(timeout=840)
        assert proc.returncode == 0, f"compile script failed:\n{stderr[-4000:]}"
        for line in stdout.splitlines():
            row = json.loads(line)
            if "total_variants" in row:
                totals.add(row["total_variants"])
            else:
                rows.append(row)
    assert len(totals) == 1 and len(rows) == totals.pop(), "shards disagree on the variant list"
    failures = [r for r in rows if not r["ok"]]
    assert not failures, "variants failed to compile for sm_90:\n" + "\n".join(json.dumps(r) for r in failures)
    assert all(r["has_cubin"] for r in rows)
    return rows


@pytest.mark.skipif(_sm90_api_missing() is not None, reason=str(_sm90_api_missing()))
def test_every_kernel_variant_compiles_for_sm90(tmp_path):
    rows = _compile_rows(tmp_path, "rules")
    assert {r["kernel"] for r in rows} == KERNELS
    dtypes = {r["variant"]["dtype"] for r in rows if r["kernel"] == "_paged_attention_kernel"}
    head_dims = {r["variant"]["HEAD_DIM"] for r in rows if r["kernel"] == "_paged_attention_kernel"}
    groups = {r["variant"]["GROUP"] for r in rows if r["kernel"] == "_paged_attention_kernel"}
    splits = {r["variant"]["IS_SPLIT"] for r in rows if r["kernel"] == "_paged_attention_kernel"}
    assert dtypes == {"*fp16", "*bf16", "*fp32"}
    assert head_dims == {"64", "80", "128"}
    assert groups == {"1", "3", "4", "8"}
    assert splits == {"True", "False"}
    sinks = {(r["variant"]["dtype"], r["variant"]["IS_SPLIT"], r["variant"]["HAS_SINKS"]) for r in rows
             if r["kernel"] == "_paged_attention_kernel"}
    assert sinks >= {(d, split, "True") for d in ("*fp16", "*bf16", "*fp32") for split in ("True", "False")}
    assert {r["variant"]["HAS_SINKS"] for r in rows if r["kernel"] == "_combine_splits_kernel"} == {"True", "False"}
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
    scalar = [r["variant"] for r in rows if r["kernel"] == "_paged_attention_kernel" and not r["vector16"]]
    assert not scalar, f"attention variants without 16-byte loads: {scalar[:3]}"
    # The decode-only, unsplit family (CUDA graphs at large batch) and the 128-row prefill tile.
    assert (16, 64, 4, 2, "False") in _shapes(rows, "*bf16")
    assert any(shape[:4] == (128, 64, 8, 3) for shape in _shapes(rows, "*bf16"))


@pytest.mark.skipif(_sm90_api_missing() is not None, reason=str(_sm90_api_missing()))
def test_every_gated_deltanet_variant_compiles_for_sm90(tmp_path):
    rows = _compile_rows(tmp_path, "gdn")
    assert {r["kernel"] for r in rows} == set(KERNELS_GDN)
    gdn = {(r["kernel"], r["variant"]["dtype"]) for r in rows}
    assert gdn == {(k, d) for k in KERNELS_GDN for d in ("*fp16", "*bf16", "*fp32")}
    chunks = {(r["variant"]["dtype"], r["variant"]["BT"]) for r in rows if r["kernel"] == "_gdn_chunk_kernel"}
    assert chunks == {("*fp16", "64"), ("*bf16", "64"), ("*fp32", "64"), ("*fp32", "16")}
    # one chunked variant per dtype and chunk, whatever the step's mix (``only``) or head grouping,
    # but the TP=4 Qwen3.5 rank's gate stride (12) is its own specialisation
    assert sum(r["kernel"] == "_gdn_chunk_kernel" for r in rows) == 5


@pytest.mark.skipif(_sm90_api_missing() is not None, reason=str(_sm90_api_missing()))
def test_every_tunable_launch_shape_compiles_for_sm90(tmp_path):
    rows = _compile_rows(tmp_path, "tuning")
    assert _shapes(rows, "*bf16") >= _candidate_shapes(quick=False), "a tunable launch shape was not compiled"
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
