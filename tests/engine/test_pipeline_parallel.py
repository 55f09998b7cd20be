"""Pipeline parallelism (engine/parallel, models/pipeline_parallel): PP=2 on CPU with gloo, fp32.

Specification:
- greedy and seeded outputs of a PP=2 engine equal a PP=1 engine's token for token, and the
  sampled tokens' logprobs (and prompt logprobs) within 1e-4 — for the default model (30
  layers: 15 per stage), synchronous and with async scheduling, with a LoRA adapter; and for
  a random 3-layer config with an untied head (the uneven split: 2 layers, then 1) with
  async scheduling, int8 weights and preemption by swap to the CPU tier (each rank's host
  tier holds its layers; also ``preemption_mode="auto"``, whose start-up calibration runs a
  prefill through the stages); prompt-lookup speculation on the default model — each under chunked prefill,
  prefix-cache hits and preemption, and with no KV block leaked (``test_tensor_parallel._check_same``, shared with the
  TP tests);
- TP=2 x PP=2 (four ranks, on the random config) equals one device the same way;
- what does not combine yet is refused by name, before any worker starts;
- a killed worker makes the next step fail naming it as a pipeline-parallel rank;
- the step passed down the stages (``step_wire.PipelinePath``) reaches every rank, and sends
  do not wait for their receiver (real gloo, three ranks in threads);
- two steps in flight (the batch queue, ``core.batch_queue``; the default at PP=2, and the
  path every PP=2 comparison above runs unless it sets ``pipeline_micro_batches=1``, which one
  case does with async scheduling): step i+1 is issued before step i completes in steady
  decode, only one step is in flight for a single request, and requests aborted while their
  steps are in flight get nothing after their abort output and leave no block behind.

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

from tests.engine.hf_reference import make_random_model, save_random_model
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
    stats = _check_same(smollm2_path, [dict(), dict(async_scheduling=True)], PP)
    assert stats.max_steps_in_flight == 2, stats  # the batch queue ran (async scheduling ignored)


def test_lora_adapter_pp2_matches_pp1(smollm2_path, smollm2_lora):
    _check_same(smollm2_path, [dict(enable_lora=True, lora_modules={"qv": smollm2_lora})], PP)


def test_uneven_stages_pp2_match_pp1(three_layers, monkeypatch):
    # Two steps in flight (the default at PP=2; async scheduling is then ignored), and one step
    # at a time with async scheduling (pipeline_micro_batches=1: the path before the batch queue).
    _check_same(three_layers, [dict(async_scheduling=True), dict(pipeline_micro_batches=1, async_scheduling=True)], PP,
                reference=dict(async_scheduling=True))
    # The CPU int8 kernel depends on a step's row count (packed up to MAX_PACKED_ROWS rows, bf16
    # results; dequantize above): two steps in flight split the running requests, so a token's
    # row meets the other kernel than at PP=1. The dequantize path checks the stages themselves.
    monkeypatch.setenv("PAGODA_INT8_KERNEL", "dequantize")
    _check_same(three_layers, [dict(quantization="int8")], PP)


def _generate(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, abort_in_flight: bool = False):
    """Run ``prompts`` to the end; each request's outputs, in order. With ``abort_in_flight``,
    once two steps are in flight, abort a request of the newer one and one of the older one."""
    outputs: dict[str, list] = {str(i): [] for i in range(len(prompts))}
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    aborted: dict[str, int] = {}  # request id -> outputs it had when aborted
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id].append(out)
        if abort_in_flight and not aborted and engine.core.num_in_flight == 2:
            queue = engine.core._queue
            victims = [queue[-1].scheduler_output.scheduled[0].request_id,
                       queue[0].scheduler_output.scheduled[-1].request_id]
            for victim in victims:
                aborted[victim] = len(outputs[victim])
                engine.abort_request(victim)
    return outputs, aborted


def test_two_steps_in_flight_overlap_in_steady_decode(three_layers):
    """The overlap, read from the batch queue's record of issued and completed steps (no timing):
    with four requests decoding, step i+1 is issued before step i completes and two steps are
    in flight; with one request only one step ever is (its next token is unknown until its step
    is applied). Outputs equal one device's."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [[1 + i, 5, 9, 13 + i, 20] for i in range(4)]
    reference = LLMEngine(EngineConfig(model=three_layers))
    try:
        outputs = _generate(reference, prompts, params)[0]
        expected = {rid: outs[-1].outputs[0].token_ids for rid, outs in outputs.items()}
    finally:
        reference.shutdown()
    engine = LLMEngine(EngineConfig(model=three_layers, pipeline_parallel_size=2))
    core = engine.core
    try:
        assert type(core).__name__ == "BatchQueueCore" and engine.config.micro_batches == 2
        single = _generate(engine, prompts[:1], params)[0]
        assert single["0"][-1].outputs[0].token_ids == expected["0"]
        assert core.max_in_flight == 1
        assert {e[2] for e in core.step_events if e[0] == "issue"} == {1}
        core.step_events.clear()
        got = _generate(engine, prompts, params)[0]
        assert {rid: outs[-1].outputs[0].token_ids for rid, outs in got.items()} == expected
        assert core.max_in_flight == 2
        events = list(core.step_events)
        at = {(kind, step_id): i for i, (kind, step_id, _) in enumerate(events)}
        issued = [step_id for kind, step_id, _ in events if kind == "issue"]
        overlapped = [a for a, b in zip(issued, issued[1:]) if at[("issue", b)] < at[("complete", a)]]
        # Each request decodes 12 tokens in steps of two requests: all but the last step overlap.
        assert len(issued) >= 12 and len(overlapped) == len(issued) - 1, events
        stats = engine.get_stats()
        assert stats.num_free_blocks == stats.num_blocks
        # Each half of a step's device job counts as waiting in the call that ran it, once.
        assert 0 < stats.step_wait_s and 0 <= stats.step_host_s, stats
    finally:
        engine.shutdown()


