"""Draft-model proposer: a smaller model with the target's tokenizer drafts ``k`` tokens.

The draft keeps its own paged KV cache (its own ``BlockPool`` without prefix caching, as
many blocks as the target's cache; ``ModelRunner`` sizes the target's cache so that both
fit the one memory budget). Per request it remembers how many tokens have KV
(``num_computed``) and which drafted tokens it fed itself last time. Each ``propose``:

1. Sync: drafted tokens the target rejected are rolled back (``num_computed`` falls to
   the longest prefix that still matches the request's tokens; their slots are simply
   overwritten later). Nothing is copied.
2. Catch-up + first draft, one batched pass: each request computes its tokens the draft
   has not seen yet (the whole prompt the first time, afterwards the last step's accepted
   tokens) and samples draft token 1 at its last position. Catch-up work per call is
   capped at ``max_num_batched_tokens`` tokens, like the target's; a request whose
   catch-up does not fit computes a chunk and proposes nothing this step.
3. ``k - 1`` single-token passes for the remaining draft tokens (batched over requests).

Draft tokens are sampled under the request's own transforms (penalties as if the earlier
drafts were generated, temperature, top-k/p, min-p; ``Sampler.process_logits`` and
``Sampler.sample_probs``): greedy requests take the argmax, seeded requests use the noise
the target's sampler will use at those positions (counter-based, so nothing is consumed),
unseeded requests sample from ``q`` with draws from the sampler's unseeded stream and hand
``q`` over for rejection sampling.

``make_layer_skip_draft`` builds "the target's first N layers with its final norm and LM
head" as a draft that shares the target's weights (no extra weight memory).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Iterable, Optional

import torch
from torch import nn

from pagoda.engine.kv.block_pool import BlockPool, KVCacheBlock
from pagoda.engine.sampling.sampler import Sampler
from pagoda.engine.spec_decode.draft import Draft, DraftRequest, VerifyMode, with_outputs
from pagoda.kernels import AttentionMetadata, LatentCache
from pagoda.models.config import ModelConfig
from pagoda.models.llama import LlamaForCausalLM


def make_layer_skip_draft(target: LlamaForCausalLM, num_layers: int) -> LlamaForCausalLM:
    """The target's first ``num_layers`` decoder layers, final norm and LM head, sharing
    the target's parameters (a "layer-skip" self-draft).

    Raises:
        ValueError: ``num_layers`` not in ``[1, num_hidden_layers)``.
    """
    total = target.config.num_hidden_layers
    if not 1 <= num_layers < total:
        raise ValueError(f"speculative_draft_num_layers: must be in [1, {total}) for this model, got {num_layers}")
    config = dataclasses.replace(target.config, num_hidden_layers=num_layers)
    draft = LlamaForCausalLM(config, dtype=target.dtype, device="meta")  # shells only; replaced below
    draft.embed_tokens = target.embed_tokens
    draft.layers = nn.ModuleList(list(target.layers)[:num_layers])
    draft.norm = target.norm
    draft.lm_head = target.lm_head
    draft.cos_sin_cache = target.cos_sin_cache
    draft.device = target.device
    return draft.eval()


def matmul_params(config: ModelConfig) -> int:
    """Weights one token multiplies through (decoder layers + LM head): a cost proxy."""
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    per_layer = config.hidden_size * (2 * q + 2 * kv) + 3 * config.hidden_size * config.intermediate_size
    return config.num_hidden_layers * per_layer + config.vocab_size * config.hidden_size


@dataclass
class _DraftSeq:
    """The draft's KV state for one request."""

    blocks: list[KVCacheBlock] = field(default_factory=list)
    num_computed: int = 0  # tokens with KV in the draft cache
    base: int = 0  # the request's length when it last proposed
    fed: list[int] = field(default_factory=list)  # drafted tokens computed at positions base, base + 1, ...

    def sync(self, token_ids: list[int]) -> None:
        """Roll back drafted tokens the request did not keep."""
        if self.fed:
            kept = 0
            for drafted, actual in zip(self.fed, token_ids[self.base :]):
                if drafted != actual:
                    break
                kept += 1
            self.num_computed = min(self.num_computed, self.base + kept)
            self.fed = []
        # The last token always goes through the draft again: it yields the first draft.
        self.num_computed = min(self.num_computed, len(token_ids) - 1)


