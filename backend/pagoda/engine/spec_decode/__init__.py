"""Speculative decoding: draft cheaply, verify k drafted tokens in one target pass.

Drafted tokens are ordinary scheduled tokens (one budget model): a decode request with
``n`` drafts is scheduled for ``1 + n`` tokens, the runner returns logits for all of them,
verification keeps a prefix of the drafts plus one token, and ``num_computed_tokens`` is
set back past the rejected ones (their KV slots are overwritten later; they were never
appended to the request, so no block holding them is ever hashed or cached).

Modules, in the order a step uses them:

* ``window``: how many tokens to draft per request (adaptive EWMA/cost model, or fixed);
* ``ngram_proposer`` / ``draft_model_proposer`` / ``hidden_proposer`` (EAGLE-3 heads,
  ``eagle3``; MTP blocks, ``mtp``; random ones for tests and benchmarks, ``random_heads``):
  the proposers, found by name in ``registry.PROPOSERS`` (``EngineConfig.speculative_method``);
* ``draft``: the proposer interface and the three verification modes;
* ``rejection_sampler``: modified rejection sampling and the greedy/seeded verifiers;
* ``speculator``: the glue ``EngineCore`` calls (and, for heads, ``ModelRunner`` after sampling).

See ``docs/speculative.md`` for usage and measurements.
"""

from pagoda.engine.spec_decode.speculator import SpecStats, SpeculativePlan, Speculator

__all__ = ["SpecStats", "SpeculativePlan", "Speculator"]
