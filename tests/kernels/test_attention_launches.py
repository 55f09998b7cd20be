"""Two launches per mixed step: decode rows with the decode shape, chunks with the prefill
shape; each launch skips the other's sequences and every output row is written once
(NaN-poisoned buffers), for the chooser's shapes and forced ones with split-K on either side."""

from __future__ import annotations

import pytest
import torch

from pagoda.kernels import triton_attention
from pagoda.kernels.triton_attention import AttentionConfig, choose_config
from tests.kernels.kernel_cases import (
    assert_close_to_reference,
    attention_bound,
    make_paged_case,
    poisoned_allocations,
    reference_attention,
)

# Decodes on and off block boundaries around two chunks (one with cached context).
RAGGED = ([1, 13, 1, 1, 6, 1], [45, 13, 16, 37, 40, 1])


@pytest.fixture
def launches(monkeypatch):
    calls = []
    real = triton_attention._launch

    def record(*args):
        calls.append(args[9:])  # (cfg, q_len_lo, q_len_hi, max_query_len) after (..., v_scale, window, sinks)
        return real(*args)

    monkeypatch.setattr(triton_attention, "_launch", record)
    return calls


def _run(case, config=None, decode_config=None):
    with poisoned_allocations():
        return triton_attention.paged_attention(case.q, case.k_cache, case.v_cache, case.meta, case.scale, config,
                                                decode_config=decode_config)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_mixed_step_takes_two_launches_with_their_own_shapes(dtype, launches):
    case = make_paged_case(*RAGGED, 8, 2, 64, dtype, block_size=16, seed=31)
    assert_close_to_reference(_run(case), reference_attention(case), dtype, attention_bound(case))
    (prefill, lo_p, hi_p, _), (decode, lo_d, hi_d, max_q) = launches
    assert (lo_p, hi_p, lo_d, hi_d, max_q) == (2, 13, 1, 1, 1)
    assert decode.block_q * 4 == 16, "decode rows get the 16-row decode tile"
    assert prefill.block_q > decode.block_q


@pytest.mark.parametrize("decode_splits,prefill_splits", [(4, 1), (1, 3), (2, 2)])
@pytest.mark.parametrize("dtype,heads", [(torch.float16, (6, 2)), (torch.bfloat16, (8, 1))], ids=str)
def test_forced_two_launch_shapes_with_split_k(decode_splits, prefill_splits, dtype, heads, launches):
    case = make_paged_case(*RAGGED, *heads, 64, dtype, block_size=16, seed=decode_splits + 3 * prefill_splits)
    decode = AttentionConfig(block_q=16 // triton_attention.group_pad(*heads), block_n=16, num_splits=decode_splits)
    prefill = AttentionConfig(block_q=4, block_n=32, num_splits=prefill_splits)
    assert_close_to_reference(_run(case, prefill, decode), reference_attention(case), dtype)
    assert [c[0] for c in launches] == [prefill, decode]


def test_single_launch_when_forced_or_uniform(launches):
    case = make_paged_case(*RAGGED, 8, 2, 64, torch.float16, block_size=16, seed=2)
    _run(case, AttentionConfig(block_q=2, block_n=16, num_splits=2))
    decode_only = make_paged_case([1] * 4, [45, 16, 3, 33], 8, 2, 64, torch.float16, block_size=16, seed=3)
    out = _run(decode_only, AttentionConfig(block_q=4, block_n=16, num_splits=3))
    assert_close_to_reference(out, reference_attention(decode_only), torch.float16)
    assert [(c[1], c[2]) for c in launches] == [(1, 13), (1, 1)]


def test_prefill_shapes_for_long_chunks():
    long = choose_config(2048, 1, 32, 8, 2048, 2048, 132)
    assert (long.block_q * 4, long.num_warps, long.num_stages) == (128, 8, 3)
    short = choose_config(8, 1, 32, 8, 8, 2048, 132)
    assert (short.block_q * 4, short.num_warps) == (32, 4)
    assert choose_config(2048, 1, 32, 8, 2048, 2048, 132, 4).block_q * 4 == 32  # fp32: 32 rows
