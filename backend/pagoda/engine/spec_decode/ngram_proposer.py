"""Prompt-lookup (n-gram) proposer: continue the text the way it continued before.

For each request, the longest suffix n-gram (``max_n`` down to ``min_n`` tokens) of its
tokens that also occurs earlier in them (prompt or output) is located, the most recent
earlier occurrence wins, and the tokens that followed it are proposed, up to the window.
No model runs; the proposals are deterministic, so ``q`` is one-hot (``Draft.probs`` is
``None``). Pays off on inputs that get copied: code edits, retrieval-augmented answers,
summaries, structured output.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch

from pagoda.engine.spec_decode.draft import Draft, DraftRequest


def find_continuation(token_ids: list[int], num_tokens: int, max_n: int = 4, min_n: int = 1) -> list[int]:
    """Up to ``num_tokens`` tokens that followed the latest earlier occurrence of the
    longest matching suffix n-gram; ``[]`` when no suffix of ``min_n`` tokens recurs."""
    length = len(token_ids)
    if length < 2 or num_tokens <= 0:
        return []
    tokens = torch.tensor(token_ids, dtype=torch.int64)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        windows = tokens[: length - 1].unfold(0, n, 1)  # [length - n, n]: n-grams that have a successor
        hits = (windows == tokens[length - n :]).all(dim=1).nonzero()
        if hits.numel():
            start = int(hits[-1]) + n
            return token_ids[start : start + num_tokens]
    return []


class NgramProposer:
    """Args:
    max_n: longest suffix n-gram looked up.
    min_n: shortest one.
    """

    draft_cost = 0.0  # relative to a target pass (for the adaptive window)

    def __init__(self, max_n: int = 4, min_n: int = 1) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes: need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.max_n = max_n
        self.min_n = min_n

    def propose(self, batch: list[DraftRequest]) -> dict[str, Draft]:
        """Drafts for the requests that have a match (others are left out)."""
        drafts = {}
        for item in batch:
            tokens = find_continuation(item.request.all_token_ids, item.num_tokens, self.max_n, self.min_n)
            if tokens:
                drafts[item.request.request_id] = Draft(tokens)
        return drafts

    def release(self, request_ids: Iterable[str]) -> None:
        """No per-request state."""

    @property
    def num_free_blocks(self) -> Optional[int]:
        return None
