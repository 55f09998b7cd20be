"""Prompt log-probabilities (``SamplingParams.prompt_logprobs``), computed from a step's forward.

A request that asks gets, for each prompt position ``q >= 1``, the log-probability of its
actual prompt token ``prompt[q]`` given ``prompt[:q]``: it comes from the hidden state at
position ``q - 1``, so a prompt chunk covering positions ``[start, end)`` yields the entries
of positions ``start + 1 .. min(end, num_prompt_tokens - 1)`` (the last needs the next
chunk's first token, which the request's prompt holds). Chunks are computed one step at
a time and the engine core writes each step's entries into ``Request.prompt_logprobs``;
position 0 has no entry (``None``, as vLLM).

Numerics: the model's logits of those rows, cast to float32, padding columns cut off
(``vocab_size``), then ``log_softmax`` in float32 (the raw model's distribution, as the
sampler's ``logprobs``; no processors, no temperature). ``rank`` is 1 + the number of tokens
with a strictly larger log-probability. Rows go through the LM head in slices of at most
``MAX_ROWS_PER_SLICE`` to bound the ``[rows, vocab]`` float32 temporaries; all slices come
back to the host in one transfer.

Cost: a step whose requests do not ask builds no plan (``PromptRows.build`` returns None)
and runs nothing here; the forward keeps only the sampling rows' logits, as before.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from pagoda.engine.sampling.row import TokenLogprobs

MAX_ROWS_PER_SLICE = 1024


@dataclass
class PromptRows:
    """Which hidden rows of a step give prompt log-probabilities, and of which tokens."""

    request_ids: list[str] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)  # per request: the prompt position of its first entry
    counts: list[int] = field(default_factory=list)  # per request: its number of entries
    num_top: list[int] = field(default_factory=list)  # per request: alternatives asked for
    rows: list[int] = field(default_factory=list)  # hidden rows, in request order
    targets: list[int] = field(default_factory=list)  # the prompt token each row scores

    @classmethod
    def build(cls, inputs: Sequence, offsets: Sequence[int]) -> Optional["PromptRows"]:
        """The plan for a step's ``StepInput``s whose first token sits at hidden row
        ``offsets[i]``; None when no input asks (nothing to compute)."""
        plan = None
        for item, offset in zip(inputs, offsets):
            if item.prompt_logprobs is None:
                continue
            prompt = item.prompt_token_ids
            start, end = item.num_computed_tokens, min(item.num_computed_tokens + item.num_new_tokens,
                                                       len(prompt) - 1)
            if end <= start:
                continue  # the chunk has no prompt position with a next prompt token
            plan = plan or cls()
            plan.request_ids.append(item.request_id)
            plan.starts.append(start + 1)
            plan.counts.append(end - start)
            plan.num_top.append(item.prompt_logprobs)
            plan.rows.extend(range(offset, offset + end - start))
            plan.targets.extend(prompt[start + 1:end + 1])
        return plan

    def run_head_only(self, model, hidden: torch.Tensor) -> None:
        """A tensor-parallel worker's part of ``compute``: the same LM-head calls (each is a
        gather to rank 0), nothing kept."""
        for begin in range(0, len(self.rows), MAX_ROWS_PER_SLICE):
            rows = torch.tensor(self.rows[begin:begin + MAX_ROWS_PER_SLICE], dtype=torch.int64, device=hidden.device)
            model.compute_logits(hidden[rows])

    def compute(self, model, hidden: torch.Tensor, vocab_size: int) -> dict[str, tuple[int, list[TokenLogprobs]]]:
        """Request id -> (first position, entries), from the step's hidden states
        ``[num_tokens, hidden]`` and ``model.compute_logits``; one device-to-host transfer."""
        device = hidden.device
        width = max(self.num_top)
        parts = []
        for begin in range(0, len(self.rows), MAX_ROWS_PER_SLICE):
            rows = torch.tensor(self.rows[begin:begin + MAX_ROWS_PER_SLICE], dtype=torch.int64, device=device)
            targets = torch.tensor(self.targets[begin:begin + MAX_ROWS_PER_SLICE], dtype=torch.int64, device=device)
            logits = model.compute_logits(hidden[rows])[:, :vocab_size].float()  # [R, V]
            logprobs = torch.log_softmax(logits, dim=-1)
            chosen = logprobs.gather(1, targets[:, None])  # [R, 1]
            ranks = (logprobs > chosen).sum(dim=-1, keepdim=True)
            top_values, top_ids = logprobs.topk(width, dim=-1)  # [R, width] each (width may be 0)
            parts.append(torch.cat([chosen.double(), ranks.double() + 1, top_ids.double(), top_values.double()], 1))
        host = torch.cat(parts).tolist()
        out: dict[str, tuple[int, list[TokenLogprobs]]] = {}
        row = 0
        for request_id, start, count, num_top in zip(self.request_ids, self.starts, self.counts, self.num_top):
            entries = []
            for j in range(count):
                values = host[row + j]
                top = [(int(t), lp) for t, lp in zip(values[2:2 + num_top], values[2 + width:2 + width + num_top])]
                entries.append(TokenLogprobs(self.targets[row + j], values[0], int(values[1]), top))
            out[request_id] = (start, entries)
            row += count
        return out
