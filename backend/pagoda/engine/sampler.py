"""The batched sampler: one step's logits for every running row in, one token per row out.

Pipeline, vectorized over the batch (per-row parameters become ``[N]`` tensors once per
call; a stage that no row needs is skipped, and a row that does not need a stage gets
its neutral value, which leaves its logits bit-for-bit unchanged):

1. Padding columns are cut off: the model's logits may be wider than the tokenizer's
   vocabulary (``vocab_size``); those columns never take part in anything below, so
   they can never be sampled and do not dilute the logprobs.
2. min_tokens: while a row has fewer than ``params.min_tokens`` output tokens, the ids in
   ``row.min_tokens_blocked_ids`` (eos and stop token ids, chosen by the engine) are -inf.
3. Repetition penalty over prompt + output tokens (HF/vLLM semantics): a seen token's
   positive logit is divided by the penalty, a negative one multiplied.
4. Presence/frequency penalties over output tokens (OpenAI/vLLM semantics):
   ``logit -= frequency_penalty * count + presence_penalty * (count > 0)``.
4b. Grammar (structured output): rows with a ``TokenBitmask`` entry get every token their
   grammar forbids set to -inf (``pagoda.engine.guided.bitmask``); skipped when ``None``.
5. Greedy rows (``params.is_greedy``) take the argmax of these logits and stop here.
6. Temperature, then top-k, then top-p (on the top-k renormalized distribution; the
   token that crosses ``top_p`` is kept, so at least one token always is), then min-p
   (drop tokens whose probability is below ``min_p`` times the most likely one's).
   top-k keeps exactly ``k`` tokens; ties at the boundary are broken by sort order.
7. Sampling by exponential race: ``argmax(probs / E)`` with ``E ~ Exp(1)`` i.i.d. per
   token, which picks token ``i`` with probability ``probs[i]``. Every random row uses
   exactly ``vocab_size`` noise draws per step. A row with its own generator (a seeded
   request) draws them from it, so its samples depend only on its seed and its own
   logits, never on which other rows share the batch or where it sits. Unseeded rows
   draw from the sampler's generator in one batched call.

Logprobs follow vLLM's default "raw" mode: they are ``log_softmax`` of the model's
logits over the real vocabulary, before penalties, temperature and filters, so they
describe the model rather than the sampling settings. ``rank`` is 1 + the number of
tokens with a strictly larger logprob.

This is the reference implementation: token lists are turned into index tensors every
step, which is fine for CPU tests and modest batches; a GPU engine would keep
persistent per-row tensors instead.
"""

from __future__ import annotations

import hashlib
import itertools
import struct
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from pagoda.engine.guided.bitmask import TokenBitmask, apply_token_bitmask
from pagoda.engine.sampling_params import SamplingParams

# Smallest positive float32; clamps Exp(1) noise away from 0 so probs / noise is finite.
_TINY = torch.finfo(torch.float32).tiny


@dataclass
class SamplingRow:
    """Everything the sampler needs to know about one request row in this step.

    Attributes:
        params: the request's sampling parameters.
        generator: the request's own RNG when ``params.seed`` is set (see
            ``make_generator``); created once per request and kept across steps.
            ``None`` means the row draws from the sampler's shared generator.
        prompt_token_ids: the prompt, for the repetition penalty.
        output_token_ids: tokens generated so far, for all penalties and min_tokens.
        min_tokens_blocked_ids: ids masked while ``len(output_token_ids) <
            params.min_tokens`` (eos ids + stop_token_ids; the engine decides).
    """

    params: SamplingParams
    generator: Optional[torch.Generator] = None
    prompt_token_ids: Sequence[int] = field(default_factory=list)
    output_token_ids: Sequence[int] = field(default_factory=list)
    min_tokens_blocked_ids: frozenset[int] = frozenset()


@dataclass(frozen=True)
class TokenLogprobs:
    """Logprob information for one sampled token (raw model distribution).

    Attributes:
        token_id: the sampled token.
        logprob: its log-probability under ``log_softmax(raw logits)``.
        rank: 1 + the number of tokens with a strictly larger logprob.
        top: the ``params.logprobs`` most likely ``(token_id, logprob)``, best first.
    """

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]


