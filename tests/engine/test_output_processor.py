"""OutputProcessor without a model: fake engine-core outputs in, RequestOutputs out.

Stop strings (one token at a time and several per step), the stop handed back to the
core as an abort, late tokens after a stop, n > 1 groups, aborts and logprobs. Only the
default model's tokenizer is loaded.
"""

from __future__ import annotations

import pytest

from pagoda.engine.core.core_output import EngineCoreOutput
from pagoda.engine.output_processor import OutputProcessor
from pagoda.engine.sampling.sampler import TokenLogprobs
from pagoda.engine.sampling_params import SamplingParams
from pagoda.models.tokenizer import Tokenizer

TEXT = "The cat sat on the mat. STOP and then more words follow here"


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    return Tokenizer.from_pretrained(smollm2_path)


def _processor(tokenizer, request_id="r", n=1, **params):
    processor = OutputProcessor(tokenizer)
    child_ids = [request_id] if n == 1 else [f"{request_id}#{i}" for i in range(n)]
    processor.add_request(request_id, "prompt", [1, 2, 3], SamplingParams(n=n, **params), child_ids, arrival_time=0.0)
    return processor


def _out(request_id, tokens, finish=None, logprobs=None):
    return EngineCoreOutput(request_id, list(tokens), logprobs or [None] * len(tokens), finish_reason=finish,
                            first_scheduled_time=0.5)


def _stop_index(tokenizer, tokens, stop):
    """Number of tokens after which the decoded text first contains ``stop``."""
    return next(i for i in range(1, len(tokens) + 1) if stop in tokenizer.decode(tokens[:i]))


def test_stop_string_one_token_per_step_ends_output_and_aborts_the_core(tokenizer):
    tokens = tokenizer.encode(TEXT, add_special_tokens=False)
    processor = _processor(tokenizer, stop=["STOP"], max_tokens=100)
    deltas, to_abort, final = [], [], None
    for i, token in enumerate(tokens):
        outputs, stopped = processor.process([_out("r", [token])], now=1.0 + i)
        to_abort += stopped
        for out in outputs:
            deltas.append(out.outputs[0].delta_text)
            final = out
        if final is not None and final.finished:
            break
    completion = final.outputs[0]
    assert completion.text == "The cat sat on the mat. "
    assert "".join(deltas) == completion.text, "deltas add up to the text, the stop string never leaks"
    assert (completion.finish_reason, completion.stop_reason) == ("stop", "STOP")
    assert to_abort == ["r"], "a stop found here goes back to the core exactly once"
    assert len(completion.token_ids) == _stop_index(tokenizer, tokens, "STOP")
    assert not processor.has_unfinished_requests()
    # Async scheduling: the core heard of the stop one step late and sends one more token.
    assert processor.process([_out("r", [tokens[-1]])]) == ([], [])


def test_stop_string_inside_a_multi_token_step_keeps_only_tokens_up_to_it(tokenizer):
    tokens = tokenizer.encode(TEXT, add_special_tokens=False)
    processor = _processor(tokenizer, stop=["STOP"], include_stop_str_in_output=True, max_tokens=100)
    (out,), stopped = processor.process([_out("r", tokens)], now=1.0)
    kept = _stop_index(tokenizer, tokens, "STOP")
    assert out.finished and stopped == ["r"]
    assert out.outputs[0].text == "The cat sat on the mat. STOP"
    assert out.outputs[0].token_ids == tokens[:kept] == out.outputs[0].delta_token_ids
    assert processor.num_generation_tokens == kept, "tokens past the stop are not counted"


def test_stop_string_and_length_in_the_same_step_report_the_stop_without_abort(tokenizer):
    tokens = tokenizer.encode("abc STOP", add_special_tokens=False)
    processor = _processor(tokenizer, stop=["STOP"], max_tokens=len(tokens))
    (out,), stopped = processor.process([_out("r", tokens, finish="length")])
    assert out.outputs[0].finish_reason == "stop" and stopped == [], "the core already finished it"


