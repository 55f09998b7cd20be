"""Structured output without a model: params, the bitmask stage, xgrammar on the real tokenizer."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest
import torch

from pagoda.engine.guided.backend import XGrammarBackend, bitmask_width, choice_grammar
from pagoda.engine.guided.bitmask import TokenBitmask, apply_token_bitmask
from pagoda.engine.guided.manager import GuidedDecodingManager
from pagoda.engine.guided.params import GuidedDecodingParams
from pagoda.engine.sampling.sampler import Sampler, SamplingRow
from pagoda.engine.sampling_params import SamplingParams


# ------------------------------------------------------------------ params
@pytest.mark.parametrize("values, message", [
    ({}, "exactly one of"),
    ({"regex": "a", "choice": ["a"]}, "got regex, choice"),
    ({"json_object": False}, "got none"),
    ({"json": "{nope"}, "guided_decoding.json: not valid JSON"),
    ({"json": [1]}, "must be an object"),
    ({"regex": ""}, "guided_decoding.regex: must be a non-empty string"),
    ({"choice": []}, "guided_decoding.choice: must be a non-empty list"),
    ({"choice": ["a", 3]}, "every choice must be a non-empty string"),
    ({"grammar": 5}, "guided_decoding.grammar: must be a non-empty string"),
    ({"json_object": "yes"}, "guided_decoding.json_object: must be a boolean"),
    ({"regex": "a", "backend": "outlines"}, "guided_decoding.backend"),
    ({"regex": "a", "whitespace": " "}, "unknown key(s) whitespace"),
])
def test_params_refuse_bad_combinations(values, message):
    with pytest.raises(ValueError, match="guided_decoding") as info:
        SamplingParams.from_dict({"guided_decoding": values})
    assert message in str(info.value)


def test_params_forms_and_cache_key():
    a = GuidedDecodingParams(json={"type": "object", "properties": {"b": {"type": "string"}, "a": {}}})
    b = SamplingParams.from_dict({"guided_decoding": {"json": json.dumps(a.json and json.loads(a.json))}})
    assert a.cache_key == b.guided_decoding.cache_key and a.kind == "json"
    assert list(json.loads(a.spec)["properties"]) == ["b", "a"]  # property order is generation order
    assert GuidedDecodingParams(json_object=True).kind == "json_object"
    assert GuidedDecodingParams(choice=["x", "y"]).spec == '["x", "y"]'
    assert SamplingParams(speculative=True, guided_decoding={"regex": "a"}).guided_decoding.regex == "a"


# ------------------------------------------------------------------ bitmask stage
def _pack(allowed: torch.Tensor) -> torch.Tensor:
    """[M, V] bool -> [M, ceil(V/32)] int32, bit t%32 of word t//32 (reference packing)."""
    rows, vocab = allowed.shape
    words = torch.zeros(rows, bitmask_width(vocab), dtype=torch.int64)
    for t in range(vocab):
        words[:, t // 32] |= allowed[:, t].long() << (t % 32)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def test_bitmask_stage_masks_only_grammar_rows():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 70, generator=gen)
    allowed = torch.rand(2, 70, generator=gen) < 0.3
    allowed[:, 31] = True  # the sign bit of a word
    mask = TokenBitmask(rows=torch.tensor([3, 1]), bits=_pack(allowed))
    out = logits.clone()
    apply_token_bitmask(out, mask)
    for j, row in enumerate([3, 1]):
        expected = logits[row].masked_fill(~allowed[j], float("-inf"))
        assert torch.equal(out[row], expected)
    assert torch.equal(out[[0, 2]], logits[[0, 2]])
    sub = mask.select([1, 2])
    assert sub.rows.tolist() == [0] and torch.equal(sub.bits, mask.bits[[1]])
    assert mask.select([0, 2]) is None


def test_sampler_follows_the_mask_for_greedy_and_sampled_rows():
    vocab = 50
    sampler = Sampler(vocab_size=vocab, seed=0)
    logits = torch.randn(3, vocab + 6, generator=torch.Generator().manual_seed(1))  # padding columns too
    allowed = torch.zeros(3, vocab, dtype=torch.bool)
    allowed[0, [7, 9]] = True
    allowed[2, [1, 40, 41]] = True
    rows = [SamplingRow(SamplingParams(temperature=0.0)), SamplingRow(SamplingParams(temperature=0.0)),
            SamplingRow(SamplingParams(temperature=1.0, top_p=0.9), seed=5)]
    mask = TokenBitmask(rows=torch.tensor([0, 2]), bits=_pack(allowed[[0, 2]]))
    for _ in range(20):
        out = sampler(logits, sampler.make_batch(rows, mask))
        assert out.token_ids[0] == [7, 9][int(logits[0, 9] > logits[0, 7])]
        assert out.token_ids[1] == int(logits[1, :vocab].argmax())  # no grammar: untouched
        assert out.token_ids[2] in (1, 40, 41)


# ------------------------------------------------------------------ xgrammar on the real tokenizer
@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    from pagoda.models.tokenizer import Tokenizer

    return Tokenizer.from_pretrained(smollm2_path)


def _item(request_id, drafts=()):
    return SimpleNamespace(request=SimpleNamespace(request_id=request_id), spec_token_ids=list(drafts))


def _tokens(bits):
    return [t for t in range(bits.shape[0] * 32) if (int(bits[t // 32]) >> (t % 32)) & 1]


def _allowed(manager, request_id):
    return _tokens(manager.prepare_bitmask([_item(request_id)]).bits[0])


def _ready(manager, timeout=60.0):
    deadline = time.monotonic() + timeout
    ready, failed = [], []
    while manager.num_waiting and time.monotonic() < deadline:
        manager.wait(1.0)
        r, f = manager.poll()
        ready += r
        failed += f
    return ready, failed


def test_manager_compiles_once_per_format_and_follows_tokens(tokenizer):
    vocab = 49152
    eos = sorted(tokenizer.eos_token_ids)
    manager = GuidedDecodingManager(lambda: XGrammarBackend(tokenizer, vocab, eos), vocab)
    params = GuidedDecodingParams(choice=["yes", "no"])
    manager.submit("a", ["a"], params)
    manager.submit("b", ["b#0", "b#1"], GuidedDecodingParams(choice=["yes", "no"]))
    manager.submit("bad", ["bad"], GuidedDecodingParams(regex="a(b"))
    assert manager.prepare_bitmask([_item("a")]) is None  # nothing ready: no grammar work at all
    ready, failed = _ready(manager)
    assert sorted(ready) == ["a", "b"] and manager.num_compilations == 2
    assert failed == [("bad", "guided_decoding.regex: cannot be compiled: Regex parsing error at position 4: "
                               "The parenthesis is not closed.")]
    first = _allowed(manager, "a")
    assert tokenizer.encode("yes", add_special_tokens=False)[0] in first and eos[0] not in first
    for token in tokenizer.encode("no", add_special_tokens=False):
        assert not manager.accept("b#0", [token])
    assert _allowed(manager, "b#0") == eos  # complete: only EOS may follow
    assert manager.accept("b#0", eos)  # terminated
    assert len(_allowed(manager, "b#1")) == len(first)  # siblings have their own matchers
    mask = manager.prepare_bitmask([_item("x"), _item("b#1"), _item("y"), _item("a")])
    assert mask.rows.tolist() == [1, 3]
    manager.release(["a", "b#0", "b#1"])
    assert manager.prepare_bitmask([_item("a")]) is None


def test_drafts_are_cut_to_the_grammar_and_masks_follow_them(tokenizer):
    vocab = 49152
    eos = sorted(tokenizer.eos_token_ids)
    manager = GuidedDecodingManager(lambda: XGrammarBackend(tokenizer, vocab, eos), vocab)
    manager.submit("r", ["r"], GuidedDecodingParams(regex="[0-9]{4}"))
    assert _ready(manager) == (["r"], [])
    digits = [tokenizer.encode(d, add_special_tokens=False)[0] for d in "1234"]
    letter = tokenizer.encode("x", add_special_tokens=False)[0]
    assert len(digits) == 4 and all(d != letter for d in digits)
    drafts = manager.truncate_drafts({"r": digits[:2] + [letter, digits[3]], "other": [letter]})
    assert drafts == {"r": digits[:2], "other": [letter]}  # cut at the first forbidden token
    # The stop token that would end the grammar is left to the target.
    assert manager.truncate_drafts({"r": digits + eos}) == {"r": digits}
    mask = manager.prepare_bitmask([_item("other"), _item("r", digits)])
    assert mask.rows.tolist() == [1, 2, 3, 4, 5]  # 1 + 4 logits rows of r, after other's row
    assert digits[0] in _tokens(mask.bits[0]) and letter not in _tokens(mask.bits[0])
    assert _tokens(mask.bits[3]) == _tokens(mask.bits[0]) and _tokens(mask.bits[4]) == eos
    assert _allowed(manager, "r") == _tokens(mask.bits[0])  # walked drafts were rolled back
    assert not manager.accept("r", digits)
    assert _allowed(manager, "r") == eos


def test_choice_grammar_escapes():
    assert choice_grammar(['say "hi"', "a\\b"]) == 'root ::= "say \\"hi\\"" | "a\\\\b"'
