"""The grammar's logits stage: forbid, on the logits' device, what the grammar forbids.

``TokenBitmask`` is one step's host-side result of the matchers (``manager.py``): the
batch rows that have a grammar and, for each, a packed ``int32`` bitmask (layout in
``backend.py``). ``apply_token_bitmask`` copies it to the logits' device (non-blocking
from pinned memory on a GPU), unpacks it with one shift-and-mask and sets every forbidden
logit of those rows to ``-inf`` with one ``masked_fill_`` (gathered rows, scattered back).
Rows without a grammar are untouched, and a batch without any grammar never builds a
``TokenBitmask``. The sampler calls it through its last logits processor
(``GrammarBitmaskProcessor``, reading ``SamplingBatch.token_bitmask``), so it works for
greedy and sampled rows alike: it runs before argmax, temperature and filters.
This module imports only torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TokenBitmask:
    """Attributes:
    rows: ``[M]`` int64, which rows of the sampler's batch have a grammar.
    bits: ``[M, ceil(vocab / 32)]`` int32, packed allowed-token bits per such row.
    """

    rows: torch.Tensor
    bits: torch.Tensor

    def select(self, batch_rows: list[int]) -> "TokenBitmask | None":
        """The mask for a sub-batch made of ``batch_rows`` (in that order), renumbered to
        positions in the sub-batch; ``None`` when none of them has a grammar."""
        position = {row: i for i, row in enumerate(batch_rows)}
        keep = [(j, position[r]) for j, r in enumerate(self.rows.tolist()) if r in position]
        if not keep:
            return None
        return TokenBitmask(rows=torch.tensor([p for _, p in keep], dtype=torch.long),
                            bits=self.bits[[j for j, _ in keep]])


def apply_token_bitmask(logits: torch.Tensor, bitmask: TokenBitmask) -> None:
    """Set forbidden logits to ``-inf`` in place.

    Args:
        logits: ``[N, V]`` float logits on any device.
        bitmask: rows (indices into ``N``) and packed bits covering at least ``V`` tokens.
    """
    device = logits.device
    vocab_size = logits.shape[1]
    bits = bitmask.bits.to(device, non_blocking=True)  # [M, W]
    rows = bitmask.rows.to(device, non_blocking=True)  # [M]
    assert bits.shape[1] * 32 >= vocab_size, f"bitmask covers {bits.shape[1] * 32} tokens, logits have {vocab_size}"
    shifts = torch.arange(32, device=device, dtype=torch.int32)
    # Work on the M grammar rows only, so the cost follows them, not the batch.
    bit = ((bits[:, :, None] >> shifts) & 1).reshape(bits.shape[0], -1)[:, :vocab_size]  # [M, V]
    logits[rows] = logits[rows].masked_fill_(bit == 0, float("-inf"))
