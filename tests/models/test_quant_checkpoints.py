"""Pre-quantized checkpoints (issue 28): compressed-tensors (made with its own library), AWQ
and GPTQ (packed here from their format specs), FP8 block-wise; each loads into the float
weights it stands for, and a tiny model generates exactly what the same model with the
dequantized weights generates. Unsupported formats are refused naming the field."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagoda import LLM, SamplingParams
from pagoda.models import load_model
from pagoda.models.quant_checkpoint import AWQ_REVERSE_ORDER, parse_quantization_config
from pagoda.models.quant_write import AWQ_PACK_ORDER, awq_tensors, fp8_block_tensors, gptq_tensors, write_variant
from tests.engine.hf_reference import save_random_model

PROMPTS = [[5, 17, 300, 42, 9], [1, 2000, 31, 7]]


@pytest.fixture(scope="module")
def float_model(tmp_path_factory, smollm2_dir):
    """A tiny random Llama in fp32 (K = 256 and 384: every group size divides)."""
    return save_random_model(tmp_path_factory.mktemp("q") / "float", str(smollm2_dir), 3, "LlamaConfig",
                             vocab_size=49152, hidden_size=256, intermediate_size=384, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                             tie_word_embeddings=True)


# ------------------------------------------------------------------ compressed-tensors, its own way
def compressed_tensors_variant(fmt: str, bits: int, strategy: str, group: int, symmetric: bool):
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams

    kind = "float" if fmt == "float-quantized" else "int"
    args = QuantizationArgs(num_bits=bits, type=kind, symmetric=symmetric, strategy=strategy,
                            group_size=group if strategy == "group" else None)
    scheme = QuantizationScheme(targets=["Linear"], weights=args, format=fmt)
    compressor = BaseCompressor.load_from_registry(fmt)

    def replace(prefix, weight):
        n, k = weight.shape
        view = weight.reshape(n, k // group, group) if strategy == "group" else weight.reshape(n, 1, k) \
            if strategy == "channel" else weight.reshape(1, 1, -1)
        scale, zero_point = calculate_qparams(view.amin(-1), view.amax(-1), args)
        scale = scale.reshape(n, -1) if strategy != "tensor" else scale.reshape(1)
        zero_point = zero_point.reshape(scale.shape)
        state = {"weight": weight, "weight_scale": scale, "weight_zero_point": zero_point}
        compressed = compressor.compress(state, scheme)
        reference = compressor.decompress(dict(compressed), scheme)["weight"]  # the library's dequantization
        return compressed, reference.float()

    config = QuantizationConfig(config_groups={"group_0": scheme}, format=fmt, quantization_status="compressed",
                                ignore=["lm_head"]).model_dump(exclude_none=True)
    config["quant_method"] = "compressed-tensors"
    return json.loads(json.dumps(config, default=str)), replace


VARIANTS = {
    "ct-w4a16-sym-g128": lambda: compressed_tensors_variant("pack-quantized", 4, "group", 128, True),
    "ct-w4a16-asym-g32": lambda: compressed_tensors_variant("pack-quantized", 4, "group", 32, False),
    "ct-w4a16-channel": lambda: compressed_tensors_variant("pack-quantized", 4, "channel", 0, True),
    "ct-w8a16-int8": lambda: compressed_tensors_variant("naive-quantized", 8, "channel", 0, True),
    "ct-fp8-channel": lambda: compressed_tensors_variant("float-quantized", 8, "channel", 0, True),
    "awq-g128": lambda: ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"},
                         lambda p, w: awq_tensors(w)),
    "gptq-g64": lambda: ({"quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": False, "sym": True},
                         lambda p, w: gptq_tensors(w, 4, 64, False, 0)),
    "gptq-g32-act-order": lambda: ({"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True,
                                    "sym": True}, lambda p, w: gptq_tensors(w, 4, 32, True, len(p))),
    "gptq-8bit": lambda: ({"quant_method": "gptq", "bits": 8, "group_size": 128, "sym": True},
                          lambda p, w: gptq_tensors(w, 8, 128, False, 0)),
    "fp8-block": lambda: ({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                           "weight_block_size": [128, 128]}, lambda p, w: fp8_block_tensors(w)),
}


def quantized_and_dequantized(variant: str, float_model: Path, tmp_path: Path) -> tuple[Path, Path]:
    """The variant's checkpoint, and the same model with its expected dequantized weights as floats
    (for compressed-tensors: the library's own ``decompress``; for AWQ/GPTQ/FP8: the spec's math)."""
    quant_config, replace = VARIANTS[variant]()
    expected = write_variant(float_model, tmp_path / variant, quant_config, replace)
    dequantized = tmp_path / "dequantized"
    shutil.copytree(float_model, dequantized)
    state = load_file(str(dequantized / "model.safetensors"))
    state.update({f"{prefix}.weight": w.float() for prefix, w in expected.items()})
    save_file(state, str(dequantized / "model.safetensors"))
    return tmp_path / variant, dequantized


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_checkpoint_loads_into_exactly_its_dequantized_weights(variant, float_model, tmp_path):
    quantized, dequantized = quantized_and_dequantized(variant, float_model, tmp_path)
    quantized_model, reference_model = load_model(quantized), load_model(dequantized)
    for (name, a), (_, b) in zip(quantized_model.state_dict().items(), reference_model.state_dict().items()):
        assert torch.equal(a, b), name  # exact: integers times float32 scales, the same on both sides


@pytest.mark.parametrize("variant", ["gptq-g32-act-order", "ct-w4a16-asym-g32"])
def test_the_engine_generates_what_the_dequantized_model_generates(variant, float_model, tmp_path):
    quantized, dequantized = quantized_and_dequantized(variant, float_model, tmp_path)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = [[o.outputs[0].token_ids for o in LLM(model=str(path), max_model_len=256).generate(PROMPTS, params)]
               for path in (quantized, dequantized)]
    assert outputs[0] == outputs[1]


def test_awq_unpack_order_is_autoawqs():
    """The order AutoAWQ packs (nibble i holds column (0,2,4,6,1,3,5,7)[i]) and the order the
    loader unpacks with are inverse permutations."""
    assert [AWQ_PACK_ORDER[AWQ_REVERSE_ORDER[j]] for j in range(8)] == list(range(8))


@pytest.mark.parametrize("config, message", [
    ({"quant_method": "bitsandbytes"}, "quant_method: 'bitsandbytes' is not supported"),
    ({"quant_method": "awq", "version": "gemv", "bits": 4}, "quantization_config.version: 'gemv'"),
    ({"quant_method": "awq", "bits": 3}, "quantization_config.bits: 3"),
    ({"quant_method": "gptq", "bits": 3}, "quantization_config.bits: 3"),
    ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "checkpoint_format: 'marlin'"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "quantization_config.fmt: 'e5m2'"),
    ({"quant_method": "compressed-tensors", "format": "marlin-24", "config_groups": {
        "g": {"weights": {"num_bits": 4, "type": "int", "strategy": "group"}}}}, "format: 'marlin-24'"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {"format": "pack-quantized", "weights": {
        "num_bits": 4, "type": "float", "strategy": "group"}}}}, "config_groups.g.weights.type: 'float'"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {"format": "pack-quantized", "weights": {
        "num_bits": 2, "type": "int", "strategy": "group"}}}}, "weights.num_bits: 2"),
    ({"quant_method": "compressed-tensors", "config_groups": {}}, "config_groups: required"),
])
def test_unsupported_formats_are_refused_naming_the_field(config, message):
    with pytest.raises(ValueError) as info:
        parse_quantization_config({"quantization_config": config})
    assert message in str(info.value)


def test_a_quantized_config_without_quantized_tensors_is_refused(float_model, tmp_path):
    out = tmp_path / "claims"
    shutil.copytree(float_model, out)
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm"}
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="no tensor of the checkpoint is quantized"):
        load_model(out)


@pytest.mark.parametrize("variant", ["ct-w4a16-asym-g32", "awq-g128", "gptq-g32-act-order"])
def test_4bit_weights_stay_packed_and_serve_the_same_tokens(variant, float_model, tmp_path, monkeypatch):
    """With 4-bit weights kept packed (on CUDA by default; PAGODA_KEEP_QUANTIZED=1 here) every
    fused projection is an Int4Weight that dequantizes to exactly the float model's weight and
    holds about a quarter of the bytes; the W4A16 Triton kernel (interpreter) computes each
    projection as the float weight does; the engine gives the same greedy tokens. In the
    act-order checkpoint gate and up have different permutations, so gate_up stays float."""
    from pagoda.kernels.triton_w4a16 import w4a16_linear
    from pagoda.models.int4 import Int4Weight

    quantized, dequantized = quantized_and_dequantized(variant, float_model, tmp_path)
    monkeypatch.setenv("PAGODA_KEEP_QUANTIZED", "1")
    packed, reference = load_model(quantized), load_model(dequantized)
    floats = dict(reference.named_modules())
    pairs = {(name, attr): (getattr(a, attr), getattr(floats[name], attr)) for name, a in packed.named_modules()
             for attr in getattr(a, "linear_weights", ())}
    stays_float = {"gate_up_weight"} if "act-order" in variant else set()
    assert len(pairs) == 8  # qkv, o, gate_up, down x 2 layers
    for (name, attr), (weight, float_weight) in pairs.items():
        if attr in stays_float:
            assert not isinstance(weight, Int4Weight), name
            continue
        assert isinstance(weight, Int4Weight), (name, attr)
        assert torch.equal(weight.dequantize(), float_weight)
        if ".layers.0." not in name + ".":
            continue  # the kernel on one layer's projections (the interpreter is slow)
        x = torch.randn(5, weight.in_features, generator=torch.Generator().manual_seed(0))
        kernel = w4a16_linear(x, weight.qweight, weight.scales, weight.zeros, weight.group_size, weight.perm)
        torch.testing.assert_close(kernel.double(), x.double() @ float_weight.double().T, rtol=1e-5, atol=1e-5)
    int4 = [w for w, _ in pairs.values() if isinstance(w, Int4Weight)]
    int4_bytes = sum(t.numel() * t.element_size() for w in int4 for t in w.buffers())
    # half a byte per weight + float32 scales (and zeros) per group: 0.25-0.375 of bf16 at groups 32..K
    assert int4_bytes < 0.4 * sum(w.shape.numel() * 2 for w in int4)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outputs = [[o.outputs[0].token_ids for o in LLM(model=str(path), max_model_len=128).generate(PROMPTS, params)]
               for path in (quantized, dequantized)]
    assert outputs[0] == outputs[1]


def test_gpt_oss_mxfp4_is_left_to_its_own_reader():
    assert parse_quantization_config({"quantization_config": {"quant_method": "mxfp4",
                                                              "modules_to_not_convert": ["router"]}}) is None
    assert parse_quantization_config({}) is None


def test_bench_formats_write_checkpoints_the_loader_reads(float_model, tmp_path):
    """``pagoda bench quant``'s checkpoint methods: each format written from a float folder
    loads, and its weights are the float ones up to the format's rounding."""
    from pagoda.models.quant_write import FORMATS, write_quantized

    reference = dict(load_model(float_model).named_parameters())
    for method in FORMATS:
        model = load_model(write_quantized(float_model, tmp_path / method, method))
        weight = dict(model.named_parameters())["layers.0.attn.qkv_weight"]
        exact = reference["layers.0.attn.qkv_weight"]
        # 4-bit: half a step (at most amax/14 for the symmetric grid) plus the fp16 scale; fp8: 2^-4 relative.
        tolerance = exact.abs().max().item() * 0.08
        assert (weight - exact).abs().max().item() <= tolerance, method


