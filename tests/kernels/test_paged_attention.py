"""Triton paged attention (interpreter) vs the float64 reference across the test matrix.

The matrices of three parameters run a pairwise covering (``kernel_cases.pairwise``: every
pair of values together in some case), not their whole product: each case is seconds of
interpreter time.

Each case is a whole engine step. ``MIXED_STEP`` holds, with block size 4: a decode whose
context ends on a block boundary, a prefill chunk with no cached context ending off a
boundary, a chunk after 8 cached tokens, a decode that fills its last block exactly, a
chunk that ends exactly on a boundary, and a 1-token sequence with no context.
"""

from __future__ import annotations

import pytest
import torch

from pagoda.kernels import reload_settings, triton_attention
from pagoda.kernels.reference import paged_attention_torch
from pagoda.kernels.triton_attention import AttentionConfig, choose_config
from tests.kernels.kernel_cases import (
    assert_close_to_reference,
    attention_bound,
    make_paged_case,
    pairwise,
    poisoned_allocations,
    reference_attention,
)

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
HEAD_DIMS = [64, 80, 128]
# (num_heads, num_kv_heads): GQA ratios 1, 3, 4, 8
HEAD_GROUPS = [(4, 4), (6, 2), (8, 2), (8, 1)]
MIXED_STEP = ([1, 7, 5, 1, 4, 1], [9, 7, 13, 4, 8, 1])


def run_kernel(case, config=None) -> torch.Tensor:
    with poisoned_allocations():
        return triton_attention.paged_attention(
            case.q, case.k_cache, case.v_cache, case.meta, case.scale, config=config
        )


def _ids(value) -> str:
    return f"h{value[0]}kv{value[1]}" if isinstance(value, tuple) else str(value)


# Every pair of (GQA group, head size, dtype) values, not the whole product (kernel_cases.pairwise).
@pytest.mark.parametrize("heads,head_dim,dtype", pairwise(HEAD_GROUPS, HEAD_DIMS, DTYPES), ids=_ids)
def test_mixed_step_matrix(dtype, head_dim, heads):
    seed = hash((str(dtype), head_dim, heads)) % 2**31
    case = make_paged_case(*MIXED_STEP, *heads, head_dim, dtype, block_size=4, seed=seed)
    assert_close_to_reference(run_kernel(case), reference_attention(case), dtype, attention_bound(case))


# Launch shapes the chooser does not pick on CPU: several key tiles per query tile, tiles
# of 1 and 2 query tokens, and split-K with a split count that is not a power of two.
CONFIGS = {
    "small_tiles": AttentionConfig(block_q=2, block_n=16, num_splits=1),
    "one_token_tiles": AttentionConfig(block_q=1, block_n=16, num_splits=1),
    "split3": AttentionConfig(block_q=8, block_n=16, num_splits=3),
}


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("dtype,head_dim,heads", [(torch.float16, 80, (6, 2)), (torch.bfloat16, 128, (8, 1))], ids=str)
def test_launch_configs_long_ragged(name, dtype, head_dim, heads):
    # Contexts well past one key tile, chunks with and without cached context.
    query_lens, seq_lens = [1, 13, 1, 6, 21], [45, 13, 37, 40, 50]
    case = make_paged_case(query_lens, seq_lens, *heads, head_dim, dtype, block_size=16, seed=7)
    assert_close_to_reference(run_kernel(case, CONFIGS[name]), reference_attention(case), dtype, attention_bound(case))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_batch_with_split(dtype):
    seq_lens = [1, 16, 17, 31, 32, 33, 80, 97]
    case = make_paged_case([1] * len(seq_lens), seq_lens, 8, 2, 64, dtype, block_size=16, seed=11)
    config = AttentionConfig(block_q=4, block_n=16, num_splits=4)
    assert_close_to_reference(run_kernel(case, config), reference_attention(case), dtype, attention_bound(case))


@pytest.mark.parametrize("window,name,dtype", pairwise([1, 7, 20], [None, "small_tiles", "split3"],
                                                      [torch.float32, torch.bfloat16]), ids=str)
def test_sliding_window(window, name, dtype):
    """A query at p sees keys in (p - window, p]: decodes and chunks whose contexts reach past
    the window, through the unmasked middle tiles, the window's masked edge and split-K
    slices wholly outside the window; the torch path too."""
    query_lens, seq_lens = [1, 13, 1, 6, 21], [45, 13, 37, 40, 50]
    case = make_paged_case(query_lens, seq_lens, 6, 2, 64, dtype, block_size=16, seed=window)
    expected = reference_attention(case, window=window)
    bound = attention_bound(case)
    with poisoned_allocations():
        out = triton_attention.paged_attention(case.q, case.k_cache, case.v_cache, case.meta, case.scale,
                                               config=CONFIGS[name] if name else None, window=window)
    assert_close_to_reference(out, expected, dtype, bound)
    torch_path = paged_attention_torch(case.q, case.k_cache, case.v_cache, case.meta, case.scale, window=window)
    assert_close_to_reference(torch_path, expected, dtype, bound)
    if window == 1:  # each query sees only itself: the output is its own value row
        assert not torch.allclose(expected, reference_attention(case).to(expected.dtype))


