"""Per-query key limits (Gemma 3's images attending to each other both ways) in every attention path.

``AttentionMetadata.key_limits``: a query sees keys up to its limit (at least its own position)
instead of its own position, within its sliding window. Checked against a dense float64 oracle
written here from the rule (each row's visible keys listed one by one, independent of the paged
reference), then the Triton kernel (interpreter; unsplit, small tiles, split-K, with and without
a window) and the torch CPU path against it with the derived float32 bound
(``kernel_cases.attention_bound``) or the 16-bit tolerances.

The step: decodes (their limit is their position), a first chunk holding an image, a chunk that
begins inside an image whose first keys are cached (a prefix hit ending inside it), and a chunk
with two images, one reaching past the window's reach of its first token.
"""

from __future__ import annotations

import pytest
import torch

from pagoda.kernels import triton_attention
from pagoda.kernels.reference import paged_attention_ref, paged_attention_torch
from pagoda.kernels.triton_attention import AttentionConfig
from tests.kernels.kernel_cases import assert_close_to_reference, attention_bound, make_paged_case, poisoned_allocations

QUERY_LENS, SEQ_LENS = [1, 13, 1, 6, 21], [45, 13, 37, 40, 50]
IMAGES = {1: [(3, 9)], 3: [(30, 38)], 4: [(30, 34), (38, 48)]}  # sequence -> [start, end) of its images
CONFIGS = {None: None, "small_tiles": AttentionConfig(block_q=2, block_n=16, num_splits=1),
           "split3": AttentionConfig(block_q=8, block_n=16, num_splits=3)}


def _limits() -> list[int]:
    limits = []
    for s, (q_len, s_len) in enumerate(zip(QUERY_LENS, SEQ_LENS)):
        for pos in range(s_len - q_len, s_len):
            limits.append(next((end - 1 for start, end in IMAGES.get(s, []) if start <= pos < end), pos))
    return limits


def _dense_oracle(case, limits: list[int], window: int) -> torch.Tensor:
    """float64, one query row at a time over the keys the rule lets it see."""
    out = torch.zeros(case.q.shape, dtype=torch.float64)
    group = case.q.shape[1] // case.k_cache.shape[2]
    block = case.k_cache.shape[1]
    row = 0
    for s, (q_len, s_len) in enumerate(zip(QUERY_LENS, SEQ_LENS)):
        table = case.meta.block_tables[s].tolist()
        keys = [(table[p // block], p % block) for p in range(s_len)]
        for pos in range(s_len - q_len, s_len):
            visible = [p for p in range(s_len) if p <= limits[row] and (window == 0 or p > pos - window)]
            k = torch.stack([case.k_cache[keys[p]].double() for p in visible])  # [n, KVH, D]
            v = torch.stack([case.v_cache[keys[p]].double() for p in visible])
            for h in range(case.q.shape[1]):
                weights = torch.softmax(k[:, h // group] @ case.q[row, h].double() * case.scale, 0)
                out[row, h] = weights @ v[:, h // group]
            row += 1
    return out


@pytest.mark.parametrize("dtype,name,window", [(torch.float32, None, 0), (torch.float32, None, 7),
                                               (torch.float32, "small_tiles", 0), (torch.float32, "split3", 7),
                                               (torch.bfloat16, None, 7)], ids=str)
def test_key_limits_in_every_path_match_the_rule(window, name, dtype):
    case = make_paged_case(QUERY_LENS, SEQ_LENS, 6, 2, 64, dtype, block_size=16, seed=11 + window)
    limits = _limits()
    causal = paged_attention_ref(case.q.double(), case.k_cache.double(), case.v_cache.double(), case.meta, case.scale,
                                 window=window)
    case.meta.set_key_limits(limits, "cpu")
    expected = _dense_oracle(case, limits, window)
    reference = paged_attention_ref(case.q.double(), case.k_cache.double(), case.v_cache.double(), case.meta,
                                    case.scale, window=window)
    assert (reference - expected).abs().max().item() < 1e-12, "the paged reference follows the rule"
    image_rows = torch.tensor([lim != pos for lim, pos in zip(limits, _positions())])
    assert (expected[~image_rows] - causal[~image_rows]).abs().max().item() < 1e-12
    assert (expected[image_rows] - causal[image_rows]).abs().amin(-1).amax().item() > 1e-3, "limits change image rows"
    bound = attention_bound(case)
    with poisoned_allocations():
        out = triton_attention.paged_attention(case.q, case.k_cache, case.v_cache, case.meta, case.scale,
                                               config=CONFIGS[name], window=window)
    assert_close_to_reference(out, expected, dtype, bound)
    if name is None:  # the torch path has no launch shapes
        torch_path = paged_attention_torch(case.q, case.k_cache, case.v_cache, case.meta, case.scale, window=window)
        assert_close_to_reference(torch_path, expected, dtype, bound)


def _positions() -> list[int]:
    return [pos for q_len, s_len in zip(QUERY_LENS, SEQ_LENS) for pos in range(s_len - q_len, s_len)]


def test_set_key_limits_reaches_every_kv_cache_group():
    case = make_paged_case([3], [3], 2, 1, 16, torch.float32, block_size=4, seed=0)
    meta = case.meta
    other = make_paged_case([3], [3], 2, 1, 16, torch.float32, block_size=4, seed=1).meta
    meta.layer_metadata = [meta, other, meta]
    meta.cpu_plans["stale"] = object()
    meta.set_key_limits([2, 2, 2], "cpu")
    assert other.key_limits_host == meta.key_limits_host == [2, 2, 2] and not meta.cpu_plans
    assert other.key_limits.tolist() == [2, 2, 2]