class PagedDraftCache:
    """A proposer's own paged KV cache (block 0 is the pool's null block) and the per-request
    states that hold its blocks (``_seqs``: id -> an object with ``blocks``); shared by the
    draft-model and hidden-state proposers."""

    def _init_cache(self, num_blocks: int, block_size: int, config: ModelConfig, num_layers: int,
                    dtype: torch.dtype, device: torch.device) -> None:
        """``num_layers`` layers' caches of ``config``'s kind: K/V pairs, or latent caches
        (multi-head latent attention: one ``[kv_lora_rank + rope]`` row per token)."""
        self.block_pool = BlockPool(num_blocks, enable_caching=False)
        if config.mla is not None:
            shape = (num_blocks, block_size, 1, config.mla.latent_dim)
            self.kv_caches = [LatentCache(torch.zeros(shape, dtype=dtype, device=device)) for _ in range(num_layers)]
        else:
            shape = (num_blocks, block_size, config.num_key_value_heads, config.head_dim)
            self.kv_caches = [(torch.zeros(shape, dtype=dtype, device=device),
                               torch.zeros(shape, dtype=dtype, device=device)) for _ in range(num_layers)]
        self._seqs: dict = {}

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    def release(self, request_ids: Iterable[str]) -> None:
        """Free the state of finished requests (unknown ids are ignored)."""
        for request_id in request_ids:
            seq = self._seqs.pop(request_id, None)
            if seq is not None:
                self.block_pool.free_blocks(reversed(seq.blocks))


