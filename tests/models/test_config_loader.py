"""ModelConfig parsing and validation; loader errors; GGUF import helpers."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from pagoda.models import (
    SUPPORTED_ARCHITECTURES, ModelConfig, build_model, config_from_dict, config_from_pretrained, load_model,
)
from pagoda.models.gguf_import import IMPORT_VERSION, _is_current_import, _unpermute_rotary_rows, default_model_dir

BASE = dict(
    architectures=["LlamaForCausalLM"],
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
)


def config(**overrides) -> ModelConfig:
    return config_from_dict({**BASE, **overrides})


def test_defaults_and_derived_values():
    c = config(eos_token_id=[5, 7], rope_theta=500000.0)
    assert (c.head_dim, c.rope_theta, c.rope_type, c.rope_scaling) == (8, 500000.0, "default", None)
    assert c.eos_token_ids == [5, 7] and config(eos_token_id=3).eos_token_ids == [3]
    assert not c.attention_bias and not c.tie_word_embeddings
    assert c.check_max_model_len(None) == 64 and c.check_max_model_len(32) == 32
    with pytest.raises(ValueError, match="max_position_embeddings"):
        c.check_max_model_len(65)


def test_rope_theta_from_transformers5_rope_parameters():
    c = config(rope_parameters={"rope_type": "default", "rope_theta": 12345.0})
    assert (c.rope_theta, c.rope_scaling) == (12345.0, None)


@pytest.mark.parametrize("layout", ["v4", "v5"])
def test_llama3_rope_scaling_matches_transformers(layout):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16)
    if layout == "v4":
        c = config(rope_theta=500000.0, rope_scaling={"type": "llama3", **scaling}, hidden_size=64)
    else:
        c = config(rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, **scaling}, hidden_size=64)
    hf_config = transformers.LlamaConfig(
        **{k: v for k, v in BASE.items() if k not in ("architectures", "hidden_size")},
        hidden_size=64,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, **scaling},
    )
    hf_inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config, "cpu")
    assert c.rope_type == "llama3"
    assert torch.equal(c.inv_freq(), hf_inv_freq.float())


YARN_CASES = {  # gpt-oss's (no truncation); DeepSeek-style mscales; a given attention factor; factor from lengths
    "gpt-oss": dict(factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False, original_max_position_embeddings=16),
    "mscale": dict(factor=4.0, mscale=0.707, mscale_all_dim=1.0, original_max_position_embeddings=16),
    "attention-factor": dict(factor=2.0, attention_factor=1.25, beta_fast=8, original_max_position_embeddings=32),
    "factor-none": dict(factor=None, original_max_position_embeddings=16),
}


@pytest.mark.parametrize("case", YARN_CASES)
def test_yarn_rope_matches_transformers(case):
    """inv_freq bit for bit and the cos/sin scale equal transformers' ``_compute_yarn_parameters``."""
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_type": "yarn", "rope_theta": 150000.0, **YARN_CASES[case]}
    c = config(rope_parameters=params, hidden_size=64, max_position_embeddings=256)
    hf_config = transformers.LlamaConfig(
        **{k: v for k, v in BASE.items() if k not in ("architectures", "hidden_size", "max_position_embeddings")},
        hidden_size=64, max_position_embeddings=256, rope_parameters=dict(params))
    hf_inv_freq, hf_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_config, "cpu")
    assert c.rope_type == "yarn"
    assert torch.equal(c.inv_freq(), hf_inv_freq.float())
    assert c.rope_attention_factor == hf_factor and hf_factor != 1.0
    assert not torch.equal(c.inv_freq(), config(rope_theta=150000.0, hidden_size=64).inv_freq())
    from pagoda.models.llama import make_cos_sin_cache

    table = make_cos_sin_cache(c)
    assert torch.allclose(table[0, : c.head_dim // 2], torch.full((c.head_dim // 2,), hf_factor))  # cos(0) * factor


def test_unsupported_inputs_are_refused_by_name():
    with pytest.raises(ValueError, match="GPT2LMHeadModel") as refused:
        config(architectures=["GPT2LMHeadModel"])
    assert f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}" in str(refused.value)
    assert "LlamaForCausalLM" in SUPPORTED_ARCHITECTURES
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
        config(architectures=None, model_type="gpt2")
    with pytest.raises(ValueError, match="rope type 'dynamic' is not supported"):
        config(rope_scaling={"rope_type": "dynamic", "factor": 4.0})
    with pytest.raises(ValueError, match="yarn rope scaling is missing original_max_position_embeddings"):
        config(rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ValueError, match="partial_rotary_factor 0.5"):
        config(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                             "partial_rotary_factor": 0.5})
    with pytest.raises(ValueError, match="llama3 rope scaling is missing"):
        config(rope_scaling={"rope_type": "llama3", "factor": 8.0})
    with pytest.raises(ValueError, match="gelu"):
        config(hidden_act="gelu")
    assert config(architectures=None, model_type="mistral").architecture == "MistralForCausalLM"


