"""pagoda's C++ CPU kernels (pagoda.kernels.cpu_native) against their definitions.

Decode attention against the float64 reference on poisoned paged caches (a read past a
context or through the wrong block is NaN): the AVX-512 tiles for head sizes that are a
multiple of 16 (a long context cut into parts among them), the portable loops for others
(head size 40; tests/kernels/cpu_gemm_avx2_check.py runs them in an AVX2 build); prefill
attention (AVX-512) on first chunks, chunks after context, windows and sinks; RMSNorm,
rotary and silu(gate) * up against the torch expressions they replace, in float32 and
bfloat16; the torch path with the native kernels against the reference on mixed steps;
``PAGODA_CPU_KERNELS``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagoda import kernels
from pagoda.kernels import cpu_native, reference, reload_settings
from tests.kernels.kernel_cases import assert_close_to_reference, attention_bound, make_paged_case, reference_attention

pytestmark = pytest.mark.skipif(cpu_native.build() is not None, reason=f"no C++ kernels: {cpu_native.build()}")

DTYPES = [torch.float32, torch.bfloat16]


def native_decode(case, window=0, sinks=None) -> torch.Tensor:
    decode = [s for s, n in enumerate(case.meta.query_lens_host) if n == 1]
    starts = case.meta.query_start_loc.tolist()
    out = torch.full_like(case.q, float("nan"))
    cpu_native.loaded_ops().decode_attention(
        case.q, case.k_cache, case.v_cache, case.meta.block_tables, case.meta.seq_lens,
        torch.tensor([starts[s] for s in decode]), torch.tensor(decode), case.scale, window, sinks, out)
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim,heads", [(64, (9, 3)), (128, (8, 1)), (80, (4, 4)), (40, (4, 2))], ids=str)
@pytest.mark.parametrize("strided", [False, True], ids=["tables", "strided_tables"])
def test_decode_attention_matches_reference(dtype, head_dim, heads, strided):
    seq_lens = [1, 16, 17, 300, 5, 64]
    case = make_paged_case([1] * len(seq_lens), seq_lens, *heads, head_dim, dtype, block_size=16, seed=head_dim,
                           strided_tables=strided)
    assert_close_to_reference(native_decode(case), reference_attention(case), dtype, attention_bound(case))


@pytest.mark.parametrize("window", [1, 7, 40])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_decode_attention_window_and_sinks(window, with_sinks):
    seq_lens = [3, 50, 33, 7]
    case = make_paged_case([1] * 4, seq_lens, 6, 2, 64, torch.float32, block_size=8, seed=window)
    sinks = torch.randn(6) if with_sinks else None
    expected = reference_attention(case, window=window, sinks=sinks)
    assert_close_to_reference(native_decode(case, window, sinks), expected, torch.float32, attention_bound(case))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("window,with_sinks", [(0, False), (700, True)])
def test_a_long_context_split_into_parts(dtype, window, with_sinks):
    """One sequence of 1,000 positions is cut into parts that threads share, merged by log-sum-exp
    (the AVX-512 path; the portable one reads it whole): same result, sinks counted once."""
    case = make_paged_case([1, 1], [1000, 3], 8, 2, 64, dtype, block_size=16, seed=11)
    sinks = torch.randn(8) if with_sinks else None
    expected = reference_attention(case, window=window, sinks=sinks)
    assert_close_to_reference(native_decode(case, window, sinks), expected, dtype, attention_bound(case))


needs_avx512 = pytest.mark.skipif("avx512f" not in cpu_native.gemm_features(), reason="no AVX-512 in this build")


def native_prefill(case, s, window=0, sinks=None) -> torch.Tensor:
    """Sequence ``s``'s chunk through ``prefill_attention``: its rows of the output."""
    start, q_len = case.meta.query_start_loc.tolist()[s], case.meta.query_lens_host[s]
    rows = slice(start, start + q_len)
    out = torch.full_like(case.q, float("nan"))
    cpu_native.loaded_ops().prefill_attention(case.q[rows], case.k_cache, case.v_cache,
                                              case.meta.block_tables[s].contiguous(), case.meta.seq_lens_host[s],
                                              case.scale, window, sinks, out[rows])
    return out[rows]


