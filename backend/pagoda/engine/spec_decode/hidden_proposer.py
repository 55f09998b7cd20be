"""Drafts from the target's own hidden states: the proposer behind EAGLE-3 and MTP heads.

A head (``eagle3.Eagle3Head``, ``mtp.MtpHead``) is one decoder layer that, at position
``p``, reads the target's hidden state(s) at ``p`` and the embedding of token ``p + 1``,
and predicts token ``p + 2``. It keeps its own paged KV cache (one layer; its own
``BlockPool`` without prefix caching, as many blocks as the target's, paid for by the
same memory budget).

Two moments per engine step:

1. ``observe(entries, hidden)``, right after the target's step was sampled/verified
   (``ModelRunner.execute`` through ``Speculator.observe_target``): for each speculating
   request the positions whose input was right (a prefill chunk's tokens; a decode's
   token and its accepted drafts) and the tokens that followed them are known, so one
   batched head pass computes their head KV from the target's hidden states of this very
   step, which stay on the device (``head.target_features``: EAGLE-3's three auxiliary
   states, MTP's final state). Its output at the last position (normed and pre-norm) is
   kept: it gives the first draft token. Positions a rejected draft occupied are
   overwritten by the next ``observe`` (``num_computed`` is set back to the step's start
   first). No target hidden state outlives its step.
2. ``propose(batch)``, before the next schedule: draft token 1 is sampled from the kept
   output; tokens 2..k come from ``k - 1`` single-token head passes that feed back the
   head's own pre-norm output (scratch KV past ``num_computed``). Sampling is the draft
   model's (``draft_model_proposer.sample_draft_tokens``): greedy argmax, seeded noise
   peeked from the target's sampler, unseeded ``q`` handed to rejection sampling.

A request whose first computed position is not 0 (a prefix-cache hit: the target never
computed the cached positions, so their hidden states do not exist) starts its head cache
at that position: ``offset`` shifts cache slots (``position - offset``) while rotary
embeddings use the true positions; the head just sees less context. The same happens when
its head state had to be evicted (blocks ran out) or it was preempted and recomputed.
Verification is exact whatever the head proposes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from pagoda.engine.kv.block_pool import KVCacheBlock
from pagoda.engine.sampling.sampler import Sampler
from pagoda.engine.spec_decode.draft import Draft, DraftRequest, VerifyMode
from pagoda.engine.spec_decode.draft_model_proposer import (PagedDraftCache, matmul_params, peek_noise,
                                                           sample_draft_tokens)
from pagoda.kernels import AttentionMetadata
from pagoda.models.llama import LlamaForCausalLM


@dataclass
class HeadEntry:
    """One request's verified positions in a target step: ``start .. start + len(next_token_ids) - 1``,
    their hidden states at rows ``row ..`` of the step, and the token after each position."""

    request_id: str
    start: int
    row: int
    next_token_ids: list[int]


@dataclass
class _HeadSeq:
    """The head's state for one request."""

    offset: int  # the position cache slot 0 holds
    num_computed: int  # positions [offset, num_computed) hold head KV from verified inputs
    blocks: list[KVCacheBlock] = field(default_factory=list)
    normed: Optional[torch.Tensor] = None  # [H] head output at num_computed - 1 (scores token num_computed + 1)
    prenorm: Optional[torch.Tensor] = None  # [H] its pre-norm twin (fed back by chained drafts)


