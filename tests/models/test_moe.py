"""The sparse MoE block (models/moe.py): routing, grouping by expert, experts-with-tokens execution.

The whole-model exactness against transformers is in ``test_llama_vs_hf.py`` (paged
logits) and ``tests/engine/test_engine_vs_hf.py`` (greedy generation); here each stage is
pinned on its own: routing against the formula transformers uses, the grouping's
offsets against a count, the experts against a float64 dense all-experts reference (and
NaN weights in experts that received no token, which a dense computation would spread).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from pagoda.models import config_from_dict, load_model
from pagoda.models.lora import LoRASlots, load_peft_adapter
from pagoda.models.moe import experts_forward, group_by_expert, route

from tests.numerics import assert_within, moe_dense_reference, moe_rounding_bound

QWEN3_MOE = dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=64, hidden_size=32, intermediate_size=48,
                 num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
                 num_experts_per_tok=2, moe_intermediate_size=24, max_position_embeddings=64)


def random_experts(num_experts: int, hidden: int, inter: int, dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden**0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=g) / inter**0.5).to(dtype)
    return w13, w2


def test_route_matches_the_transformers_formula():
    logits = torch.randn(7, 6, generator=torch.Generator().manual_seed(1))
    probs = torch.softmax(logits, dim=-1)
    weights, ids = route(logits, 3, renormalize=False)
    assert torch.equal(ids, probs.topk(3, dim=-1).indices)
    assert torch.allclose(weights, probs.topk(3, dim=-1).values)
    renormed, same_ids = route(logits, 3, renormalize=True)
    assert torch.equal(same_ids, ids)
    assert torch.allclose(renormed.sum(dim=-1), torch.ones(7))
    assert torch.allclose(renormed, weights / weights.sum(dim=-1, keepdim=True))
    assert route(logits.bfloat16(), 3, renormalize=True)[0].dtype == torch.bfloat16


@pytest.mark.parametrize("case", ["spread", "one-expert", "top-k-equals-experts", "idle-experts"])
def test_grouping_sorts_assignments_by_expert_with_offsets(case):
    num_experts, g = 5, torch.Generator().manual_seed(2)
    ids = {
        "spread": torch.stack([torch.randperm(num_experts, generator=g)[:2] for _ in range(9)]),
        "one-expert": torch.full((7, 1), 3),
        "top-k-equals-experts": torch.stack([torch.randperm(num_experts, generator=g) for _ in range(3)]),
        "idle-experts": torch.tensor([[4, 0], [0, 4], [4, 0]]),
    }[case]
    weights = torch.rand(ids.shape, generator=g)
    groups = group_by_expert(ids, weights, num_experts)
    assert groups.counts.tolist() == [int((ids == e).sum()) for e in range(num_experts)]
    assert groups.offsets[0] == 0 and groups.offsets[-1] == ids.numel()
    for e in range(num_experts):
        rows = slice(int(groups.offsets[e]), int(groups.offsets[e + 1]))
        tokens = groups.token_index[rows]
        assert tokens.tolist() == sorted(tokens.tolist()), "stable: tokens keep their order inside an expert"
        assert torch.equal(tokens, (ids == e).any(dim=1).nonzero().flatten())
        assert torch.equal(groups.weights[rows], weights[ids == e])


def test_grouping_reads_nothing_back_from_the_device():
    # Meta tensors have no data: any .item()/.tolist()/data-dependent shape would raise.
    ids = torch.empty(11, 2, dtype=torch.int64, device="meta")
    groups = group_by_expert(ids, torch.empty(11, 2, device="meta"), 8)
    assert groups.offsets.shape == (9,) and groups.token_index.shape == (22,) and groups.weights.shape == (22,)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_tokens,top_k", [(1, 2), (13, 2), (6, 6)])
def test_experts_with_tokens_equal_the_moe_dense_reference(dtype, num_tokens, top_k):
    num_experts, hidden, inter = 6, 32, 24
    g = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, hidden, generator=g).to(dtype)
    w13, w2 = random_experts(num_experts, hidden, inter, dtype)
    weights, ids = route(torch.randn(num_tokens, num_experts, generator=g).to(dtype), top_k, renormalize=True)
    out = experts_forward(x, group_by_expert(ids, weights, num_experts), w13, w2)
    ref = moe_dense_reference(x, ids, weights, w13, w2)
    assert out.dtype == dtype
    bound = moe_rounding_bound(x, ids, weights, w13, w2, dtype)
    assert_within(out, ref, bound, f"{num_tokens} tokens, top-{top_k}, {dtype}")


def test_experts_without_tokens_are_never_computed():
    num_experts, hidden, inter = 6, 16, 8
    x = torch.randn(5, hidden)
    w13, w2 = random_experts(num_experts, hidden, inter, torch.float32)
    ids = torch.tensor([[1, 4]] * 5)
    weights = torch.full((5, 2), 0.5)
    for idle in (0, 2, 3, 5):  # a dense all-experts pass would turn these NaNs into NaN outputs
        w13[idle] = float("nan")
        w2[idle] = float("nan")
    out = experts_forward(x, group_by_expert(ids, weights, num_experts), w13, w2)
    assert torch.isfinite(out).all()
    assert_within(out, moe_dense_reference(x, ids, weights, w13.nan_to_num(), w2.nan_to_num()), 1e-5, "two experts")


def test_sparse_layers_follow_decoder_sparse_step_and_mlp_only_layers():
    c = config_from_dict({**QWEN3_MOE, "decoder_sparse_step": 2, "mlp_only_layers": [3]})
    assert [c.is_moe_layer(i) for i in range(4)] == [False, True, False, False]
    assert not c.norm_topk_prob  # transformers' default for Qwen3-MoE
    mixtral = config_from_dict({**QWEN3_MOE, "architectures": ["MixtralForCausalLM"], "num_local_experts": 4})
    assert mixtral.norm_topk_prob and all(mixtral.is_moe_layer(i) for i in range(4))
    assert mixtral.moe_intermediate_size == mixtral.intermediate_size
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        config_from_dict({**QWEN3_MOE, "num_experts_per_tok": 5})


# ---- what a MoE model refuses --------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_qwen3_moe(tmp_path_factory):
    """A saved random Qwen3-MoE: layer 0 dense (mlp_only_layers), layers 1-3 sparse."""
    transformers = pytest.importorskip("transformers")
    kwargs = {k: v for k, v in QWEN3_MOE.items() if k != "architectures"}
    config = transformers.Qwen3MoeConfig(**kwargs, mlp_only_layers=[0], norm_topk_prob=True)
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("qwen3moe")
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    return folder


def write_adapter(folder, keys: list[str], rank: int = 2):
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 4, "target_modules": ["q_proj"]}))
    shapes = {"q_proj": (64, 32), "gate_proj": (48, 32), "w1": (24, 32)}
    tensors = {}
    for key in keys:
        out_f, in_f = shapes[key.split(".")[-1]]
        tensors[f"base_model.model.{key}.lora_A.weight"] = torch.randn(rank, in_f)
        tensors[f"base_model.model.{key}.lora_B.weight"] = torch.randn(out_f, rank)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


def test_lora_on_expert_weights_is_refused_and_attention_lora_works(tiny_qwen3_moe, tmp_path):
    model = load_model(tiny_qwen3_moe)
    expert = write_adapter(tmp_path / "expert", ["model.layers.1.mlp.experts.2.gate_proj"])
    with pytest.raises(ValueError, match="LoRA on MoE expert or router weights is not supported"):
        load_peft_adapter("e", str(expert), model.config, 8)
    sparse_mlp = write_adapter(tmp_path / "sparse", ["model.layers.2.mlp.gate_proj"])
    with pytest.raises(ValueError, match="layer 2, a MoE layer; LoRA on MoE expert weights is not supported"):
        load_peft_adapter("s", str(sparse_mlp), model.config, 8)
    mixtral_style = write_adapter(tmp_path / "mixtral", ["model.layers.1.block_sparse_moe.experts.0.w1"])
    with pytest.raises(ValueError, match="MoE expert or router"):
        load_peft_adapter("m", str(mixtral_style), model.config, 8)
    # Attention everywhere and the dense layer's MLP are adapted as usual.
    ok = write_adapter(tmp_path / "ok", ["model.layers.1.self_attn.q_proj", "model.layers.0.mlp.gate_proj"])
    adapter = load_peft_adapter("ok", str(ok), model.config, 8)
    slots = LoRASlots(model, num_slots=1, max_rank=8)
    slots.load(0, adapter)
    a_stack, _ = model.layers[0].mlp.lora_stacks["gate_up_weight"]
    assert a_stack[0].abs().sum() > 0
    assert not hasattr(model.layers[1].mlp, "lora_stacks")  # no slots on a sparse block


def test_quantizing_expert_weights_is_refused(tiny_qwen3_moe):
    with pytest.raises(ValueError, match="quantization 'int8': MoE expert weights cannot be quantized"):
        load_model(tiny_qwen3_moe, quantization="int8")


def test_dummy_weights_of_a_moe_model_scale_by_each_experts_fan_in():
    """``load_format="dummy"`` (benchmarks of a shape): stacked experts get N(0, 1/fan_in) too."""
    from pagoda.engine.runner.model_runner import make_random_model

    config = config_from_dict({**QWEN3_MOE, "hidden_size": 256, "moe_intermediate_size": 64})
    model = make_random_model(config, torch.float32, torch.device("cpu"), seed=0)
    moe = model.layers[1].mlp
    assert abs(moe.w13.std().item() - 256**-0.5) < 0.1 * 256**-0.5  # fan-in = hidden
    assert abs(moe.w2.std().item() - 64**-0.5) < 0.1 * 64**-0.5  # fan-in = expert intermediate
    assert torch.equal(model.layers[0].attn.q_norm, torch.ones(16))
