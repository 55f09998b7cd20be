"""FP8 (e4m3) weights: the round-trip error bound of the scheme and of the dynamic
activation quantization, the CPU emulation against float64, the ``torch._scaled_mm``
call (its layouts and row-wise scales, run on torch's CPU kernel), the refusal on GPUs
below sm_89, and the engine, ``LLM()`` and ``pagoda serve`` accepting ``fp8``. The fp8
model-vs-fp32 checks (tiny and default model) are in test_quant.py beside int8's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagoda.engine.config import EngineConfig
from pagoda.models import fp8
from pagoda.models.fp8 import FP8_MAX, Fp8Weight, dequantize_fp8, quantize_activations, quantize_fp8
from pagoda.models.quant import linear
from tests.numerics import UNIT_ROUNDOFF, assert_within, gamma

transformers = pytest.importorskip("transformers")

HALF_STEP = 2.0**-4  # e4m3: 3 mantissa bits, neighbours 2^-3 apart (relative); rounding errs by half
SUBNORMAL_HALF_STEP = 2.0**-10  # below 2^-6 (scaled units) the spacing is 2^-9, absolute


def e4m3_bound(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``max(2^-4 |v|, 2^-10 scale)`` per element, plus the fp32 division's own rounding."""
    return torch.maximum(HALF_STEP * values.abs(), SUBNORMAL_HALF_STEP * scale) * (1 + 2.0**-20)


def test_weight_round_trip_is_within_half_an_e4m3_step():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(64, 96, generator=gen) * torch.logspace(-4, 2, 64)[:, None]
    w[5, :48] *= 1e-4  # subnormal territory in a row of normal values
    w[7] = 0
    q, scale = quantize_fp8(w)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (64,)
    assert torch.all(q.float().abs().amax(dim=1)[w.abs().amax(dim=1) > 0] == FP8_MAX), "row max maps to 448"
    err = (dequantize_fp8(q, scale) - w).abs()
    assert torch.all(err <= e4m3_bound(w, scale[:, None]))
    assert scale[7] == 1 and torch.all(q[7].float() == 0)
    rel = (err / w.abs())[w.abs() > 2.0**-6 * scale[:, None]]
    assert rel.max() > HALF_STEP / 2, "the error should reach the e4m3 scale, else this tests nothing"
    for dtype in (torch.float16, torch.bfloat16):
        wh = w.to(dtype)
        qh, sh = quantize_fp8(wh)
        assert torch.all((dequantize_fp8(qh, sh) - wh.float()).abs() <= e4m3_bound(wh.float(), sh[:, None]))


def test_activation_round_trip_per_token():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(9, 40, generator=gen) * torch.logspace(-3, 3, 9)[:, None]
    x[4] = 0
    x8, x_scale = quantize_activations(x)
    assert x8.dtype == torch.float8_e4m3fn and x_scale.shape == (9, 1) and x_scale.dtype == torch.float32
    assert torch.all((x8.float() * x_scale - x).abs() <= e4m3_bound(x, x_scale))
    assert torch.all(x8[4].float() == 0)


def fp8_linear_bound(x, weight: Fp8Weight, bias):
    """fp32 accumulation (``gamma_{K+2}``) plus, for 16-bit activations, the dequantized
    weight's, bias add's and output's roundings (three 16-bit units) of the magnitude."""
    deq = weight.dequantize(torch.float64)
    magnitude = F.linear(x.double().abs(), deq.abs()) + bias.double().abs()
    rel = gamma(x.shape[1] + 2, torch.float32) + (3 * UNIT_ROUNDOFF[x.dtype] if x.dtype != torch.float32 else 0)
    return rel * magnitude


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_emulation_matches_float64(dtype):
    gen = torch.Generator().manual_seed(2)
    weight = Fp8Weight(torch.randn(200, 136, generator=gen) * 0.05)
    bias = torch.randn(200, generator=gen).to(dtype)
    for rows in (1, 17, 80):
        x = torch.randn(rows, 136, generator=gen).to(dtype)
        out = linear(x, weight, bias)
        assert out.dtype == dtype and out.shape == (rows, 200)
        assert weight.kernel_for(x) == "dequantize + F.linear"
        ref = F.linear(x.double(), weight.dequantize(torch.float64), bias.double())
        assert_within(out, ref, fp8_linear_bound(x, weight, bias), f"fp8 emulation {dtype} rows={rows}")


@pytest.mark.skipif(not torch._C._dispatch_has_kernel_for_dispatch_key("aten::_scaled_mm", "CPU"),
                    reason="this torch build has no CPU _scaled_mm")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_scaled_mm_call_matches_its_exact_product(dtype):
    """The CUDA path's call (column-major ``Q.t()``, row-wise float32 scales ``[M, 1]`` and
    ``[1, N]``, output dtype) run on torch's CPU ``_scaled_mm``: it must compute the product
    of the e4m3 activations and weights. What the GPU kernel does with it is not tested here."""
    gen = torch.Generator().manual_seed(3)
    weight = Fp8Weight(torch.randn(64, 96, generator=gen) * 0.05)
    for rows in (1, 17, 33):
        x = torch.randn(rows, 96, generator=gen).to(dtype)
        out = fp8.scaled_mm_linear(x, weight.qweight, weight.scale_row)
        assert out.dtype == dtype and out.shape == (rows, 64)
        assert_within(out, fp8.scaled_mm_exact(x, weight.qweight, weight.scale),
                      fp8.scaled_mm_bound(x, weight.qweight, weight.scale), f"_scaled_mm {dtype} rows={rows}")
    assert fp8._scaled_mm_works(weight, dtype) is None


def test_fp8_is_refused_where_it_cannot_run(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ValueError, match=r"compute capability 8\.9\+.*A100.*sm_80.*int8"):
        fp8.check_fp8_device(torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    fp8.check_fp8_device(torch.device("cuda"))  # H100: accepted
    with pytest.raises(ValueError, match="'mps'"):
        fp8.check_fp8_device(torch.device("mps"))
    fp8.check_fp8_device(torch.device("cpu"))  # emulation
    assert fp8.select_fp8_kernel([Fp8Weight(torch.randn(32, 32))], torch.float32).startswith("fp8 emulation")


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory, smollm2_path):
    from tests.engine.hf_reference import make_random_model

    return str(make_random_model(tmp_path_factory.mktemp("fp8") / "llama", "llama-gqa4-hd80-untied", smollm2_path))


def test_llm_fp8_generates_and_frees_every_block(tiny_path):
    from pagoda.engine.llm import LLM
    from pagoda.engine.sampling_params import SamplingParams

    llm = LLM(tiny_path, quantization="fp8")
    engine = llm.engine
    assert isinstance(engine.runner.model.layers[0].attn.qkv_weight, Fp8Weight)
    outs = llm.generate([list(range(2000, 2100)), list(range(500, 507))],
                        [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                         SamplingParams(temperature=0.8, seed=3, max_tokens=5, ignore_eos=True)])
    assert [len(o.outputs[0].token_ids) for o in outs] == [6, 5]
    stats = engine.get_stats()
    assert stats.num_free_blocks == stats.num_blocks


def test_fp8_is_accepted_by_config_and_serve_flags():
    from pagoda.serving.launch.serve_flags import make_parser

    assert EngineConfig(quantization="fp8").quantization == "fp8"
    args = make_parser().parse_args(["--quantization", "fp8"])
    assert args.quantization == "fp8"
    with pytest.raises(SystemExit):
        make_parser().parse_args(["--quantization", "fp4"])
