"""The end-to-end section of ``pagoda bench kernels`` on a CPU: the ours -> Hugging Face
weight mapping gives HF's logits exactly (shared storage, fp32), and ``--small --device
cpu`` runs the whole section (engine and HF on one tiny model) and prints the table."""

from __future__ import annotations

import pytest
import torch

from pagoda.bench import kernels as bench
from pagoda.bench import kernels_e2e as e2e
from pagoda.engine.config import EngineConfig
from pagoda.engine.runner.model_runner import make_random_model
from pagoda.models.registry import config_from_dict
from pagoda.models.testing import StepInput, make_kv_caches, run_step
from tests.numerics import assert_within, model_error_bound

pytest.importorskip("transformers")


@pytest.mark.parametrize("tied", [False, True])
def test_hf_model_on_our_weights_gives_the_same_logits(tied):
    raw = e2e.raw_config(e2e.SMALL) | {"tie_word_embeddings": tied}
    ours = make_random_model(config_from_dict(raw), torch.float32, torch.device("cpu"), seed=1)
    hf = e2e.make_hf_model(raw, ours, torch.device("cpu"), torch.float32)
    assert hf.model.layers[1].self_attn.k_proj.weight.data_ptr() == (
        ours.layers[1].attn.qkv_weight[ours.layers[1].attn.q_size :].data_ptr())  # a view, not a copy
    assert hf.model.layers[0].mlp.up_proj.weight.shape == (256, 128)
    ids = torch.randint(0, raw["vocab_size"], (37,), generator=torch.Generator().manual_seed(0)).tolist()
    caches = make_kv_caches(ours.config, num_blocks=4, block_size=16)
    expected = hf(torch.tensor([ids])).logits[0].float()  # [37, vocab]
    actual = run_step(ours, caches, [StepInput(ids, 0, [2, 0, 3])], block_size=16)
    bound = 2 * model_error_bound(ours.config, len(ids), torch.float32, expected.abs().max().item())
    assert_within(actual, expected, bound, "ours vs HF on shared weights")
    assert torch.equal(actual.argmax(-1), expected.argmax(-1))


def test_decode_bytes_count_every_weight_but_the_embedding_table():
    raw = e2e.raw_config(e2e.SMALL)
    model = make_random_model(config_from_dict(raw), torch.bfloat16, torch.device("cpu"), seed=0)
    weights, kv = e2e.decode_bytes_per_token(model, context=100)
    total = sum(p.numel() for p in model.parameters()) * 2
    assert weights == total - (512 - 1) * 128 * 2
    assert kv == 2 * 2 * 2 * 32 * 2 * 100  # K and V x layers x KV heads x head_dim x bf16 x context


def test_workload_is_bench_offlines_scaled_into_the_vocabulary():
    assert e2e.scaled_workload(32, 0, vocab_size=128256) == e2e.make_workload(32, 0)  # Llama-3 vocab: unchanged
    items = e2e.scaled_workload(8, 0, vocab_size=512)
    assert all(64 <= t < 512 for it in items for t in it.prompt_token_ids)


def test_small_cpu_run_prints_the_table(capsys, restore_threads):
    argv = ["--small", "--device", "cpu", "--threads", "1", "--e2e-requests", "4", "--e2e-prompt-len", "24",
            "--e2e-decode-tokens", "12", "--e2e-greedy-prompts", "3", "--e2e-greedy-tokens", "12", "--iters", "4"]
    assert bench.main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("## pagoda bench kernels, end to end: CPU")
    for heading in ("### Batch-1 decode", "### Mixed workload", "### Greedy agreement"):
        assert heading in out
    assert "| pagoda | " in out and "| pagoda, eager decode |" in out and "| HF generate |" in out
    assert "| pagoda, continuous batching |" in out and "| HF generate, static batches of 8 |" in out
    assert "CUDA graphs: off" in out  # the CPU path never captures
    assert "Greedy agreement: 3/3 prompts identical." in out


def test_cpu_needs_small_and_load_format_is_validated(capsys):
    assert bench.main(["--device", "cpu"]) == 2
    assert "--small" in capsys.readouterr().err
    with pytest.raises(ValueError, match="load_format"):
        EngineConfig(load_format="pickle")
