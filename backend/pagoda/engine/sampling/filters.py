"""Temperature, top-k, top-p and min-p for the random rows, and the exponential race.

All per-row parameters of one call travel to the logits' device in a single packed copy
(``RandomRows``); everything after that is batched tensor work on that device.

Filters work on *candidates*: each row's ``K`` largest scaled logits, in descending order
(``topk``, or a full sort when ``K`` is the vocabulary). ``K`` is chosen so that every
token a filter keeps is a candidate:

* rows with ``top_k`` keep at most ``top_k`` tokens, so ``K >= max(top_k)`` suffices;
* a row with ``top_p`` but no ``top_k`` can keep any number of tokens. On a device the
  candidates are then the whole vocabulary (a sort; deciding a smaller ``K`` would need
  a host round trip). On the CPU, where reading a value costs nothing, ``K`` is
  ``CPU_START_WIDTH``; a row whose candidates hold less than ``top_p`` of the mass (a
  flat distribution) races over the whole vocabulary instead, which picks the filtered
  race's token whenever the filters keep the winner (about ``top_p`` of the time), and
  is redone on the sorted vocabulary otherwise.

Within the candidates, with ``w = exp(logit - max)`` and ``cw = cumsum(w)``: top-k drops
positions ``>= top_k``; top-p normalises by ``Z = cw[top_k - 1]`` for top-k rows (the
top-k renormalised distribution) and by the full vocabulary's sum otherwise, and drops a
position when the mass before it, ``(cw - w) / Z``, is ``>= top_p`` (so the token that
crosses ``top_p`` is kept, and the first token always is); min-p drops
``logit < max + log(min_p)``. Ties at a boundary are broken by sort order. The prefix
sums at a position depend only on the tokens before it, so the outcome does not depend on
``K`` (on the CPU bit for bit; on a device as far as its scan kernel is prefix-stable).

The race: a token is chosen as ``argmax(w / E)`` with ``E ~ Exp(1)`` i.i.d. per token
from ``sampling.noise``, which picks token ``i`` with probability proportional to
``w[i]``. Noise is evaluated only at the candidates; as the noise at a column is a
function of (row key, column) alone, the choice equals the dense race over the whole
vocabulary (``race_dense``), which speculative decoding uses on the same weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from pagoda.engine.sampling.noise import exponential_noise

CPU_START_WIDTH = 64
_NEG_INF = float("-inf")


@dataclass
class RandomRows:
    """Per-row sampling parameters of random rows, on the logits' device.

    ``top_k`` is ``vocab_size`` where off, ``top_p`` 2.0 where off (a mass before any
    token is at most 1); the ``host_*`` lists are the same values, for decisions that
    must not read the device.
    """

    temperature: torch.Tensor  # [R] float32
    top_k: torch.Tensor  # [R] int64
    top_p: torch.Tensor  # [R] float32
    min_p: torch.Tensor  # [R] float32
    keys: torch.Tensor  # [R] int64 noise row keys
    host_top_k: list[int]
    host_top_p: list[float]
    host_min_p: list[float]

    @classmethod
    def build(cls, params: Sequence, keys: np.ndarray, vocab_size: int, device: torch.device) -> "RandomRows":
        """Pack ``params`` (one ``SamplingParams`` per row) and ``keys`` into one host
        tensor and copy it to ``device`` once."""
        return cls.upload(HostRandomRows.pack(params, vocab_size), keys, device)

    @classmethod
    def upload(cls, host: "HostRandomRows", keys: np.ndarray, device: torch.device) -> "RandomRows":
        """``host``'s parameters and ``keys`` in one copy to ``device``."""
        packed = torch.cat([host.packed, torch.from_numpy(keys.astype(np.float64))[None]])  # keys < 2**32: exact
        packed = packed.to(device, non_blocking=True)
        return cls(packed[0].float(), packed[1].long(), packed[2].float(), packed[3].float(), packed[4].long(),
                   host.top_k, host.top_p, host.min_p)

    def select(self, index: list[int]) -> "RandomRows":
        at = torch.tensor(index, dtype=torch.int64).to(self.keys.device, non_blocking=True)
        return RandomRows(self.temperature[at], self.top_k[at], self.top_p[at], self.min_p[at], self.keys[at],
                          [self.host_top_k[i] for i in index], [self.host_top_p[i] for i in index],
                          [self.host_min_p[i] for i in index])

    def needs_candidates(self, vocab_size: int) -> list[bool]:
        return [k < vocab_size or p < 1.0 for k, p in zip(self.host_top_k, self.host_top_p)]


