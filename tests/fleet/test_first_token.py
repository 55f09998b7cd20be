"""The early first token's rules and cut (``fleet.api.first_token``), without servers; the
streams through real replicas are ``test_router_disaggregated.py``'s."""

from __future__ import annotations

import json

import pytest

from pagoda.fleet.api.first_token import (FirstTokenMismatch, Splice, is_early, merged_values, stage_seed,
                                          stage_values)


def test_which_requests_stream_their_first_token_early():
    assert is_early({"stream": True})
    assert is_early({"stream": True, "n": 1, "max_tokens": 2, "temperature": 0.7})
    assert not is_early({})  # not streaming: one answer at the end
    assert not is_early({"stream": True, "n": 2})
    assert not is_early({"stream": True, "best_of": 3})
    assert not is_early({"stream": True, "use_beam_search": True})
    assert not is_early(merged_values({"stream": True, "beam_width": 4}))
    assert not is_early({"stream": True, "prompt_logprobs": 0})
    assert not is_early({"stream": True, "max_tokens": 1})  # the prefill stage's first response would be its last


def test_merged_values_first_source_wins_and_aliases_resolve():
    values = merged_values({"max_tokens": 4, "random_seed": 9}, {"max_tokens": 8, "min_length": 3}, {"n": 1})
    assert values == {"max_tokens": 4, "seed": 9, "min_tokens": 3, "n": 1}


def test_the_first_stage_allows_a_stop_at_the_first_token_exactly_when_the_request_does():
    handle = {"do_remote_decode": True}
    assert stage_values({}, early=False) == {"max_tokens": 1, "min_tokens": 0, "kv_transfer_params": handle}
    assert stage_values({}, early=True) == {"max_tokens": 2, "min_tokens": 0, "kv_transfer_params": handle}
    assert stage_values({"min_tokens": 1}, early=True)["min_tokens"] == 1
    assert stage_values({"min_tokens": 50}, early=True)["min_tokens"] == 2  # > 1 either way: no stop at token 1


def test_a_seed_only_where_the_two_stages_would_otherwise_sample_apart():
    assert stage_seed({"seed": 3}, early=True) is None
    assert stage_seed({"temperature": 0}, early=True) is None  # greedy
    assert stage_seed({}, early=False) is None  # the first stage's token is dropped
    seeds = {stage_seed({"temperature": 0.8}, early=True) for _ in range(8)}
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
