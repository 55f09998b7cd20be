"""Async scheduling through the whole engine, on a tiny random model (2 layers, 2048-token
vocabulary, SmolLM2's tokenizer files).

With ``async_scheduling`` on, outputs must equal the synchronous engine's token for token
(greedy and seeded; stop strings, stop tokens, max_tokens, an abort mid-stream, chunked
prefill, n > 1, and preemption in a tight KV cache), streamed deltas must add up, and
every block must be free at the end. A step hook sees the logits before sampling and the
accepted tokens after each update.
"""

from __future__ import annotations

import re

import pytest
import torch

from pagoda.engine.config import EngineConfig
from pagoda.engine.llm_engine import LLMEngine
from pagoda.engine.sampling_params import SamplingParams

from tests.engine.test_spec_engine import VOCAB, make_small_model


@pytest.fixture(scope="module")
def model(tmp_path_factory, smollm2_path):
    return make_small_model(tmp_path_factory.mktemp("async") / "m", smollm2_path, seed=3)


def _engine(model, async_scheduling, **overrides):
    values = dict(model=model, async_scheduling=async_scheduling, max_num_batched_tokens=64, max_model_len=256)
    values.update(overrides)
    return LLMEngine(EngineConfig(**values))


def _run(engine, requests, abort_at=None):
    """requests: {id: (prompt, params)}; abort_at: {id: k} aborts once k tokens streamed.
    Returns the final outputs by id."""
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    finals, streamed = {}, {}
    try:
        while engine.has_unfinished_requests():
            for out in engine.step():
                ids = streamed.setdefault(out.request_id, [[] for _ in out.outputs])
                for c in out.outputs:
                    ids[c.index] += c.delta_token_ids
                if out.finished:
                    finals[out.request_id] = out
                elif len(out.outputs[0].token_ids) >= (abort_at or {}).get(out.request_id, 10**9):
                    engine.abort_request(out.request_id)
        stats = engine.get_stats()
    finally:
        engine.shutdown()
    assert stats.num_free_blocks == stats.num_blocks and stats.num_running == stats.num_waiting == 0
    for request_id, out in finals.items():
        assert streamed[request_id] == [c.token_ids for c in out.outputs], "deltas add up"
    return finals, stats


def _prompt(seed, length):
    return [(seed * 131 + 17 * i) % (VOCAB - 3) + 3 for i in range(length)]


def _summary(finals):
    return {rid: [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in out.outputs]
            for rid, out in finals.items()}


def test_overlap_matches_the_synchronous_engine(model):
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    base, _ = _run(_engine(model, False), {"s": (_prompt(1, 30), greedy), "t": (_prompt(2, 9), greedy)})
    text = base["s"].outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip(), "need a visible stop string"
    stop_id = base["t"].outputs[0].token_ids[6]
    requests = {
        "greedy": (_prompt(3, 12), greedy),
        "one-token": (_prompt(4, 5), greedy.clone(max_tokens=1)),
        "stop-string": (_prompt(1, 30), greedy.clone(stop=[stop])),
        "stop-token": (_prompt(2, 9), greedy.clone(stop_token_ids=[stop_id])),
        "aborted": (_prompt(5, 20), greedy.clone(max_tokens=40)),
        "chunked": (_prompt(6, 100), greedy.clone(max_tokens=8)),
        "seeded-n2": (_prompt(7, 25), SamplingParams(n=2, temperature=0.9, top_p=0.9, seed=11, max_tokens=15,
                                                     ignore_eos=True)),
    }
    results = {}
    for overlap in (False, True):
        # 12 blocks of 16 tokens, fewer than the requests hold at peak: preemption happens.
        engine = _engine(model, overlap, num_gpu_blocks_override=13)
        assert engine.core.is_async == overlap
        results[overlap] = _run(engine, requests, abort_at={"aborted": 3})
    (sync, sync_stats), (overlapped, async_stats) = results[False], results[True]
    assert _summary(overlapped) == _summary(sync)
    assert sync_stats.num_preemptions > 0 and async_stats.num_preemptions > 0
    assert sync["stop-string"].outputs[0].finish_reason == "stop"
    assert sync["stop-token"].outputs[0].stop_reason == stop_id
    assert sync["aborted"].outputs[0].finish_reason == "abort" and len(sync["aborted"].outputs[0].token_ids) == 3
    assert async_stats.num_generation_tokens == sync_stats.num_generation_tokens
    for stats in (sync_stats, async_stats):
        assert stats.step_device_s > 0 and stats.step_host_s > 0 and stats.step_device_idle_s >= 0


