"""DeepSeek-V3 (multi-head latent attention + group-limited sigmoid-routed MoE) against transformers 5.

Two tiny random configs built with ``transformers.DeepseekV3Config`` in the test (float32,
``initializer_range`` 0.2; the router's correction bias randomised so that it changes choices),
saved with ``save_pretrained`` and loaded by pagoda's loader:

- ``q-lora``: a q low-rank projection, interleaved rope (DeepSeek's checkpoints), 8 experts in 4
  groups (top-2 groups, top-2 experts), one shared expert, the first layer dense, renormalised
  weights times ``routed_scaling_factor``;
- ``yarn``: ``q_proj`` straight from the hidden state, rope in halves, YaRN (factor 4 over 32
  positions, ``mscale`` and ``mscale_all_dim``: the cos/sin factor and the softmax-scale
  correction both count) on 48-token prompts, one group (Kimi K2's), no renormalisation;
- ``glm-lite``: ``Glm4MoeLiteConfig`` (GLM-4.7-Flash: the same architecture), its dense layer
  in the middle (``mlp_layer_types``), one group.

Checks (the harness of ``models.testing``: no engine), each within twice the derived rounding
bound of the exact values (``mla_path_length``): a prompt's logits in one step (the expanded
prefill); the same prompt as a chunk then decodes (the absorbed form over the latent cache);
three sequences of different lengths in flat steps mixing chunks and decodes, with the torch
path and with the Triton kernels (interpreted), the latent rows no sequence owns holding NaN.
"""

from __future__ import annotations

import pytest
import torch

from pagoda.kernels import LatentCache
from pagoda.models import load_model
from pagoda.models.testing import StepInput, make_layer_caches, run_step

from tests.models.mixed_steps import check_mixed_steps
from tests.numerics import UNIT_ROUNDOFF, assert_within

transformers = pytest.importorskip("transformers")

BLOCK_SIZE, NUM_BLOCKS = 4, 40
COMMON = dict(vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
              num_attention_heads=4, n_routed_experts=8, num_experts_per_tok=2, kv_lora_rank=16, qk_nope_head_dim=8,
              qk_rope_head_dim=8, v_head_dim=12, max_position_embeddings=128, initializer_range=0.2,
              tie_word_embeddings=False)
CONFIGS = {
    "q-lora": dict(q_lora_rank=24, n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=1,
                   routed_scaling_factor=2.5, norm_topk_prob=True, rope_interleave=True),
    "yarn": dict(q_lora_rank=None, n_group=1, topk_group=1, n_shared_experts=2, first_k_dense_replace=0,
                 routed_scaling_factor=1.5, norm_topk_prob=False, rope_interleave=False,
                 rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, mscale=0.8,
                                      mscale_all_dim=0.6, original_max_position_embeddings=32,
                                      beta_fast=32.0, beta_slow=1.0)),
    # GLM-4.7-Flash: the same attention and MoE, its dense layer in the middle (mlp_layer_types).
    "glm-lite": dict(q_lora_rank=24, n_group=1, topk_group=1, n_shared_experts=1, routed_scaling_factor=1.8,
                     norm_topk_prob=True, rope_interleave=True, mlp_layer_types=["sparse", "dense", "sparse"]),
}
CLASSES = {"glm-lite": ("Glm4MoeLiteConfig", "Glm4MoeLiteForCausalLM")}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, tmp_path_factory):
    """(transformers model, pagoda model) for one config."""
    config_class, model_class = CLASSES.get(request.param, ("DeepseekV3Config", "DeepseekV3ForCausalLM"))
    config = getattr(transformers, config_class)(**COMMON, **CONFIGS[request.param])
    torch.manual_seed(0)
    hf = getattr(transformers, model_class)(config).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if "norm" in name:
                param.add_(0.3 * torch.randn(param.shape))
        for name, buffer in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.2 * torch.randn(buffer.shape))
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder)
    return hf, load_model(folder)


