"""Sampler: distributions (chi-square against a float64 reference), penalties against the
direct formula, min_tokens, seeded reproducibility across batch compositions, logprobs."""

from __future__ import annotations

import random
from typing import Optional

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from pagoda.engine.sampling.logits_processors import GrammarBitmaskProcessor
from pagoda.engine.sampling.sampler import Sampler, SamplingRow, make_seed
from pagoda.engine.sampling_params import SamplingParams

# A small vocabulary with distinct logits, so top-k/top-p/min-p sets are unambiguous.
LOGITS = [2.0, 1.5, 1.0, 0.6, 0.3, 0.0, -0.4, -0.8, -1.2, -1.7, -2.3, -3.0]
VOCAB_SIZE = len(LOGITS)
NUM_SAMPLES = 20_000
P_VALUE_FLOOR = 1e-3


def reference_probs(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> np.ndarray:
    """The intended distribution in float64, written token by token."""
    scaled = np.array(LOGITS, dtype=np.float64) / temperature
    order = sorted(range(VOCAB_SIZE), key=lambda t: -scaled[t])
    kept = set(order[:top_k] if top_k else order)

    def renormalized():
        weights = np.array([np.exp(scaled[t]) if t in kept else 0.0 for t in range(VOCAB_SIZE)])
        return weights / weights.sum()

    if top_p < 1.0:
        probs, mass_before = renormalized(), 0.0
        for t in order:
            if t in kept:
                assert abs(mass_before - top_p) > 1e-4, "top_p too close to a boundary for a stable test"
                if mass_before >= top_p:
                    kept.discard(t)
                mass_before += probs[t]
    if min_p > 0.0:
        probs = renormalized()
        for t in list(kept):
            assert abs(probs[t] - min_p * probs.max()) > 1e-6, "min_p too close to a boundary"
            if probs[t] < min_p * probs.max():
                kept.discard(t)
    return renormalized()


def draw_counts(params: SamplingParams, num_padding: int = 0, seed: int = 0, seeded_rows: bool = False):
    """Sample NUM_SAMPLES tokens for identical rows in one batch; return per-token counts."""
    logits = torch.tensor(LOGITS + [50.0] * num_padding).expand(NUM_SAMPLES, -1)
    if seeded_rows:
        rows = [SamplingRow(params, make_seed(seed + i)) for i in range(NUM_SAMPLES)]
    else:
        rows = [SamplingRow(params) for _ in range(NUM_SAMPLES)]
    sampler = Sampler(VOCAB_SIZE, seed=seed)
    output = sampler(logits, sampler.make_batch(rows))
    return np.bincount(output.token_ids, minlength=VOCAB_SIZE + num_padding)


def assert_matches(counts: np.ndarray, expected: np.ndarray) -> None:
    assert len(counts) == VOCAB_SIZE, "a padding column was sampled"
    excluded = expected == 0
    assert counts[excluded].sum() == 0, f"excluded tokens sampled: {np.nonzero(counts * excluded)}"
    if (~excluded).sum() == 1:
        return  # a single allowed token: the check above is the whole test
    result = chisquare(counts[~excluded], expected[~excluded] * counts.sum())
    assert result.pvalue > P_VALUE_FLOOR, (result, counts, expected)


FILTER_CASES = [
    dict(temperature=0.5),
    dict(temperature=1.0),
    dict(temperature=2.0),
    dict(top_k=1),
    dict(top_k=3),
    dict(top_k=5, temperature=0.7),
    dict(top_p=0.6),
    dict(top_p=0.9, temperature=1.5),
    dict(min_p=0.1),
    dict(min_p=0.3, temperature=2.0),
    dict(top_k=6, top_p=0.8, temperature=1.5),
    dict(top_k=8, min_p=0.2),
    dict(top_p=0.85, min_p=0.15, temperature=0.8),
    dict(top_k=7, top_p=0.9, min_p=0.05, temperature=1.3),
]


@pytest.mark.parametrize("case", FILTER_CASES, ids=[",".join(f"{k}={v}" for k, v in c.items()) for c in FILTER_CASES])
def test_distribution_matches_reference(case):
    expected = reference_probs(**case)
    assert (expected > 0).sum() > 1 or case.get("top_k") == 1  # the case really samples
    assert_matches(draw_counts(SamplingParams(**case), seed=len(FILTER_CASES)), expected)


def test_seeded_rows_draw_from_the_same_distribution():
    case = dict(top_k=6, temperature=0.9)
    assert_matches(draw_counts(SamplingParams(**case, seed=1), seed=11, seeded_rows=True), reference_probs(**case))


def test_padding_columns_never_sampled():
    # Padding logits of 50 would win every draw if they took part.
    case = dict(temperature=1.0)
    assert_matches(draw_counts(SamplingParams(**case), num_padding=4)[:VOCAB_SIZE], reference_probs(**case))
    counts = draw_counts(SamplingParams(**case), num_padding=4)
    assert counts[VOCAB_SIZE:].sum() == 0
    sampler = Sampler(VOCAB_SIZE)
    batch = sampler.make_batch([SamplingRow(SamplingParams(temperature=0))])
    greedy = sampler(torch.tensor([LOGITS + [50.0] * 4]), batch)
    assert greedy.token_ids == [0]


def test_greedy_is_argmax_and_mixes_with_random_rows():
    torch.manual_seed(0)
    logits = torch.randn(16, 40)
    temperatures = [0.0 if i % 2 == 0 else 1e-6 if i % 4 == 1 else 1.0 for i in range(16)]
    rows = [SamplingRow(SamplingParams(temperature=t)) for t in temperatures]
    sampler = Sampler(40)
    output = sampler(logits, sampler.make_batch(rows))
    for i, row in enumerate(rows):
        if row.params.is_greedy:
            assert output.token_ids[i] == int(logits[i].argmax())


def _penalty_reference(logits, params, prompt, output):
    """Direct per-token formula: repetition (prompt+output), then presence/frequency (output)."""
    result = []
    for token, value in enumerate(logits.tolist()):
        if token in prompt or token in output:
            value = value / params.repetition_penalty if value > 0 else value * params.repetition_penalty
        count = output.count(token)
        value -= params.frequency_penalty * count + params.presence_penalty * (count > 0)
        result.append(value)
    return torch.tensor(result)


PENALTY_CASES = [
    dict(repetition_penalty=1.3),
    dict(repetition_penalty=0.7),
    dict(presence_penalty=0.5),
    dict(frequency_penalty=-0.8),
    dict(presence_penalty=-1.5, frequency_penalty=0.3),
    dict(repetition_penalty=1.8, presence_penalty=0.4, frequency_penalty=1.1),
    dict(),
]


def test_penalties_match_direct_formula():
    torch.manual_seed(1)
    vocab_size = 30
    logits = torch.randn(len(PENALTY_CASES), vocab_size + 2) * 3
    rng = random.Random(1)
    rows = [
        SamplingRow(
            SamplingParams(**case),
            prompt_token_ids=[rng.randrange(vocab_size) for _ in range(8)],
            output_token_ids=[rng.randrange(vocab_size) for _ in range(12)] + [3, 3, 3],
        )
        for case in PENALTY_CASES
    ]
    sampler = Sampler(vocab_size)
    processed = sampler.process_logits(logits, sampler.make_batch(rows))
    assert processed.shape == (len(rows), vocab_size)
    for i, row in enumerate(rows):
        expected = _penalty_reference(logits[i, :vocab_size], row.params, row.prompt_token_ids, row.output_token_ids)
        torch.testing.assert_close(processed[i], expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(processed[-1], logits[-1, :vocab_size]), "neutral row changed"


def test_greedy_uses_penalized_logits():
    logits = torch.tensor([[5.0, 4.0, 1.0]])
    row = SamplingRow(SamplingParams(temperature=0, repetition_penalty=2.0), prompt_token_ids=[0])
    sampler = Sampler(3)
    assert sampler(logits, sampler.make_batch([row])).token_ids == [1]  # 5/2 < 4


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_allowed_token_ids_and_logit_bias_edit_only_their_rows(temperature):
    """vLLM's allowed_token_ids (every other id is -inf) and logit_bias (added to the logit),
    per row: a row that sets neither keeps its logits bit for bit."""
    logits = torch.tensor([LOGITS]).expand(300, -1).contiguous()
    allowed = SamplingParams(temperature=temperature, allowed_token_ids=[5, 9])
    biased = SamplingParams(temperature=temperature, logit_bias={"11": 100.0, 0: -100.0})
    plain = SamplingParams(temperature=temperature)
    sampler = Sampler(VOCAB_SIZE)
    rows = [SamplingRow(p) for p in (allowed, biased, plain)] * 100
    batch = sampler.make_batch(rows)
    processed = sampler.process_logits(logits.clone(), batch)
    assert torch.isinf(processed[0, [i for i in range(VOCAB_SIZE) if i not in (5, 9)]]).all()
    assert processed[0, 5] == LOGITS[5] and processed[0, 9] == LOGITS[9]
    assert processed[1, 11] == pytest.approx(LOGITS[11] + 100.0) and processed[1, 0] == pytest.approx(LOGITS[0] - 100)
    assert torch.equal(processed[2], logits[2])
    tokens = sampler(logits, batch).token_ids
    assert set(tokens[0::3]) <= {5, 9} and set(tokens[1::3]) == {11}
    if temperature == 0.0:
        assert set(tokens[2::3]) == {0}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_blocks_eos_and_stop_ids_until_reached(temperature):
    eos, stop_id = 0, 1
    logits = torch.tensor([[30.0, 29.0, 0.0, 0.0, 0.0]]).expand(200, -1)
    params = SamplingParams(temperature=temperature, min_tokens=3, stop_token_ids=[stop_id])
    sampler = Sampler(5)
    blocked = frozenset({eos, stop_id, 999})  # ids past the vocabulary are ignored
    for num_output in range(5):
        rows = [SamplingRow(params, output_token_ids=[2] * num_output, min_tokens_blocked_ids=blocked)] * 200
        tokens = set(sampler(logits, sampler.make_batch(rows)).token_ids)
        if num_output < 3:
            assert tokens.isdisjoint(blocked), (num_output, tokens)
        else:
            assert eos in tokens


def test_bad_words_mask_the_token_that_would_complete_one():
    """vLLM's bad_words as sequences: a one-token word is never sampled; a two-token word's
    last token is masked only right after its first, so the rest of the text is free."""
    logits = torch.tensor([[0.0, 10.0, 9.0, 8.0, 0.0]])
    row = SamplingRow(SamplingParams(temperature=0.0, bad_words=["x"]), bad_words_token_ids=((1,), (4, 2)))
    sampler = Sampler(5)
    assert sampler(logits, sampler.make_batch([row])).token_ids == [2]  # 1 is banned outright
    after_first = SamplingRow(row.params, output_token_ids=[4], bad_words_token_ids=row.bad_words_token_ids)
    assert sampler(logits, sampler.make_batch([after_first])).token_ids == [3]  # 4 then 2 would complete it
    plain = SamplingRow(SamplingParams(temperature=0.0))
    assert sampler.make_batch([plain]).bad_words is None
    assert torch.equal(sampler.process_logits(logits.clone(), sampler.make_batch([plain])), logits)


def _random_row(rng: random.Random, vocab_size: int) -> SamplingRow:
    params = SamplingParams(
        temperature=rng.choice([0.0, 0.5, 1.0, 1.7]),
        top_k=rng.choice([0, 1, 5, 20]),
        top_p=rng.choice([1.0, 0.5, 0.9]),
        min_p=rng.choice([0.0, 0.05]),
        repetition_penalty=rng.choice([1.0, 1.2]),
        presence_penalty=rng.choice([0.0, 0.5]),
        frequency_penalty=rng.choice([0.0, -0.3]),
        logprobs=rng.choice([None, 2]),
        seed=rng.choice([None, rng.randrange(1000)]),
        min_tokens=rng.choice([0, 2]),
    )
    return SamplingRow(
        params,
        params.seed,
        prompt_token_ids=[rng.randrange(vocab_size) for _ in range(rng.randrange(1, 10))],
        output_token_ids=[rng.randrange(vocab_size) for _ in range(rng.randrange(0, 5))],
        min_tokens_blocked_ids=frozenset({0}),
    )


SEEDED_TARGETS = [
    dict(seed=1234),
    dict(seed=7, temperature=0.9, top_k=20, top_p=0.95, min_p=0.01, repetition_penalty=1.1, presence_penalty=0.2),
    dict(seed=2**64 - 1, temperature=1.5, frequency_penalty=0.5, logprobs=3, min_tokens=3),
]


@pytest.mark.parametrize("target", SEEDED_TARGETS, ids=["plain", "filters", "penalties"])
def test_seeded_row_ignores_batch_composition_and_position(target):
    vocab_size, width, num_steps = 50, 56, 8
    params = SamplingParams(**target)
    step_logits = torch.randn(num_steps, width, generator=torch.Generator().manual_seed(3)) * 2

    def run(rng: Optional[random.Random]):
        outputs, logprobs = [], []
        sampler = Sampler(vocab_size, seed=rng.randrange(100) if rng else 0)
        for step in range(num_steps):
            row = SamplingRow(params, params.seed, [1, 2, 3], list(outputs), frozenset({0}))
            others = [_random_row(rng, vocab_size) for _ in range(rng.randrange(1, 8))] if rng else []
            position = rng.randrange(len(others) + 1) if rng else 0
            batch = others[:position] + [row] + others[position:]
            logits = torch.randn(len(batch), width) * 2
            logits[position] = step_logits[step]
            result = sampler(logits, sampler.make_batch(batch))
            outputs.append(result.token_ids[position])
            logprobs.append(result.logprobs[position])
        return outputs, logprobs

    alone = run(None)
    assert len(set(alone[0])) > 1
    for trial in range(3):
        assert run(random.Random(trial)) == alone


def test_same_seed_same_logits_same_tokens_different_seed_differs():
    logits = torch.zeros(3, 50)
    params = [SamplingParams(seed=5), SamplingParams(seed=5), SamplingParams(seed=6)]
    rows = [SamplingRow(p, p.seed) for p in params]
    sampler = Sampler(50)
    tokens = [sampler(logits, sampler.make_batch(rows)).token_ids for _ in range(10)]
    assert all(step[0] == step[1] for step in tokens)
    assert any(step[0] != step[2] for step in tokens)


def test_make_seed():
    assert make_seed(None) is None and make_seed(None, 3) is None
    assert make_seed(9) == make_seed(9, 0) == 9
    children = [make_seed(9, i) for i in range(4)]
    assert len(set(children)) == 4 and children[2] == make_seed(9, 2)
    assert all(0 <= c < 2**64 for c in children) and make_seed(10, 1) != children[1]


def test_logprobs_are_raw_log_softmax_with_rank_and_ordered_top():
    torch.manual_seed(2)
    vocab_size = 40
    logits = torch.randn(5, vocab_size + 3) * 2
    logits[:, vocab_size:] = 100.0  # padding must not dilute the distribution
    rows = [
        SamplingRow(SamplingParams(logprobs=0)),
        SamplingRow(SamplingParams(logprobs=1, temperature=0)),
        SamplingRow(SamplingParams(logprobs=5, temperature=0.3, top_k=3, repetition_penalty=1.5), None, [0, 1, 2]),
        SamplingRow(SamplingParams(logprobs=20, temperature=2.0)),
        SamplingRow(SamplingParams()),
    ]
    sampler = Sampler(vocab_size)
    output = sampler(logits, sampler.make_batch(rows))
    assert output.logprobs[4] is None
    reference = torch.log_softmax(logits[:, :vocab_size].double(), dim=-1)
    for i, row in enumerate(rows[:4]):
        info, token = output.logprobs[i], output.token_ids[i]
        assert info.token_id == token
        assert info.logprob == pytest.approx(reference[i, token].item(), abs=1e-5)
        assert info.rank == 1 + int((reference[i] > reference[i, token]).sum())
        assert len(info.top) == row.params.logprobs
        top_ids = [t for t, _ in info.top]
        assert top_ids == reference[i].argsort(descending=True)[: len(top_ids)].tolist()
        for t, value in info.top:
            assert value == pytest.approx(reference[i, t].item(), abs=1e-5)
    assert output.logprobs[1].rank == 1


def test_bad_logits_shape_raises():
    sampler = Sampler(10)
    with pytest.raises(ValueError, match="^logits:"):
        sampler(torch.zeros(2, 10), sampler.make_batch([SamplingRow(SamplingParams())]))
    with pytest.raises(ValueError, match="^logits:"):
        sampler(torch.zeros(1, 9), sampler.make_batch([SamplingRow(SamplingParams())]))


def test_sampling_batch_gathers_each_stage_once_and_leaves_unused_stages_empty():
    rows = [SamplingRow(SamplingParams(temperature=0)),
            SamplingRow(SamplingParams(temperature=1.0, repetition_penalty=1.2), prompt_token_ids=[1, 2],
                        output_token_ids=[3])]
    batch = Sampler(10).make_batch(rows)
    assert batch.random_rows == (1,) and batch.logprob_rows == ()
    assert batch.min_tokens is None and batch.counted is None and batch.token_bitmask is None
    assert batch.repetition.row_index.tolist() == [1, 1, 1] and batch.repetition.token_index.tolist() == [1, 2, 3]
    assert batch.repetition_penalty.tolist() == pytest.approx([1.0, 1.2])


def test_the_grammar_bitmask_is_the_last_logits_processor():
    assert isinstance(Sampler(10).logits_processors[-1], GrammarBitmaskProcessor)