@needs_avx512
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("q_len,s_len,heads,head_dim,window,with_sinks", [
    (37, 37, (9, 3), 64, 0, False),  # a first chunk: plain causal, a tail of 5 rows past the 32-row block
    (70, 300, (9, 3), 64, 0, False),  # a chunk after 230 positions of context
    (50, 120, (8, 1), 128, 0, False),
    (33, 200, (6, 2), 64, 40, True),  # the window's edge crosses tiles; sinks join the denominator
    (5, 90, (4, 4), 80, 7, False),
    (600, 4600, (4, 2), 64, 0, False),  # a long context: 256-position items (query_block), a tail of 88
    (300, 2400, (6, 3), 64, 500, True),  # 128-position items, the window across several of them
], ids=str)
def test_prefill_attention_matches_reference(dtype, q_len, s_len, heads, head_dim, window, with_sinks):
    case = make_paged_case([q_len, 1], [s_len, 9], *heads, head_dim, dtype, block_size=16, seed=q_len)
    sinks = torch.randn(heads[0]) if with_sinks else None
    expected = reference_attention(case, window=window, sinks=sinks)[:q_len]
    assert_close_to_reference(native_prefill(case, 0, window, sinks), expected, dtype, attention_bound(case))


@needs_avx512
def test_prefill_attention_refuses_a_chunk_past_its_table():
    case = make_paged_case([6], [6], 4, 2, 64, torch.float32, block_size=4, seed=0)
    with pytest.raises(RuntimeError, match="must end at s_len inside the block table"):
        cpu_native.loaded_ops().prefill_attention(case.q, case.k_cache, case.v_cache,
                                                  case.meta.block_tables[0, :1].contiguous(), 6, 0.1, 0, None,
                                                  torch.empty_like(case.q))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_torch_path_uses_it_on_mixed_steps(dtype, monkeypatch):
    """Decode rows and (an AVX-512 build) prompt chunks go to C++ in one step with the rest."""
    monkeypatch.setenv(cpu_native.KERNELS_ENV, "auto")
    reload_settings()
    case = make_paged_case([1, 7, 5, 1, 4, 1], [9, 7, 13, 4, 8, 1], 8, 2, 64, dtype, block_size=4, seed=5)
    case.k_cache.nan_to_num_(0), case.v_cache.nan_to_num_(0)  # SDPA's masked rows must stay finite
    out = reference.paged_attention_torch(case.q, case.k_cache, case.v_cache, case.meta, case.scale)
    assert cpu_native.native_decode(case.q, case.k_cache, case.v_cache)
    native = "avx512f" in cpu_native.gemm_features()
    plan = reference.cpu_plan(case.meta, 4, 0, case.q.device, True, native)
    assert len(plan.native_prefills) == (3 if native else 0) and len(plan.prefills) == (0 if native else 3)
    assert_close_to_reference(out, reference_attention(case), dtype, attention_bound(case))


