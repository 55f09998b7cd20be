"""Qwen3-Next, Qwen3.5 and Qwen3.5-MoE (Gated DeltaNet + gated attention) against transformers 5.

Each architecture is a tiny random config built with transformers in the test (float32,
``initializer_range`` 0.2), its norm weights, ``dt_bias`` and the DeltaNet's gated-norm weight
moved off their initial constants (so every ``1 + w`` offset and gate counts), saved with
``save_pretrained`` (Qwen3.5-MoE in several shards) and loaded by pagoda's loader. A tiny
harness (``models.testing``) builds the metadata, the KV caches and the state slots directly:
no engine. Checks, each within twice the derived rounding bound of the exact values
(``tests/numerics.hybrid_path_length``):

- every decoder layer's output over a prompt (transformers' layer outputs via hooks);
- the logits of a prompt in one step, and in several steps of odd sizes with the DeltaNet's
  chunk size cut to 4 (the recurrent state and the conv state carried through the slots);
- three sequences of different lengths in flat steps mixing prefill chunks, decode tokens and a
  one-token prompt, in slots out of order; the slots no sequence owns hold NaN, and stay NaN;
- a greedy continuation driven by the harness (decode steps carrying state) == ``generate``.

Switches covered: Qwen3-Next's interleaved ``in_proj_qkvz`` / ``in_proj_ba``, routed experts
with ``norm_topk_prob`` false, a shared expert, ``mlp_only_layers`` and explicit ``layer_types``;
Qwen3.5's split projections, partial rotary 0.5, a conv kernel of 3; Qwen3.5-MoE's always
renormalised router. Tensor parallelism (two ranks on gloo, threads) equals one rank for Qwen3.5.
"""

from __future__ import annotations

import json
import threading

import pytest
import torch
import torch.distributed as dist

from pagoda.kernels import reload_settings
from pagoda.models import config_from_dict, load_model
from pagoda.models.testing import StepInput, make_kv_caches, make_layer_caches, run_step

from tests.models.mixed_steps import check_mixed_steps
from tests.numerics import UNIT_ROUNDOFF, assert_within, hybrid_path_length

transformers = pytest.importorskip("transformers")

BLOCK_SIZE, NUM_BLOCKS, NUM_SLOTS = 4, 24, 5
COMMON = dict(vocab_size=96, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
              max_position_embeddings=128, initializer_range=0.2, tie_word_embeddings=False)
L, F = "linear_attention", "full_attention"
ARCHS = {
    "qwen3-next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
        num_hidden_layers=5, layer_types=[L, F, L, L, F], intermediate_size=40, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=24, shared_expert_intermediate_size=20, norm_topk_prob=False, mlp_only_layers=[2])),
    "qwen3.5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(
        num_hidden_layers=4, intermediate_size=48, linear_conv_kernel_dim=3,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5))),
    "qwen3.5-moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", dict(
        num_hidden_layers=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
        shared_expert_intermediate_size=20)),
}


@pytest.fixture(scope="module", params=sorted(ARCHS))
def pair(request, tmp_path_factory):
    """(transformers model, pagoda model, folder) for one architecture."""
    config_name, model_name, extra = ARCHS[request.param]
    config = getattr(transformers, config_name)(**COMMON, **extra)
    torch.manual_seed(0)
    hf = getattr(transformers, model_name)(config).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if "norm" in name or name.endswith("dt_bias"):
                param.add_(0.3 * torch.randn(param.shape))
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder, max_shard_size="40KB" if request.param == "qwen3.5-moe" else "50MB")
    return hf, load_model(folder), folder