@pytest.mark.parametrize("variant", ["ct-fp8-channel", "fp8-block"])
def test_fp8_checkpoints_keep_their_e4m3_values_as_fp8_weights(variant, float_model, tmp_path, monkeypatch):
    """Kept quantized, a row-scaled FP8 checkpoint becomes Fp8Weight holding the checkpoint's own
    e4m3 values (the existing FP8 paths serve it); 128x128 blocks have no row form and stay float."""
    from pagoda.models.fp8 import Fp8Weight

    quantized, dequantized = quantized_and_dequantized(variant, float_model, tmp_path)
    monkeypatch.setenv("PAGODA_KEEP_QUANTIZED", "1")
    kept, reference = load_model(quantized), load_model(dequantized)
    floats = dict(reference.named_modules())
    weights = [(getattr(a, attr), getattr(floats[name], attr)) for name, a in kept.named_modules()
               for attr in getattr(a, "linear_weights", ())]
    assert len(weights) == 8
    if variant == "fp8-block":
        assert not any(isinstance(w, Fp8Weight) for w, _ in weights)
        return
    assert all(isinstance(w, Fp8Weight) and w.qweight.dtype == torch.float8_e4m3fn for w, _ in weights)
    for weight, float_weight in weights:
        assert torch.equal(weight.dequantize(), float_weight)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outputs = [[o.outputs[0].token_ids for o in LLM(model=str(path), max_model_len=128).generate(PROMPTS, params)]
               for path in (quantized, dequantized)]
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize("method", ["awq", "fp8-channel"])
def test_default_model_checkpoint_logits_are_within_the_bound_of_a_float64_reference(
        method, smollm2_dir, tmp_path, monkeypatch):
    """The default model written as a 4-bit AWQ-layout (group 64, kept packed: Int4Weight) or an
    FP8 per-channel checkpoint (kept as Fp8Weight): pagoda's fp32 prefill logits are within the
    derived rounding bound (tests/numerics.py) of transformers' float64 forward of the same
    dequantized weights."""
    transformers = pytest.importorskip("transformers")
    from pagoda.models.int4 import Int4Weight
    from pagoda.models.fp8 import Fp8Weight
    from pagoda.models.quant_write import FORMATS
    from pagoda.models.testing import StepInput, make_kv_caches, run_step
    from pagoda.models.tokenizer import Tokenizer
    from tests.numerics import assert_within, model_error_bound

    config, replace = FORMATS[method]
    expected = write_variant(Path(smollm2_dir), tmp_path / method, config, lambda p, w: replace(p, w.float()))
    dequantized = tmp_path / "dequantized"
    shutil.copytree(smollm2_dir, dequantized)
    state = load_file(str(dequantized / "model.safetensors"))
    state.update({f"{prefix}.weight": w.float() for prefix, w in expected.items()})
    save_file(state, str(dequantized / "model.safetensors"))

    monkeypatch.setenv("PAGODA_KEEP_QUANTIZED", "1")
    model = load_model(tmp_path / method)
    kind = Int4Weight if method == "awq" else Fp8Weight
    assert sum(isinstance(m, kind) for m in model.modules()) == 4 * model.config.num_hidden_layers
    ids = Tokenizer.from_pretrained(smollm2_dir).encode("The old mill by the river still turns on Sundays")
    kv = make_kv_caches(model.config, 8, 16)
    ours = run_step(model, kv, [StepInput(ids, 0, list(range(8)))], 16)
    hf = transformers.AutoModelForCausalLM.from_pretrained(dequantized, dtype=torch.float64).eval()
    with torch.no_grad():
        exact = hf(torch.tensor([ids])).logits[0]
    bound = model_error_bound(model.config, len(ids), torch.float32, exact.abs().max().item())
    assert_within(ours, exact, bound, f"{method} default model vs float64")


