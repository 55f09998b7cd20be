"""``kv_cache_dtype="fp8_e4m3"`` end to end: config, cache pool size, engine, server flag.

The engine runs a tiny random Llama (GQA 4, head_dim 80) on CPU with an fp8 cache through
the torch references and through the Triton kernels (interpreter): their greedy tokens
agree, and, given the same K/V to quantize, they store the same e4m3 bytes and their
logits stay within the float32 bound. (Left to compute their own K/V, the two paths
differ by float32 roundings, e.g. in rotary, and such a difference can move a value
across an e4m3 rounding boundary: on an AMD EPYC one K element of a layer's 2,000 was
stored as 1.125 by one path and 1.0 by the other (one e4m3 step), which no float32 bound
covers. So the logits comparison feeds the reference the K/V the Triton path wrote.)
The accuracy cost of fp8 against the full-precision cache is measured by
``pagoda bench kernels --kv-accuracy`` (docs/kernels.md), not asserted here.
"""

from __future__ import annotations

from typing import Optional

import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda import kernels as kernel_ops
from pagoda.engine.config import EngineConfig
from pagoda.engine.llm_engine import LLMEngine
from pagoda.engine.runner.placement import kv_bytes_per_block
from pagoda.kernels import reload_settings
from pagoda.kernels import write_kv as _write_kv
from pagoda.models import load_model
from pagoda.models.testing import StepInput, make_kv_caches, run_step
from tests.engine.driving import drain
from tests.engine.hf_reference import make_random_model
from tests.numerics import assert_within, model_error_bound

BLOCK_SIZE = 16
FP8 = torch.float8_e4m3fn


@pytest.fixture(scope="module")
def model_path(tmp_path_factory, smollm2_path):
    name = "llama-gqa4-hd80-untied"
    return str(make_random_model(tmp_path_factory.mktemp("m") / name, name, smollm2_path))


@pytest.mark.parametrize("value", ["fp8", "float8_e4m3fn", "fp8_e5m2", ""])
def test_bad_kv_cache_dtype_is_refused(value):
    with pytest.raises(ValueError, match="kv_cache_dtype: must be one of"):
        EngineConfig(kv_cache_dtype=value)


def test_fp8_pool_holds_more_blocks_for_the_same_bytes(model_path):
    budget = 4 * 2**20
    full = LLMEngine(EngineConfig(model=model_path, kv_cache_memory_bytes=budget, dtype="bfloat16"))
    fp8 = LLMEngine(EngineConfig(model=model_path, kv_cache_memory_bytes=budget, dtype="bfloat16",
                                 kv_cache_dtype="fp8_e4m3"))
    assert fp8.runner.kv_caches[0][0].dtype == FP8 and full.runner.kv_caches[0][0].dtype == torch.bfloat16
    # Half the bytes per block (get_stats excludes the reserved null block).
    per_block = kv_bytes_per_block(full.runner.model_config, full.runner.block_size, torch.bfloat16)
    assert full.get_stats().num_blocks + 1 == budget // per_block
    assert fp8.get_stats().num_blocks + 1 == budget // (per_block // 2)
    assert fp8.runner.kv_caches[0][0].element_size() == 1


def _engine_greedy(model_path: str, kernels: str, monkeypatch) -> tuple[dict, LLMEngine]:
    monkeypatch.setenv("PAGODA_KERNELS", kernels)
    reload_settings()
    # A 24-token budget makes the 40-token prompt prefill in chunks beside decodes.
    engine = LLMEngine(EngineConfig(model=model_path, block_size=BLOCK_SIZE, max_num_batched_tokens=24,
                                    kv_cache_dtype="fp8_e4m3"))
    greedy = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    for name, length in (("short", 5), ("long", 40)):
        engine.add_request(name, list(range(1000 + length, 1000 + 2 * length)), greedy)
    tokens = {rid: out.outputs[0].token_ids for rid, out in drain(engine).items()}
    return tokens, engine


def test_engine_fp8_cache_triton_matches_torch_and_frees_blocks(model_path, monkeypatch):
    expected, _ = _engine_greedy(model_path, "torch", monkeypatch)
    actual, engine = _engine_greedy(model_path, "triton", monkeypatch)
    assert actual == expected and all(len(t) == 5 for t in actual.values())
    stats = engine.get_stats()
    assert stats.num_free_blocks == stats.num_blocks, "KV blocks leaked"