def bound(model, num_tokens: int, scale: float, num_layers: int | None = None) -> float:
    """Both sides are float32 forwards, each within the derived bound of the exact values."""
    path = hybrid_path_length(model.config, num_tokens, num_layers)
    return 2 * path * UNIT_ROUNDOFF[torch.float32] * max(scale, 1.0)


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def prompt(seed: int, length: int) -> list[int]:
    return torch.randint(0, COMMON["vocab_size"], (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def set_chunk_size(model, chunk: int) -> None:
    for layer in model.layers:
        if layer.is_linear:
            layer.linear_attn.chunk_size = chunk


def test_each_layer_equals_transformers(pair):
    hf, ours, _ = pair
    ids = prompt(1, 13)
    outputs = []
    hooks = [layer.register_forward_hook(lambda mod, args, out: outputs.append(out[0] if isinstance(out, tuple)
                                                                               else out))
             for layer in hf.model.layers]
    hf_logits(hf, ids)
    for hook in hooks:
        hook.remove()
    caches = make_layer_caches(ours, NUM_BLOCKS, BLOCK_SIZE, NUM_SLOTS, state_fill=float("nan"))
    from pagoda.kernels import AttentionMetadata

    meta = AttentionMetadata.build([13], [13], [[3, 9, 0, 7]], BLOCK_SIZE, state_indices=[2])
    positions = torch.arange(13)
    with torch.inference_mode():
        h, residual = ours.embed(torch.tensor(ids)), None
        for i, (layer, cache) in enumerate(zip(ours.layers, caches)):
            h, residual = layer(h, residual, positions, ours.cos_sin_cache, cache, meta)
            expected = outputs[i][0]
            assert_within(h + residual, expected, bound(ours, 13, float(expected.abs().max()), i + 1),
                          f"layer {i} ({ours.config.layer_types[i]})")


def test_prompt_in_one_step(pair):
    hf, ours, _ = pair
    ids = prompt(2, 17)
    caches = make_layer_caches(ours, NUM_BLOCKS, BLOCK_SIZE, NUM_SLOTS, state_fill=float("nan"))
    ref = hf_logits(hf, ids)
    out = run_step(ours, caches, [StepInput(ids, 0, [4, 1, 8, 2, 6], state_slot=3)], BLOCK_SIZE)
    assert_within(out, ref, bound(ours, 17, float(ref.abs().max())), "one step")


def test_prompt_in_steps_carries_the_state_through_its_slot(pair):
    hf, ours, _ = pair
    ids = prompt(3, 17)
    ref = hf_logits(hf, ids)
    set_chunk_size(ours, 4)  # chunks of 4 inside steps of 5, 1, 7 and 4 tokens
    try:
        caches = make_layer_caches(ours, NUM_BLOCKS, BLOCK_SIZE, NUM_SLOTS, state_fill=float("nan"))
        start = 0
        for size in (5, 1, 7, 4):
            out = run_step(ours, caches, [StepInput(ids[start:start + size], start, [5, 0, 11, 3, 9], state_slot=1)],
                           BLOCK_SIZE)
            assert_within(out, ref[start:start + size], bound(ours, 17, float(ref.abs().max())),
                          f"step of {size} at {start}")
            start += size
    finally:
        set_chunk_size(ours, 64)


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_sequences_of_different_lengths_share_flat_steps(pair, kernels, monkeypatch):
    """The torch kernels (the CPU path) and, on Qwen3-Next, the Triton kernels (interpreted;
    chunk size 16, the smallest they tile) give transformers' logits."""
    hf, ours, _ = pair
    if kernels == "triton" and ours.config.architecture != "Qwen3NextForCausalLM":
        pytest.skip("interpreter time (~1 min a model): Qwen3-Next's case runs every kernel, the MoE ones too")
    calls = count_triton_calls(monkeypatch)
    monkeypatch.setenv("PAGODA_KERNELS", kernels)
    reload_settings()
    set_chunk_size(ours, 16)
    seqs = {"a": prompt(4, 10), "b": prompt(5, 9), "c": prompt(6, 6)}
    refs = {name: hf_logits(hf, ids) for name, ids in seqs.items()}
    tables = {"a": [3, 17, 8], "b": [12, 1, 20], "c": [6, 14]}
    slots = {"a": 4, "b": 0, "c": 2}  # 1 and 3 belong to no sequence
    caches = make_layer_caches(ours, NUM_BLOCKS, BLOCK_SIZE, NUM_SLOTS, state_fill=float("nan"))

    def piece(name: str, start: int, end: int) -> StepInput:
        return StepInput(seqs[name][start:end], start, tables[name], state_slot=slots[name])

    scale = max(float(r.abs().max()) for r in refs.values())
    check_mixed_steps(ours, caches, piece, refs, tables, BLOCK_SIZE, bound(ours, 10, scale))
    for layer, cache in zip(ours.layers, caches):
        if layer.is_linear:
            for free in (1, 3):
                assert cache.conv_states[free].isnan().all() and cache.ssm_states[free].isnan().all()
    set_chunk_size(ours, 64)
    assert all(calls.values()) == (kernels == "triton") and any(calls.values()) == (kernels == "triton"), calls


def count_triton_calls(monkeypatch) -> dict[str, int]:
    """Counts the calls that reach the Triton wrappers of the DeltaNet kernels."""
    from pagoda.kernels import triton_ops

    calls = {name: 0 for name in ("causal_conv1d", "gated_delta_rule", "gated_rms_norm")}
    for name in calls:
        def counted(*args, _real=getattr(triton_ops, name), _name=name):
            calls[_name] += 1
            return _real(*args)

        monkeypatch.setattr(triton_ops, name, counted)
    return calls


def test_greedy_continuation_equals_generate(pair):
    hf, ours, _ = pair
    prompts = [prompt(7, 6), prompt(8, 9)]
    new_tokens = 6
    expected = []
    for ids in prompts:
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False,
                              min_new_tokens=new_tokens)
        expected.append(out[0, len(ids):].tolist())
    caches = make_layer_caches(ours, NUM_BLOCKS, BLOCK_SIZE, NUM_SLOTS, state_fill=float("nan"))
    tables = [[2, 7, 11, 19], [5, 13, 1, 22]]
    tokens = [list(p) for p in prompts]
    step = [StepInput(tokens[i], 0, tables[i], state_slot=3 - 2 * i) for i in range(2)]  # slots 3 and 1
    while min(len(t) - len(p) for t, p in zip(tokens, prompts)) < new_tokens:
        logits = run_step(ours, caches, step, BLOCK_SIZE)
        ends = torch.tensor([len(s.token_ids) for s in step]).cumsum(0) - 1
        for i, token in enumerate(logits[ends].argmax(-1).tolist()):
            tokens[i].append(token)
        step = [StepInput([tokens[i][-1]], len(tokens[i]) - 1, tables[i], state_slot=3 - 2 * i) for i in range(2)]
    assert [t[len(p):] for t, p in zip(tokens, prompts)] == expected


def test_sharded_folder_loads(pair):
    _, ours, folder = pair
    sharded = (folder / "model.safetensors.index.json").exists()
    assert sharded == (ours.config.architecture == "Qwen3_5MoeForCausalLM")
    if sharded:
        files = set(json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"].values())
        assert len(files) > 1


def test_tensor_parallel_two_ranks_equal_one(pair):
    hf, ours, folder = pair  # the MoE variants too: experts and shared expert split by intermediate rows
    from pagoda.engine.parallel.group import ProcessGroup
    from pagoda.models.tensor_parallel import kv_head_range, shard_model

    ids = prompt(9, 11)
    ref = hf_logits(hf, ids)
    store = dist.HashStore()
    results, errors = {}, []

    def rank(r: int) -> None:
        try:
            group = ProcessGroup(r, 2, store, torch.device("cpu"), timeout_s=60)
            model = shard_model(load_model(folder), group)
            kv_heads = kv_head_range(model.config.num_key_value_heads, 2, r)[1]
            caches = make_layer_caches(model, NUM_BLOCKS, BLOCK_SIZE, NUM_SLOTS, kv_heads=kv_heads)
            first = run_step(model, caches, [StepInput(ids[:7], 0, [0, 1, 2], state_slot=2)], BLOCK_SIZE)
            rest = run_step(model, caches, [StepInput(ids[7:], 7, [0, 1, 2], state_slot=2)], BLOCK_SIZE)
            results[r] = torch.cat([first, rest]) if r == 0 else None
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert_within(results[0], ref, bound(ours, 11, float(ref.abs().max())), "two ranks")


# ---- configs and refusals ---------------------------------------------------------------------

def raw_config(architecture: str, **extra) -> dict:
    return {"architectures": [architecture], "vocab_size": 96, "hidden_size": 32, "intermediate_size": 48,
            "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2, **extra}


def test_layer_types_default_to_every_fourth_layer_full_and_rope_defaults():
    config = config_from_dict(raw_config("Qwen3_5ForCausalLM"))
    assert config.layer_types == (L, L, L, F) * 2
    assert config.head_dim == 256 and config.partial_rotary_factor == 0.25 and config.rotary_dim == 64
    config = config_from_dict(raw_config("Qwen3NextForCausalLM", full_attention_interval=2, head_dim=16,
                                         rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                                          "partial_rotary_factor": 0.5, "mrope_section": [2, 1, 1],
                                                          "mrope_interleaved": True}))
    assert config.layer_types == (L, F) * 4 and config.rotary_dim == 8 and config.rope_theta == 1e6
    assert config.rope_scaling is None and config.inv_freq().shape == (4,)


@pytest.mark.parametrize("extra,match", [
    (dict(layer_types=["linear_attention"] * 7 + ["sliding_attention"]), "layer_types"),
    (dict(layer_types=["linear_attention"] * 3), "layer_types"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64}), "rope"),
    (dict(linear_num_key_heads=3, linear_num_value_heads=4), "linear_num_value_heads"),
])
def test_configs_that_do_not_work_are_refused(extra, match):
    with pytest.raises(ValueError, match=match):
        config_from_dict(raw_config("Qwen3NextForCausalLM", **extra))


