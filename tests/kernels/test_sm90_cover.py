"""The covering subset of sm_90 launch variants (tests/kernels/sm90_cover.py), on made-up variants."""

from __future__ import annotations

import itertools

from tests.kernels.sm90_cover import covering, features, pairs


def _pairs(variant) -> set:
    return pairs(features(variant[1], variant[2]))


def _grid() -> list[tuple[str, dict, dict]]:
    """A kernel launched over a full 3 x 3 x 2 x 2 grid (36 variants), and a one-variant kernel."""
    variants = []
    for dtype, block, split, stages in itertools.product(("*fp16", "*bf16", "*fp32"), (16, 32, 64),
                                                          (True, False), (2, 3)):
        variants.append(("attn", {"dtype": dtype, "cache": dtype, "BLOCK": block, "IS_SPLIT": split},
                         {"num_warps": 4, "num_stages": stages}))
    return variants + [("norm", {"dtype": "*bf16", "cache": "", "BLOCK": 1024}, {"num_warps": 4})]


def test_every_pair_of_values_is_compiled_together_and_far_fewer_variants():
    variants = _grid()
    chosen = covering(variants)
    for kernel in ("attn", "norm"):
        everything = set().union(*(_pairs(v) for v in variants if v[0] == kernel))
        compiled = set().union(*(_pairs(variants[i]) for i in chosen if variants[i][0] == kernel))
        assert compiled == everything, kernel
    assert len([i for i in chosen if variants[i][0] == "attn"]) <= 12  # of 36: a 3 x 3 pair needs 9 at least
    assert variants[-1] in [variants[i] for i in chosen]  # a lone variant is compiled


def test_the_largest_launch_of_each_dtype_is_compiled():
    variants = _grid()
    chosen = {i for i in covering(variants)}
    for dtype in ("*fp16", "*bf16", "*fp32"):
        largest = [i for i, v in enumerate(variants)
                   if v[1]["dtype"] == dtype and v[1]["BLOCK"] == 64 and v[2]["num_stages"] == 3]
        assert chosen & set(largest), dtype  # 64 x 3 stages (either split: equal size, the first)


def test_variants_differing_only_in_their_hints_are_compiled_once_and_the_choice_is_stable():
    one = ("attn", {"dtype": "*bf16", "cache": "*bf16", "BLOCK": 16}, {"num_stages": 2})
    assert covering([one, one, one]) == [0]  # the same parameters (divisibility hints differ): the first
    assert covering(_grid()) == covering(_grid())