@pytest.mark.parametrize("name,window,dtype", pairwise([None, "small_tiles", "split3"], [0, 7],
                                                      [torch.float32, torch.bfloat16]), ids=str)
def test_attention_sinks(window, name, dtype):
    """gpt-oss sinks: one logit per head in each row's softmax denominator (no value), with
    and without a window, unsplit and through the split-K merge; the torch path too. The
    sinks span below and above the scores (a sink far above them makes a head's output ~0)."""
    query_lens, seq_lens = [1, 13, 1, 6, 21], [45, 13, 37, 40, 50]
    case = make_paged_case(query_lens, seq_lens, 6, 2, 64, dtype, block_size=16, seed=5 + window)
    sinks = torch.tensor([-3.0, 0.0, 0.5, 2.0, 8.0, 40.0])
    expected = reference_attention(case, window=window, sinks=sinks)
    bound = attention_bound(case)
    with poisoned_allocations():
        out = triton_attention.paged_attention(case.q, case.k_cache, case.v_cache, case.meta, case.scale,
                                               config=CONFIGS[name] if name else None, window=window, sinks=sinks)
    assert_close_to_reference(out, expected, dtype, bound)
    torch_path = paged_attention_torch(case.q, case.k_cache, case.v_cache, case.meta, case.scale, window=window,
                                       sinks=sinks)
    assert_close_to_reference(torch_path, expected, dtype, bound)
    plain = reference_attention(case, window=window)
    assert (expected[:, 5].abs().max() < 1e-6 * plain[:, 5].abs().max()), "a sink far above the scores takes the mass"
    assert not torch.allclose(expected[:, :4], plain[:, :4], atol=1e-3), "the sinks change the output"


def test_sinks_of_the_wrong_shape_are_refused():
    case = make_paged_case([1], [5], 4, 2, 64, torch.float32, block_size=16, seed=0)
    with pytest.raises(ValueError, match="sinks must be float32"):
        triton_attention.paged_attention(case.q, case.k_cache, case.v_cache, case.meta, case.scale,
                                         sinks=torch.zeros(2))


@pytest.mark.parametrize("config", [None, CONFIGS["split3"]], ids=["chooser", "split3"])
def test_strided_block_tables(config):
    case = make_paged_case(*MIXED_STEP, 8, 2, 64, torch.float16, block_size=4, seed=3, strided_tables=True)
    assert_close_to_reference(run_kernel(case, config), reference_attention(case), torch.float16)


@pytest.mark.parametrize("seed", [101, 202, 303])
def test_random_steps(seed):
    gen = torch.Generator().manual_seed(seed)
    num_seqs = int(torch.randint(1, 7, (1,), generator=gen))
    query_lens, seq_lens = [], []
    for _ in range(num_seqs):
        q_len = 1 if torch.rand(1, generator=gen) < 0.5 else int(torch.randint(1, 16, (1,), generator=gen))
        query_lens.append(q_len)
        seq_lens.append(q_len + int(torch.randint(0, 33, (1,), generator=gen)))
    heads = HEAD_GROUPS[seed % len(HEAD_GROUPS)]
    dtype = DTYPES[seed % len(DTYPES)]
    block_size = [4, 8, 16][seed % 3]
    case = make_paged_case(query_lens, seq_lens, *heads, 64, dtype, block_size, seed=seed)
    config = AttentionConfig(block_q=2, block_n=16, num_splits=1 + seed % 3)
    assert_close_to_reference(run_kernel(case, config), reference_attention(case), dtype, attention_bound(case))


def test_public_wrapper_matches_reference():
    from pagoda.kernels import triton_ops

    case = make_paged_case(*MIXED_STEP, 8, 2, 64, torch.float16, block_size=4, seed=5)
    with poisoned_allocations():
        out = triton_ops.paged_attention(case.q, case.k_cache, case.v_cache, case.meta, case.scale)
    assert_close_to_reference(out, reference_attention(case), torch.float16)


def test_rejects_mismatched_dtypes():
    case = make_paged_case([1], [3], 4, 4, 64, torch.float16, block_size=4, seed=1)
    with pytest.raises(ValueError, match="dtypes differ"):
        triton_attention.paged_attention(case.q.float(), case.k_cache, case.v_cache, case.meta, case.scale)


