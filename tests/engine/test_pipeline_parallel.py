"""Pipeline parallelism (engine/parallel, models/pipeline_parallel): PP=2 on CPU with gloo, fp32.

Specification:
- greedy and seeded outputs of a PP=2 engine equal a PP=1 engine's token for token, and the
  sampled tokens' logprobs (and prompt logprobs) within 1e-4 — for the default model (30
  layers: 15 per stage), synchronous and with async scheduling, with a LoRA adapter; and for
  a random 3-layer config with an untied head (the uneven split: 2 layers, then 1) with
  async scheduling, int8 weights and preemption by swap to the CPU tier (each rank's host
  tier holds its layers; also ``preemption_mode="auto"``, whose start-up calibration runs a
  prefill through the stages); prompt-lookup speculation on the default model — each under chunked prefill, prefix-cache hits and preemption, and with no KV
  block leaked (``test_tensor_parallel._check_same``, shared with the TP tests);
- TP=2 x PP=2 (four ranks, on the random config) equals one device the same way;
- what does not combine yet is refused by name, before any worker starts;
- a killed worker makes the next step fail naming it as a pipeline-parallel rank;
- the step passed down the stages (``step_wire.PipelinePath``) reaches every rank, and sends
  do not wait for their receiver (real gloo, three ranks in threads).

The stage arithmetic itself (three stages, a middle one included, bit-identical to the whole
model) is tested without processes in tests/models/test_pipeline_stages.py.
"""

from __future__ import annotations

import json

import pytest
import torch

from pagoda.engine.config import EngineConfig
from pagoda.engine.llm import LLM
from pagoda.engine.llm_engine import LLMEngine
from pagoda.engine.parallel.group import ProcessGroup
from pagoda.engine.parallel.step_wire import PipelinePath, StepReceiver, StepSender
from pagoda.engine.runner.request_states import RequestStates
from pagoda.engine.sampling_params import SamplingParams
from pagoda.engine.scheduler_output import SchedulerOutput

from tests.engine.hf_reference import save_random_model
from tests.engine.test_tensor_parallel import _check_same, _item, kill_rank1_then_expect
from tests.models.test_pipeline_stages import _in_threads

PP = "pipeline_parallel_size"


@pytest.fixture(scope="module")
def three_layers(tmp_path_factory, smollm2_path) -> str:
    """A random Llama with 3 layers (stage 0 runs two, stage 1 one), 1 KV head, an untied head."""
    return str(save_random_model(tmp_path_factory.mktemp("pp3"), smollm2_path, 0, vocab_size=49152,
                                 hidden_size=256, intermediate_size=384, num_hidden_layers=3, num_attention_heads=4,
                                 num_key_value_heads=1, head_dim=64, max_position_embeddings=1024,
                                 tie_word_embeddings=False))


def test_default_model_pp2_matches_pp1(smollm2_path):
    _check_same(smollm2_path, [dict(), dict(async_scheduling=True)], PP)


def test_lora_adapter_pp2_matches_pp1(smollm2_path, smollm2_lora):
    _check_same(smollm2_path, [dict(enable_lora=True, lora_modules={"qv": smollm2_lora})], PP)


def test_uneven_stages_pp2_match_pp1(three_layers):
    _check_same(three_layers, [dict(async_scheduling=True)], PP)
    _check_same(three_layers, [dict(quantization="int8")], PP)


def test_steps_travel_down_the_stages_and_sends_do_not_wait():
    """``PipelinePath`` over a real gloo world of three ranks (threads): rank 0 sends two steps
    (the second overflowing the buffer) and their hidden states before it receives the first
    step's logits, while the last rank sends those logits before it receives the second step —
    the batch queue's order. Every rank reads the steps rank 0 sent (the middle one forwards
    them). With sends that waited for their receiver, ranks 0 and 2 would wait on each other
    until the group's timeout (checked on gloo itself: they do)."""
    steps = [SchedulerOutput([_item("a", 0, [1, 2, 3], [4, 5], True), _item("b", 0, [7, 8], [9], True)]),
             SchedulerOutput([_item("c", 0, list(range(20)), list(range(10, 30)), True)], finished_request_ids=["a"])]
    hidden = [torch.full((2, 5, 4), 1.0), torch.full((2, 20, 4), 2.0)]

    def run(group: ProcessGroup):
        path = PipelinePath(group)
        if group.rank == 0:
            sender, states = StepSender(group, capacity=40, device=torch.device("cpu"), path=path), RequestStates()
            sent = []
            for step, h in zip(steps, hidden):
                inputs = states.update(step)
                sender.send(step, inputs, None)
                group.send(h.clone(), 1)
                sent.append([(i.block_ids, i.token_ids) for i in inputs])
            logits = [torch.empty(3) for _ in steps]
            for t in logits:
                group.recv(t, 2)
            group.flush()
            return sent, [t.tolist() for t in logits]
        receiver, got = StepReceiver(group, capacity=40, device=torch.device("cpu"), path=path), []
        for h in hidden:
            inputs = receiver.recv()
            got.append([(i.block_ids, i.token_ids) for i in inputs])
            received = torch.empty_like(h)
            group.recv(received, group.rank - 1)
            if group.rank == 1:
                group.send(received + 1, 2)
            else:
                group.send(torch.full((3,), received[0, 0, 0].item()), 0)
        group.flush()
        return got

    results = _in_threads(3, run, timeout_s=20)
    sent, logits = results[0]
    assert results[1] == results[2] == sent
    assert logits == [[2.0] * 3, [3.0] * 3]


