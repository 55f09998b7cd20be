"""Pipeline stages (models/pipeline_parallel.py) compute the whole model's logits.

Three ranks run in three threads of this process over a real gloo group (no spawn: cheap),
so the first, a middle and the last stage all run: each builds the same seeded model, keeps
its stage, and runs one mixed step (a prefill chunk beside a decode over cached tokens) on a
KV cache of its own layers only; rank 0's logits (sent back by the last stage) must equal
the whole model's. A stage runs the very layers the whole model runs, in the same order, on
the same inputs, so the logits are bit-identical (asserted exactly). Cases: a dense Llama
with an untied head and 4 layers over 3 stages (the uneven split 1/2/1), and a Qwen3-MoE
with a dense first layer; and TP=2 x PP=2 in four threads (within 1e-4: the shards'
all-reduces reorder sums). Families with their own forward (Gemma 3) are refused by name.
"""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch
import torch.distributed as dist

from pagoda.engine.parallel.group import ProcessGroup, make_groups
from pagoda.engine.runner.model_runner import make_random_model
from pagoda.models import config_from_dict
from pagoda.models.pipeline_parallel import PipelineStage, check_stages, stage_layers
from pagoda.models.tensor_parallel import shard_model
from pagoda.models.testing import StepInput, run_step

from tests.models.test_config_loader import BASE, GEMMA3
from tests.models.test_moe import QWEN3_MOE

BLOCK = 8
LLAMA = dict(architectures=["LlamaForCausalLM"], vocab_size=256, hidden_size=64, intermediate_size=96,
             num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=128, tie_word_embeddings=False)
CASES = {"llama-untied-4-layers": LLAMA, "qwen3-moe-dense-first": {**QWEN3_MOE, "mlp_only_layers": [0]}}


def _step(model, num_layers: int, config) -> torch.Tensor:
    shape = (8, BLOCK, config.num_key_value_heads, config.head_dim)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(num_layers)]
    prompt_a, prompt_b = list(range(5, 20)), list(range(30, 41))
    run_step(model, caches, [StepInput(prompt_b[:10], 0, [3, 4])], BLOCK)  # b's first 10 tokens cached
    return run_step(model, caches, [StepInput(prompt_a, 0, [0, 1]), StepInput(prompt_b[10:], 10, [3, 4])], BLOCK)


def _in_threads(size: int, run, timeout_s: float = 60) -> dict:
    """``run(world_group)`` for each rank of a gloo world of ``size``, one thread each; the results by rank.

    A rank keeps its group until every rank is done: the last stage's logits leave by an
    ``isend`` that completes only once rank 0 posted its receive, and a group dropped before
    that closes the connection under it (rank 0 then reads "connection closed by peer", seen
    on a loaded CI machine). So each rank flushes its sends, then waits for the others.
    """
    store = dist.HashStore()
    results, errors = {}, []
    everyone_done = threading.Barrier(size)

    def rank(r: int) -> None:
        try:
            group = ProcessGroup(r, size, store, torch.device("cpu"), timeout_s=timeout_s)
            results[r] = run(group)
            group.flush()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
            everyone_done.abort()  # the others stop waiting for this rank
        try:
            everyone_done.wait(timeout=2 * timeout_s)
        except threading.BrokenBarrierError:
            pass

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=3 * timeout_s)
    assert not errors, errors
    assert len(results) == size, f"ranks {sorted(set(range(size)) - set(results))} did not finish"
    return results


@pytest.mark.parametrize("name", sorted(CASES))
def test_three_stages_equal_the_whole_model(name):
    config = config_from_dict(CASES[name])
    whole = make_random_model(config, torch.float32, torch.device("cpu"), seed=3)
    expected = _step(whole, config.num_hidden_layers, config)

    def run(group):
        stage = PipelineStage(make_random_model(config, torch.float32, torch.device("cpu"), seed=3), group)
        return len(stage.layers), _step(stage, len(stage.layers), config)

    results = _in_threads(3, run)
    assert [results[r][0] for r in range(3)] == [1, 2, 1]
    assert results[1][1].numel() == 0 and results[2][1].numel() == 0
    assert torch.equal(results[0][1], expected)


def test_layer_split_follows_vllm():
    # Even, then the remainder on the stages just before the last.
    assert [stage_layers(30, 2, r) for r in (0, 1)] == [range(0, 15), range(15, 30)]
    assert [stage_layers(3, 2, r) for r in (0, 1)] == [range(0, 2), range(2, 3)]
    assert [stage_layers(6, 4, r) for r in range(4)] == [range(0, 1), range(1, 3), range(3, 5), range(5, 6)]


class _NoGroup:
    rank, size = 0, 2


def test_what_a_stage_cannot_split_is_named():
    with pytest.raises(ValueError, match="pipeline_parallel_size=4: num_hidden_layers=2 must be at least"):
        check_stages(config_from_dict({**LLAMA, "num_hidden_layers": 2}), 4)
    gemma = config_from_dict({**BASE, **GEMMA3, "rope_theta": 1e6, "rope_local_base_freq": 1e4,
                              "sliding_window_pattern": 6})
    model = make_random_model(gemma, torch.float32, torch.device("cpu"), seed=0)
    with pytest.raises(ValueError, match="pipeline parallelism: Gemma3ForCausalLM has its own forward"):
        PipelineStage(model, _NoGroup())


def test_two_stages_of_two_tensor_parallel_ranks_equal_the_whole_model():
    """TP=2 x PP=2 in four threads: each stage is a tensor-parallel group of its own (the
    shards' all-reduces reorder sums: within 1e-4, as TP alone)."""
    config = config_from_dict(LLAMA)
    expected = _step(make_random_model(config, torch.float32, torch.device("cpu"), seed=3), 4, config)

    def run(world):
        groups = make_groups(world, 2, 2, timeout_s=60)
        model = shard_model(make_random_model(config, torch.float32, torch.device("cpu"), seed=3), groups["tp"])
        stage = PipelineStage(model, groups["pp"])
        return _step(stage, len(stage.layers), dataclasses.replace(config, num_key_value_heads=1))

    results = _in_threads(4, run)
    assert all(results[r].numel() == 0 for r in (1, 2, 3))
    assert (results[0] - expected).abs().max().item() < 1e-4
