"""The raw logits a step's requests asked for (``engine.logits_output``: what they are, the bound,
who keeps them): the context rows of prompt chunks from the step's hidden states, and the sampled
rows of the step's logits before the sampler touches them.

Context rows: an input asking (``StepInput.context_logits``) whose chunk covers prompt positions
``[start, end)`` (``end`` at most the prompt's length; positions past it are outputs being
recomputed after a preemption and are generation rows already) gives the hidden rows of those
positions; they go through the LM head in slices of ``MAX_ROWS_PER_SLICE`` rows, cut to
``vocab_size`` columns, float32, and come to the host in one transfer per slice. A tensor-parallel
engine refuses context logits (``InputProcessor``): the workers would need the same LM-head calls.

Generation rows: the sampling rows of each asking input (``1 + len(spec_token_ids)``) copied to the
host before sampling; after sampling only the rows of the tokens it kept (accepted drafts and the
bonus token) are returned.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np
import torch

MAX_ROWS_PER_SLICE = 1024


@dataclass
class ContextRows:
    """Which hidden rows of a step are context logits, and of which request and positions."""

    request_ids: list[str] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)

    @classmethod
    def build(cls, inputs: Sequence, offsets: Sequence[int]) -> Optional["ContextRows"]:
        """The plan for ``inputs`` whose first token sits at hidden row ``offsets[i]``; None when none asks."""
        plan = None
        for item, offset in zip(inputs, offsets):
            if not item.context_logits:
                continue
            start = item.num_computed_tokens
            end = min(start + item.num_new_tokens, item.num_prompt_tokens)
            if end <= start:
                continue
            plan = plan or cls()
            plan.request_ids.append(item.request_id)
            plan.starts.append(start)
            plan.counts.append(end - start)
            plan.rows.extend(range(offset, offset + end - start))
        return plan

    def compute(self, model, hidden: torch.Tensor, vocab_size: int) -> dict[str, tuple[int, np.ndarray]]:
        """Request id -> (first prompt position, float32 rows ``[count, vocab_size]``)."""
        parts = []
        for begin in range(0, len(self.rows), MAX_ROWS_PER_SLICE):
            rows = torch.tensor(self.rows[begin:begin + MAX_ROWS_PER_SLICE], dtype=torch.int64, device=hidden.device)
            parts.append(model.compute_logits(hidden[rows])[:, :vocab_size].float().cpu().numpy())
        host = np.concatenate(parts)
        out, row = {}, 0
        for request_id, start, count in zip(self.request_ids, self.starts, self.counts):
            out[request_id] = (start, host[row:row + count])
            row += count
        return out


def copy_sampled_rows(logits: torch.Tensor, items: Sequence, vocab_size: int) -> dict[str, np.ndarray]:
    """Request id -> its sampling rows ``[1 + len(spec_token_ids), vocab_size]`` on the host, for the
    step's sampling ``ScheduledRequest`` items (in the logits' row order) that ask for generation
    logits; {} when none asks."""
    wanted, rows, row = [], [], 0
    for item in items:
        num_rows = 1 + len(item.spec_token_ids)
        if item.request.sampling_params.return_generation_logits:
            wanted.append((item.request_id, num_rows))
            rows.extend(range(row, row + num_rows))
        row += num_rows
    if not wanted:
        return {}
    index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    host = logits[index][:, :vocab_size].float().cpu().numpy()
    out, row = {}, 0
    for request_id, num_rows in wanted:
        out[request_id] = host[row:row + num_rows]
        row += num_rows
    return out


def kept_rows(copied: dict[str, np.ndarray], output) -> dict[str, np.ndarray]:
    """The copied rows of the tokens the step kept per request (``output``: its ``ModelRunnerOutput``)."""
    if not copied:
        return {}
    kept = output.tokens_by_id()
    # Copies: a view would keep the whole step's host array (every asking request's rows) alive for
    # as long as any one request keeps its rows (a non-streaming request: until it finishes).
    return {request_id: rows[:len(kept.get(request_id, ()))].copy() for request_id, rows in copied.items()}