def test_lora_is_refused_for_hybrid_models(pair):
    _, ours, _ = pair
    from pagoda.models.lora import LoRASlots

    with pytest.raises(ValueError, match="LoRA adapters are not supported"):
        LoRASlots(ours, 2, 8)


def test_two_pipeline_stages_equal_the_whole_model(pair):
    """A stage runs the very layers the whole model runs, each with its own cache kind: the
    logits are bit-identical."""
    _, ours, folder = pair
    from pagoda.models.pipeline_parallel import PipelineStage

    from tests.models.test_pipeline_stages import _in_threads

    ids = prompt(10, 9)

    def steps(model):
        caches = make_layer_caches(model, NUM_BLOCKS, BLOCK_SIZE, NUM_SLOTS, state_fill=float("nan"))
        first = run_step(model, caches, [StepInput(ids[:6], 0, [1, 4, 7], state_slot=3)], BLOCK_SIZE)
        return torch.cat([first, run_step(model, caches, [StepInput(ids[6:], 6, [1, 4, 7], state_slot=3)], BLOCK_SIZE)])

    expected = steps(ours)
    # a generous timeout: on a loaded 2-core machine one rank may load its model a minute later
    results = _in_threads(2, lambda group: steps(PipelineStage(load_model(folder), group)), timeout_s=300)
    assert torch.equal(results[0], expected) and results[1].numel() == 0


