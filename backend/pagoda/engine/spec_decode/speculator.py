"""The engine's speculative-decoding step: choose windows, propose, verify, keep score.

Per engine step (see ``EngineCore.step``):

1. ``propose(running, budget)``, before ``Scheduler.schedule``: every running request at
   the end of its known tokens (a decode) that speculates (``SamplingParams.speculative``,
   else the server default) gets a window ``k`` (``window.py``; capped so that accepted
   tokens plus the bonus never exceed ``max_tokens``), and the proposer drafts up to
   ``k`` tokens. The result is the ``spec_token_ids`` argument of ``schedule``; drafts are
   ordinary scheduled tokens there, inside the same token budget (the scheduler may cut
   a draft short, or drop it rather than preempt anyone).
2. ``sample(logits, items, token_bitmask)``, inside ``ModelRunner.execute`` after the
   forward: requests without drafts go through the plain ``Sampler`` in one batch;
   requests with drafts are verified from the ``1 + n`` logits rows the runner computed
   for them (``draft.py`` for the three modes, ``rejection_sampler.py`` for the math), the
   grammar (structured output) masking the target's rows as the last logits processor.
   Tokens (accepted drafts, then one more) and raw logprobs go back in the runner's
   ``ModelRunnerOutput``; ``Scheduler.update_from_output`` rolls the KV of rejected
   drafts back.
3. ``observe_target(scheduled, output, hidden)``, after sampling, only for proposers that
   read the target's hidden states (EAGLE-3, MTP; ``hidden_proposer.py``): each
   speculating request's verified positions of the step (its prefill chunk; its decode
   token and accepted drafts), the tokens that followed them and their rows in the
   step's hidden states go to the proposer, which computes its head's KV from them.
4. ``release(ids)`` when requests finish: frees their draft KV and acceptance estimates.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional, Union

import torch

from pagoda.engine.config import EngineConfig
from pagoda.engine.guided.bitmask import TokenBitmask
from pagoda.engine.request import Request, RequestStatus
from pagoda.engine.sampling.sampler import Sampler, TokenLogprobs
from pagoda.engine.spec_decode.draft import Draft, DraftRequest, VerifyMode, with_outputs
from pagoda.engine.spec_decode.hidden_proposer import HeadEntry
from pagoda.engine.spec_decode.registry import PROPOSERS, Proposer
from pagoda.engine.spec_decode.rejection_sampler import coupled_verify, greedy_verify, rejection_sample
from pagoda.engine.spec_decode.window import SATURATION_TOKENS, AcceptanceEstimate, AdaptiveWindow, FixedWindow
from pagoda.models.config import ModelConfig
from pagoda.models.llama import LlamaForCausalLM

# Acceptance assumed for a request before it has been observed, until the server has data.
_PRIOR_ACCEPTANCE = 0.6


@dataclass
class SpecStats:
    num_drafts: int = 0  # verifications (request-steps with drafted tokens)
    num_draft_tokens: int = 0  # drafted tokens verified
    num_accepted_tokens: int = 0  # of which accepted
    num_emitted_tokens: int = 0  # tokens produced by verifications (accepted + one each)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def tokens_per_verification(self) -> float:
        return self.num_emitted_tokens / self.num_drafts if self.num_drafts else 0.0


@dataclass
class SpeculativePlan:
    """What speculative decoding needs before the target's KV cache is sized.

    Attributes:
        draft_config: the draft's model config (its KV shares the memory budget), or None
            for the n-gram proposer.
        draft_model: a draft loaded from its own folder (loaded first, so a GPU budget sees
            its weights), or None for a layer-skip self-draft / n-gram.
    """

    config: EngineConfig
    draft_config: Optional[ModelConfig] = None
    draft_model: Optional[LlamaForCausalLM] = None

    @classmethod
    def from_config(cls, config: EngineConfig, model_config: ModelConfig, device: torch.device,
                    dtype: torch.dtype) -> Optional["SpeculativePlan"]:
        """None when speculation is off. Raises ValueError for an unusable draft folder."""
        if config.speculative_method is None:
            return None
        draft_config, draft_model = PROPOSERS[config.speculative_method].load_draft(config, model_config, device,
                                                                                    dtype)
        return cls(config, draft_config, draft_model)

    @property
    def needs_target_hidden(self) -> bool:
        """The proposer reads the target's hidden states of every step (no CUDA graphs)."""
        return PROPOSERS[self.config.speculative_method].needs_target_hidden

    def build(self, model_config: ModelConfig, target: LlamaForCausalLM, num_blocks: int, sampler: Sampler,
              max_model_len: int) -> "Speculator":
        cfg = self.config
        proposer = PROPOSERS[cfg.speculative_method].build(cfg, model_config, target, self.draft_model, num_blocks,
                                                           sampler, max_model_len)
        if cfg.spec_adaptive:
            window = AdaptiveWindow(cfg.num_speculative_tokens, proposer.draft_cost,
                                    SATURATION_TOKENS.get(target.device.type, SATURATION_TOKENS["cuda"]))
        else:
            window = FixedWindow(cfg.num_speculative_tokens)
        return Speculator(proposer, window, sampler, cfg.speculative_by_default, cfg.max_num_batched_tokens,
                          seed=cfg.seed + 2)


