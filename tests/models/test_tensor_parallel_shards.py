"""Sharded models (models/tensor_parallel.py) compute the whole model's logits.

Two ranks run in two threads of this process over a real gloo group (no spawn, so the
cases are cheap): each builds the same seeded model, keeps its shard, and runs one mixed
step (a prefill chunk beside a decode over cached tokens) on its own KV cache of its own
KV heads; rank 0's gathered logits must equal the unsharded model's within 1e-4 (fp32;
the all-reduce sums two partial products instead of one GEMM's accumulation: ~1e-6).
Cases: biases on q/k/v and o (o's on rank 0 only), an untied head, 1 KV head replicated on
both ranks, the uneven KV-group cut (6 query / 3 KV heads), Qwen3's per-head q/k norms.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

from pagoda.engine.parallel.group import ProcessGroup
from pagoda.engine.runner.model_runner import make_random_model
from pagoda.models.config import ModelConfig
from pagoda.models.tensor_parallel import kv_head_range, shard_model
from pagoda.models.testing import StepInput, run_step

BLOCK = 8
CASES = {
    "llama-bias-untied": dict(num_attention_heads=4, num_key_value_heads=2, attention_bias=True, o_proj_bias=True,
                              tie_word_embeddings=False),
    "kv1-replicated": dict(num_attention_heads=4, num_key_value_heads=1),
    "uneven-kv-groups": dict(num_attention_heads=6, num_key_value_heads=3),
    "qwen3-qk-norm": dict(architecture="Qwen3ForCausalLM", num_attention_heads=4, num_key_value_heads=2),
}


def _config(**kw) -> ModelConfig:
    base = dict(architecture="LlamaForCausalLM", vocab_size=256, hidden_size=64, intermediate_size=96,
                num_hidden_layers=2, head_dim=16, rms_norm_eps=1e-5, max_position_embeddings=128,
                rope_theta=10000.0, tie_word_embeddings=True)
    return ModelConfig(**{**base, **kw})


def _model(config: ModelConfig):
    model = make_random_model(config, torch.float32, torch.device("cpu"), seed=3)
    generator = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "bias" in name or name.endswith("_norm_weight") or "q_norm" in name or "k_norm" in name:
                param.copy_(1.0 + 0.3 * torch.randn(param.shape, generator=generator))
    return model


def _step(model, kv_heads: int, config: ModelConfig) -> torch.Tensor:
    shape = (8, BLOCK, kv_heads, config.head_dim)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(config.num_hidden_layers)]
    prompt_a, prompt_b = list(range(5, 20)), list(range(30, 41))
    run_step(model, caches, [StepInput(prompt_b[:10], 0, [3, 4])], BLOCK)  # b's first 10 tokens cached
    return run_step(model, caches, [StepInput(prompt_a, 0, [0, 1]), StepInput(prompt_b[10:], 10, [3, 4])], BLOCK)


@pytest.mark.parametrize("name", sorted(CASES))
def test_sharded_logits_equal_the_whole_model(name):
    config = _config(**CASES[name])
    expected = _step(_model(config), config.num_key_value_heads, config)
    store = dist.HashStore()
    results, errors = {}, []

    def rank(r: int) -> None:
        try:
            group = ProcessGroup(r, 2, store, torch.device("cpu"), timeout_s=60)
            model = shard_model(_model(config), group)
            results[r] = _step(model, kv_head_range(config.num_key_value_heads, 2, r)[1], config)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert results[0].shape == expected.shape and results[1].numel() == 0
    assert (results[0] - expected).abs().max().item() < 1e-4  # measured: <= 2e-5 on logits of std ~4