def test_int8_weights_apply_to_the_dense_family_and_are_refused_with_experts(pair, monkeypatch):
    """``quantization="int8"`` quantizes every projection, the DeltaNet's included, and the
    quantized model computes what its dequantized weights compute in float32. (Against the
    float model it differs by up to ~15% of the logits here: the decay ``exp(-A softplus(a))``
    with ``A`` up to 16 amplifies the error of ``a``'s rows; a model property, not the path.)"""
    _, ours, folder = pair
    if ours.config.num_experts:
        with pytest.raises(ValueError, match="MoE expert weights cannot be quantized"):
            load_model(folder, quantization="int8")
        return
    from pagoda.models.quant import Int8Weight, dequantize_int8

    monkeypatch.setenv("PAGODA_INT8_KERNEL", "dequantize")  # float32 activations on every CPU
    quantized = load_model(folder, quantization="int8")
    dequantized = load_model(folder, quantization="int8")
    mixers = [layer.linear_attn for layer in quantized.layers if layer.is_linear]
    assert all(isinstance(m.in_proj_weight, Int8Weight) and isinstance(m.out_proj_weight, Int8Weight) for m in mixers)
    for module in dequantized.modules():
        for name in getattr(module, "linear_weights", ()):
            weight = getattr(module, name)
            delattr(module, name)
            dequantized_weight = dequantize_int8(weight.qweight, weight.scale)
            setattr(module, name, torch.nn.Parameter(dequantized_weight, requires_grad=False))
    ids = prompt(11, 9)
    outs = []
    for model in (quantized, dequantized):
        caches = make_layer_caches(model, NUM_BLOCKS, BLOCK_SIZE, NUM_SLOTS)
        outs.append(run_step(model, caches, [StepInput(ids, 0, [0, 1, 2], state_slot=0)], BLOCK_SIZE))
    assert_within(outs[0], outs[1], bound(ours, 9, float(outs[1].abs().max())), "int8 model vs its dequantized weights")


