"""One schedule of mixed steps for the model-vs-transformers tests: three sequences ``a``, ``b``,
``c`` (10, 9 and 6 tokens) through five steps that put a first chunk beside a decode, a chunk
beside a decode and a one-token prompt, and end with three decodes."""

from typing import Callable

from pagoda.models.testing import StepInput, run_step
from tests.numerics import assert_within


def check_mixed_steps(model, caches, piece: Callable[[str, int, int], StepInput], refs: dict, tables: dict,
                      block_size: int, bound: float) -> None:
    """Run the schedule (``piece(name, start, end)`` makes a sequence's step input) and check each
    step's rows against ``refs[name]`` (the reference logits by position) within ``bound``."""
    steps = [[piece("a", 0, 6)],
             [piece("a", 6, 7), piece("b", 0, 3)],  # a decode beside a first chunk
             [piece("b", 3, 7), piece("a", 7, 8), piece("c", 0, 1)],  # a chunk, a decode, a one-token prompt
             [piece("c", 1, 5), piece("a", 8, 9), piece("b", 7, 8)],
             [piece("b", 8, 9), piece("c", 5, 6), piece("a", 9, 10)]]  # three decodes
    for number, step in enumerate(steps):
        out = run_step(model, caches, step, block_size)
        row = 0
        for s in step:
            name = next(n for n, t in tables.items() if t is s.block_table)
            n = len(s.token_ids)
            expected = refs[name][s.num_computed_tokens:s.num_computed_tokens + n]
            assert_within(out[row:row + n], expected, bound, f"step {number}: {name}")
            row += n
