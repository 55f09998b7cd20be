"""gpt-oss pieces beyond the HF-exactness cases (test_llama_vs_hf.py, tests/engine/test_engine_vs_hf.py):
MXFP4 checkpoints (models/mxfp4.py) against transformers' own dequantization, the loader
hook, and the refusals (LoRA on experts or the router, int8 experts).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagoda.models import load_model, mxfp4
from pagoda.models.lora import load_peft_adapter
from pagoda.models.testing import StepInput, make_kv_caches, run_step

from tests.numerics import assert_within, model_error_bound

transformers = pytest.importorskip("transformers")
from transformers.integrations.mxfp4 import convert_moe_packed_tensors  # noqa: E402

HIDDEN, INTER, EXPERTS = 64, 64, 4  # multiples of the 32-value MXFP4 block


def packed(shape: tuple[int, ...], seed: int, scale_range=(120, 131)) -> tuple[torch.Tensor, torch.Tensor]:
    """Random MXFP4 ``_blocks`` / ``_scales`` for a ``[..., rows, cols]`` weight."""
    gen = torch.Generator().manual_seed(seed)
    *lead, cols = shape
    blocks = torch.randint(0, 256, (*lead, cols // 32, 16), generator=gen, dtype=torch.int32).to(torch.uint8)
    scales = torch.randint(*scale_range, (*lead, cols // 32), generator=gen, dtype=torch.int32).to(torch.uint8)
    return blocks, scales


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_dequantize_matches_transformers_convert(dtype):
    """Every byte value (so every pair of E2M1 codes, both signs of zero) under exponents from
    2^-27 to 2^28: identical to ``convert_moe_packed_tensors``, including its transpose."""
    blocks = torch.arange(256, dtype=torch.int32).to(torch.uint8).reshape(2, 2, 4, 16)  # [E, rows, G, 16]
    scales = torch.tensor([100, 127, 128, 155], dtype=torch.uint8).repeat(2, 2, 1)
    ours = mxfp4.unpacked("w", {"w_blocks": blocks, "w_scales": scales}.__getitem__, dtype)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=dtype)
    assert ours.shape == theirs.shape == (2, 4 * 32, 2)
    assert torch.equal(ours, theirs)
    # by hand: byte 0x2F = low nibble 0xF (-6), high nibble 0x2 (+1); scale 127 -> x1
    one = mxfp4.dequantize(torch.tensor([[[0x2F] + [0] * 15]], dtype=torch.uint8),
                           torch.tensor([[127]], dtype=torch.uint8))
    assert one[0, :3].tolist() == [-6.0, 1.0, 0.0]


def test_dequantize_refuses_what_is_not_mxfp4():
    blocks, scales = packed((2, 64), seed=0)
    with pytest.raises(ValueError, match="w: MXFP4 blocks .* do not fit scales"):
        mxfp4.dequantize(blocks, scales[:1], name="w")
    with pytest.raises(ValueError, match="must be uint8"):
        mxfp4.dequantize(blocks.to(torch.int16), scales)
    assert mxfp4.logical_names({"a_blocks", "a_scales", "b_blocks", "c"}) == {"a", "b_blocks", "c"}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The same tiny gpt-oss twice: experts as float tensors, and as MXFP4 blocks/scales
    (what the released checkpoints ship), with transformers' model for the logits."""
    root = tmp_path_factory.mktemp("gpt-oss")
    config = transformers.GptOssConfig(vocab_size=256, hidden_size=HIDDEN, intermediate_size=INTER,
                                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                       num_local_experts=EXPERTS, num_experts_per_tok=2, sliding_window=4,
                                       max_position_embeddings=64, initializer_range=0.3)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    packs = {}
    with torch.no_grad():
        for i, layer in enumerate(hf.model.layers):
            experts = layer.mlp.experts
            for proj, rows, cols in (("gate_up_proj", 2 * INTER, HIDDEN), ("down_proj", HIDDEN, INTER)):
                blocks, scales = packed((EXPERTS, rows, cols), seed=10 * i + len(proj))
                getattr(experts, proj).copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
                packs[f"model.layers.{i}.mlp.experts.{proj}"] = (blocks, scales)
            for name, param in layer.named_parameters():
                if name.endswith("bias") or name.endswith("sinks"):
                    param.normal_(0.0, 0.5)
    plain = root / "plain"
    hf.save_pretrained(plain)
    quantized = root / "mxfp4"
    shutil.copytree(plain, quantized)
    tensors = load_file(str(quantized / "model.safetensors"))
    for name, (blocks, scales) in packs.items():
        del tensors[name]
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
    save_file(tensors, str(quantized / "model.safetensors"))
    raw = json.loads((quantized / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (quantized / "config.json").write_text(json.dumps(raw))
    return hf, plain, quantized


def test_an_mxfp4_checkpoint_loads_the_dequantized_weights(checkpoints):
    hf, plain, quantized = checkpoints
    ours, reference = load_model(quantized), load_model(plain)
    for (name, a), (_, b) in zip(ours.named_parameters(), reference.named_parameters()):
        assert torch.equal(a, b), name
    assert ours.layers[0].mlp.w13.abs().max() > 1.0  # scales 2^-7..2^3 times codes up to 6
    ids = [3, 17, 200, 5, 99, 42, 7, 1, 250]
    kv = make_kv_caches(ours.config, 8, 4)
    logits = run_step(ours, kv, [StepInput(ids, 0, [5, 1, 6])], 4)
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0]
    assert_within(logits, expected, 2 * model_error_bound(ours.config, len(ids), torch.float32,
                                                          expected.abs().max().item()), "mxfp4 gpt-oss vs transformers")


def test_an_mxfp4_half_pair_is_named(checkpoints, tmp_path):
    _, _, quantized = checkpoints
    broken = tmp_path / "broken"
    shutil.copytree(quantized, broken)
    tensors = load_file(str(broken / "model.safetensors"))
    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing 1 tensors \(model.layers.1.mlp.experts.down_proj\); "
                                         r"unexpected 1 tensors \(model.layers.1.mlp.experts.down_proj_blocks\)"):
        load_model(broken)


def test_lora_on_experts_or_router_and_int8_experts_are_refused(checkpoints, tmp_path):
    _, plain, _ = checkpoints
    config = load_model(plain).config
    for key, shape, message in (
        ("model.layers.0.mlp.experts.gate_up_proj", (2 * INTER, HIDDEN),
         "LoRA on MoE expert or router weights is not supported"),
        ("model.layers.1.mlp.router", (EXPERTS, HIDDEN), "unsupported LoRA target 'router'"),
    ):
        folder = tmp_path / key.split(".")[-1]
        folder.mkdir()
        (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4}))
        save_file({f"base_model.model.{key}.lora_A.weight": torch.randn(2, shape[1]),
                   f"base_model.model.{key}.lora_B.weight": torch.randn(shape[0], 2)},
                  str(folder / "adapter_model.safetensors"))
        with pytest.raises(ValueError, match=message):
            load_peft_adapter("a", str(folder), config, 8)
    with pytest.raises(ValueError, match="quantization 'int8': MoE expert weights cannot be quantized"):
        load_model(plain, quantization="int8")