class Speculator:
    """Args:
    proposer: drafts tokens (``propose(list[DraftRequest]) -> {request_id: Draft}``).
    window: chooses ``k`` per request and step.
    sampler: the engine's sampler.
    default_on: whether requests with ``speculative=None`` speculate.
    max_num_batched_tokens: the scheduler's budget (load estimate for the window).
    seed: seed of the generator used for rejection sampling of unseeded requests.
    """

    def __init__(self, proposer: Proposer, window: Union[AdaptiveWindow, FixedWindow], sampler: Sampler,
                 default_on: bool, max_num_batched_tokens: int, seed: int = 0) -> None:
        self.proposer = proposer
        self.window = window
        self.sampler = sampler
        self.default_on = default_on
        self.max_num_batched_tokens = max_num_batched_tokens
        self.stats = SpecStats()
        self._seed = seed
        self._generator = torch.Generator().manual_seed(seed)
        self._server_estimate = AcceptanceEstimate(_PRIOR_ACCEPTANCE, weight=0.05)
        self._estimates: dict[str, AcceptanceEstimate] = {}
        self._drafts: dict[str, Draft] = {}

    def wants(self, request: Request) -> bool:
        opt_in = request.sampling_params.speculative
        return self.default_on if opt_in is None else opt_in

    # 1. propose -------------------------------------------------------------------------
    def propose(self, running: list[Request]) -> dict[str, list[int]]:
        """Drafts for this step's decodes, as ``Scheduler.schedule``'s ``spec_token_ids``."""
        num_step_tokens = min(self.max_num_batched_tokens,
                              sum(max(0, r.num_tokens - r.num_computed_tokens) for r in running))
        candidates = [r for r in running if r.status == RequestStatus.RUNNING
                      and r.num_tokens - r.num_computed_tokens == 1 and self.wants(r)]
        batch = []
        for request in candidates:
            # Accepted drafts plus the bonus must fit in max_tokens (and so in max_model_len).
            cap = request.max_tokens - request.num_output_tokens - 1
            if cap <= 0:
                continue
            estimate = self._estimates.setdefault(request.request_id,
                                                  AcceptanceEstimate(self._server_estimate.value))
            k = min(cap, self.window.choose(estimate, num_step_tokens, len(candidates)))
            if k > 0:
                batch.append(DraftRequest(request, k, request.sampling_state))
        self._drafts = self.proposer.propose(batch) if batch else {}
        return {request_id: draft.token_ids for request_id, draft in self._drafts.items()}

    # 2. verify --------------------------------------------------------------------------
    def sample(self, logits: torch.Tensor, items: list, token_bitmask: Optional[TokenBitmask] = None,
               ) -> tuple[list[list[int]], list[list[Optional[TokenLogprobs]]]]:
        """Tokens (and raw logprobs, ``None`` entries when not asked for) per sampling
        request, in ``items`` order (the runner wraps them in its ``ModelRunnerOutput``).

        Args:
            logits: ``ModelRunner.execute``'s rows: ``1 + len(item.spec_token_ids)`` per item.
            items: the step's ``ScheduledRequest``s with ``is_sampling``, in batch order.
            token_bitmask: grammar masks, rows indexing the logits rows (``prepare_bitmask``).
        """
        tokens: dict[str, list[int]] = {}
        logprobs: dict[str, list[Optional[TokenLogprobs]]] = {}
        starts, row = [], 0
        for item in items:
            starts.append(row)
            row += 1 + len(item.spec_token_ids)
        assert row == logits.shape[0], f"expected {row} logits rows, got {logits.shape[0]}"
        plain = [i for i, item in enumerate(items) if not item.spec_token_ids]
        if plain:
            rows = [items[i].request.sampling_state for i in plain]
            mask = token_bitmask.select([starts[i] for i in plain]) if token_bitmask is not None else None
            result = self.sampler(logits[[starts[i] for i in plain]], self.sampler.make_batch(rows, mask))
            for i, token_id, lp in zip(plain, result.token_ids, result.logprobs):
                tokens[items[i].request.request_id] = [token_id]
                logprobs[items[i].request.request_id] = [lp]
        spec = [(items[i], starts[i]) for i in range(len(items)) if items[i].spec_token_ids]
        if spec:
            self._verify(logits, spec, tokens, logprobs, token_bitmask)
        self._drafts = {}
        req_ids = [item.request.request_id for item in items]
        return [tokens[i] for i in req_ids], [logprobs[i] for i in req_ids]

    def _verify(self, logits, spec, tokens, logprobs, token_bitmask=None) -> None:
        ext_rows, raw_index = [], []
        for item, start in spec:
            drafts = item.spec_token_ids
            ext_rows += [with_outputs(item.request.sampling_state, drafts[:j]) for j in range(len(drafts) + 1)]
            raw_index += range(start, start + len(drafts) + 1)
        raw = logits[raw_index]  # [sum(n + 1), >= V]
        mask = token_bitmask.select(raw_index) if token_bitmask is not None else None
        processed = self.sampler.process_logits(raw, self.sampler.make_batch(ext_rows, mask))  # [sum(n + 1), V]
        random = [i for i, r in enumerate(ext_rows) if not r.params.is_greedy]
        probs = torch.zeros_like(processed)
        filtered = torch.full_like(processed, float("-inf"))
        if random:
            filtered[random] = self.sampler.filter_logits(processed[random], [ext_rows[i] for i in random])
            probs[random] = filtered[random].softmax(dim=-1)
        rejection, offset = [], 0
        for item, _ in spec:
            rid, drafts, n = item.request.request_id, item.spec_token_ids, len(item.spec_token_ids)
            mode = VerifyMode.of(item.request.sampling_state)
            rows = slice(offset, offset + n + 1)
            if mode == VerifyMode.GREEDY:
                tokens[rid] = greedy_verify(processed[rows].argmax(dim=-1).tolist(), drafts)
            elif mode == VerifyMode.COUPLED:
                tokens[rid] = coupled_verify(self.sampler.race(filtered[rows], ext_rows[rows]).tolist(), drafts)
            else:
                rejection.append((item, offset))
            offset += n + 1
        if rejection:
            self._rejection_sample(probs, rejection, tokens)
        offset = 0
        for item, _ in spec:
            rid, n = item.request.request_id, len(item.spec_token_ids)
            out = tokens[rid]
            self._observe(rid, n, len(out) - 1)
            idx = list(range(offset, offset + len(out)))
            logprobs[rid] = self.sampler.compute_logprobs(
                raw[idx], [ext_rows[i] for i in idx], torch.tensor(out, device=raw.device))
            offset += n + 1

    def _rejection_sample(self, probs, rejection, tokens) -> None:
        """Modified rejection sampling for all unseeded random requests in one batch."""
        k = max(len(item.spec_token_ids) for item, _ in rejection)
        vocab = probs.shape[1]
        p = probs.new_zeros(len(rejection), k + 1, vocab)
        q = probs.new_zeros(len(rejection), k, vocab)
        x = torch.zeros(len(rejection), k, dtype=torch.int64, device=probs.device)
        num_drafts = torch.zeros(len(rejection), dtype=torch.int64, device=probs.device)
        for r, (item, offset) in enumerate(rejection):
            n = len(item.spec_token_ids)
            p[r, : n + 1] = probs[offset : offset + n + 1]
            x[r, :n] = torch.tensor(item.spec_token_ids, device=probs.device)
            draft = self._drafts[item.request.request_id].truncate(n)
            if draft.probs is None:
                q[r, torch.arange(n), x[r, :n]] = 1.0
            else:
                q[r, :n] = draft.probs.to(q.device)
            num_drafts[r] = n
        if self._generator.device != probs.device:  # rejection sampling draws where the logits are
            self._generator = torch.Generator(device=probs.device).manual_seed(self._seed)
        num_accepted, next_token = rejection_sample(p, q, x, num_drafts, self._generator)
        for r, (item, _) in enumerate(rejection):
            a = int(num_accepted[r])
            tokens[item.request.request_id] = list(item.spec_token_ids[:a]) + [int(next_token[r])]

    def _observe(self, request_id: str, num_drafted: int, num_accepted: int) -> None:
        self.stats.num_drafts += 1
        self.stats.num_draft_tokens += num_drafted
        self.stats.num_accepted_tokens += num_accepted
        self.stats.num_emitted_tokens += num_accepted + 1
        estimate = self._estimates.get(request_id)
        if estimate is not None:
            estimate.observe(num_drafted, num_accepted)
        self._server_estimate.observe(num_drafted, num_accepted)

    # 3. after the step (proposers that read the target's hidden states) -----------------
    def observe_target(self, scheduled: list, sampled: dict[str, list[int]], hidden: torch.Tensor) -> None:
        """Hand the step's verified positions to the proposer.

        Args:
            scheduled: the step's ``ScheduledRequest``s in batch order (``num_new_tokens``
                rows each in ``hidden``), their requests not yet extended by this step.
            sampled: request id -> the step's tokens (accepted drafts, then one more).
            hidden: the target's final hidden states ``[num_tokens, H]`` of the step.
        """
        entries, row = [], 0
        for item in scheduled:
            request, start, n = item.request, item.num_computed_tokens, item.num_new_tokens
            if self.wants(request):
                new = sampled.get(request.request_id, []) if item.is_sampling else []
                num_spec = len(item.spec_token_ids)
                num_valid = n - num_spec + (len(new) - 1 if num_spec else 0)
                following = list(request.all_token_ids[start + 1 : start + 1 + num_valid])
                following += new[: num_valid - len(following)]
                entries.append(HeadEntry(request.request_id, start, row, following))
            row += n
        if entries:
            self.proposer.observe(entries, hidden)

    # 4. release -------------------------------------------------------------------------
    def release(self, request_ids: Iterable[str]) -> None:
        """Forget finished requests (their draft KV and acceptance estimates)."""
        request_ids = list(request_ids)
        for request_id in request_ids:
            self._estimates.pop(request_id, None)
        self.proposer.release(request_ids)