def test_abort_while_its_step_is_in_flight(three_layers):
    """Aborting requests whose steps are in flight (one in the older step, one in the newer):
    nothing after their abort output, every KV block free at the end, the others unharmed."""
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    prompts = [[1 + i, 5, 9, 13 + i, 20] for i in range(4)]
    engine = LLMEngine(EngineConfig(model=three_layers, pipeline_parallel_size=2))
    try:
        clean = _generate(engine, prompts, params)[0]
        got, aborted = _generate(engine, prompts, params, abort_in_flight=True)
        assert len(aborted) == 2, aborted
        for rid, outs in got.items():
            if rid in aborted:
                after = outs[aborted[rid]:]
                assert len(after) == 1 and after[0].outputs[0].finish_reason == "abort", after
                assert len(after[0].outputs[0].token_ids) < params.max_tokens
            else:
                assert outs[-1].outputs[0].token_ids == clean[rid][-1].outputs[0].token_ids
        stats = engine.get_stats()
        assert stats.num_free_blocks == stats.num_blocks and stats.num_running == stats.num_waiting == 0
    finally:
        engine.shutdown()


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
    replicated), the first stage's embedding and the last one's LM head vocabulary-parallel.
    Two steps in flight: rank 0 broadcasts each step in stage 0's group, each stage-0 rank
    passes it to its peer in stage 1."""
    stats = _check_same(three_layers, [dict(tensor_parallel_size=2, async_scheduling=True)], PP,
                        reference=dict(async_scheduling=True))
    assert stats.max_steps_in_flight == 2, stats


def test_prompt_lookup_speculation_pp2_matches_pp1(smollm2_path):
    stats = _check_same(smollm2_path, [dict(speculative_method="ngram", num_speculative_tokens=3,
                                            spec_adaptive=False)], PP)
    # The drafts' rows of logits travel back from the last stage; rank 0 verifies them.
    assert stats.spec_num_draft_tokens > 0 and stats.spec_num_accepted_tokens > 0, stats


def test_kv_swap_to_the_cpu_tier_pp2_matches_pp1(three_layers):
    # Swapped-out requests hit no prefix of their own: the hits are request 2 on request 1's
    # prefix (~2 blocks), which two steps in flight would prefill side by side unless the
    # shared-prefix wait (here lowered to one block) also waits for the steps in flight.
    stats = _check_same(three_layers, [dict(cpu_offload_bytes=64 << 20, preemption_mode="swap",
                                            min_shared_prefix_to_wait=16)], PP)
    assert stats.num_swapped_out > 0 and stats.num_swapped_in > 0, stats
    # "auto" calibrates at start: rank 0's timed prefill runs through the stages, mirrored on the workers.
    _check_same(three_layers, [dict(cpu_offload_bytes=64 << 20, preemption_mode="auto", min_shared_prefix_to_wait=16)],
                PP)


@pytest.mark.parametrize("fields,message", [
    (dict(pipeline_parallel_size=3, tensor_parallel_nodes=2, tensor_parallel_leader="10.0.0.1:29500"),
     "tensor_parallel_nodes: tensor_parallel_size=1 x pipeline_parallel_size=3 = 3 ranks is not a multiple of 2"),
    (dict(pipeline_parallel_size=2, speculative_method="draft", speculative_draft_num_layers=1),
     "speculative_method: 'draft' is not supported with pipeline_parallel_size > 1"),
    (dict(pipeline_parallel_size=0), "pipeline_parallel_size: must be an integer >= 1"),
    (dict(pipeline_micro_batches=2), "pipeline_micro_batches=2: steps in flight need pipeline_parallel_size > 1"),
    (dict(pipeline_parallel_size=2, pipeline_micro_batches=0), "pipeline_micro_batches: must be an integer >= 1"),
    (dict(pipeline_parallel_size=2, pipeline_micro_batches=3),
     "pipeline_micro_batches=3: at most pipeline_parallel_size=2"),
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
        [output] = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True))
        assert len(output.outputs[0].token_ids) == 3
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
    # Two requests, two stages: each step holds one request, and both are in flight at once.
    assert results["tp2"]["micro_batches"] == 2 and results["tp2"]["max_steps_in_flight"] == 2
    with pytest.raises(SystemExit, match="--tensor-parallel-size and --pipeline-parallel-size each compare"):
        offline.main(["--pipeline-parallel-size", "2", "--tensor-parallel-size", "2"])


def test_kv_cache_groups_pp2_match_pp1(tmp_path, smollm2_path):
    """gpt-oss: layer 0 windowed (stage 0), layer 1 full attention (stage 1), so each stage holds
    one KV cache group's layer; the wire carries both groups' tables, the batch queue included."""
    path = str(make_random_model(tmp_path / "oss", "gpt-oss-window8", smollm2_path))
    swap = dict(cpu_offload_bytes=64 << 20, preemption_mode="swap", min_shared_prefix_to_wait=16)
    stats = _check_same(path, [dict(num_gpu_blocks_override=13), dict(num_gpu_blocks_override=13, **swap)], PP,
                        reference=dict(num_gpu_blocks_override=13))
    assert stats.num_swapped_out > 0, stats
