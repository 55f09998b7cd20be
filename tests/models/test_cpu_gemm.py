"""models/cpu_gemm: oneDNN-prepacked CPU weights, against float64 and against themselves.

The engine packs every CPU float model (ModelRunner), so the engine-vs-Hugging-Face parity
tests (tests/engine/test_engine_vs_hf.py, tests/models/test_llama_vs_hf.py through the
engine) run on packed weights; here: the matmul's error bound, that a row's result does not
depend on the rows beside it (batch invariance, bit for bit), what gets packed, and the
switch.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pagoda.kernels import cpu_native, reload_settings
from pagoda.models.cpu_gemm import GEMM_ENV, PackedWeight, pack_model, packing_kind, packing_reason
from pagoda.models.quant import linear

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
KINDS = ["onednn", pytest.param("pagoda", marks=pytest.mark.skipif(cpu_native.build() is not None,
                                                                   reason="no C++ kernels"))]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_packed_matmul_equals_float64_within_the_fp32_bound(rows, kind):
    gen = torch.Generator().manual_seed(rows)
    x, w, b = torch.randn(rows, 576, generator=gen), torch.randn(960, 576, generator=gen), torch.randn(960)
    out = PackedWeight(w, kind).matmul(x, b)
    exact = x.double() @ w.double().T + b.double()
    # Any summation order of K fp32 products: |error| <= K * 2^-23 * sum_k |x_k w_k| (+ the bias add).
    bound = 576 * 2.0**-23 * (x.double().abs() @ w.double().abs().T + b.double().abs())
    assert out.dtype == torch.float32 and out.shape == (rows, 960)
    assert ((out.double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("kind", KINDS)
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(kind):
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(100, 576, generator=gen), torch.randn(1536, 576, generator=gen)
    packed = PackedWeight(w, kind)
    whole = packed.matmul(x)
    for rows in (1, 7, 32):
        assert torch.equal(packed.matmul(x[:rows]), whole[:rows])
    assert torch.equal(packed.matmul(x.view(4, 25, 576)), whole.view(4, 25, 1536))  # leading dims kept
    assert torch.equal(packed.dense(), w)


class _Layer(nn.Module):
    linear_weights = ("w",)

    def __init__(self, dtype):
        super().__init__()
        self.w = nn.Parameter(torch.randn(64, 32).to(dtype), requires_grad=False)


class _Model(nn.Module):
    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.layers = nn.ModuleList([_Layer(dtype), _Layer(dtype)])
        self.lm_head = nn.Parameter(torch.randn(100, 32).to(dtype), requires_grad=False)


def test_pack_model_replaces_the_linear_weights_and_adds_a_packed_head(monkeypatch):
    monkeypatch.delenv(GEMM_ENV, raising=False)
    model = _Model()
    dense = model.layers[0].w.clone()
    assert pack_model(model, torch.device("cpu"), torch.float32) == 3
    packed = model.layers[0].w
    assert isinstance(packed, PackedWeight) and packed.shape == dense.shape
    assert "w" not in dict(model.named_parameters())
    x = torch.randn(3, 32)
    assert torch.allclose(linear(x, packed), x @ dense.T, atol=1e-5)
    assert isinstance(model.lm_head, nn.Parameter) and isinstance(model.lm_head_packed, PackedWeight)


def test_the_switch_and_the_cases_that_stay_on_blas(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setenv(GEMM_ENV, "blas")
    model = _Model()
    assert pack_model(model, cpu, torch.float32) == 0 and isinstance(model.layers[0].w, nn.Parameter)
    monkeypatch.setenv(GEMM_ENV, "mkl")
    with pytest.raises(ValueError, match=f"{GEMM_ENV}='mkl': must be one of auto, pagoda, onednn, blas"):
        packing_reason(cpu, torch.float32)
    monkeypatch.setenv(GEMM_ENV, "auto")
    assert packing_reason(cpu, torch.float16) == "torch.float16 weights"
    assert packing_reason(torch.device("meta"), torch.float32) == "not a CPU model"
    monkeypatch.setattr("pagoda.models.cpu_gemm.native_bf16", lambda: False)
    assert packing_reason(cpu, torch.bfloat16) == "bf16 without native bf16 instructions on this CPU"
    monkeypatch.setenv(GEMM_ENV, "onednn")  # forced: packed even where oneDNN emulates bf16
    assert packing_reason(cpu, torch.bfloat16) is None


def test_the_engine_runs_on_packed_weights(monkeypatch, tmp_path, smollm2_path):
    """So the parity tests that drive the engine cover the packed path."""
    from pagoda.engine.llm import LLM
    from pagoda.engine.sampling_params import SamplingParams
    from tests.engine.hf_reference import RANDOM_CONFIGS, make_random_model

    monkeypatch.delenv(GEMM_ENV, raising=False)
    name = next(iter(RANDOM_CONFIGS))
    llm = LLM(str(make_random_model(tmp_path / name, name, smollm2_path)), num_gpu_blocks_override=32)
    model = llm.engine.runner.model
    assert isinstance(model.layers[0].attn.qkv_weight, PackedWeight) and isinstance(model.lm_head_packed, PackedWeight)
    assert len(llm.generate(["hello"], SamplingParams(max_tokens=2, temperature=0))[0].outputs[0].token_ids) == 2


@pytest.mark.skipif(cpu_native.build() is not None, reason="no C++ kernels")
def test_pagodas_matmul_only_where_its_vector_tiles_run(monkeypatch):
    """Runtime dispatch: a CPU without AVX-512 (an AVX2-only EPYC) or without AVX512-BF16 for
    bfloat16 packs for oneDNN; ``pagoda`` forces the plain C++ tiles there; without the C++
    kernels ``auto`` takes oneDNN and ``pagoda`` is refused, naming why."""
    monkeypatch.delenv(GEMM_ENV, raising=False)
    monkeypatch.setattr(cpu_native, "gemm_features", lambda: frozenset({"avx512f"}))
    assert packing_kind(torch.float32) == "pagoda" and packing_kind(torch.bfloat16) == "onednn"
    monkeypatch.setattr(cpu_native, "gemm_features", lambda: frozenset())
    assert packing_kind(torch.float32) == "onednn"
    model = _Model()
    pack_model(model, torch.device("cpu"), torch.float32)
    assert model.layers[0].w.kind == "onednn" and model.lm_head_packed.kind == "onednn"
    monkeypatch.setenv(GEMM_ENV, "pagoda")
    assert packing_kind(torch.float32) == "pagoda"
    monkeypatch.setenv(cpu_native.KERNELS_ENV, "torch")
    reload_settings()
    with pytest.raises(ValueError, match=f"{GEMM_ENV}=pagoda: pagoda's C.. kernels are off"):
        packing_kind(torch.float32)
    monkeypatch.setenv(GEMM_ENV, "auto")
    assert packing_kind(torch.float32) == "onednn"