def test_qwen2_bias_and_mistral_sliding_window():
    qwen = config(architectures=["Qwen2ForCausalLM"], sliding_window=32, use_sliding_window=False)
    assert qwen.attention_bias and not qwen.o_proj_bias and qwen.sliding_window is None
    llama_bias = config(attention_bias=True)
    assert llama_bias.attention_bias and llama_bias.o_proj_bias
    mistral = config(architectures=["MistralForCausalLM"], sliding_window=32)
    # the window is applied by the attention, so the context is not capped at it
    assert mistral.check_max_model_len(None) == 64 and mistral.check_max_model_len(48) == 48
    assert mistral.layer_window(0) == 32 and config().layer_window(0) == 0
    qwen_swa = config(architectures=["Qwen2ForCausalLM"], num_hidden_layers=3, sliding_window=16,
                      use_sliding_window=True, max_window_layers=1)
    assert [qwen_swa.layer_window(i) for i in range(3)] == [0, 16, 16]
    typed = config(architectures=["Qwen3ForCausalLM"], num_hidden_layers=2, sliding_window=8, use_sliding_window=True,
                   layer_types=["sliding_attention", "full_attention"])
    assert [typed.layer_window(i) for i in range(2)] == [8, 0]


def test_from_pretrained_reads_a_folder(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(BASE))
    assert config_from_pretrained(tmp_path).num_key_value_heads == 2


# ---- loader ------------------------------------------------------------------------


def write_checkpoint(folder, drop=(), extra=(), **overrides):
    cfg = {**BASE, "tie_word_embeddings": True, **overrides}
    (folder / "config.json").write_text(json.dumps(cfg))
    c = config_from_dict(cfg)
    names = build_model(c).expected_weight_names()
    shapes = {name: _hf_shape(name, c) for name in names}
    tensors = {n: torch.randn(s) for n, s in shapes.items() if n not in drop}
    tensors.update({n: torch.zeros(2) for n in extra})
    save_file(tensors, str(folder / "model.safetensors"))
    return tensors


def _hf_shape(name: str, c: ModelConfig) -> tuple[int, ...]:
    kv = c.num_key_value_heads * c.head_dim
    table = {
        "embed_tokens": (c.vocab_size, c.hidden_size),
        "lm_head": (c.vocab_size, c.hidden_size),
        "q_proj": (c.num_attention_heads * c.head_dim, c.hidden_size),
        "k_proj": (kv, c.hidden_size),
        "v_proj": (kv, c.hidden_size),
        "o_proj": (c.hidden_size, c.num_attention_heads * c.head_dim),
        "gate_proj": (c.intermediate_size, c.hidden_size),
        "up_proj": (c.intermediate_size, c.hidden_size),
        "down_proj": (c.hidden_size, c.intermediate_size),
    }
    for key, shape in table.items():
        if key in name:
            return shape if name.endswith("weight") else shape[:1]
    return (c.hidden_size,)  # norms


def test_loader_fuses_weights_and_casts(tmp_path):
    tensors = write_checkpoint(tmp_path, extra=["lm_head.weight", "model.layers.0.self_attn.rotary_emb.inv_freq"])
    model = load_model(tmp_path, dtype=torch.bfloat16)
    attn = model.layers[0].attn
    assert attn.qkv_weight.dtype == torch.bfloat16
    k = tensors["model.layers.0.self_attn.k_proj.weight"].to(torch.bfloat16)
    assert torch.equal(attn.qkv_weight[attn.q_size : attn.q_size + attn.kv_size], k)
    assert model.lm_head is model.embed_tokens