@dataclass
class HostRandomRows:
    """``RandomRows``' parameters gathered on the host (no keys yet): ``packed`` is
    ``[4, R]`` float64 (temperature, top_k, top_p, min_p), the lists the same values."""

    packed: torch.Tensor
    top_k: list[int]
    top_p: list[float]
    min_p: list[float]

    @classmethod
    def pack(cls, params: Sequence, vocab_size: int) -> "HostRandomRows":
        top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
        top_p = [p.top_p if p.top_p < 1.0 else 2.0 for p in params]
        min_p = [p.min_p for p in params]
        packed = torch.tensor([[p.temperature for p in params], top_k, top_p, min_p], dtype=torch.float64)
        return cls(packed, top_k, top_p, min_p)


def _initial_width(rows: RandomRows, vocab_size: int, device: torch.device) -> int:
    top_k_only = [k for k, p in zip(rows.host_top_k, rows.host_top_p) if k < vocab_size]
    width = max(top_k_only, default=1)
    if any(p < 1.0 and k >= vocab_size for k, p in zip(rows.host_top_k, rows.host_top_p)):
        width = max(width, CPU_START_WIDTH) if device.type == "cpu" else vocab_size
    return min(width, vocab_size)


def _dense_width(rows: RandomRows, vocab_size: int) -> int:
    if any(p < 1.0 for p in rows.host_top_p):
        return vocab_size
    return min(max(k for k in rows.host_top_k), vocab_size)


def kept_candidates(scaled: torch.Tensor, rows: RandomRows, width: int):
    """Candidates and the filters' verdict at ``width`` (see the module docstring).

    Args:
        scaled: ``[R, V]`` temperature-scaled logits.
        rows: the rows' parameters.
        width: ``K``.

    Returns:
        ``(weights [R, K], ids [R, K], values [R, K], is_covered [R], dense)``: ``w`` with
        removed positions 0, the candidates' token ids, their logits with removed
        positions -inf, whether the row's kept set surely lies within the candidates, and
        ``(exp(scaled - max) [R, V], its row sums [R])`` when top-p needed them, else None.
    """
    vocab_size = scaled.shape[1]
    if width < vocab_size:
        values, ids = scaled.topk(width, dim=-1)  # [R, K] each, descending
    else:
        values, ids = scaled.sort(dim=-1, descending=True)
    top = values[:, :1]
    weights = (values - top).exp_()  # [R, K]; weights[:, 0] == 1
    removed = torch.arange(width, device=scaled.device)[None, :] >= rows.top_k[:, None]
    is_covered = rows.top_k <= width
    dense = None
    if any(p < 1.0 for p in rows.host_top_p):
        prefix = weights.cumsum(dim=-1)
        has_top_k = rows.top_k < vocab_size
        top_k_sum = prefix.gather(1, (rows.top_k.clamp(max=width) - 1)[:, None])[:, 0]
        dense_weights = (scaled - top).exp_()  # [R, V]
        full_sum = dense_weights.sum(dim=-1)  # the same at every width
        dense = (dense_weights, full_sum)
        total = torch.where(has_top_k, top_k_sum, full_sum)[:, None]
        removed |= (prefix - weights) / total >= rows.top_p[:, None]
        is_covered |= prefix[:, -1] / total[:, 0] >= rows.top_p
    if any(p > 0.0 for p in rows.host_min_p):
        removed |= values < top + rows.min_p.log()[:, None]  # log(0) = -inf removes nothing
    return weights.masked_fill_(removed, 0.0), ids, values.masked_fill(removed, _NEG_INF), is_covered, dense