class HiddenStateProposer(PagedDraftCache):
    """Args:
    head: the draft head (``target_features``, ``combine``, ``forward``, ``compute_logits``).
    target: the target model (the head reads its hidden states).
    num_blocks: blocks in the head's KV cache (block 0 is the pool's null block).
    block_size: tokens per block (the target's).
    sampler: the engine's sampler (transforms and noise).
    """

    needs_target_hidden = True

    def __init__(self, head, target: LlamaForCausalLM, num_blocks: int, block_size: int, sampler: Sampler) -> None:
        self.head = head
        self.target = target
        self.block_size = block_size
        self.sampler = sampler
        self.vocab_size = target.config.vocab_size
        self.draft_cost = head.matmul_params() / matmul_params(target.config)
        cfg = head.config
        self._init_cache(num_blocks, block_size, cfg, 1, head.dtype, head.device)  # one layer; _seqs: id -> _HeadSeq

    # 1. after the target's step ---------------------------------------------------------
    @torch.inference_mode()
    def observe(self, entries: Sequence[HeadEntry], hidden: torch.Tensor) -> None:
        """Head KV for the verified positions of the step whose final hidden states are
        ``hidden`` ``[num_tokens, H]`` (the head reads what it needs through ``target_features``)."""
        keep = {e.request_id for e in entries}
        rows, ids, positions, query_lens, seq_lens, tables, seqs = [], [], [], [], [], [], []
        for e in entries:
            seq = self._seqs.get(e.request_id)
            if seq is None or not seq.offset <= e.start <= seq.num_computed:
                self.release([e.request_id])
                seq = self._seqs[e.request_id] = _HeadSeq(offset=e.start, num_computed=e.start)
            n = len(e.next_token_ids)
            seq.num_computed, seq.normed, seq.prenorm = e.start, None, None
            if n == 0 or not self._reserve(seq, e.start + n - seq.offset, keep):
                continue
            rows.extend(range(e.row, e.row + n))
            ids.extend(e.next_token_ids)
            positions.extend(range(e.start, e.start + n))
            query_lens.append(n)
            seq_lens.append(e.start + n - seq.offset)
            tables.append([b.block_id for b in seq.blocks])
            seq.num_computed = e.start + n
            seqs.append(seq)
        if not seqs:
            return
        device = self.head.device
        features = self.head.target_features(self.target, hidden)
        fused = self.head.combine(features[torch.tensor(rows, dtype=torch.int64, device=features.device)])
        normed, prenorm = self._forward(ids, positions, fused, query_lens, seq_lens, tables)
        last = torch.tensor(query_lens, device=device).cumsum(0) - 1
        normed, prenorm = normed[last], prenorm[last]
        for i, seq in enumerate(seqs):
            seq.normed, seq.prenorm = normed[i], prenorm[i]

    def _forward(self, ids, positions, hidden, query_lens, seq_lens, tables):
        device = self.head.device
        meta = AttentionMetadata.build(query_lens, seq_lens, tables, self.block_size, device)
        return self.head(torch.tensor(ids, dtype=torch.int64, device=device),
                         torch.tensor(positions, dtype=torch.int64, device=device), hidden, self.kv_caches, meta)

    def _reserve(self, seq: _HeadSeq, num_slots: int, keep: set[str]) -> bool:
        """Grow ``seq``'s block table to ``num_slots`` slots, evicting the head state of
        requests not in ``keep`` (preempted ones) if blocks run out."""
        num_needed = -(-num_slots // self.block_size) - len(seq.blocks)
        if num_needed > self.block_pool.num_free_blocks:
            self.release([rid for rid, other in self._seqs.items() if rid not in keep and other is not seq])
        if num_needed > self.block_pool.num_free_blocks:
            return False
        if num_needed > 0:
            seq.blocks.extend(self.block_pool.get_new_blocks(num_needed))
        return True

    # 2. before the next schedule --------------------------------------------------------
    @torch.inference_mode()
    def propose(self, batch: list[DraftRequest]) -> dict[str, Draft]:
        """Draft up to ``item.num_tokens`` tokens per request; requests without a head
        output for their last position (or without blocks) propose nothing."""
        keep = {item.request.request_id for item in batch}
        active = []
        for item in batch:
            seq = self._seqs.get(item.request.request_id)
            if seq is None or seq.normed is None or seq.num_computed != item.request.num_tokens - 1:
                continue
            if self._reserve(seq, seq.num_computed + item.num_tokens - 1 - seq.offset, keep):
                active.append((item, seq))
        if not active:
            return {}
        drafts = {item.request.request_id: [] for item, _ in active}
        probs = {item.request.request_id: [] for item, _ in active}
        noise = {item.request.request_id: peek_noise(self.sampler, item, self.head.device) for item, _ in active
                 if item.mode == VerifyMode.COUPLED}
        normed = torch.stack([seq.normed for _, seq in active])
        prenorm = torch.stack([seq.prenorm for _, seq in active])
        step = 0
        while True:
            sample_draft_tokens(self.sampler, self.head.compute_logits(normed, self.vocab_size), active, drafts, probs,
                                noise)
            more = [i for i, (item, _) in enumerate(active) if len(drafts[item.request.request_id]) < item.num_tokens]
            if not more:
                break
            active = [active[i] for i in more]
            positions = [seq.num_computed + step for _, seq in active]
            normed, prenorm = self._forward(
                [drafts[item.request.request_id][-1] for item, _ in active], positions,
                prenorm[torch.tensor(more, dtype=torch.int64, device=prenorm.device)], [1] * len(active),
                [p + 1 - seq.offset for p, (_, seq) in zip(positions, active)],
                [[b.block_id for b in seq.blocks] for _, seq in active])
            step += 1
        return {rid: Draft(tokens, torch.stack(probs[rid]) if probs[rid] else None) for rid, tokens in drafts.items()}
