"""A tiny random Llama (and a Qwen3-MoE for the fused MoE kernels, a Mistral with a 16-token
sliding window for windowed attention, a gpt-oss for sinks and its biased clamped-SwiGLU
experts) gives the same logits
and greedy tokens with the Triton kernels (under the interpreter) as with the torch
references, at the model and at the engine level.

The random models come from ``tests/engine/hf_reference.py`` (2 layers, initializer range
0.3 so greedy choices are not near ties). Setting ``PAGODA_KERNELS`` and calling
``reload_settings`` switches the path, so one process can run both on the same weights.
"""

from __future__ import annotations

import pytest
import torch

from pagoda import SamplingParams
from pagoda.engine.config import EngineConfig
from pagoda.engine.llm_engine import LLMEngine
from pagoda.kernels import reload_settings, triton_ops
from pagoda.models import config_from_pretrained, load_model
from pagoda.models.testing import StepInput, make_kv_caches, run_step
from tests.engine.driving import drain
from tests.engine.hf_reference import make_random_model
from tests.numerics import assert_within, model_error_bound

BLOCK_SIZE = 16


@pytest.fixture(scope="module", params=["llama-gqa3-hd64", "llama-gqa4-hd80-untied", "qwen3-moe", "mistral-window16",
                                        "gpt-oss-window8"])
def model_path(request, tmp_path_factory, smollm2_path):
    return str(make_random_model(tmp_path_factory.mktemp("m") / request.param, request.param, smollm2_path))


@pytest.fixture
def triton_calls(monkeypatch):
    """Counts calls that reach the Triton wrappers, proving the kernels really ran."""
    calls = {name: 0 for name in triton_ops.__all__}
    for name in calls:
        real = getattr(triton_ops, name)

        def counted(*args, _real=real, _name=name):
            calls[_name] += 1
            return _real(*args)

        monkeypatch.setattr(triton_ops, name, counted)
    return calls


GATED_DELTANET_KERNELS = ("causal_conv1d", "gated_delta_rule", "gated_rms_norm")


def _ran_every_kernel(calls: dict[str, int], config) -> bool:
    """Every kernel the model uses was called (the MoE kernels only by a MoE model, the Gated
    DeltaNet's only by a hybrid one: tests/models/test_hybrid_vs_hf.py runs those)."""
    def used(name: str) -> bool:
        if name == "moe_experts":
            return bool(config.num_experts)
        return name not in GATED_DELTANET_KERNELS or config.linear_attention is not None

    return all(n for name, n in calls.items() if used(name))


def _scenario_logits(model, kernels: str, monkeypatch) -> list[torch.Tensor]:
    """Chunked prefill of A next to a prefill of B, then mixed and decode steps, greedy."""
    monkeypatch.setenv("PAGODA_KERNELS", kernels)
    reload_settings()
    caches = make_kv_caches(model.config, num_blocks=16, block_size=BLOCK_SIZE)
    table_a, table_b = [3, 9, 1], [12, 0]  # shuffled, non-adjacent blocks
    gen = torch.Generator().manual_seed(0)
    prompt_a = torch.randint(100, 40000, (21,), generator=gen).tolist()
    prompt_b = torch.randint(100, 40000, (9,), generator=gen).tolist()
    steps = [[StepInput(prompt_a[:16], 0, table_a), StepInput(prompt_b, 0, table_b)]]
    all_logits = [run_step(model, caches, steps[0], BLOCK_SIZE)]
    next_b = int(all_logits[0][-1].argmax())
    # A's second chunk (16 cached tokens) beside B's first decode.
    step = [StepInput(prompt_a[16:], 16, table_a), StepInput([next_b], 9, table_b)]
    all_logits.append(run_step(model, caches, step, BLOCK_SIZE))
    len_a, len_b = 21, 10
    for _ in range(4):  # decodes; A crosses into its third block
        logits = all_logits[-1]
        next_a, next_b = int(logits[-2].argmax()), int(logits[-1].argmax())
        step = [StepInput([next_a], len_a, table_a), StepInput([next_b], len_b, table_b)]
        all_logits.append(run_step(model, caches, step, BLOCK_SIZE))
        len_a, len_b = len_a + 1, len_b + 1
    return all_logits


def test_model_logits_match_torch_references(model_path, monkeypatch, triton_calls):
    """Both float32 paths within the derived rounding bound of a float64 run of the same
    weights (tests/numerics.py), so the check holds whatever the CPU's reduction order."""
    model = load_model(model_path, dtype=torch.float32)
    expected = _scenario_logits(model, "torch", monkeypatch)
    assert not any(triton_calls.values())
    actual = _scenario_logits(model, "triton", monkeypatch)
    assert _ran_every_kernel(triton_calls, model.config), triton_calls
    exact = _scenario_logits(load_model(model_path, dtype=torch.float64), "torch", monkeypatch)
    for step, (a, e, x) in enumerate(zip(actual, expected, exact)):
        assert torch.equal(a.argmax(-1), e.argmax(-1)), f"greedy tokens differ at step {step}"
        bound = model_error_bound(model.config, 32, torch.float32, x.abs().max().item())
        assert_within(e, x, bound, f"torch references, step {step}")
        assert_within(a, x, bound, f"triton kernels, step {step}")


def _engine_greedy(model_path: str, kernels: str, monkeypatch) -> dict[str, list[int]]:
    monkeypatch.setenv("PAGODA_KERNELS", kernels)
    reload_settings()
    # A small token budget makes the 40-token prompt prefill in chunks beside decodes.
    engine = LLMEngine(EngineConfig(model=model_path, block_size=BLOCK_SIZE, max_num_batched_tokens=24))
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for name, length in (("short", 5), ("mid", 17), ("long", 40)):
        engine.add_request(name, list(range(1000 + length, 1000 + 2 * length)), greedy)
    tokens = {rid: out.outputs[0].token_ids for rid, out in drain(engine).items()}
    return tokens


@pytest.mark.parametrize("model_path", ["llama-gqa4-hd80-untied"], indirect=True)  # one model: time
def test_engine_greedy_tokens_match_torch_references(model_path, monkeypatch, triton_calls):
    expected = _engine_greedy(model_path, "torch", monkeypatch)
    assert not any(triton_calls.values())
    actual = _engine_greedy(model_path, "triton", monkeypatch)
    assert _ran_every_kernel(triton_calls, config_from_pretrained(model_path)), triton_calls
    assert actual == expected
    assert all(len(t) == 6 for t in actual.values())
