"""The early first token's rules and cut (``fleet.api.first_token``), without servers; the
streams through real replicas are ``test_router_disaggregated.py``'s."""

from __future__ import annotations

import json

import pytest

from pagoda.engine.sampling_params import SamplingParams
from pagoda.fleet.api.first_token import (FirstTokenMismatch, Splice, is_early, prefill_stage, seeded_for_stages)
from pagoda.serving.wire import OutputOptions, WireRequest


def wire(stream=True, **sampling):
    return WireRequest(prompt="x", params=SamplingParams(**sampling), output=OutputOptions(stream=stream))


def test_which_requests_stream_their_first_token_early():
    assert is_early(wire())
    assert is_early(wire(n=1, max_tokens=2, temperature=0.7))
    assert not is_early(wire(stream=False))  # not streaming: one answer at the end
    assert not is_early(wire(n=2))
    assert not is_early(wire(best_of=3, n=3))
    assert not is_early(wire(use_beam_search=True, best_of=2, temperature=0))
    assert not is_early(wire(use_beam_search=True, beam_width=4, temperature=0))
    assert not is_early(wire(prompt_logprobs=0))
    assert not is_early(wire(max_tokens=1))  # the prefill stage's first response would be its last


def test_the_first_stage_allows_a_stop_at_the_first_token_exactly_when_the_request_does():
    handle = {"do_remote_decode": True}
    late, early = prefill_stage(wire(max_tokens=9), early=False), prefill_stage(wire(max_tokens=9), early=True)
    assert (late.params.max_tokens, late.params.min_tokens, dict(late.options.kv_transfer_params)) == (1, 0, handle)
    assert (early.params.max_tokens, early.params.min_tokens) == (2, 0) and early.output.stream
    assert not late.output.stream  # its token is dropped: only the final response's KV handle matters
    assert prefill_stage(wire(min_tokens=1), early=True).params.min_tokens == 1
    assert prefill_stage(wire(min_tokens=50, max_tokens=60), early=True).params.min_tokens == 2  # no stop at token 1
    original = wire(max_tokens=9)
    prefill_stage(original, early=True)
    assert original.params.max_tokens == 9 and original.options.kv_transfer_params is None  # untouched


def test_a_seed_only_where_the_two_stages_would_otherwise_sample_apart():
    assert seeded_for_stages(wire(seed=3, temperature=0.8), early=True).params.seed == 3
    assert seeded_for_stages(wire(temperature=0), early=True).params.seed is None  # greedy
    assert seeded_for_stages(wire(temperature=0.8), early=False).params.seed is None  # the first token is dropped
    seeds = {seeded_for_stages(wire(temperature=0.8), early=True).params.seed for _ in range(8)}
    assert len(seeds) == 8 and all(0 <= s < 2 ** 63 for s in seeds)


def test_splice_cuts_the_sent_token_across_responses():
    entry = {"token_id": 5, "logprob": -0.5}
    splice = Splice.of("Hello", 1, json.dumps([entry]))
    # the decode replica held part of the text back (a stop string may start there)
    first = splice.cut({"text_output": "Hel", "num_output_tokens": 1, "logprobs": json.dumps([entry])})
    assert first == {"text_output": "", "num_output_tokens": 0, "logprobs": "[]"}
    assert not splice.is_done
    second = splice.cut({"text_output": ["lo world"], "num_output_tokens": [1], "logprobs": [json.dumps([{"t": 6}])]})
    assert second == {"text_output": [" world"], "num_output_tokens": [1], "logprobs": [json.dumps([{"t": 6}])]}
    assert splice.is_done
    assert splice.cut({"text_output": "!", "num_output_tokens": 1}) == {"text_output": "!", "num_output_tokens": 1}


def test_splice_refuses_a_stream_that_does_not_continue_the_sent_token():
    splice = Splice.of(" Paris")
    with pytest.raises(FirstTokenMismatch, match="differs from the one the prefill replica streamed"):
        splice.cut({"text_output": " London"})


def test_splice_without_counts_or_logprobs_cuts_text_only():
    splice = Splice.of("A", None, "null")
    assert splice.cut({"text_output": "AB", "logprobs": "null"}) == {"text_output": "B", "logprobs": "null"}
    assert splice.is_done