@dataclass
class SamplerOutput:
    """One step's result: ``token_ids[i]`` and ``logprobs[i]`` belong to ``rows[i]``;
    ``logprobs[i]`` is ``None`` when the row did not ask for logprobs."""

    token_ids: list[int]
    logprobs: list[Optional[TokenLogprobs]]


def make_generator(seed: Optional[int], index: int = 0) -> Optional[torch.Generator]:
    """Build the generator for child ``index`` of a seeded request (``n > 1``).

    Child 0 is seeded with ``seed`` itself, so an ``n == 1`` request behaves as
    ``torch.Generator().manual_seed(seed)``. Other children get a seed derived as the
    first 8 bytes (little-endian) of ``SHA-256(b"pagoda-sampler-child-v1" ||
    u64le(seed) || u32le(index))``: deterministic across processes (no ``hash()``) and
    different for every index.

    Args:
        seed: the request's seed, or ``None`` for an unseeded request.
        index: which of the request's ``n`` children.

    Returns:
        A CPU ``torch.Generator``, or ``None`` when ``seed`` is ``None``.
    """
    if seed is None:
        return None
    if index == 0:
        child_seed = seed
    else:
        digest = hashlib.sha256(b"pagoda-sampler-child-v1" + struct.pack("<QI", seed, index)).digest()
        child_seed = int.from_bytes(digest[:8], "little")
    return torch.Generator().manual_seed(child_seed)