def test_two_stages_of_two_tensor_parallel_ranks_match_one_device(three_layers):
    """TP=2 x PP=2: four processes; each stage shards its layers over two ranks (the 1 KV head
    replicated), the first stage's embedding and the last one's LM head vocabulary-parallel."""
    _check_same(three_layers, [dict(tensor_parallel_size=2, async_scheduling=True)], PP,
                reference=dict(async_scheduling=True))


def test_prompt_lookup_speculation_pp2_matches_pp1(smollm2_path):
    stats = _check_same(smollm2_path, [dict(speculative_method="ngram", num_speculative_tokens=3,
                                            spec_adaptive=False)], PP)
    # The drafts' rows of logits travel back from the last stage; rank 0 verifies them.
    assert stats.spec_num_draft_tokens > 0 and stats.spec_num_accepted_tokens > 0, stats


def test_kv_swap_to_the_cpu_tier_pp2_matches_pp1(three_layers):
    stats = _check_same(three_layers, [dict(cpu_offload_bytes=64 << 20, preemption_mode="swap")], PP)
    assert stats.num_swapped_out > 0 and stats.num_swapped_in > 0, stats
    # "auto" calibrates at start: rank 0's timed prefill runs through the stages, mirrored on the workers.
    _check_same(three_layers, [dict(cpu_offload_bytes=64 << 20, preemption_mode="auto")], PP)


@pytest.mark.parametrize("fields,message", [
    (dict(pipeline_parallel_size=3, tensor_parallel_nodes=2, tensor_parallel_leader="10.0.0.1:29500"),
     "tensor_parallel_nodes: tensor_parallel_size=1 x pipeline_parallel_size=3 = 3 ranks is not a multiple of 2"),
    (dict(pipeline_parallel_size=2, speculative_method="draft", speculative_draft_num_layers=1),
     "speculative_method: 'draft' is not supported with pipeline_parallel_size > 1"),
    (dict(pipeline_parallel_size=0), "pipeline_parallel_size: must be an integer >= 1"),
])
def test_what_does_not_combine_is_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**fields)


def test_more_stages_than_layers_is_refused_before_spawning(three_layers):
    with pytest.raises(ValueError, match="pipeline_parallel_size=4: num_hidden_layers=3 must be at least"):
        LLMEngine(EngineConfig(model=three_layers, pipeline_parallel_size=4))


def test_killed_worker_is_named(three_layers):
    llm = LLM(three_layers, pipeline_parallel_size=2)
    engine = llm.engine
    try:
        assert len(llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True))[0].outputs[0].token_ids) == 3
        with pytest.raises(ValueError, match="use_beam_search: not supported with tensor_parallel_size or pipeline"):
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, use_beam_search=True, n=2, temperature=0.0))
        kill_rank1_then_expect(llm, r"pipeline-parallel worker rank 1 \(pid \d+\) exited with code -9")
    finally:
        engine.shutdown()


def test_bench_offline_compares_pp1_and_pp2(tmp_path, smollm2_path):
    """`pagoda bench offline --pipeline-parallel-size 2` runs both sizes in one run (a tiny
    workload: this checks the command, not the speed)."""
    from pagoda.bench import offline

    out = tmp_path / "pp.json"
    assert offline.main(["--pipeline-parallel-size", "2", "--tp-config", "default", "--num-requests", "2",
                         "--tp-max-tokens", "3", "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    assert results["mode"] == "PP" and results["identical_outputs"] == "2/2"
    assert results["tp2"]["tokens"] == results["tp1"]["tokens"] == 6
    assert results["tp2"]["broadcast_us_per_step"] > 0 and "broadcast_us_per_step" not in results["tp1"]
    with pytest.raises(SystemExit, match="--tensor-parallel-size and --pipeline-parallel-size each compare"):
        offline.main(["--pipeline-parallel-size", "2", "--tensor-parallel-size", "2"])
