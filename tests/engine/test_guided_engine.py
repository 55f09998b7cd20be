"""Structured output end to end on the default model (SmolLM2-135M-Instruct, ``LLM()``), and once on a MoE model.

Every constrained output must parse and validate; constrained and unconstrained requests
share batches; a bad format fails only its own request. Generations are short.
"""

from __future__ import annotations

import json
import re
import threading
import time

import jsonschema
import pytest

from pagoda.engine.guided import GuidedDecodingParams
from pagoda.engine.llm import LLM
from pagoda.engine.sampling_params import SamplingParams

SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                                  "admin": {"type": "boolean"}},
                 "required": ["name", "admin"], "additionalProperties": False}},
        "required": ["user"], "additionalProperties": False},
    "enum_number": {"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "score": {"type": "number", "minimum": 0, "maximum": 10}},
        "required": ["color", "score"], "additionalProperties": False},
    "array": {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 1, "maxItems": 3}},
        "required": ["tags"], "additionalProperties": False},
    "pattern": {"type": "object", "properties": {
        "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
        "count": {"type": "integer", "minimum": 1, "maximum": 99}},
        "required": ["code", "count"], "additionalProperties": False},
}
MAX_TOKENS = 60


@pytest.fixture(scope="module")
def llm():
    return LLM(max_num_seqs=32, seed=0)


def _prompt(llm, text):
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": text}])


def _guided(schema, **kw):
    return GuidedDecodingParams(json=schema, disable_any_whitespace=True, **kw)


def test_schemas_greedy_and_sampled_batched_with_unconstrained(llm):
    prompts, params = [], []
    for name, schema in SCHEMAS.items():
        prompt = _prompt(llm, f"Reply with a JSON object for a {name} example.")
        prompts += [prompt, prompt]
        params += [SamplingParams(max_tokens=MAX_TOKENS, temperature=0, guided_decoding=_guided(schema)),
                   SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=7, guided_decoding=_guided(schema))]
    # any whitespace allowed (the default) and any-JSON, plus two unconstrained rows.
    prompts += [_prompt(llm, "A JSON object about a cat, please."), _prompt(llm, 'Reply with exactly {"ok": true}'),
                "Once upon a time", "The sky is"]
    params += [SamplingParams(max_tokens=MAX_TOKENS, temperature=0, guided_decoding=GuidedDecodingParams(
                   json=SCHEMAS["enum_number"])),
               SamplingParams(max_tokens=MAX_TOKENS, temperature=0, guided_decoding=GuidedDecodingParams(
                   json_object=True)),
               SamplingParams(max_tokens=12, temperature=0), SamplingParams(max_tokens=12, temperature=0.8, seed=1)]
    outputs = llm.generate(prompts, params)
    schemas = [s for s in SCHEMAS.values() for _ in range(2)] + [SCHEMAS["enum_number"], {"type": "object"}]
    for output, schema in zip(outputs, schemas):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", completion
        jsonschema.validate(json.loads(completion.text), schema)
    # The unconstrained rows are exactly what they are alone.
    alone = llm.generate(prompts[-2:], params[-2:])
    assert [o.outputs[0].token_ids for o in outputs[-2:]] == [o.outputs[0].token_ids for o in alone]


def test_regex_choice_grammar_and_length(llm):
    prompt = _prompt(llm, "Is the sky blue? Then give a product code.")
    grammar = 'root ::= "answer: " ("yes" | "no") "."'
    outputs = llm.generate([prompt] * 6, [
        SamplingParams(max_tokens=20, temperature=0, guided_decoding=GuidedDecodingParams(choice=["yes", "no"])),
        SamplingParams(max_tokens=20, temperature=1.0, seed=3,
                       guided_decoding=GuidedDecodingParams(regex=r"[A-Z]{3}-[0-9]{2}")),
        SamplingParams(max_tokens=20, temperature=0, guided_decoding=GuidedDecodingParams(grammar=grammar)),
        SamplingParams(n=2, max_tokens=20, temperature=1.0, seed=5,
                       guided_decoding=GuidedDecodingParams(choice=["red", "green", "blue"])),
        SamplingParams(max_tokens=4, temperature=0, guided_decoding=_guided(SCHEMAS["nested"])),
        SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, guided_decoding=GuidedDecodingParams(
            choice=["yes", "no"])),
    ])
    assert outputs[0].outputs[0].text in ("yes", "no")
    assert re.fullmatch(r"[A-Z]{3}-[0-9]{2}", outputs[1].outputs[0].text)
    assert re.fullmatch(r"answer: (yes|no)\.", outputs[2].outputs[0].text)
    assert all(c.text in ("red", "green", "blue") and c.finish_reason == "stop" for c in outputs[3].outputs)
    cut = outputs[4].outputs[0]  # max_tokens inside the structure: length, as vLLM does
    assert cut.finish_reason == "length" and len(cut.token_ids) == 4
    with pytest.raises(json.JSONDecodeError):
        json.loads(cut.text)
    # ignore_eos: EOS does not stop the request, but it completes the grammar: stop there.
    done = outputs[5].outputs[0]
    assert done.text in ("yes", "no") and done.finish_reason == "stop"
    assert done.token_ids[-1] in llm.engine.eos_token_ids