class Sampler:
    """Samples one token per row from a batch of logits. See the module docstring.

    Args:
        vocab_size: the tokenizer's vocabulary size; logits columns at or past it are
            padding and are never sampled.
        seed: seed of the shared generator used by unseeded rows.
        device: device of the shared generator. Noise is drawn where the generator
            lives and moved to the logits' device, so seeded rows (CPU generators)
            give the same samples whatever device the logits are on.
    """

    def __init__(self, vocab_size: int, seed: int = 0, device: str | torch.device = "cpu") -> None:
        if vocab_size <= 0:
            raise ValueError(f"vocab_size: must be > 0, got {vocab_size}")
        self.vocab_size = vocab_size
        self._generator = torch.Generator(device=device).manual_seed(seed)

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow],
                 token_bitmask: Optional[TokenBitmask] = None) -> SamplerOutput:
        """Sample one token for each row.

        Args:
            logits: ``[num_rows, >= vocab_size]`` float logits; not modified.
            rows: one ``SamplingRow`` per logits row, in the same order.
            token_bitmask: allowed tokens of the rows that follow a grammar, or ``None``.

        Returns:
            ``SamplerOutput`` with one token id (and optional logprobs) per row.
        """
        raw_logits = self._cut_padding(logits, rows)  # [N, V]
        processed = self.process_logits(raw_logits, rows, token_bitmask)  # [N, V]
        token_ids = processed.argmax(dim=-1)  # [N]; final for greedy rows
        random_rows = [i for i, row in enumerate(rows) if not row.params.is_greedy]
        if random_rows:
            index = torch.tensor(random_rows, device=logits.device)
            sampled = self._sample(processed[index], [rows[i] for i in random_rows])
            token_ids[index] = sampled
        return SamplerOutput(
            token_ids=token_ids.tolist(),
            logprobs=_compute_logprobs(raw_logits, rows, token_ids),
        )

    def process_logits(self, logits: torch.Tensor, rows: Sequence[SamplingRow],
                       token_bitmask: Optional[TokenBitmask] = None) -> torch.Tensor:
        """Apply min_tokens masking, the penalties and the grammar (stages 2-4b); greedy
        rows take the argmax of the result.

        Args:
            logits: ``[num_rows, vocab_size]`` logits; not modified.
            rows: one ``SamplingRow`` per logits row.
            token_bitmask: allowed tokens of the rows that follow a grammar, or ``None``.

        Returns:
            A new ``[num_rows, vocab_size]`` float32 tensor.
        """
        logits = logits[:, : self.vocab_size].to(torch.float32, copy=True)
        _apply_min_tokens(logits, rows)
        logits = _apply_repetition_penalty(logits, rows)
        logits = _apply_presence_frequency_penalties(logits, rows)
        if token_bitmask is not None:
            apply_token_bitmask(logits, token_bitmask)
        return logits

    def _cut_padding(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits: expected shape [{len(rows)}, vocab], got {list(logits.shape)}")
        if logits.shape[1] < self.vocab_size:
            raise ValueError(f"logits: {logits.shape[1]} columns, fewer than vocab_size={self.vocab_size}")
        return logits[:, : self.vocab_size].float()

    def _sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """Stages 6-7 for non-greedy rows: temperature, filters, exponential race."""
        probs = self.sample_probs(logits, rows)  # [R, V]
        noise = self.draw_noise(rows, logits.device)  # [R, V]
        return (probs / noise).argmax(dim=-1)

    def sample_probs(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """Stage 6 for non-greedy rows: the distribution each row samples from.

        Args:
            logits: ``[R, vocab_size]`` output of ``process_logits``; not modified.
            rows: one non-greedy ``SamplingRow`` per logits row.
        Returns:
            ``[R, vocab_size]`` probabilities after temperature, top-k, top-p and min-p.
        """
        temperature = torch.tensor([row.params.temperature for row in rows], device=logits.device)
        logits = logits / temperature[:, None]
        logits = _apply_top_k_top_p(logits, rows)
        logits = _apply_min_p(logits, rows)
        return logits.softmax(dim=-1)

    def compute_logprobs(
        self, logits: torch.Tensor, rows: Sequence[SamplingRow], token_ids: torch.Tensor
    ) -> list[Optional[TokenLogprobs]]:
        """Raw-mode logprobs of ``token_ids`` (one per row) for rows that ask for them.

        Args:
            logits: ``[R, >= vocab_size]`` model logits (padding columns are cut off).
            rows: one ``SamplingRow`` per logits row.
            token_ids: ``[R]`` the token chosen at each row.
        """
        return _compute_logprobs(self._cut_padding(logits, rows), rows, token_ids)

    def draw_noise(self, rows: Sequence[SamplingRow], device: torch.device) -> torch.Tensor:
        """Exp(1) noise, exactly ``vocab_size`` draws per row from the row's generator."""
        vocab_size = self.vocab_size
        noise = torch.empty(len(rows), vocab_size, device=device)
        shared_rows = [i for i, row in enumerate(rows) if row.generator is None]
        for i, row in enumerate(rows):
            if row.generator is not None:
                own = torch.empty(vocab_size, device=row.generator.device)
                noise[i] = own.exponential_(generator=row.generator).to(device)
        if shared_rows:
            shared = torch.empty(len(shared_rows), vocab_size, device=self._generator.device)
            shared.exponential_(generator=self._generator)
            noise[torch.tensor(shared_rows, device=device)] = shared.to(device)
        return noise.clamp_min_(_TINY)


def _flat_indices(token_lists: Sequence[Sequence[int]], row_ids: Sequence[int], device: torch.device):
    """``(row_index, token_id)`` pairs for scattering per-row token lists into ``[N, V]``."""
    counts = torch.tensor([len(tokens) for tokens in token_lists], device=device)
    row_index = torch.repeat_interleave(torch.tensor(list(row_ids), device=device), counts)
    token_index = torch.tensor(list(itertools.chain.from_iterable(token_lists)), dtype=torch.long, device=device)
    return row_index, token_index


def _apply_min_tokens(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    vocab_size = logits.shape[1]
    blocked_rows, blocked_lists = [], []
    for i, row in enumerate(rows):
        if row.min_tokens_blocked_ids and len(row.output_token_ids) < row.params.min_tokens:
            blocked_rows.append(i)
            # An id outside the vocabulary can never be sampled anyway.
            blocked_lists.append(sorted(t for t in row.min_tokens_blocked_ids if 0 <= t < vocab_size))
    if blocked_rows:
        row_index, token_index = _flat_indices(blocked_lists, blocked_rows, logits.device)
        logits[row_index, token_index] = float("-inf")


def _apply_repetition_penalty(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    penalized_rows = [i for i, row in enumerate(rows) if row.params.repetition_penalty != 1.0]
    if not penalized_rows:
        return logits
    seen_lists = [list(rows[i].prompt_token_ids) + list(rows[i].output_token_ids) for i in penalized_rows]
    row_index, token_index = _flat_indices(seen_lists, penalized_rows, logits.device)
    _check_token_ids(token_index, logits.shape[1])
    is_seen = torch.zeros_like(logits, dtype=torch.bool)  # [N, V]
    is_seen[row_index, token_index] = True
    penalty = torch.tensor([row.params.repetition_penalty for row in rows], device=logits.device)[:, None]
    penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(is_seen, penalized, logits)


def _apply_presence_frequency_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    penalized_rows = [
        i for i, row in enumerate(rows) if row.params.presence_penalty != 0.0 or row.params.frequency_penalty != 0.0
    ]
    if not penalized_rows:
        return logits
    device = logits.device
    row_index, token_index = _flat_indices([rows[i].output_token_ids for i in penalized_rows], penalized_rows, device)
    _check_token_ids(token_index, logits.shape[1])
    counts = torch.zeros_like(logits)  # [N, V]
    counts.index_put_((row_index, token_index), torch.ones_like(token_index, dtype=counts.dtype), accumulate=True)
    presence = torch.tensor([row.params.presence_penalty for row in rows], device=device)[:, None]
    frequency = torch.tensor([row.params.frequency_penalty for row in rows], device=device)[:, None]
    return logits - frequency * counts - presence * (counts > 0).to(logits.dtype)


def _check_token_ids(token_index: torch.Tensor, vocab_size: int) -> None:
    if token_index.numel():
        assert 0 <= int(token_index.min()) and int(token_index.max()) < vocab_size, (
            f"token ids must lie in [0, {vocab_size}), got {int(token_index.min())}..{int(token_index.max())}"
        )


def _apply_top_k_top_p(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Top-k then top-p, both decided in one descending sort."""
    vocab_size = logits.shape[1]
    needs_top_k = any(0 < row.params.top_k < vocab_size for row in rows)
    needs_top_p = any(row.params.top_p < 1.0 for row in rows)
    if not (needs_top_k or needs_top_p):
        return logits
    device = logits.device
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)  # [R, V] each
    top_k = torch.tensor([row.params.top_k or vocab_size for row in rows], device=device)
    position = torch.arange(vocab_size, device=device)
    is_removed = position[None, :] >= top_k[:, None]  # [R, V], sorted order
    if needs_top_p:
        # 2.0 never triggers: the mass before any token is at most 1.
        top_p = torch.tensor([row.params.top_p if row.params.top_p < 1.0 else 2.0 for row in rows], device=device)
        sorted_probs = sorted_logits.masked_fill(is_removed, float("-inf")).softmax(dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        is_removed |= mass_before >= top_p[:, None]
    is_removed = torch.zeros_like(is_removed).scatter_(1, sorted_ids, is_removed)
    return logits.masked_fill(is_removed, float("-inf"))


def _apply_min_p(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Drop tokens with ``p < min_p * p_max``, compared in log space: the softmax
    normalizer cancels, so ``logit < max_logit + log(min_p)``."""
    if not any(row.params.min_p > 0.0 for row in rows):
        return logits
    min_p = torch.tensor([row.params.min_p for row in rows], device=logits.device)
    threshold = logits.max(dim=-1, keepdim=True).values + min_p.log()[:, None]  # log(0) = -inf keeps all
    return logits.masked_fill(logits < threshold, float("-inf"))


def _compute_logprobs(
    raw_logits: torch.Tensor, rows: Sequence[SamplingRow], token_ids: torch.Tensor
) -> list[Optional[TokenLogprobs]]:
    """Raw-mode logprobs (see module docstring) for rows with ``params.logprobs`` set."""
    result: list[Optional[TokenLogprobs]] = [None] * len(rows)
    wanted = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    if not wanted:
        return result
    index = torch.tensor(wanted, device=raw_logits.device)
    logprobs = torch.log_softmax(raw_logits[index], dim=-1)  # [M, V]
    chosen = token_ids[index]
    chosen_logprobs = logprobs.gather(1, chosen[:, None])  # [M, 1]
    ranks = (logprobs > chosen_logprobs).sum(dim=-1) + 1
    num_top = min(max(rows[i].params.logprobs for i in wanted), logprobs.shape[1])
    top_values, top_ids = logprobs.topk(num_top, dim=-1)  # [M, num_top] each
    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    chosen, chosen_logprobs, ranks = chosen.tolist(), chosen_logprobs[:, 0].tolist(), ranks.tolist()
    for j, i in enumerate(wanted):
        num_wanted = rows[i].params.logprobs
        result[i] = TokenLogprobs(
            token_id=chosen[j],
            logprob=chosen_logprobs[j],
            rank=ranks[j],
            top=list(zip(top_ids[j][:num_wanted], top_values[j][:num_wanted])),
        )
    return result