class _BanToken:
    """A logits processor that masks one token, and a step hook that records accepted tokens."""

    def __init__(self, token_id):
        self.token_id = token_id
        self.accepted = {}

    def __call__(self, logits, batch):
        logits[:, self.token_id] = -torch.inf
        return logits

    def on_update(self, updates):
        for update in updates:
            self.accepted.setdefault(update.request.request_id, []).extend(update.new_token_ids)


def test_logits_processor_masks_logits_and_step_hook_sees_accepted_tokens(model):
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    base, _ = _run(_engine(model, False), {"r": (_prompt(8, 20), greedy)})
    banned = base["r"].outputs[0].token_ids[3]
    engine = _engine(model, True)
    hook = _BanToken(banned)
    engine.sampler.logits_processors.append(hook)  # the one door that edits logits
    engine.core.step_hooks.append(hook)
    finals, _ = _run(engine, {"r": (_prompt(8, 20), greedy)})
    tokens = finals["r"].outputs[0].token_ids
    assert banned not in tokens and tokens[:3] == base["r"].outputs[0].token_ids[:3]
    assert hook.accepted["r"] == tokens


def test_speculative_decoding_keeps_the_synchronous_core(model):
    engine = _engine(model, True, speculative_method="ngram")
    assert not engine.core.is_async
    engine.shutdown()


@pytest.mark.parametrize("overlap", [False, True])
def test_a_failed_step_is_undone_and_run_again(model, overlap):
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    requests = {"a": (_prompt(9, 10), greedy), "b": (_prompt(10, 40), greedy)}
    base, _ = _run(_engine(model, False), requests)
    engine = _engine(model, overlap)
    execute, calls = engine.runner.execute, []

    def failing_once(scheduler_output, *args):
        calls.append(len(scheduler_output.scheduled))
        if len(calls) == 3:
            raise RuntimeError("device fault")
        return execute(scheduler_output, *args)

    engine.runner.execute = failing_once
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    finals, failures = {}, 0
    while engine.has_unfinished_requests():
        try:
            outputs = engine.step()
        except RuntimeError as exc:
            failures += 1
            assert "device fault" in str(exc)
            continue
        finals.update({out.request_id: out for out in outputs if out.finished})
    engine.shutdown()
    assert failures == 1 and _summary(finals) == _summary(base)
    stats = engine.get_stats()
    assert stats.num_free_blocks == stats.num_blocks


def test_guided_requests_keep_the_overlap_with_the_same_output():
    """A structured-output request no longer switches the overlap off (its grammar bitmask
    is filled in the device job, behind the gate), beside unconstrained and seeded
    requests; outputs equal the synchronous engine's."""
    from pagoda.engine.guided import GuidedDecodingParams
    from pagoda.engine.llm import LLM

    guided = SamplingParams(temperature=0, max_tokens=8, guided_decoding=GuidedDecodingParams(regex="[a-c]{2,5}x"))
    seeded = SamplingParams(temperature=0.9, seed=3, max_tokens=8, guided_decoding=GuidedDecodingParams(
        regex="[a-c]{2,5}x"))
    plain = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts, params = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16], [17, 18]], [plain, guided, plain, seeded]
    results = []
    for overlap in (False, True):
        llm = LLM(async_scheduling=overlap, max_model_len=256)
        outs = llm.generate(prompts, params)
        results.append([(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in outs])
        assert llm.engine.core.is_async == overlap
        engine, overlapped = llm.engine, False
        engine.add_request("g", [9, 10, 11], guided)
        while engine.has_unfinished_requests():
            engine.step()
            overlapped |= engine.core._in_flight is not None and engine.guided.has_matcher("g")
        assert overlapped == overlap
        engine.shutdown()
    assert results[0] == results[1]
    assert re.fullmatch("[a-c]{2,5}x", results[1][1][1])
