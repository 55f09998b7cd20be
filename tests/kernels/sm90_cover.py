"""Which of the recorded sm_90 launch variants a test session compiles: a covering subset.

``sm90_compile.py`` records every launch the public wrappers make (each distinct one is a
*variant*: a kernel with its constexprs, argument types, divisibility hints, warps and
stages). Compiling all of them is ~25 CPU-minutes on the 2-core CI machine, most of it the
attention kernel's ~150 variants at 3-20 s each, more than the rest of the suite can spare
once it runs on both cores. So by default a session compiles a subset chosen to keep what
the check is for, and ``PAGODA_SM90_ALL=1`` compiles every variant:

* **every pair of parameter values** that occurs together among a kernel's recorded
  variants occurs together in one compiled variant (a pairwise covering array, built
  greedily from the recorded launches, so only combinations the wrappers really make are
  compiled). A compile failure caused by one parameter's value, or by the interaction of
  two (an fp8 cache with a split decode, sinks with a 128-row tile, a dtype with a number
  of stages), is caught; one that needs three specific values at once may not be;
* **each kernel's largest launch per dtype pair** (argument dtype, cache dtype): the one
  whose integer constexprs (tiles, head size, group) times its pipeline stages multiply to
  the most, so the shared-memory ceiling (227 KiB on an H100) is met by the launch most
  likely to exceed it.

A parameter here is a constexpr, the kernel's first pointer type (``dtype``), its cache type
(``cache``), ``num_warps`` or ``num_stages``; variants that differ only in their divisibility
hints add no pair and so are compiled once (the first recorded). Every variant is still
recorded and reported (the tests' coverage assertions read all of them: which dtypes, head
sizes, tiles and features the wrappers launch); only ``compiled`` ones carry compile results.
The choice is deterministic: the recorded order, ties to the first.
"""

from __future__ import annotations

import itertools
from typing import Sequence


def features(desc: dict, options: dict) -> tuple:
    """A variant's parameters as sorted ``(name, value)`` pairs (values as strings)."""
    return tuple(sorted((str(k), str(v)) for k, v in {**desc, **options}.items()))


def pairs(feats: tuple) -> set:
    """The pairs of parameter values in ``feats`` (the lone one of a one-parameter variant)."""
    return set(itertools.combinations(feats, 2)) if len(feats) > 1 else {feats}


def _size(desc: dict, options: dict) -> int:
    """How large a launch is: its integer constexprs times its stages (bools and dtypes ignored)."""
    size = int(options.get("num_stages", 1))
    for value in desc.values():
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            size *= value
    return size


def covering(variants: Sequence[tuple[str, dict, dict]]) -> list[int]:
    """The indices (ascending) of the variants to compile.

    Args:
        variants: ``(kernel name, desc, options)`` per recorded variant, in recorded order;
            ``desc`` holds the constexprs and the ``dtype`` / ``cache`` pointer types.

    Returns:
        Indices such that, per kernel, every pair of parameter values found in one of its
        variants is found in a chosen one, and each (dtype, cache) pair's largest variant is chosen.
    """
    by_kernel: dict[str, list[int]] = {}
    for i, (kernel, _, _) in enumerate(variants):
        by_kernel.setdefault(kernel, []).append(i)
    chosen: set[int] = set()
    for indices in by_kernel.values():
        feats = {i: features(variants[i][1], variants[i][2]) for i in indices}
        needed = set().union(*(pairs(feats[i]) for i in indices))
        largest: dict[tuple, int] = {}
        for i in indices:
            _, desc, options = variants[i]
            key = (str(desc.get("dtype")), str(desc.get("cache")))
            if key not in largest or _size(desc, options) > _size(*variants[largest[key]][1:]):
                largest[key] = i
        picked = set(largest.values())
        for i in picked:
            needed -= pairs(feats[i])
        while needed:
            best = max(indices, key=lambda i: (len(needed & pairs(feats[i])), -i))
            picked.add(best)
            needed -= pairs(feats[best])
        chosen |= picked
    return sorted(chosen)
