"""A DeepSeek-format FP8 checkpoint (``quant_method: fp8``, ``weight_block_size [128, 128]``: each
linear module's e4m3 ``weight`` and ``weight_scale_inv``, the router left float) made here from
the format's spec (``models.quant_write``) out of a tiny random ``DeepseekV3Config`` whose
dimensions make the blocks count (hidden 160: two block columns, the second partial; fused
projections of two block rows).

- Read as floats (the CPU default) it equals the dequantized reference folder, tensor for tensor.
- Kept as FP8 (``PAGODA_KEEP_QUANTIZED=1``, what a GPU does): the attention's fused q_a | kv_a,
  q_b and o projections, the dense MLP and the shared experts become ``Fp8BlockWeight`` (the
  checkpoint's own bytes and block scales), every MoE layer's experts e4m3 stacks; each equals
  its dequantized float weight exactly, ``kv_b_proj`` stays float (read as views by the absorbed
  attention), and the weights take less than half the bytes.
- The engine serving the kept FP8 folder generates exactly what it generates from the
  dequantized reference folder.
"""

from __future__ import annotations

import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.kernels.w8a16 import dequantize_blocks
from pagoda.models import load_model
from pagoda.models.fp8 import Fp8BlockWeight
from pagoda.models.quant import weight_bytes
from tests.engine.hf_reference import save_random_model
from tests.models.test_quant_checkpoints import quantized_and_dequantized

PROMPTS = [[5, 17, 300, 42, 9, 1200, 77], [1, 2000, 31, 7]]
SHAPE = dict(vocab_size=49152, hidden_size=160, intermediate_size=256, moe_intermediate_size=128,
             num_hidden_layers=2, num_attention_heads=3, n_routed_experts=4, num_experts_per_tok=2, n_group=2,
             topk_group=1, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=96, q_lora_rank=128,
             qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=32, max_position_embeddings=256,
             tie_word_embeddings=False)


@pytest.fixture(scope="module")
def folders(tmp_path_factory, smollm2_path):
    root = tmp_path_factory.mktemp("fp8-block")
    float_dir = save_random_model(root / "float", smollm2_path, 3, "DeepseekV3Config", **SHAPE)
    return quantized_and_dequantized("fp8-block", float_dir, root)


def test_read_as_floats_it_equals_its_dequantized_reference(folders):
    quantized, dequantized = folders
    ours, reference = load_model(quantized), load_model(dequantized)
    for (name, a), (_, b) in zip(ours.state_dict().items(), reference.state_dict().items()):
        assert torch.equal(a, b), name


def test_kept_as_fp8_each_weight_is_exactly_its_dequantized_reference(folders, monkeypatch):
    quantized, dequantized = folders
    reference = load_model(dequantized)
    monkeypatch.setenv("PAGODA_KEEP_QUANTIZED", "1")
    ours = load_model(quantized)
    dense, sparse = ours.layers
    kept = [(layer.attn, name) for layer in ours.layers for name in ("qkv_a_weight", "q_b_weight", "o_weight")]
    kept += [(dense.mlp, "gate_up_weight"), (dense.mlp, "down_weight"),
             (sparse.mlp.shared_experts, "gate_up_weight"), (sparse.mlp.shared_experts, "down_weight")]
    for owner, name in kept:
        weight = getattr(owner, name)
        assert isinstance(weight, Fp8BlockWeight) and weight.qweight.dtype == torch.float8_e4m3fn, name
        assert torch.equal(weight.dequantize(), _float(reference, owner, ours, name)), name
    assert sparse.mlp.w13.dtype == torch.float8_e4m3fn and sparse.mlp.block_scales[2] == 128
    s13, s2, _ = sparse.mlp.block_scales
    float_experts = reference.layers[1].mlp
    for e in range(4):
        assert torch.equal(dequantize_blocks(sparse.mlp.w13[e], s13[e], 128, torch.float32), float_experts.w13[e])
        assert torch.equal(dequantize_blocks(sparse.mlp.w2[e], s2[e], 128, torch.float32), float_experts.w2[e])
    assert isinstance(dense.attn.kv_b_weight, torch.nn.Parameter)
    assert weight_bytes(ours) < 0.5 * weight_bytes(reference) + 2 * 49152 * 160 * 4  # + the float embeddings/head


def _float(reference, owner, ours, name) -> torch.Tensor:
    """The reference model's parameter at the same place as ``owner.<name>`` in ``ours``."""
    path = next(p for p, m in ours.named_modules() if m is owner)
    return getattr(reference.get_submodule(path), name)


def test_the_engine_serves_kept_fp8_exactly_as_the_dequantized_folder(folders, monkeypatch):
    quantized, dequantized = folders
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in LLM(model=str(dequantized), max_model_len=256).generate(PROMPTS,
                                                                                                         params)]
    monkeypatch.setenv("PAGODA_KEEP_QUANTIZED", "1")
    llm = LLM(model=str(quantized), max_model_len=256)
    assert isinstance(llm.engine.executor.runner.model.layers[0].attn.o_weight, Fp8BlockWeight)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] == expected
