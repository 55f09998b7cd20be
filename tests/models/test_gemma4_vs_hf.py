"""Gemma 4 text (``Gemma4ForCausalLM``) against transformers 5.24, switch by switch.

Tiny random float32 configs built with ``transformers.Gemma4TextConfig`` here (4 layers, sliding
and full attention alternating, a 5-token window, full layers twice the sliding head_dim; norms,
router scales and ``layer_scalar`` moved off their initial constants), saved with
``save_pretrained`` and loaded by pagoda's loader:

- ``base``: per-layer head dims (``global_head_dim``), the proportional rope (partial 0.25),
  softmax scale 1, scale-free ``v_norm``, final logit soft-capping;
- ``k-eq-v``: ``attention_k_eq_v`` with ``num_global_key_value_heads`` (full layers: 1 KV head of
  16, sliding: 2 of 8), so the full layers' values are their key projection;
- ``shared``: ``num_kv_shared_layers=2`` (layers 2 and 3 read layers 0's and 1's caches, no k/v
  weights) with the double-wide MLP and per-layer inputs (transformers 5.24 fails on KV-shared
  layers without per-layer inputs: its ``_maybe_slice_kv_shared_inputs`` slices ``None``);
- ``moe``: ``enable_moe_block`` (4 experts, top-2) beside the dense MLP, with per-layer inputs.

Checks (``models.testing``, no engine), within twice the derived rounding bound
(``gemma4_path_length``): a 12-token prompt in one step; the same prompt as a chunk then decodes
(past the window); three sequences in flat steps mixing chunks and decodes.
"""

from __future__ import annotations

import json

import pytest
import torch

from pagoda.models import load_model
from pagoda.models.registry import config_from_dict
from pagoda.models.testing import StepInput, make_layer_caches, run_step

from tests.models.mixed_steps import check_mixed_steps
from tests.numerics import UNIT_ROUNDOFF, assert_within

transformers = pytest.importorskip("transformers")

BLOCK_SIZE, NUM_BLOCKS = 4, 24
COMMON = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, global_head_dim=16, sliding_window=5, max_position_embeddings=64,
              layer_types=["sliding_attention", "full_attention"] * 2, hidden_size_per_layer_input=0,
              initializer_range=0.2)
PLE = dict(hidden_size_per_layer_input=8, vocab_size_per_layer_input=96)
CONFIGS = {
    "base": dict(final_logit_softcapping=30.0, tie_word_embeddings=False),
    "k-eq-v": dict(attention_k_eq_v=True, num_global_key_value_heads=1),
    "shared": dict(num_kv_shared_layers=2, use_double_wide_mlp=True, **PLE),
    "moe": dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=16, **PLE),
}


@torch.no_grad()
def move_constants(model) -> None:
    """Norm weights, router scales and each layer's ``layer_scalar`` off their initial ones."""
    for name, param in model.named_parameters():
        if "norm" in name or "scale" in name:
            param.add_(0.3 * torch.randn(param.shape))
    for name, buffer in model.named_buffers():
        if name.endswith("layer_scalar"):
            buffer.copy_(1 + 0.3 * torch.randn(buffer.shape))


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, tmp_path_factory):
    """(transformers model, pagoda model) for one config."""
    config = transformers.Gemma4TextConfig(**{**COMMON, **CONFIGS[request.param]})
    torch.manual_seed(0)
    hf = transformers.Gemma4ForCausalLM(config).eval()
    move_constants(hf)
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder)
    return hf, load_model(folder)


def gemma4_path_length(config, num_tokens: int) -> int:
    """Sum of reduction lengths along a Gemma 4 forward's deepest path (``tests/numerics``): per
    layer six norms of the stream, q/k/v norms and scores (head_dim), softmax and P@V (twice the
    context), o_proj, gate/up (hidden) and down (the layer's intermediate), the router, the
    experts and their two norms, the per-layer input's gate, projection and norm; before the
    layers the per-layer projection and its norm; then the final norm and the head."""
    hidden, options = config.hidden_size, config.gemma4
    head_dim = max(dim for _, dim in config.layer_kv_shapes)
    per_layer = (7 * hidden + 3 * head_dim + 2 * num_tokens + config.num_attention_heads * head_dim
                 + 2 * config.intermediate_size)
    if options.moe:
        per_layer += 5 * hidden + config.moe_intermediate_size + config.num_experts
    if options.ple_dim:
        per_layer += 2 * hidden + options.ple_dim
    return config.num_hidden_layers * per_layer + 4 * hidden + options.ple_dim