def test_lora_on_a_4bit_base_equals_lora_on_the_dequantized_base(float_model, tmp_path, monkeypatch):
    """A PEFT adapter on every projection serves on a kept-packed 4-bit base exactly as on the
    same base with dequantized float weights (the adapter's delta is added to the base output)."""
    from tests.engine.lora_reference import make_peft_adapter

    quantized, dequantized = quantized_and_dequantized("awq-g128", float_model, tmp_path)
    adapter = make_peft_adapter(str(dequantized), tmp_path / "adapters", "all-r4", seed=1)
    monkeypatch.setenv("PAGODA_KEEP_QUANTIZED", "1")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outputs = []
    for path in (quantized, dequantized):
        llm = LLM(model=str(path), max_model_len=128, enable_lora=True, max_lora_rank=8,
                  lora_modules={"a": str(adapter)})
        outputs.append([o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, lora_name="a")])
        base = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    assert outputs[0] == outputs[1] and outputs[1] != base  # the adapter matters, and the same on both bases


def test_checkpoint_kv_cache_scales_reach_the_fp8_kv_cache(float_model, tmp_path):
    """``model.layers.N.self_attn.k_scale`` / ``v_scale`` (vLLM's names) become each layer's fp8
    KV-cache scales: an fp8 cache uses them (an extreme scale saturates and changes the answer),
    an fp32 cache ignores them, and a non-positive scale is refused naming the tensor."""
    quantized, _ = quantized_and_dequantized("ct-fp8-channel", float_model, tmp_path)

    def with_scales(name: str, value: float) -> Path:
        out = tmp_path / name
        shutil.copytree(quantized, out)
        state = load_file(str(out / "model.safetensors"))
        for layer in range(2):
            for kind in ("k_scale", "v_scale"):
                state[f"model.layers.{layer}.self_attn.{kind}"] = torch.tensor(value)
        save_file(state, str(out / "model.safetensors"))
        return out

    scaled = with_scales("scaled", 1e-3)
    model = load_model(scaled)
    assert [(layer.attn.k_scale, layer.attn.v_scale) for layer in model.layers] == [(pytest.approx(1e-3),) * 2] * 2
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    def tokens(path: Path, kv_cache_dtype: str) -> list:
        llm = LLM(model=str(path), max_model_len=128, kv_cache_dtype=kv_cache_dtype)
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]

    assert tokens(scaled, "auto") == tokens(quantized, "auto")  # fp32 cache: scales do not apply
    assert tokens(scaled, "fp8_e4m3") != tokens(quantized, "fp8_e4m3")  # |K| / 1e-3 saturates at 448
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.k_scale: a KV-cache scale must be"):
        load_model(with_scales("zero", 0.0))