def _logits(model, kernels: str, monkeypatch, kv_inputs: Optional[list] = None):
    """A chunk beside a prefill, then a mixed step (two attention launches) over an fp8 cache.

    Returns the two steps' logits, the K/V each ``write_kv`` call was given (in call order)
    and the caches' bytes; with ``kv_inputs`` those K/V are written instead of the step's own.
    """
    monkeypatch.setenv("PAGODA_KERNELS", kernels)
    reload_settings()
    written = []

    def write_kv(k, v, *args, **kwargs):
        if kv_inputs is not None:
            k, v = kv_inputs[len(written)]
        written.append((k.clone(), v.clone()))
        _write_kv(k, v, *args, **kwargs)

    monkeypatch.setattr(kernel_ops, "write_kv", write_kv)
    caches = [(k.to(FP8), v.to(FP8)) for k, v in make_kv_caches(model.config, num_blocks=8, block_size=BLOCK_SIZE)]
    prompt = torch.randint(100, 40000, (21,), generator=torch.Generator().manual_seed(0)).tolist()
    first = run_step(model, caches, [StepInput(prompt[:16], 0, [3, 5]), StepInput(prompt[:9], 0, [6])], BLOCK_SIZE)
    step = [StepInput(prompt[16:], 16, [3, 5]), StepInput([int(first[-1].argmax())], 9, [6])]
    logits = [first, run_step(model, caches, step, BLOCK_SIZE)]
    return logits, written, [t.view(torch.uint8).clone() for kv in caches for t in kv]


def test_model_logits_over_fp8_cache_triton_vs_torch(model_path, monkeypatch):
    """Both paths quantize the K/V the Triton path computed (module docstring): the caches
    hold the same bytes, and the logits differ only by float32 roundings."""
    model = load_model(model_path, dtype=torch.float32)
    actual, written, actual_bytes = _logits(model, "triton", monkeypatch)
    expected, _, expected_bytes = _logits(model, "torch", monkeypatch, kv_inputs=written)
    assert all(torch.equal(a, e) for a, e in zip(actual_bytes, expected_bytes)), "the two writes rounded differently"
    for step, (a, e) in enumerate(zip(actual, expected)):
        bound = model_error_bound(model.config, 32, torch.float32, e.abs().max().item())
        assert_within(a, e, bound, f"fp8 cache, triton vs torch, step {step}")


def test_llm_and_server_flag_take_kv_cache_dtype(model_path, tmp_path):
    llm = LLM(model_path, kv_cache_dtype="fp8_e4m3", kv_cache_memory_bytes=2**20)
    assert llm.engine.runner.kv_caches[0][0].dtype == FP8
    out = llm.generate([[1000, 1001, 1002]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(model_path, kv_cache_dtype="int8")

    from pagoda.serving.launch.serve_options import materialize_repository
    from pagoda.serving.launch.serve_flags import make_parser, options_from_args
    from pagoda.serving.model_config import engine_config_from_parameters
    from tests.serving.test_serving_model_config import REPOSITORY, parameters_of

    options = options_from_args(make_parser().parse_args(["--kv-cache-dtype", "fp8_e4m3"]))
    repo = materialize_repository(REPOSITORY, tmp_path / "repo", options)
    config = engine_config_from_parameters(parameters_of((repo / "pagoda" / "config.pbtxt").read_text()))
    assert config.kv_cache_dtype == "fp8_e4m3"
    with pytest.raises(SystemExit):
        make_parser().parse_args(["--kv-cache-dtype", "fp8"])


def test_cpu_tier_swaps_fp8_blocks_bytewise():
    from pagoda.engine.runner.host_kv_cache import HostKVCache

    gen = torch.Generator().manual_seed(0)
    device = [tuple(torch.randn(6, 4, 2, 8, generator=gen).to(FP8) for _ in range(2)) for _ in range(2)]
    host = HostKVCache(device, num_blocks=3)
    assert host.host_caches[0][0].dtype == FP8
    before = [t.view(torch.uint8).clone() for kv in device for t in kv]
    host.swap_out([(1, 0), (4, 2)])
    for kv in device:
        for t in kv:
            t.view(torch.uint8)[[1, 4]] = 0
    host.swap_in([(0, 1), (2, 4)])
    assert all(torch.equal(t.view(torch.uint8), b) for t, b in zip((t for kv in device for t in kv), before))