@pytest.mark.parametrize("guided, message", [
    (GuidedDecodingParams(regex="a(b"), "guided_decoding.regex: cannot be compiled"),
    (GuidedDecodingParams(grammar="root ::= missing"), "guided_decoding.grammar: cannot be compiled"),
    (GuidedDecodingParams(json={"type": "nope"}), "guided_decoding.json: cannot be compiled"),
])
def test_bad_format_fails_only_its_request(llm, guided, message):
    engine = llm.engine
    engine.add_request("ok", "Hello", SamplingParams(max_tokens=3, temperature=0))
    engine.add_request("bad", "Hello", SamplingParams(max_tokens=3, guided_decoding=guided))
    final = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                final[output.request_id] = output
    assert message in final["bad"].error and final["bad"].outputs[0].finish_reason == "abort"
    assert final["ok"].error is None and len(final["ok"].outputs[0].token_ids) == 3
    assert engine.scheduler.num_free_blocks == engine.runner.num_blocks - 1  # nothing leaked
    with pytest.raises(ValueError, match="prompt 0: guided_decoding"):
        llm.generate("Hello", SamplingParams(max_tokens=3, guided_decoding=guided))


def test_a_grammar_bomb_is_refused_before_it_compiles(llm):
    # issue 25 defect 2: ~2 KB of schema, 40 length-bounded strings (minutes of CPU on the
    # reporter's replica): refused at add_request with the limit's name, nothing queued.
    bomb = {"type": "object", "properties": {f"f{i}": {"type": "string", "minLength": 500, "maxLength": 1000}
                                             for i in range(80)}}
    engine, compiles = llm.engine, llm.engine.guided.num_compilations
    with pytest.raises(ValueError, match=r"guided_decoding.json: 80000 as repetition bound, over "
                                         r"guided_max_length_bound=65536"):
        engine.add_request("bomb", "Hello", SamplingParams(max_tokens=3, guided_decoding=GuidedDecodingParams(
            json=bomb)))
    assert engine.guided.num_compilations == compiles and engine.guided.num_waiting == 0
    assert not engine.has_unfinished_requests()


def test_a_compile_past_its_budget_fails_alone_and_a_full_pool_is_an_overload(monkeypatch):
    # A compile that does not return until released (a grammar bomb: C++ that Python cannot
    # interrupt), injected at the backend seam; everything else is the real engine.
    from pagoda.engine.core.load_shedding import EngineOverloaded
    from pagoda.engine.guided.backend import XGrammarBackend

    release, real_compile = threading.Event(), XGrammarBackend.compile

    def slow_compile(backend, kind, spec, any_whitespace=True):
        release.wait(60)
        return real_compile(backend, kind, spec, any_whitespace)

    monkeypatch.setattr(XGrammarBackend, "compile", slow_compile)
    engine = LLM(max_num_seqs=4, guided_compile_timeout_s=0.2, guided_max_stuck_compiles=1).engine
    engine.add_request("slow", "Hello", SamplingParams(max_tokens=3, guided_decoding=GuidedDecodingParams(
        choice=["yes", "no"])))
    engine.add_request("plain", "Hello", SamplingParams(max_tokens=3, temperature=0))
    final = _run(engine)
    assert final["slow"].error.startswith("guided_decoding: the grammar did not compile within "
                                          "guided_compile_timeout_s=0.2 s")
    assert final["plain"].error is None and len(final["plain"].outputs[0].token_ids) == 3
    assert engine.guided.num_stuck_compiles == 1
    with pytest.raises(EngineOverloaded, match=r"^overloaded: .*guided_max_stuck_compiles=1"):
        engine.add_request("next", "Hello", SamplingParams(max_tokens=3, guided_decoding=GuidedDecodingParams(
            regex="[0-9]")))
    assert not engine.has_unfinished_requests()
    release.set()  # the stuck call returns: its slot is free again
    deadline = time.monotonic() + 60
    while engine.guided.num_stuck_compiles and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.guided.num_stuck_compiles == 0
    engine.add_request("next", "Hello", SamplingParams(max_tokens=3, guided_decoding=GuidedDecodingParams(
        regex="[0-9]")))
    assert final["plain"].error is None and _run(engine)["next"].error is None


