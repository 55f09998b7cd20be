"""Verification math of speculative decoding, without a model.

The defining property of modified rejection sampling: whatever the draft distribution
``q``, every emitted token is distributed as the target ``p`` at its position. Checked
with chi-square tests over many trials, for a draft that disagrees often, a one-hot
(n-gram) draft, and a perfect draft; plus the greedy and seeded verifiers, the window
policy and the n-gram lookup.
"""

import pytest
import torch
from scipy.stats import chisquare

from pagoda.engine.sampling.sampler import Sampler, SamplingRow
from pagoda.engine.sampling_params import SamplingParams
from pagoda.engine.spec_decode.ngram_proposer import find_continuation
from pagoda.engine.spec_decode.rejection_sampler import coupled_verify, greedy_verify, rejection_sample
from pagoda.engine.spec_decode.window import AcceptanceEstimate, AdaptiveWindow

V, K, TRIALS = 6, 3, 40_000


def _dists(seed):
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(K + 1, V, generator=g) + 0.1
    p[:, 0] = 0.0  # a token the target never emits
    q = torch.rand(K, V, generator=g) + 0.1
    q[:, 1] = q[:, 1] + 4.0  # the draft's favourite, far likelier than under p
    return p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)


def _run(p, q, one_hot_tokens=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    if one_hot_tokens is None:
        x = torch.stack([torch.multinomial(q[j], TRIALS, replacement=True, generator=g) for j in range(K)], dim=1)
        draft_probs = q.expand(TRIALS, K, V)
    else:
        x = torch.tensor(one_hot_tokens).expand(TRIALS, K)
        draft_probs = None
    num_accepted, nxt = rejection_sample(p.expand(TRIALS, K + 1, V), draft_probs, x,
                                         torch.full((TRIALS,), K), generator=g)
    return x, num_accepted, nxt


def _emitted_at(x, num_accepted, nxt, j):
    """Tokens emitted at position j by the trials that reach it."""
    reached = num_accepted >= j
    token = torch.where(num_accepted[reached] == j, nxt[reached], x[reached][:, min(j, K - 1)])
    return token


def _assert_distributed_as(tokens, p):
    counts = torch.bincount(tokens, minlength=V).double()
    assert counts[p == 0].sum() == 0, "emitted a token the target gives probability 0"
    keep = p > 0
    assert chisquare(counts[keep].numpy(), _expected(p[keep], counts.sum())).pvalue > 1e-3


def _expected(p, total):
    p = p.double()
    return (p / p.sum() * total).numpy()


@pytest.mark.parametrize("case", ["disagreeing", "one_hot", "perfect"])
def test_rejection_sampling_emits_the_target_distribution(case):
    p, q = _dists(seed=3)
    if case == "perfect":
        q = p[:K].clone()
    x, num_accepted, nxt = _run(p, q, one_hot_tokens=[1, 4, 0] if case == "one_hot" else None)
    for j in range(K + 1):
        tokens = _emitted_at(x, num_accepted, nxt, j)
        assert j < 2 or len(tokens) > 0 or case == "one_hot"
        if len(tokens) >= 500:
            _assert_distributed_as(tokens, p[j])
    rate = num_accepted.double().mean().item()
    if case == "perfect":
        assert rate > K - 0.01  # p == q: everything is accepted, every trial gets the bonus
    elif case == "disagreeing":
        # The test has power: the drafts themselves are far from p, and often rejected.
        drafts = torch.bincount(x[:, 0], minlength=V).double()
        keep = p[0] > 0
        assert chisquare(drafts[keep].numpy(), _expected(p[0][keep], drafts[keep].sum())).pvalue < 1e-10
        assert rate < 1.0


def test_rejection_respects_num_drafts_per_row():
    p, q = _dists(seed=5)
    x = torch.zeros(3, K, dtype=torch.int64)
    num_accepted, _ = rejection_sample(p.expand(3, K + 1, V), q.expand(3, K, V), x + 1, torch.tensor([0, 1, 3]))
    assert num_accepted[0] == 0 and num_accepted[1] <= 1


def test_greedy_verify():
    assert greedy_verify([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]  # all accepted + bonus
    assert greedy_verify([5, 9, 7, 8], [5, 6, 7]) == [5, 9]  # first mismatch replaced
    assert greedy_verify([4], []) == [4]


def test_coupled_verify_equals_plain_seeded_sampling():
    """Seeded rows: the verified tokens are what the plain sampler draws with the same
    seed at each output position, whatever was drafted."""
    sampler = Sampler(vocab_size=V)
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=11)
    logits = torch.randn(K + 2, V, generator=torch.Generator().manual_seed(7))
    plain = []
    for j in range(K + 2):
        row = SamplingRow(params, 11, output_token_ids=list(plain))
        plain.append(sampler(logits[j : j + 1], sampler.make_batch([row])).token_ids[0])
    for drafts in ([plain[0], plain[1], plain[2]], [plain[0], (plain[1] + 1) % V, 3], [(plain[0] + 1) % V]):
        rows = [SamplingRow(params, 11, output_token_ids=list(drafts[:j])) for j in range(len(drafts) + 1)]
        filtered = sampler.filter_logits(sampler.process_logits(logits[: len(rows)], sampler.make_batch(rows)), rows)
        out = coupled_verify(sampler.race(filtered, rows).tolist(), drafts)
        assert out == plain[: len(out)]


def test_adaptive_window_shrinks_with_load_and_low_acceptance():
    window = AdaptiveWindow(max_k=5, draft_cost=0.1, saturation_tokens=16)
    high, low = AcceptanceEstimate(0.9), AcceptanceEstimate(0.1)
    k_small_batch = window.choose(high, num_step_tokens=1, num_speculating=1)
    k_big_batch = window.choose(AcceptanceEstimate(0.9), num_step_tokens=64, num_speculating=64)
    assert k_small_batch >= 3 and k_big_batch < k_small_batch
    # Low acceptance: 0, and after probe_interval steps at 0 one probe with k = 1.
    picks = [window.choose(low, 1, 1) for _ in range(3 * window.probe_interval)]
    probes = [i for i, k in enumerate(picks) if k]
    assert probes == [window.probe_interval - 1, 3 * window.probe_interval - 1]  # then twice as long
    assert set(picks) == {0, 1}
    est = AcceptanceEstimate(0.5)
    est.observe(num_drafted=4, num_accepted=4)
    assert est.value > 0.5
    est.observe(num_drafted=4, num_accepted=0)
    assert est.value < 0.8


def test_ngram_lookup():
    assert find_continuation([1, 2, 3, 4, 9, 1, 2, 3], 3) == [4, 9, 1]  # longest suffix [1, 2, 3]
    assert find_continuation([1, 2, 7, 2, 8, 1, 2], 2) == [7, 2]  # latest match of the longest suffix
    assert find_continuation([5, 6, 5], 4) == [6, 5]  # suffix [5]: stops at the end of the text
    assert find_continuation([1, 2, 3], 2) == []
