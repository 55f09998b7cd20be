"""openai_answer: the replica's outputs -> OpenAI objects for echo, echo without generation,
streamed echo and several prompts (no server; the door's end-to-end tests are in
tests/serving/test_openai_door.py)."""

from __future__ import annotations

import json

from pagoda.fleet.api.openai_answer import Answer, merge_final
from pagoda.fleet.api.openai_io import build_completion_requests


class FakeTokenizer:
    """Token id i is the letter chr(96 + i)."""

    def encode(self, text):
        return [ord(c) - 96 for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(96 + i) for i in ids)


def _entry(token_id, logprob, top=()):
    return {"token_id": token_id, "logprob": logprob, "rank": 1,
            "top_logprobs": [{"token_id": t, "logprob": lp} for t, lp in top]}


PROMPT_LOGPROBS = json.dumps([None, _entry(2, -1.0, [(5, -0.5)]), _entry(3, -2.0, [(3, -2.0)])])


def _outputs(text, token_id, logprob, reason=None, with_prompt=True):
    out = {"text_output": [text], "finish_reason": [reason or ""], "num_input_tokens": [3],
           "num_output_tokens": [1], "logprobs": [json.dumps([_entry(token_id, logprob, [(token_id, logprob)])])]}
    if with_prompt:
        out["prompt_logprobs"] = [PROMPT_LOGPROBS]
    return out


def _answers(body):
    tokenizer = FakeTokenizer()
    return [Answer(False, "cmpl-1", "m", built, tokenizer, index_offset=k * built.n)
            for k, built in enumerate(build_completion_requests(body, tokenizer))]


def test_echo_with_logprobs_puts_the_prompt_tokens_first():
    (answer,) = _answers({"prompt": "abc", "echo": True, "logprobs": 1, "max_tokens": 2})
    answer.add(_outputs("d", 4, -0.25))
    answer.add(_outputs("e", 5, -0.75, "length", with_prompt=False))
    (choice,) = merge_final([answer])["choices"]
    assert choice["text"] == "abcde"
    assert choice["logprobs"] == {"tokens": ["a", "b", "c", "d", "e"],
                                  "token_logprobs": [None, -1.0, -2.0, -0.25, -0.75],
                                  "top_logprobs": [None, {"e": -0.5}, {"c": -2.0}, {"d": -0.25}, {"e": -0.75}],
                                  "text_offset": [0, 1, 2, 3, 4]}


def test_echo_without_generation_drops_the_generated_token_everywhere():
    (answer,) = _answers({"prompt": [1, 2, 3], "echo": True, "logprobs": 1, "max_tokens": 0})
    assert answer.built.wire.params.max_tokens == 1
    answer.add(_outputs("d", 4, -0.25, "length"))
    whole = merge_final([answer])
    (choice,) = whole["choices"]
    assert choice["text"] == "abc" and choice["logprobs"]["token_logprobs"] == [None, -1.0, -2.0]
    assert whole["usage"]["completion_tokens"] == 0 and whole["usage"]["prompt_tokens"] == 3


def test_streamed_echo_sends_the_prompt_once_with_the_first_chunk():
    (answer,) = _answers({"prompt": "abc", "echo": True, "logprobs": 0, "max_tokens": 2, "stream": True})
    first = answer.chunks(_outputs("d", 4, -0.25))
    second = answer.chunks(_outputs("e", 5, -0.75, "length", with_prompt=False))
    assert [c["choices"][0]["text"] for c in first + second] == ["abcd", "e"]
    assert first[0]["choices"][0]["logprobs"]["token_logprobs"] == [None, -1.0, -2.0, -0.25]
    assert second[0]["choices"][0]["logprobs"] == {"tokens": ["e"], "token_logprobs": [-0.75],
                                                   "top_logprobs": [{"e": -0.75}], "text_offset": [4]}


def test_several_prompts_are_numbered_prompt_times_n_plus_i_and_usage_is_summed():
    answers = _answers({"prompt": ["ab", "cd"], "n": 2, "max_tokens": 1})
    for answer in answers:
        answer.add({"text_output": ["x", "y"], "finish_reason": ["length", "length"], "num_input_tokens": [2],
                    "num_cached_tokens": [1], "num_output_tokens": [1, 1]})
    whole = merge_final(answers)
    assert [(c["index"], c["text"]) for c in whole["choices"]] == [(0, "x"), (1, "y"), (2, "x"), (3, "y")]
    assert whole["usage"] == {"prompt_tokens": 4, "completion_tokens": 4, "total_tokens": 8,
                              "prompt_tokens_details": {"cached_tokens": 2}}
    assert answers[1].chunks({"text_output": ["z", ""], "finish_reason": ["", ""]})[0]["choices"][0]["index"] == 2
