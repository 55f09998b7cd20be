"""SamplingParams validation: every bad field raises ValueError naming the field."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from pagoda.engine.sampling_params import MAX_LOGPROBS, MAX_N, MAX_STOP_STRINGS, RequestOutputKind, SamplingParams

NAN = float("nan")
INF = float("inf")

# (field, bad value); every entry must be rejected both by the constructor and from_dict.
BAD_VALUES = [
    *[("n", v) for v in (0, -1, MAX_N + 1, 1.5, 2.0, "2", True, None)],
    *[("temperature", v) for v in (-0.1, NAN, INF, 100.5, "1", True, None)],
    *[("top_p", v) for v in (0.0, -0.1, 1.01, NAN, "0.5", True, None)],
    *[("top_k", v) for v in (-2, 1.5, -1.0, 5.0, "3", True, None)],
    *[("min_p", v) for v in (-0.1, 1.01, NAN, INF, "0", True)],
    *[("repetition_penalty", v) for v in (0.0, -1.0, NAN, 100.5, "1", False)],
    *[("presence_penalty", v) for v in (-2.01, 2.01, NAN, -INF, "0", True)],
    *[("frequency_penalty", v) for v in (-2.01, 2.01, NAN, INF, "0", True)],
    *[("seed", v) for v in (-1, 2**64, 1.0, "1", True)],
    *[("max_tokens", v) for v in (0, -1, -100, 1.5, "16", True)],
    *[("min_tokens", v) for v in (-1, 1.5, "1", True, None)],
    *[("stop", v) for v in ("", [""], ["ok", ""], [1], [None], ["x"] * (MAX_STOP_STRINGS + 1), 5, {"a": 1})],
    *[("stop_token_ids", v) for v in ([-1], [1.5], [True], ["1"], 5, "12")],
    *[("include_stop_str_in_output", v) for v in (1, 0, "yes", None)],
    *[("ignore_eos", v) for v in (1, "true", None)],
    *[("skip_special_tokens", v) for v in (0, "false", None)],
    *[("return_context_logits", v) for v in (1, "true", None)],
    *[("return_generation_logits", v) for v in (0, "false", None)],
    *[("output_kind", v) for v in (2, -1, 1.0, "delta", True, None)],
    *[("logprobs", v) for v in (-1, MAX_LOGPROBS + 1, 1.5, "5", True)],
    *[("prompt_logprobs", v) for v in (-1, MAX_LOGPROBS + 1, 1.5, "5", True)],
    *[("speculative", v) for v in (1, 0, "true")],
    *[("guided_decoding", v) for v in ("a+", 5, [], {}, {"regex": "a", "choice": ["a"]}, {"json_object": False},
                                        {"regexp": "a"})],
    *[("allowed_token_ids", v) for v in ([], [-1], [1.5], [True], 5, "1")],
    *[("logit_bias", v) for v in ([1], {"a": 1.0}, {"1": 100.5}, {"1": "x"}, {-1: 1.0}, {"2": NAN})],
    *[("bad_words", v) for v in ("", ["ok", " "], [3], {"a": 1}, ["w"] * 65)],
    *[("truncate_prompt_tokens", v) for v in (0, -2, 1.5, "3", True)],
    *[("spaces_between_special_tokens", v) for v in (1, "true")],
    *[("use_beam_search", v) for v in (1, "true", None)],
    *[("best_of", v) for v in (0, 2, 1.5, "2", True)],  # 2: best_of > n without beam search
    *[("beam_width", v) for v in (0, 2, 1.5, "2")],
    *[("length_penalty", v) for v in (NAN, INF, 100.5, "1", True)],
    *[("early_stopping", v) for v in ("always", 1.5, None, "true")],
]

BEAM = dict(use_beam_search=True, temperature=0.0)
# Beam search: (extra fields, the field the error names); each is refused with use_beam_search.
BAD_BEAM = [
    (dict(temperature=1.0), "temperature"), (dict(top_p=0.9), "top_p"), (dict(top_k=5), "top_k"),
    (dict(min_p=0.1), "min_p"), (dict(repetition_penalty=1.2), "repetition_penalty"),
    (dict(presence_penalty=0.5), "presence_penalty"), (dict(frequency_penalty=0.5), "frequency_penalty"),
    (dict(min_tokens=2), "min_tokens"), (dict(prompt_logprobs=1), "prompt_logprobs"),
    (dict(allowed_token_ids=[1]), "allowed_token_ids"),
    (dict(logit_bias={1: 1.0}), "logit_bias"), (dict(bad_words=["x"]), "bad_words"),
    (dict(speculative=True), "speculative"),
    (dict(beam_width=0), "beam_width"), (dict(beam_width=11), "beam_width"), (dict(best_of=64), "best_of"),
    (dict(beam_width=2, best_of=4), "beam_width"), (dict(beam_width=2, n=3), "n"), (dict(n=12), "n"),
]


@pytest.mark.parametrize("extra,field", BAD_BEAM, ids=[f for _, f in BAD_BEAM])
def test_beam_search_refuses_what_it_does_not_rank(extra, field):
    with pytest.raises(ValueError) as err:
        SamplingParams(**{**BEAM, **extra})
    assert str(err.value).startswith(f"{field}:"), str(err.value)


def test_beam_width_resolution():
    assert SamplingParams(**BEAM, n=3).num_beams == 3  # vLLM's old API: best_of defaults to n
    assert SamplingParams(**BEAM, best_of=4, n=2).num_beams == 4
    assert SamplingParams(**BEAM, beam_width=8).num_beams == 8
    beam = SamplingParams.from_dict({**BEAM, "best_of": 4, "length_penalty": 0.5, "early_stopping": "never"})
    assert beam.num_beams == 4
    assert SamplingParams(n=2).num_beams == 0 and SamplingParams(best_of=2, n=2).num_beams == 0


def _case_id(case):
    name, value = case
    return f"{name}={value!r}"[:40]


@pytest.mark.parametrize("case", BAD_VALUES, ids=[_case_id(c) for c in BAD_VALUES])
def test_bad_value_raises_naming_field(case):
    name, value = case
    with pytest.raises(ValueError) as constructed:
        SamplingParams(**{name: value})
    assert str(constructed.value).startswith(f"{name}:"), str(constructed.value)
    with pytest.raises(ValueError) as from_json:
        SamplingParams.from_dict({name: value})
    assert str(from_json.value).startswith(f"{name}:"), str(from_json.value)


def test_every_field_has_a_bad_value_case():
    tested = {name for name, _ in BAD_VALUES}
    # ``given`` records which fields a request gave (with_defaults); no client sends it.
    assert tested == {f.name for f in dataclasses.fields(SamplingParams)} - {"given"}
    with pytest.raises(ValueError, match="unknown sampling parameter"):
        SamplingParams.from_dict({"given": ["temperature"]})


def test_vllm_extras_are_read_as_vllm_does():
    params = SamplingParams.from_dict({"logit_bias": {"7": -100, "9": 2.5}, "allowed_token_ids": [3, 7],
                                       "truncate_prompt_tokens": -1, "spaces_between_special_tokens": False})
    assert params.logit_bias == {7: -100, 9: 2.5} and params.allowed_token_ids == [3, 7]
    assert params.truncate_prompt_tokens == -1
    # pagoda joins special tokens without spaces: asking for spaces while keeping them is refused.
    with pytest.raises(ValueError, match="^spaces_between_special_tokens: pagoda joins special tokens"):
        SamplingParams(skip_special_tokens=False, spaces_between_special_tokens=True)
    SamplingParams(skip_special_tokens=False, spaces_between_special_tokens=False)
    SamplingParams(spaces_between_special_tokens=True)  # special tokens skipped: nothing to space


def test_min_tokens_above_max_tokens_names_min_tokens():
    with pytest.raises(ValueError, match=r"^min_tokens: must be <= max_tokens \(10\)"):
        SamplingParams(min_tokens=11, max_tokens=10)
    SamplingParams(min_tokens=10, max_tokens=10)
    SamplingParams(min_tokens=1000, max_tokens=None)


def test_clone_validates():
    params = SamplingParams(temperature=0.5)
    assert params.clone(top_k=5).top_k == 5
    with pytest.raises(ValueError, match="^temperature:"):
        params.clone(temperature=-1.0)


def test_defaults_are_valid_and_vllm_like():
    params = SamplingParams()
    assert (params.n, params.temperature, params.top_p, params.top_k, params.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (params.repetition_penalty, params.presence_penalty, params.frequency_penalty) == (1.0, 0.0, 0.0)
    assert params.seed is None and params.logprobs is None
    assert params.max_tokens == 16 and params.min_tokens == 0
    assert params.stop == [] and params.stop_token_ids == []
    assert not params.ignore_eos and not params.include_stop_str_in_output and params.skip_special_tokens
    assert not params.is_greedy
    assert SamplingParams.from_dict({}) == params


def test_boundary_values_are_accepted():
    SamplingParams(n=MAX_N, temperature=0, top_p=1.0, top_k=1, min_p=1.0, repetition_penalty=100)
    SamplingParams(presence_penalty=-2, frequency_penalty=2, seed=0, logprobs=0)
    SamplingParams(seed=2**64 - 1, logprobs=MAX_LOGPROBS, max_tokens=None, temperature=100)
    SamplingParams(stop=["x"] * MAX_STOP_STRINGS, stop_token_ids=[0, 2])


def test_normalizations():
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop=None, stop_token_ids=None).stop == []
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(temperature=1).temperature == 1  # ints are fine where floats are expected


def test_from_dict_rejects_unknown_keys_naming_them():
    with pytest.raises(ValueError) as error:
        SamplingParams.from_dict({"temperature": 0.5, "beam_size": 2, "use_beam_serach": True})
    message = str(error.value)
    assert "beam_size" in message and "use_beam_serach" in message
    assert message.startswith("unknown sampling parameter(s): beam_size, use_beam_serach")


def test_from_dict_unknown_non_string_key():
    with pytest.raises(ValueError, match="unknown sampling parameter"):
        SamplingParams.from_dict({1: 2, "zzz": 3})


@pytest.mark.parametrize("values", [None, [], ["temperature", 1.0], "temperature=1", 3, 1.5])
def test_from_dict_rejects_non_dict(values):
    with pytest.raises(ValueError, match="must be a JSON object"):
        SamplingParams.from_dict(values)


def test_from_dict_valid_json_values():
    params = SamplingParams.from_dict(
        {"n": 2, "temperature": 0.7, "top_k": -1, "stop": ["\n"], "seed": 42, "logprobs": 5, "max_tokens": 32}
    )
    assert params.n == 2 and math.isclose(params.temperature, 0.7) and params.top_k == 0
    assert params.stop == ["\n"] and params.seed == 42 and params.logprobs == 5 and params.max_tokens == 32


def test_output_kind_reads_vllm_values_and_round_trips():
    """``output_kind`` (vLLM's ``RequestOutputKind`` values; pagoda: 0 cumulative, 1 delta)."""
    delta = SamplingParams.from_dict({"output_kind": 1})
    assert delta.output_kind is RequestOutputKind.DELTA and SamplingParams().output_kind is RequestOutputKind.CUMULATIVE
    assert SamplingParams.from_dict(json.loads(json.dumps(delta.to_dict()))) == delta