def test_text_is_held_back_while_a_stop_string_may_still_match(tokenizer):
    processor = _processor(tokenizer, stop=["ZZZZZZ"], max_tokens=100)
    tokens = tokenizer.encode("hello world", add_special_tokens=False)
    (out,), _ = processor.process([_out("r", tokens)])
    assert out.outputs[0].text == "hello world"[: len("hello world") - 5]
    (out,), _ = processor.process([_out("r", [], finish="length")])
    assert out.finished and out.outputs[0].text == "hello world" and out.outputs[0].delta_text == "world"[-5:]


def test_n_children_report_together_and_finish_when_all_do(tokenizer):
    processor = _processor(tokenizer, request_id="g", n=2, stop=["STOP"], max_tokens=8)
    a = tokenizer.encode("one two", add_special_tokens=False)
    b = tokenizer.encode("x STOP y", add_special_tokens=False)
    (out,), stopped = processor.process([_out("g#0", a[:1]), _out("g#1", b)])
    assert out.request_id == "g" and not out.finished and stopped == ["g#1"]
    assert [c.index for c in out.outputs] == [0, 1]
    assert out.outputs[1].finish_reason == "stop" and out.outputs[0].finish_reason is None
    (out,), stopped = processor.process([_out("g#0", a[1:], finish="length"), _out("g#1", [5])])
    assert out.finished and stopped == []
    assert out.outputs[0].token_ids == a and out.outputs[0].text == "one two"
    assert out.metrics.first_scheduled_time == 0.5 and out.metrics.finished_time is not None
    assert not processor.has_unfinished_requests()


def test_abort_returns_live_children_and_a_final_output(tokenizer):
    processor = _processor(tokenizer, request_id="g", n=3, max_tokens=8)
    processor.process([_out("g#0", [10], finish="length")])
    assert processor.abort("g") == ["g#1", "g#2"]
    assert processor.abort("g") == [] and processor.abort("unknown") == []
    (out,), stopped = processor.process([_out("g#1", [11])])  # a late token for an aborted child
    assert out.finished and stopped == []
    assert [c.finish_reason for c in out.outputs] == ["length", "abort", "abort"]
    assert out.outputs[1].token_ids == []


def test_logprobs_accumulate_and_stop_at_the_kept_tokens(tokenizer):
    tokens = tokenizer.encode("a STOP b", add_special_tokens=False)
    lps = [TokenLogprobs(t, -0.5 * (i + 1), 1, [(t, -0.5 * (i + 1))]) for i, t in enumerate(tokens)]
    processor = _processor(tokenizer, stop=["STOP"], max_tokens=10, logprobs=1)
    (out,), _ = processor.process([_out("r", tokens, logprobs=lps)])
    kept = _stop_index(tokenizer, tokens, "STOP")
    completion = out.outputs[0]
    assert [lp.token_id for lp in completion.logprobs] == tokens[:kept]
    assert completion.cumulative_logprob == pytest.approx(sum(-0.5 * (i + 1) for i in range(kept)))
    assert completion.delta_logprobs == completion.logprobs


def test_a_stop_token_ends_the_text_without_its_own_text(tokenizer):
    """EOS or a stop_token_ids hit: the id stays in token_ids, its text is dropped (vLLM's
    detokenizer, TensorRT-LLM's end_id) unless include_stop_str_in_output; a finish on a
    completed grammar keeps its last token's text."""
    tokens = tokenizer.encode("The cat sat.", add_special_tokens=False)
    stop_id = tokens[-1]  # "." as a stop token id
    eos = sorted(tokenizer.eos_token_ids)[0]
    cases = [
        (dict(stop_token_ids=[stop_id]), tokens, stop_id, "The cat sat"),
        (dict(stop_token_ids=[stop_id], include_stop_str_in_output=True), tokens, stop_id, "The cat sat."),
        (dict(skip_special_tokens=False), tokens[:-1] + [eos], None, "The cat sat"),
        (dict(), tokens, None, "The cat sat."),  # e.g. a completed grammar: the last token is text
    ]
    for params, ids, stop_reason, text in cases:
        processor = _processor(tokenizer, max_tokens=50, **params)
        core = EngineCoreOutput("r", list(ids), [None] * len(ids), finish_reason="stop", stop_reason=stop_reason,
                                first_scheduled_time=0.5)
        (out,) = processor.process([core], now=1.0)[0]
        completion = out.outputs[0]
        assert (completion.text, completion.token_ids) == (text, list(ids)), params
        assert completion.delta_text == text and completion.finish_reason == "stop"
