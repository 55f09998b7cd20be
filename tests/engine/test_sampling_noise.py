"""Counter-based noise: the byte-exact specification, Exp(1) statistics, independence of
neighbouring keys, and the candidate race equal to the dense race (speculative decoding
relies on it)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import kstest, pearsonr

from pagoda.engine.sampling.sampler import Sampler, SamplingRow
from pagoda.engine.sampling.noise import _bits_torch, _top_bits_numpy, exponential_noise, row_keys, to_exponential_
from pagoda.engine.sampling_params import SamplingParams

M32, M64 = (1 << 32) - 1, (1 << 64) - 1


def _mix64(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def _hash32(x: int) -> int:
    x = ((x ^ (x >> 16)) * 0x21F0AAAD) & M32
    x = ((x ^ (x >> 15)) * 0x735A2D97) & M32
    return x ^ (x >> 15)


def _reference_noise(seed: int, position: int, column: int) -> float:
    """The module docstring's specification, in plain Python integers."""
    key = _mix64((_mix64(seed ^ 0x5851F42D4C957F2D) + position * 0x9E3779B97F4A7C15) & M64) >> 32
    bits = _hash32(_hash32(column ^ 0x9E3779B9) ^ key)
    return -float(np.log(np.float32(((bits >> 9) + 0.5) / 2**23)))


def test_noise_matches_the_specification_bit_for_bit():
    seeds, positions = [0, 1, 2**64 - 1, 123456789], [0, 7, 2**40, 3]
    keys = torch.from_numpy(row_keys(seeds, positions))
    columns = torch.tensor([[0, 1, 5, 49151]] * len(seeds))
    noise = exponential_noise(keys, 49152, columns)
    for r, (seed, position) in enumerate(zip(seeds, positions)):
        for c, column in enumerate(columns[r].tolist()):
            assert noise[r, c].item() == pytest.approx(_reference_noise(seed, position, column), rel=1e-6)
    # A column's value is the same whether evaluated alone or in the dense row.
    assert torch.equal(exponential_noise(keys, 49152)[:, [0, 1, 5, 49151]], noise)
    # The CPU's numpy uint32 bits equal the int64 tensor bits every other device uses.
    assert torch.equal(_bits_torch(keys, 49152, None) >> 9, exponential_noise_bits_cpu(keys, 49152))


def exponential_noise_bits_cpu(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    return _top_bits_numpy(keys.numpy(), vocab_size, None).to(torch.int64)


def test_noise_is_exp1_and_neighbouring_positions_are_independent():
    vocab_size = 20_000
    keys = torch.from_numpy(row_keys([42] * 3 + [43], [0, 1, 2, 0]))
    noise = exponential_noise(keys, vocab_size).double()  # [4, V]
    for row in noise:
        assert kstest(row.numpy(), "expon").pvalue > 1e-3
    # The extreme draws are finite and positive (u is never 0 or 1), so a race never
    # divides by zero: exhaustively over the 2**23 uniform levels the bits can give.
    draws = to_exponential_(torch.arange(2**23, dtype=torch.float32))
    assert bool(torch.isfinite(draws).all()) and float(draws.min()) > 0
    for a, b in ((0, 1), (1, 2), (0, 3)):  # next position; another seed
        assert abs(pearsonr(noise[a].numpy(), noise[b].numpy()).statistic) < 4 / vocab_size**0.5
    # Neighbouring columns of one row are independent too.
    assert abs(pearsonr(noise[0, :-1].numpy(), noise[0, 1:].numpy()).statistic) < 4 / vocab_size**0.5


@pytest.mark.parametrize("case", [dict(top_p=0.9), dict(top_k=40, top_p=0.8), dict(top_k=7, min_p=0.02),
                                  dict(top_p=0.97, min_p=0.001)])
def test_candidate_race_equals_dense_race(case):
    """Plain sampling races over candidates (widening on the CPU when top_p needs more);
    the dense race over ``filter_logits`` (speculative verification) picks the same tokens."""
    vocab_size, num_rows = 1000, 48
    generator = torch.Generator().manual_seed(5)
    scale = torch.linspace(0.1, 6.0, num_rows)[:, None]  # flat rows need every candidate, peaked ones few
    logits = torch.randn(num_rows, vocab_size, generator=generator) * scale
    params = SamplingParams(temperature=0.9, seed=1, **case)
    rows = [SamplingRow(params, seed=1000 + i, output_token_ids=[3] * (i % 5)) for i in range(num_rows)]
    sampler = Sampler(vocab_size)
    plain = sampler(logits, sampler.make_batch(rows)).token_ids
    filtered = sampler.filter_logits(sampler.process_logits(logits, sampler.make_batch(rows)), rows)
    assert sampler.race(filtered, rows).tolist() == plain
    kept = torch.isfinite(filtered)
    assert all(kept[i, t] for i, t in enumerate(plain))


def test_unseeded_rows_get_fresh_draws_every_call():
    sampler = Sampler(10, seed=4)
    rows = [SamplingRow(SamplingParams())] * 2
    first, second = sampler.draw_noise(rows, torch.device("cpu")), sampler.draw_noise(rows, torch.device("cpu"))
    assert not torch.equal(first[0], first[1]) and not torch.equal(first, second)
    again = Sampler(10, seed=4).draw_noise(rows, torch.device("cpu"))
    assert torch.equal(first, again), "the unseeded stream is reproducible from the engine seed"


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.8, 0.95), (1.3, 0.5)])
def test_tokens_masked_to_minus_inf_are_never_sampled(temperature, top_p):
    """A grammar leaves a few tokens finite; no draw, however extreme, may pick another."""
    vocab_size, num_rows = 3000, 256
    generator = torch.Generator().manual_seed(2)
    logits = torch.randn(num_rows, vocab_size, generator=generator)
    allowed = torch.rand(num_rows, vocab_size, generator=generator) < 0.002
    allowed[:, 0] = True
    logits = logits.masked_fill(~allowed, float("-inf"))
    params = SamplingParams(temperature=temperature, top_p=top_p)
    rows = [SamplingRow(params, seed=i if i % 2 else None) for i in range(num_rows)]
    sampler = Sampler(vocab_size)
    tokens = sampler(logits, sampler.make_batch(rows)).token_ids
    assert all(allowed[i, t] for i, t in enumerate(tokens))