def _run(engine):
    final = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                final[output.request_id] = output
    return final


def test_abort_while_compiling(llm):
    engine = llm.engine
    engine.add_request("gone", "Hello", SamplingParams(max_tokens=3, guided_decoding=GuidedDecodingParams(
        regex="[a-z]{1,3}x")))
    engine.abort_request("gone")
    [out] = engine.step()
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert not engine.has_unfinished_requests() and engine.guided.num_waiting == 0


def test_preemption_by_recompute_keeps_outputs_valid():
    # 11 usable blocks of 8 tokens cannot hold 4 requests of ~33 + ~20 tokens: preemptions.
    llm = LLM(num_gpu_blocks_override=12, block_size=8, max_num_seqs=4, enable_prefix_caching=False)
    prompt = _prompt(llm, "JSON please.")
    outputs = llm.generate([prompt] * 4, [SamplingParams(max_tokens=40, temperature=0.7, seed=i,
                                                         guided_decoding=_guided(SCHEMAS["array"]))
                                          for i in range(4)])
    assert llm.engine.get_stats().num_preemptions > 0
    for output in outputs:
        assert output.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(output.outputs[0].text), SCHEMAS["array"])


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculative_decoding_with_grammars(llm, method):
    # The prompt holds the answer, so n-gram lookup drafts it; the draft model is the
    # target's first layers. Greedy outputs must equal the non-speculative engine's.
    spec = LLM(speculative_method=method, num_speculative_tokens=3, speculative_draft_num_layers=8
               if method == "draft" else None, max_num_seqs=8)
    schema = SCHEMAS["pattern"]
    prompt = _prompt(spec, 'Repeat exactly: {"code": "AB-123", "count": 12} and {"code": "CD-456", "count": 7}')
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0, guided_decoding=_guided(schema)),
              SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=2, guided_decoding=_guided(schema)),
              SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, guided_decoding=_guided(schema)),
              SamplingParams(max_tokens=20, temperature=0, speculative=True,
                             guided_decoding=GuidedDecodingParams(regex=r"[a-z ]{5,30}\."))]
    outputs = spec.generate([prompt] * 4, params)
    for output in outputs[:3]:
        assert output.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(output.outputs[0].text), schema)
    assert re.fullmatch(r"[a-z ]{5,30}\.", outputs[3].outputs[0].text)
    stats = spec.engine.get_stats()
    assert stats.spec_num_drafts > 0 and stats.spec_num_accepted_tokens > 0
    reference = llm.generate([prompt, prompt], [params[0], params[3].clone(speculative=None)])
    assert [o.outputs[0].token_ids for o in outputs[::3]] == [o.outputs[0].token_ids for o in reference]


@pytest.mark.parametrize("family", ["qwen3-moe", "gpt-oss-window8"])
def test_structured_output_on_a_moe_model(tmp_path, smollm2_path, family):
    """A random Qwen3-MoE and a gpt-oss (MoE with an 8-token window on layer 0;
    tests/engine/hf_reference.py): batched constrained requests (JSON schema, choice, regex)
    beside an unconstrained one all hold their format."""
    from tests.engine.hf_reference import make_random_model

    moe = LLM(model=str(make_random_model(tmp_path / "moe", family, smollm2_path)), seed=0)
    assert moe.engine.model_config.num_experts == 8
    outputs = moe.generate([[1, 504, 2931, 314]] * 4, [
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0, guided_decoding=_guided(SCHEMAS["pattern"])),
        SamplingParams(max_tokens=20, temperature=0, guided_decoding=GuidedDecodingParams(choice=["yes", "no"])),
        SamplingParams(max_tokens=20, temperature=1.0, seed=3, guided_decoding=GuidedDecodingParams(regex=r"[0-9]{4}")),
        SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
    ])
    jsonschema.validate(json.loads(outputs[0].outputs[0].text), SCHEMAS["pattern"])
    assert outputs[1].outputs[0].text in ("yes", "no")
    assert re.fullmatch(r"[0-9]{4}", outputs[2].outputs[0].text)
    assert len(outputs[3].outputs[0].token_ids) == 8