def bound(model, num_tokens: int, scale: float) -> float:
    """Both sides are float32 forwards, each within the derived bound of the exact values."""
    return 2 * gemma4_path_length(model.config, num_tokens) * UNIT_ROUNDOFF[torch.float32] * max(scale, 1.0)


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def prompt(seed: int, length: int) -> list[int]:
    return torch.randint(0, COMMON["vocab_size"], (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def poisoned_caches(model) -> list:
    """Per-layer caches of each layer's shape (KV-shared layers: their source's pair), NaN where
    no sequence wrote: a read of a block no table owns shows up in the logits."""
    caches = make_layer_caches(model, NUM_BLOCKS, BLOCK_SIZE, 1)
    for k_cache, v_cache in caches:
        k_cache.fill_(float("nan"))
        v_cache.fill_(float("nan"))
    return caches


def test_config_reads_each_layers_shape_and_cache_source(pair):
    _, ours = pair
    config, options = ours.config, ours.config.gemma4
    heads = 1 if options.k_eq_v else 2
    assert config.layer_kv_shapes == ((2, 8), (heads, 16), (2, 8), (heads, 16))
    assert config.kv_source_layers == ((0, 1, 0, 1) if options.num_kv_shared_layers else (0, 1, 2, 3))
    assert [layer.attn.shares_kv for layer in ours.layers] == [i != s for i, s in enumerate(config.kv_source_layers)]
    assert ours.layers[3].mlp.intermediate_size == (96 if options.double_wide_mlp else 48)
    assert ours.layers[1].attn.k_eq_v == options.k_eq_v and not ours.layers[0].attn.k_eq_v


def test_prompt_in_one_step_then_chunk_and_decodes(pair):
    hf, ours = pair
    ids = prompt(2, 12)
    ref = hf_logits(hf, ids)
    table = [9, 2, 17]
    limit = bound(ours, 12, float(ref.abs().max()))
    assert_within(run_step(ours, poisoned_caches(ours), [StepInput(ids, 0, table)], BLOCK_SIZE), ref, limit,
                  "one step")
    caches = poisoned_caches(ours)
    pieces = [run_step(ours, caches, [StepInput(ids[:5], 0, table)], BLOCK_SIZE)]
    pieces += [run_step(ours, caches, [StepInput([ids[i]], i, table)], BLOCK_SIZE) for i in range(5, 12)]
    assert_within(torch.cat(pieces), ref, limit, "a chunk, then decodes past the window")


def test_sequences_of_different_lengths_share_flat_steps(pair):
    hf, ours = pair
    seqs = {"a": prompt(4, 10), "b": prompt(5, 9), "c": prompt(6, 6)}
    refs = {name: hf_logits(hf, ids) for name, ids in seqs.items()}
    tables = {"a": [3, 17, 8], "b": [12, 1, 20], "c": [6, 14]}

    def piece(name: str, start: int, end: int) -> StepInput:
        return StepInput(seqs[name][start:end], start, tables[name])

    scale = max(float(r.abs().max()) for r in refs.values())
    check_mixed_steps(ours, poisoned_caches(ours), piece, refs, tables, BLOCK_SIZE, bound(ours, 10, scale))


def raw_config(**changes) -> dict:
    raw = json.loads(transformers.Gemma4TextConfig(**COMMON).to_json_string())
    raw["architectures"] = ["Gemma4ForCausalLM"]
    return {**raw, **changes}


def test_config_without_per_layer_config_reads_the_global_fields():
    """A config.json in the released form (``global_head_dim``, ``num_global_key_value_heads``)."""
    raw = raw_config(attention_k_eq_v=True, global_head_dim=32, num_global_key_value_heads=1)
    raw.pop("per_layer_config")
    assert config_from_dict(raw).layer_kv_shapes == ((2, 8), (1, 32), (2, 8), (1, 32))
    raw["attention_k_eq_v"] = False  # transformers applies the KV-head override only with k_eq_v
    assert config_from_dict(raw).layer_kv_shapes == ((2, 8), (2, 32), (2, 8), (2, 32))


@pytest.mark.parametrize("changes, field", [
    (dict(hidden_activation="silu"), "hidden_activation"),
    (dict(use_bidirectional_attention="all"), "use_bidirectional_attention"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(per_layer_config={"1": {"intermediate_size": 64}}), "per_layer_config"),
    (dict(rope_parameters={"sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
                           "full_attention": {"rope_type": "proportional", "rope_theta": 1e6}}), "sliding_attention"),
    (dict(rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                           "full_attention": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e6}}),
     "full_attention"),
    (dict(num_kv_shared_layers=3), "num_kv_shared_layers"),
    (dict(hidden_size_per_layer_input=8, vocab_size_per_layer_input=50), "vocab_size_per_layer_input"),
])
def test_refused_switches_name_the_field(changes, field):
    with pytest.raises(ValueError, match=field):
        config_from_dict(raw_config(**changes))


def test_lora_is_refused_naming_why(pair):
    from pagoda.models.lora import LoRASlots

    _, ours = pair
    with pytest.raises(ValueError, match="LoRA adapters are not supported for Gemma4ForCausalLM"):
        LoRASlots(ours, 2, 4)