def test_decode_attention_refuses_what_it_cannot_read():
    case = make_paged_case([1], [5], 4, 2, 64, torch.float32, block_size=4, seed=0)
    with pytest.raises(RuntimeError, match="share one dtype"):
        cpu_native.loaded_ops().decode_attention(case.q.double(), case.k_cache, case.v_cache, case.meta.block_tables,
                                                 case.meta.seq_lens, torch.tensor([0]), torch.tensor([0]), 0.1, 0,
                                                 None, torch.empty_like(case.q).double())
    fp8 = case.k_cache.to(torch.float8_e4m3fn)
    assert not cpu_native.native_decode(case.q, fp8, fp8)  # fp8: gather + SDPA
    strided = torch.cat([case.k_cache, case.k_cache], dim=-1)[..., :64]
    assert not cpu_native.native_decode(case.q, strided, strided)  # a cache view it cannot walk: the torch path


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(dtype, with_residual):
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(37, 576, generator=gen) * 3).to(dtype)
    residual = torch.randn(37, 576, generator=gen).to(dtype) if with_residual else None
    weight = torch.rand(576, generator=gen).to(dtype)
    out, new_residual = kernels.rms_norm(x, weight, 1e-5, residual)
    expected, expected_residual = reference.rms_norm(x, weight, 1e-5, residual)
    if with_residual:
        assert torch.equal(new_residual, expected_residual)  # the add rounds exactly as torch's does
    else:
        assert new_residual is None
    # One rounding of a float32 result apart at most (the sum of squares is ordered differently).
    tol = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=0, rtol=2**-7)
    torch.testing.assert_close(out, expected, **tol)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_mul(dtype):
    gen = torch.Generator().manual_seed(2)
    gate_up = (torch.randn(13, 2 * 1536, generator=gen) * 6).to(dtype)
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # saturated and zero inputs
    gate, up = gate_up.chunk(2, dim=-1)
    tol = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=0, rtol=2**-7)
    torch.testing.assert_close(kernels.silu_mul(gate_up), F.silu(gate) * up, **tol)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rotary_on_strided_heads(dtype):
    """q and k as the model has them: views into the fused qkv projection's rows."""
    from pagoda.models.config import ModelConfig  # noqa: F401  (the model's table builder below)
    from pagoda.models.llama import make_cos_sin_cache

    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(11, (9 + 2 * 3) * 64, generator=gen).to(dtype)
    q = qkv[:, :576].view(11, 9, 64)
    k = qkv[:, 576:768].view(11, 3, 64)
    positions = torch.tensor([0, 1, 2, 500, 4, 5, 1023, 7, 8, 9, 10])
    cos_sin = torch.cat([torch.cos(torch.arange(1024.0)[:, None] * torch.rand(32, generator=gen)),
                         torch.sin(torch.arange(1024.0)[:, None] * torch.rand(32, generator=gen))], dim=1)
    rq, rk = kernels.apply_rotary(q, k, positions, cos_sin)
    eq, ek = reference.apply_rotary(q, k, positions, cos_sin)
    tol = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=0, rtol=2**-7)
    torch.testing.assert_close(rq, eq, **tol)
    torch.testing.assert_close(rk, ek, **tol)
    assert rq.is_contiguous() and rk.is_contiguous()
    assert make_cos_sin_cache  # the model's own table is float32, what the kernel reads


def test_the_environment_variable(monkeypatch):
    x = torch.randn(2, 8)
    monkeypatch.setenv(cpu_native.KERNELS_ENV, "torch")
    reload_settings()
    assert cpu_native.native_ops(x) is None
    monkeypatch.setenv(cpu_native.KERNELS_ENV, "auto")
    reload_settings()
    assert cpu_native.native_ops(x) is not None
    assert cpu_native.native_ops(x.double()) is None and cpu_native.native_ops(torch.empty(2, 8, device="meta")) is None
    monkeypatch.setenv(cpu_native.KERNELS_ENV, "fast")
    reload_settings()
    with pytest.raises(ValueError, match="PAGODA_CPU_KERNELS='fast'"):
        cpu_native.native_ops(x)


def test_a_failed_build_falls_back_to_torch_naming_why(monkeypatch, tmp_path, caplog):
    broken = tmp_path / "broken.cpp"
    broken.write_text("this is not C++\n")
    monkeypatch.setattr(cpu_native, "_SOURCES", [broken])
    monkeypatch.setattr(cpu_native, "_state", {})
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.setenv(cpu_native.KERNELS_ENV, "auto")
    reload_settings()
    x = torch.randn(2, 8)
    assert cpu_native.native_ops(x) is None
    assert "the C++ kernels did not build" in caplog.text
    out, _ = kernels.rms_norm(x, torch.ones(8), 1e-6)  # the torch reference serves
    torch.testing.assert_close(out, reference.rms_norm(x, torch.ones(8), 1e-6)[0])
    monkeypatch.setenv(cpu_native.KERNELS_ENV, "native")
    reload_settings()
    with pytest.raises(RuntimeError, match="PAGODA_CPU_KERNELS=native: the C.. kernels did not build"):
        cpu_native.native_ops(x)
