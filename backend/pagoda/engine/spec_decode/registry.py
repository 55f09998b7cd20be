"""Speculative proposers by name: ``EngineConfig.speculative_method`` -> a proposer class.

``PROPOSERS`` maps each method name to a ``ProposerKind``: a class that knows the two
moments a proposer is made at.

1. ``load_draft`` runs before the target's KV cache is sized: a draft model's weights
   are loaded first (a GPU budget sees them) and its config says how many KV bytes per
   block the draft adds. A proposer without a model returns ``(None, None)``.
2. ``build`` runs once the target model and its KV cache exist, and returns the proposer
   (``propose(list[DraftRequest]) -> {request_id: Draft}``, ``release``, ``draft_cost``).

Proposers that read the target's hidden states (EAGLE-3, MTP: ``hidden_proposer``) set
``needs_target_hidden``: the runner then hands every step's hidden states to
``Speculator.observe_target`` and runs without CUDA graphs (``ModelRunner``).

Adding a proposer (Medusa, ...): one ``ProposerKind`` class, one entry here, and
its name in ``pagoda.engine.config.SPECULATIVE_METHODS``
(``tests/engine/test_spec_engine.py`` keeps the two equal). Nothing else branches on the
method's name.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional, Protocol, Union

import torch

from pagoda.engine.config import EngineConfig
from pagoda.engine.sampling.sampler import Sampler
from pagoda.engine.spec_decode.draft_model_proposer import DraftModelProposer, make_layer_skip_draft
from pagoda.engine.spec_decode.hidden_proposer import HiddenStateProposer
from pagoda.engine.spec_decode.ngram_proposer import NgramProposer
from pagoda.models.config import ModelConfig
from pagoda.models.llama import LlamaForCausalLM

Proposer = Union[DraftModelProposer, NgramProposer, HiddenStateProposer]


class ProposerKind(Protocol):
    needs_target_hidden: bool  # the proposer reads the target's hidden states of every step

    @classmethod
    def load_draft(cls, config: EngineConfig, model_config: ModelConfig, device: torch.device,
                   dtype: torch.dtype) -> tuple[Optional[ModelConfig], Optional[LlamaForCausalLM]]:
        """(the draft's config, a draft model loaded from its own folder), either may be None."""

    @classmethod
    def build(cls, config: EngineConfig, model_config: ModelConfig, target: LlamaForCausalLM,
              draft_model: Optional[LlamaForCausalLM], num_blocks: int, sampler: Sampler,
              max_model_len: int) -> Proposer:
        """The proposer, once the target and its KV cache exist."""


class NgramKind:
    """Prompt lookup (``ngram_proposer.py``): no model, no KV."""

    needs_target_hidden = False

    @classmethod
    def load_draft(cls, config, model_config, device, dtype):
        return None, None

    @classmethod
    def build(cls, config, model_config, target, draft_model, num_blocks, sampler, max_model_len) -> Proposer:
        return NgramProposer()


class DraftModelKind:
    """A draft model (``draft_model_proposer.py``): its own folder, the target's first
    layers, or both; its KV cache gets as many blocks as the target's."""

    needs_target_hidden = False

    @classmethod
    def load_draft(cls, config, model_config, device, dtype):
        """Raises ValueError for a draft folder without ``config.json``."""
        draft_model, draft_config = None, model_config
        if config.speculative_model is not None:
            from pagoda.models.loader import load_model

            if not (Path(config.speculative_model) / "config.json").exists():
                raise ValueError(f"speculative_model: no config.json in {config.speculative_model!r}")
            draft_model = load_model(config.speculative_model, dtype=dtype, device=device)
            draft_config = draft_model.config
        if config.speculative_draft_num_layers is not None:
            draft_config = dataclasses.replace(draft_config, num_hidden_layers=config.speculative_draft_num_layers)
        return draft_config, draft_model

    @classmethod
    def build(cls, config, model_config, target, draft_model, num_blocks, sampler, max_model_len) -> Proposer:
        draft = draft_model if draft_model is not None else target
        if config.speculative_draft_num_layers is not None:
            draft = make_layer_skip_draft(draft, config.speculative_draft_num_layers)
        return DraftModelProposer(draft, model_config, num_blocks, config.block_size, sampler,
                                  config.max_num_batched_tokens, max_model_len, seed=config.seed + 1)


class Eagle3Kind:
    """An EAGLE-3 head (``eagle3.py``) from ``speculative_model``, reading three of the
    target's layers; one layer of KV, as many blocks as the target's."""

    needs_target_hidden = True

    @classmethod
    def load_draft(cls, config, model_config, device, dtype):
        """The head's one-layer config (its KV shares the budget); the head itself needs the
        target (shared embeddings) and is loaded in ``build``."""
        from pagoda.engine.spec_decode.eagle3 import head_kv_config

        return head_kv_config(config.speculative_model), None

    @classmethod
    def build(cls, config, model_config, target, draft_model, num_blocks, sampler, max_model_len) -> Proposer:
        from pagoda.engine.spec_decode.eagle3 import load_eagle3_head

        if type(target).forward is not LlamaForCausalLM.forward:
            raise ValueError(f"speculative_method 'eagle3': the {model_config.architecture} family does not "
                             "expose auxiliary hidden states (only the Llama decoder's forward keeps them)")
        head = load_eagle3_head(config.speculative_model, target, max_model_len, target.dtype, target.device)
        target.aux_layer_ids = head.aux_layer_ids
        return HiddenStateProposer(head, target, num_blocks, config.block_size, sampler)


class MtpKind:
    """The MTP block (``mtp.py``) of the target's checkpoint (or of ``speculative_model``);
    one layer of KV, as many blocks as the target's."""

    needs_target_hidden = True

    @classmethod
    def load_draft(cls, config, model_config, device, dtype):
        return dataclasses.replace(model_config, num_hidden_layers=1), None

    @classmethod
    def build(cls, config, model_config, target, draft_model, num_blocks, sampler, max_model_len) -> Proposer:
        from pagoda.engine.spec_decode.mtp import load_mtp_head

        if config.speculative_model is None and config.model is None:
            raise ValueError("speculative_method 'mtp': the default model carries no MTP layers; serve a "
                             "checkpoint that does, or name one in speculative_model")
        head = load_mtp_head(config.speculative_model, config.model, target)
        return HiddenStateProposer(head, target, num_blocks, config.block_size, sampler)


PROPOSERS: dict[str, type[ProposerKind]] = {"ngram": NgramKind, "draft": DraftModelKind, "eagle3": Eagle3Kind,
                                            "mtp": MtpKind}