def test_stacked_expert_checkpoint_loads_the_same_weights(pair, tmp_path):
    """The released Qwen3.5-MoE folders stack each layer's experts (``mlp.experts.gate_up_proj``,
    ``mlp.experts.down_proj``: transformers 5's own parameters); ``save_pretrained`` writes them per
    expert. Both load to the same model."""
    hf, ours, folder = pair
    if not ours.config.num_experts:
        pytest.skip("a dense model has no experts")
    from safetensors.torch import save_file

    state = {name: tensor.contiguous() for name, tensor in hf.state_dict().items()}
    assert any(name.endswith("mlp.experts.gate_up_proj") for name in state)
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    stacked = load_model(tmp_path)
    for (name, mine), (_, theirs) in zip(ours.named_parameters(), stacked.named_parameters()):
        assert torch.equal(mine, theirs), name


GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True}
QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkvz", "in_proj_ba", "in_proj_qkv", "in_proj_z",
             "in_proj_b", "in_proj_a", "out_proj")


def test_a_4bit_checkpoint_loads_into_its_dequantized_weights(pair, tmp_path, monkeypatch):
    """GPTQ 4-bit attention and DeltaNet projections (where the format's packing fits the shape):
    dequantized at load to exactly the float weights they stand for; kept packed
    (``PAGODA_KEEP_QUANTIZED=1``), every such projection serves its float weight's logits, but
    Qwen3-Next's DeltaNet projection stays float (its rows are reordered at load)."""
    from safetensors.torch import load_file, save_file

    from pagoda.models.int4 import Int4Weight
    from pagoda.models.loader import checkpoint_files
    from pagoda.models.quant_write import gptq_tensors

    _, ours, folder = pair
    state = {k: v for file in checkpoint_files(folder) for k, v in load_file(str(file)).items()}
    quantized, dequantized = dict(state), dict(state)
    for name, weight in state.items():
        module = name.removesuffix(".weight")
        if module.split(".")[-1] in QUANTIZED and weight.dim() == 2 and weight.shape[0] % 8 == 0:
            tensors, expected = gptq_tensors(weight, 4, 32, False, 0)
            del quantized[name]
            quantized |= {f"{module}.{k}": v.contiguous() for k, v in tensors.items()}
            dequantized[name] = expected.float()
    config = json.loads((folder / "config.json").read_text())
    for out, tensors, extra in ((tmp_path / "q", quantized, {"quantization_config": GPTQ}),
                                (tmp_path / "f", dequantized, {})):
        out.mkdir()
        save_file(tensors, str(out / "model.safetensors"))
        (out / "config.json").write_text(json.dumps({**config, **extra}))
    reference = load_model(tmp_path / "f")
    for (name, a), (_, b) in zip(load_model(tmp_path / "q").state_dict().items(), reference.state_dict().items()):
        assert torch.equal(a, b), name
    monkeypatch.setenv("PAGODA_KEEP_QUANTIZED", "1")
    packed = load_model(tmp_path / "q")
    attention = [layer.attn for layer in packed.layers if not layer.is_linear]
    deltanets = [layer.linear_attn for layer in packed.layers if layer.is_linear]
    assert all(isinstance(a.qkv_weight, Int4Weight) and isinstance(a.o_weight, Int4Weight) for a in attention)
    assert all(isinstance(d.out_proj_weight, Int4Weight) for d in deltanets)
    if deltanets[0].layout == "qkvz":
        assert not any(isinstance(d.in_proj_weight, Int4Weight) for d in deltanets)
    ids = prompt(12, 9)
    outs = [run_step(model, make_layer_caches(model, NUM_BLOCKS, BLOCK_SIZE, NUM_SLOTS),
                     [StepInput(ids, 0, [0, 1, 2], state_slot=0)], BLOCK_SIZE) for model in (packed, reference)]
    assert_within(outs[0], outs[1], bound(ours, 9, float(outs[1].abs().max())), "packed 4-bit vs its float weights")


def test_a_linear_attention_layer_given_a_kv_pair_says_it_needs_state_slots(pair):
    _, ours, _ = pair
    caches = make_kv_caches(ours.config, NUM_BLOCKS, BLOCK_SIZE)  # what a runner without state slots makes
    with pytest.raises(ValueError, match="needs a StateCache"):
        run_step(ours, caches, [StepInput([1, 2, 3], 0, [0], state_slot=0)], BLOCK_SIZE)