def mla_path_length(config, num_tokens: int) -> int:
    """Sum of reduction lengths along a DeepSeek forward's deepest path (``tests/numerics``):
    per layer the norms, the fused q/latent projection, q's bottleneck, the latent norm, the
    absorbed query (nope) and score (rank + rope) or the expanded key (rank) and score (qk),
    softmax and P@V (twice the context), ``W_UV`` (rank), ``o_proj``, and the router and
    experts (or the dense MLP); then the final norm and the head."""
    mla, hidden = config.mla, config.hidden_size
    attention = (mla.q_lora_rank or 0) + 2 * mla.kv_lora_rank + mla.latent_dim + mla.qk_nope_head_dim
    attention += 2 * num_tokens + config.num_attention_heads * mla.v_head_dim
    mlp = max(config.intermediate_size, config.moe_intermediate_size + config.shared_expert_intermediate_size
              + config.num_experts + 2 * hidden)
    return config.num_hidden_layers * (5 * hidden + attention + mlp) + 2 * hidden


def bound(model, num_tokens: int, scale: float) -> float:
    """Both sides are float32 forwards, each within the derived bound of the exact values."""
    return 2 * mla_path_length(model.config, num_tokens) * UNIT_ROUNDOFF[torch.float32] * max(scale, 1.0)


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def prompt(seed: int, length: int) -> list[int]:
    return torch.randint(0, COMMON["vocab_size"], (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def poisoned_caches(model) -> list[LatentCache]:
    caches = make_layer_caches(model, NUM_BLOCKS, BLOCK_SIZE, 1)
    for cache in caches:
        cache.latent.fill_(float("nan"))
    return caches


def test_config_reads_the_latent_shape_and_the_router(pair):
    _, ours = pair
    config = ours.config
    assert config.mla.latent_dim == 16 + 8 and config.head_dim == 8
    assert ours.layers[-1].mlp.router.num_groups in (1, 4)
    assert ours.layers[-1].mlp.gate_weight.dtype == torch.float32  # transformers keeps the router in fp32
    dense = [i for i, layer in enumerate(ours.layers) if type(layer.mlp).__name__ == "MLP"]
    assert dense == ([1] if config.architecture == "Glm4MoeLiteForCausalLM" else list(config.mlp_only_layers))


def test_prompt_in_one_step_then_decodes(pair):
    hf, ours = pair
    ids = prompt(2, 48)
    ref = hf_logits(hf, ids)
    table = list(range(12, 24))
    out = run_step(ours, poisoned_caches(ours), [StepInput(ids, 0, table)], BLOCK_SIZE)
    assert_within(out, ref, bound(ours, 48, float(ref.abs().max())), "one step")
    caches = poisoned_caches(ours)
    pieces = [run_step(ours, caches, [StepInput(ids[:41], 0, table)], BLOCK_SIZE)]
    pieces += [run_step(ours, caches, [StepInput([ids[i]], i, table)], BLOCK_SIZE) for i in range(41, 48)]
    assert_within(torch.cat(pieces), ref, bound(ours, 48, float(ref.abs().max())), "a chunk, then decodes")


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_sequences_of_different_lengths_share_flat_steps(pair, kernels, monkeypatch):
    """The torch path and the Triton kernels (interpreted: the latent write and the split-K
    decode) give transformers' logits; rows no sequence owns stay NaN and are never read."""
    hf, ours = pair
    if kernels == "triton" and (ours.config.mla.q_lora_rank is None or "Glm" in ours.config.architecture):
        pytest.skip("interpreter time: the q-lora case runs every Triton kernel")
    monkeypatch.setenv("PAGODA_KERNELS", kernels)
    seqs = {"a": prompt(4, 10), "b": prompt(5, 9), "c": prompt(6, 6)}
    refs = {name: hf_logits(hf, ids) for name, ids in seqs.items()}
    tables = {"a": [3, 17, 8], "b": [12, 1, 20], "c": [6, 14]}
    caches = poisoned_caches(ours)

    def piece(name: str, start: int, end: int) -> StepInput:
        return StepInput(seqs[name][start:end], start, tables[name])

    scale = max(float(r.abs().max()) for r in refs.values())
    check_mixed_steps(ours, caches, piece, refs, tables, BLOCK_SIZE, bound(ours, 10, scale))
    owned = [b for table in tables.values() for b in table]
    free = [b for b in range(NUM_BLOCKS) if b not in owned]
    assert all(cache.latent[free].isnan().all() for cache in caches)