@pytest.mark.parametrize("heads", HEAD_GROUPS + [(32, 8), (64, 8), (9, 3)], ids=str)
@pytest.mark.parametrize("max_query_len", [1, 4, 512])
@pytest.mark.parametrize("element_size", [2, 4])
def test_choose_config_shapes(heads, max_query_len, element_size):
    num_heads, num_kv_heads = heads
    cfg = choose_config(64, 64, num_heads, num_kv_heads, max_query_len, 4096, 132, element_size)
    gpad = triton_attention.group_pad(num_heads, num_kv_heads)
    block_m = cfg.block_q * gpad
    assert block_m >= 16 and block_m & (block_m - 1) == 0, "tl.dot needs >= 16 rows, arange a power of two"
    assert cfg.block_n >= 16 and cfg.block_n & (cfg.block_n - 1) == 0
    assert block_m <= (128 if element_size == 2 else 32) or block_m == gpad


def test_choose_config_splits_only_when_the_gpu_is_underfilled():
    # Batch-1 decode at 4k context on 132 SMs: 8 tiles, so split the keys.
    small = choose_config(1, 1, 32, 8, 1, 4096, 132)
    assert small.num_splits > 1 and small.num_splits & (small.num_splits - 1) == 0
    assert 4096 / small.num_splits >= triton_attention.DECODE_MIN_SPLIT_LEN
    # Small-batch decode: more, cheaper slices than the prefill rule's >= 256 keys, and
    # never fewer programs as the batch shrinks.
    splits = [choose_config(b, b, 32, 8, 1, 4096, 132).num_splits for b in (1, 2, 4, 8, 16, 32, 64)]
    assert splits[0] == 4096 // triton_attention.DECODE_MIN_SPLIT_LEN
    assert splits == sorted(splits, reverse=True)
    assert choose_config(4, 1, 32, 8, 4, 4096, 132).num_splits <= 4096 // triton_attention.MIN_SPLIT_LEN
    # Many sequences, short contexts or a big prefill: enough tiles already.
    assert choose_config(256, 256, 32, 8, 1, 4096, 132).num_splits == 1
    assert choose_config(1, 1, 32, 8, 1, 200, 132).num_splits == 1
    assert choose_config(4096, 1, 32, 8, 4096, 4096, 132).num_splits == 1


def test_decode_buckets_split_contexts_of_very_different_lengths():
    from pagoda.kernels.reference import decode_buckets

    lens = [3, 200, 4, 5, 6, 7, 90, 100, 110, 120, 8, 210]
    buckets = decode_buckets(lens, list(range(len(lens))))
    assert sorted(s for b in buckets for s in b) == list(range(len(lens)))
    assert [[lens[s] for s in b] for b in buckets] == [[3, 4, 5, 6, 7, 8], [90, 100, 110, 120, 200, 210]]
    assert decode_buckets([10] * 100, list(range(100))) == [list(range(36)), list(range(36, 100))]  # at most 64 each


@pytest.mark.parametrize("window", [0, 9])
def test_torch_path_decodes_buckets_of_different_lengths(window, monkeypatch):
    """The CPU path's decode buckets (reference.decode_buckets) give the reference's result;
    a row's output depends on its bucket's padding only in the last bits (SDPA's blocking
    of the padded keys), as it did on the batch's padding before buckets."""
    from pagoda.kernels.reference import AttentionMetadata, cpu_plan

    monkeypatch.setenv("PAGODA_CPU_KERNELS", "torch")  # the buckets, not the C++ decode (test_cpu_native.py)
    reload_settings()
    seq_lens = [3, 700, 4, 5, 6, 7, 400, 450, 500, 550, 8, 750]
    case = make_paged_case([1] * len(seq_lens), seq_lens, 6, 2, 64, torch.float32, block_size=16, seed=3)
    # Unowned slots hold NaN here; the engine's cache is zeroed at start and only ever holds
    # finite K/V, which the padded rows of a bucket may read (masked out, weight 0).
    case.k_cache.nan_to_num_(0), case.v_cache.nan_to_num_(0)
    out = paged_attention_torch(case.q, case.k_cache, case.v_cache, case.meta, case.scale, window=window)
    assert len(cpu_plan(case.meta, 16, window, case.q.device).decodes) == 2
    assert_close_to_reference(out, reference_attention(case, window=window), torch.float32, attention_bound(case))
    alone = AttentionMetadata.build([1], [seq_lens[1]], [case.meta.block_tables[1].tolist()], 16)
    single = paged_attention_torch(case.q[1:2], case.k_cache, case.v_cache, alone, case.scale, window=window)
    assert torch.allclose(single[0], out[1], rtol=0, atol=1e-6)