def test_loader_names_missing_and_unexpected_weights(tmp_path):
    write_checkpoint(tmp_path, drop=["model.layers.0.mlp.up_proj.weight"], extra=["model.layers.1.mlp.up_proj.weight"])
    with pytest.raises(ValueError, match=r"missing 1 tensors \(model.layers.0.mlp.up_proj.weight\).*unexpected 1"):
        load_model(tmp_path)


def test_loader_rejects_wrong_shapes_and_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(BASE))
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_model(tmp_path)
    write_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**BASE, "tie_word_embeddings": True, "intermediate_size": 40}))
    with pytest.raises(ValueError, match="shape"):
        load_model(tmp_path)


# ---- GGUF helpers ------------------------------------------------------------------


def test_unpermute_inverts_llama_cpp_permutation():
    num_heads, head_dim, hidden = 3, 8, 5
    weight = torch.arange(num_heads * head_dim * hidden, dtype=torch.float32).reshape(-1, hidden).numpy()
    # llama.cpp's converter: per head, interleave the two rotary halves.
    permuted = weight.reshape(num_heads, 2, head_dim // 2, hidden).swapaxes(1, 2).reshape(weight.shape)
    assert (_unpermute_rotary_rows(permuted, num_heads) == weight).all()


def test_default_model_dir_honours_env(monkeypatch, tmp_path):
    monkeypatch.setenv("PAGODA_MODEL_DIR", str(tmp_path / "m"))
    assert default_model_dir() == tmp_path / "m"
    monkeypatch.delenv("PAGODA_MODEL_DIR")
    assert default_model_dir().parts[-3:] == ("pagoda", "models", "SmolLM2-135M-Instruct")


def test_cached_import_is_reused_only_when_current(tmp_path):
    def write(**cfg):
        (tmp_path / "config.json").write_text(json.dumps(cfg))

    assert not _is_current_import(tmp_path, "float32")  # nothing there yet
    write(torch_dtype="float32")  # an older importer wrote no version
    assert not _is_current_import(tmp_path, "float32")
    write(torch_dtype="float32", pagoda_gguf_import_version=IMPORT_VERSION)
    assert _is_current_import(tmp_path, "float32") and not _is_current_import(tmp_path, "bfloat16")


def test_qwen3_head_dim_is_its_own_and_no_bias_by_default():
    qwen3 = config(architectures=["Qwen3ForCausalLM"], head_dim=24, sliding_window=32, use_sliding_window=False)
    assert qwen3.head_dim == 24 and qwen3.hidden_size // qwen3.num_attention_heads == 8
    assert not qwen3.attention_bias and not qwen3.o_proj_bias and qwen3.sliding_window is None
    model = build_model(qwen3)
    assert {"model.layers.0.self_attn.q_norm.weight", "model.layers.0.self_attn.k_norm.weight"} <= \
        model.expected_weight_names()
    assert type(model).__name__ == "Qwen3ForCausalLM"


GEMMA3 = dict(architectures=["Gemma3ForCausalLM"], hidden_activation="gelu_pytorch_tanh", num_hidden_layers=7,
              head_dim=16, sliding_window=8, query_pre_attn_scalar=24)


@pytest.mark.parametrize("layout", ["v4", "v5"])
def test_gemma3_rope_per_layer_type_and_its_fields(layout):
    """transformers 5 keys rope_parameters by layer type; transformers 4 wrote rope_theta,
    rope_scaling (global layers) and rope_local_base_freq at top level, and
    sliding_window_pattern instead of layer_types. Both give transformers' inv_freq."""
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {"rope_type": "linear", "factor": 8.0}
    by_type = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
               "full_attention": {**scaling, "rope_theta": 1e6}}
    if layout == "v5":
        layer_types = ["sliding_attention"] * 5 + ["full_attention"] * 2
        c = config(**GEMMA3, rope_parameters=by_type, layer_types=layer_types)
    else:
        c = config(**GEMMA3, rope_theta=1e6, rope_scaling=scaling, rope_local_base_freq=10000.0,
                   sliding_window_pattern=6)
        layer_types = ["sliding_attention"] * 5 + ["full_attention", "sliding_attention"]
    assert c.architecture == "Gemma3ForCausalLM" and list(c.layer_types) == layer_types
    assert (c.rope_theta, c.rope_scaling, c.local_rope_theta) == (1e6, {"rope_type": "linear", "factor": 8.0}, 1e4)
    assert c.query_pre_attn_scalar == 24.0 and c.final_logit_softcapping is None
    assert [c.layer_window(i) for i in range(7)] == [8 if t == "sliding_attention" else 0 for t in layer_types]
    fields = {k: v for k, v in {**BASE, **GEMMA3}.items() if k != "architectures"}
    hf = transformers.Gemma3TextConfig(**fields, rope_parameters=by_type, layer_types=layer_types)
    hf_inv_freq, _ = ROPE_INIT_FUNCTIONS["linear"](hf, "cpu", layer_type="full_attention")
    assert torch.equal(c.inv_freq(), hf_inv_freq.float())
    model = build_model(c)
    assert torch.equal(model.local_cos_sin_cache[5, :8], torch.cos(5 * 1e4 ** -(torch.arange(0, 16, 2) / 16)))
    assert "lm_head.weight" not in model.expected_weight_names()  # tied by default
    assert {"model.layers.0.pre_feedforward_layernorm.weight", "model.layers.0.post_feedforward_layernorm.weight",
            "model.layers.0.self_attn.q_norm.weight"} <= model.expected_weight_names()