class DraftModelProposer(PagedDraftCache):
    """Args:
    model: the draft model (same vocabulary as the target).
    target_config: the target's config (for the cost ratio and checks).
    num_blocks: blocks in the draft's KV cache (block 0 is the pool's null block).
    block_size: tokens per block (the target's).
    sampler: the engine's sampler (transforms and noise).
    max_num_batched_tokens: catch-up tokens per ``propose`` call.
    max_model_len: longest sequence the draft must handle.
    seed: unused since unseeded drafts draw from the sampler's stream; kept for callers.
    """

    def __init__(self, model: LlamaForCausalLM, target_config: ModelConfig, num_blocks: int, block_size: int,
                 sampler: Sampler, max_num_batched_tokens: int, max_model_len: int, seed: int = 0) -> None:
        config = model.config
        if config.vocab_size != target_config.vocab_size:
            raise ValueError(f"speculative_model: vocabulary of {config.vocab_size} tokens differs from the "
                             f"target's {target_config.vocab_size}; the draft must share the target's tokenizer")
        if config.max_position_embeddings < max_model_len:
            raise ValueError(f"speculative_model: max_position_embeddings {config.max_position_embeddings} is "
                             f"shorter than max_model_len {max_model_len}")
        self.model = model
        self.block_size = block_size
        self.sampler = sampler
        self.max_num_batched_tokens = max_num_batched_tokens
        self.draft_cost = matmul_params(config) / matmul_params(target_config)
        self._init_cache(num_blocks, block_size, config, config.num_hidden_layers, model.dtype,
                         model.device)  # _seqs: id -> _DraftSeq

    @torch.inference_mode()
    def propose(self, batch: list[DraftRequest]) -> dict[str, Draft]:
        """Draft up to ``item.num_tokens`` tokens per request; requests left out of the
        result propose nothing this step (catch-up did not fit, or no blocks)."""
        budget = self.max_num_batched_tokens
        wanted = {item.request.request_id for item in batch}
        first_pass, proposing = [], []
        for item in batch:
            tokens = item.request.all_token_ids
            seq = self._seqs.setdefault(item.request.request_id, _DraftSeq())
            seq.sync(tokens)
            num_new = min(len(tokens) - seq.num_computed, budget)
            if num_new <= 0:
                continue
            completes = seq.num_computed + num_new == len(tokens)
            end = len(tokens) + item.num_tokens - 1 if completes else seq.num_computed + num_new
            if not self._reserve(seq, end, keep=wanted):
                continue
            budget -= num_new
            first_pass.append((seq, tokens[seq.num_computed : seq.num_computed + num_new], completes))
            if completes:
                proposing.append((item, seq))
        if not first_pass:
            return {}
        logits = self._forward(first_pass)
        drafts = {item.request.request_id: [] for item, _ in proposing}
        probs = {item.request.request_id: [] for item, _ in proposing}
        noise = {item.request.request_id: self._peek_noise(item) for item, _ in proposing
                 if item.mode == VerifyMode.COUPLED}
        for item, seq in proposing:
            seq.base, seq.fed = item.request.num_tokens, []
        active = proposing
        while active:
            self._sample(logits, active, drafts, probs, noise)
            active = [(item, seq) for item, seq in active if len(drafts[item.request.request_id]) < item.num_tokens]
            if not active:
                break
            feed = []
            for item, seq in active:
                token = drafts[item.request.request_id][-1]
                seq.fed.append(token)
                feed.append((seq, [token], True))
            logits = self._forward(feed)
        return {rid: Draft(tokens, torch.stack(probs[rid]) if probs[rid] else None) for rid, tokens in drafts.items()}

    def _reserve(self, seq: _DraftSeq, num_tokens: int, keep: set[str]) -> bool:
        """Grow ``seq``'s block table to ``num_tokens`` slots, evicting the draft state of
        requests not proposing now (preempted ones) if blocks run out."""
        num_needed = -(-num_tokens // self.block_size) - len(seq.blocks)
        if num_needed > self.block_pool.num_free_blocks:
            self.release([rid for rid, other in self._seqs.items() if rid not in keep and other is not seq])
        if num_needed > self.block_pool.num_free_blocks:
            return False
        if num_needed > 0:
            seq.blocks.extend(self.block_pool.get_new_blocks(num_needed))
        return True

    def _forward(self, entries: list[tuple[_DraftSeq, list[int], bool]]) -> torch.Tensor:
        """One draft pass; advances each ``num_computed`` and returns the logits of the
        last token of every entry whose flag is set, in order."""
        input_ids, positions, query_lens, seq_lens, tables, rows = [], [], [], [], [], []
        for seq, tokens, sample in entries:
            start = seq.num_computed
            input_ids.extend(tokens)
            positions.extend(range(start, start + len(tokens)))
            query_lens.append(len(tokens))
            seq_lens.append(start + len(tokens))
            tables.append([b.block_id for b in seq.blocks])
            seq.num_computed += len(tokens)
            if sample:
                rows.append(len(input_ids) - 1)
        device = self.model.device
        meta = AttentionMetadata.build(query_lens, seq_lens, tables, self.block_size, device)
        hidden = self.model(torch.tensor(input_ids, dtype=torch.int64, device=device),
                            torch.tensor(positions, dtype=torch.int64, device=device), self.kv_caches, meta)
        return self.model.compute_logits(hidden[torch.tensor(rows, dtype=torch.int64, device=device)])

    def _peek_noise(self, item: DraftRequest) -> torch.Tensor:
        return peek_noise(self.sampler, item, self.model.device)

    def _sample(self, logits: torch.Tensor, active, drafts, probs, noise) -> None:
        sample_draft_tokens(self.sampler, logits, active, drafts, probs, noise)


def peek_noise(sampler: Sampler, item: DraftRequest, device: torch.device) -> torch.Tensor:
    """The Exp(1) noise the target's sampler will use for the request's next ``k``
    samples (counter-based: computing it consumes nothing)."""
    return sampler.draw_noise([item.row] * item.num_tokens, device, offsets=range(item.num_tokens))  # [k, V]


def sample_draft_tokens(sampler: Sampler, logits: torch.Tensor, active, drafts, probs, noise) -> None:
    """Append one draft token per active ``(DraftRequest, state)`` (row ``i`` of ``logits``
    ``[A, V]``) to ``drafts[request_id]``, under the request's own transforms: greedy takes
    the argmax, seeded rows race the peeked ``noise``, unseeded rows draw from the sampler's
    stream and append their ``q`` to ``probs[request_id]``."""
    rows = [with_outputs(item.row, drafts[item.request.request_id]) for item, _ in active]
    processed = sampler.process_logits(logits, sampler.make_batch(rows))  # [A, V]
    chosen = processed.argmax(dim=-1)
    random = [i for i, (item, _) in enumerate(active) if item.mode != VerifyMode.GREEDY]
    if random:
        q = sampler.sample_probs(processed[random], [rows[i] for i in random])  # [R, V]
        for j, i in enumerate(random):
            item = active[i][0]
            rid = item.request.request_id
            if item.mode == VerifyMode.COUPLED:
                race = noise[rid][len(drafts[rid])]
            else:
                race = sampler.draw_noise([rows[i]], q.device)[0]  # the sampler's unseeded stream
                probs[rid].append(q[j])
            chosen[i] = (q[j] / race).argmax()
    for (item, _), token in zip(active, chosen.tolist()):
        drafts[item.request.request_id].append(token)