def race_candidates(scaled: torch.Tensor, rows: RandomRows, width: int = 0) -> torch.Tensor:
    """One token per row through temperature-scaled logits ``scaled`` ``[R, V]``, filtered
    on ``width`` candidates (0: the initial width). Returns ``[R]`` int64 token ids."""
    vocab_size = scaled.shape[1]
    width = width or _initial_width(rows, vocab_size, scaled.device)
    weights, ids, _, is_covered, dense = kept_candidates(scaled, rows, width)
    noise = exponential_noise(rows.keys, vocab_size, ids)  # [R, K]
    tokens = ids.gather(1, (weights / noise).argmax(dim=-1, keepdim=True))[:, 0]
    if width < vocab_size and scaled.device.type == "cpu":
        redo = [i for i, covered in enumerate(is_covered.tolist()) if not covered]  # free on the CPU
        if redo:
            at = slice(None) if len(redo) == len(tokens) else redo  # a view when every row is redone
            tokens[redo] = _race_uncovered(scaled[at], rows.select(redo), dense[0][at], dense[1][at])
    return tokens


def _race_uncovered(scaled: torch.Tensor, rows: RandomRows, weights: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """CPU, top-p rows (no top-k) whose candidates hold less than ``top_p``: race over the
    whole vocabulary with the same draws. The filtered race's winner is this winner
    whenever the filters keep it (the kept set is a subset that contains it); rows whose
    winner is filtered out are redone on the fully sorted vocabulary.

    ``weights``/``total``: ``exp(scaled - max)`` ``[U, V]`` and its row sums, from
    ``kept_candidates``."""
    vocab_size = scaled.shape[1]
    noise = exponential_noise(rows.keys, vocab_size)  # [U, V]
    tokens = torch.div(weights, noise, out=noise).argmax(dim=-1)
    chosen = weights.gather(1, tokens[:, None])
    mass_before = weights.masked_fill(weights <= chosen, 0.0).sum(dim=-1) / total
    # min-p in kept_candidates' own terms: logit >= max + log(min_p), where w == 1 at the max.
    top = scaled.gather(1, weights.argmax(dim=-1, keepdim=True))[:, 0] if any(p > 0 for p in rows.host_min_p) else None
    is_kept = mass_before < rows.top_p
    if top is not None:
        is_kept &= scaled.gather(1, tokens[:, None])[:, 0] >= top + rows.min_p.log()
    redo = [i for i, kept in enumerate(is_kept.tolist()) if not kept]
    if redo:
        tokens[redo] = race_candidates(scaled[redo], rows.select(redo), vocab_size)
    return tokens


def filter_dense(scaled: torch.Tensor, rows: RandomRows) -> torch.Tensor:
    """``scaled`` ``[R, V]`` with every token a filter removes set to -inf (a new tensor)."""
    vocab_size = scaled.shape[1]
    if any(rows.needs_candidates(vocab_size)):
        _, ids, values, _, _ = kept_candidates(scaled, rows, _dense_width(rows, vocab_size))
        return torch.full_like(scaled, _NEG_INF).scatter_(1, ids, values)
    if any(p > 0.0 for p in rows.host_min_p):
        threshold = scaled.max(dim=-1, keepdim=True).values + rows.min_p.log()[:, None]
        return scaled.masked_fill(scaled < threshold, _NEG_INF)
    return scaled


def race_dense(filtered: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``argmax(exp(filtered - max) / E)`` per row over the whole vocabulary; ``[R]``."""
    weights = (filtered - filtered.max(dim=-1, keepdim=True).values).exp_()
    return (weights / exponential_noise(keys, filtered.shape[1])).argmax(dim=-1)