def test_gemma3_refuses_what_the_kernels_do_not_do():
    with pytest.raises(ValueError, match="hidden_activation 'gelu' is not supported"):
        config(**{**GEMMA3, "hidden_activation": "gelu"})
    with pytest.raises(ValueError, match="attn_logit_softcapping"):
        config(**GEMMA3, attn_logit_softcapping=50.0)
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        config(**GEMMA3, use_bidirectional_attention=True)
    with pytest.raises(ValueError, match="sliding_attention layers"):
        config(**GEMMA3, rope_parameters={"sliding_attention": {"rope_type": "linear", "factor": 2.0},
                                          "full_attention": {"rope_type": "default"}})
    with pytest.raises(ValueError, match="linear rope scaling is missing factor"):
        config(rope_scaling={"rope_type": "linear"})
    assert config(architectures=None, model_type="gemma3_text").architecture == "Gemma3ForCausalLM"
    with pytest.raises(ValueError, match="Gemma3ForConditionalGeneration"):  # the multimodal one: not served
        config(architectures=["Gemma3ForConditionalGeneration"])


def test_gpt_oss_config_defaults_as_transformers():
    """Absent fields take GptOssConfig's defaults: even layers slide, YaRN (factor 32 over
    4096, base 150000, untruncated), attention bias, top-4, SwiGLU (1.702, 7.0); OpenAI's
    ``experts_per_token`` is read too; a config without experts is refused by name."""
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    raw = {k: v for k, v in BASE.items() if k != "architectures"}
    c = config(architectures=["GptOssForCausalLM"], num_hidden_layers=3, num_local_experts=8, sliding_window=4,
               head_dim=16, max_position_embeddings=131072)
    assert c.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
    assert [c.layer_window(i) for i in range(3)] == [4, 0, 4]
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) == (8, 4, 48)
    assert c.clamped_swiglu == (1.702, 7.0) and c.attention_sinks and c.attention_bias and c.o_proj_bias
    hf = transformers.GptOssConfig(**{**raw, "num_hidden_layers": 3, "head_dim": 16, "max_position_embeddings": 131072})
    hf_inv_freq, hf_factor = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    assert c.rope_type == "yarn" and c.rope_theta == 150000.0
    assert torch.equal(c.inv_freq(), hf_inv_freq.float()) and c.rope_attention_factor == hf_factor
    openai_key = config(architectures=["GptOssForCausalLM"], num_local_experts=8, experts_per_token=2)
    assert openai_key.num_experts_per_tok == 2
    with pytest.raises(ValueError, match="missing num_local_experts"):
        config(architectures=["GptOssForCausalLM"])
    model = build_model(c)
    assert {"model.layers.0.self_attn.sinks", "model.layers.0.mlp.router.bias",
            "model.layers.2.mlp.experts.down_proj_bias", "model.layers.1.self_attn.o_proj.bias",
            "lm_head.weight"} <= model.expected_weight_names()
    assert model.layers[0].attn.sinks.dtype == torch.float32
