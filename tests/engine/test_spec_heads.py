"""EAGLE-3 and MTP draft heads (engine/spec_decode/eagle3.py, mtp.py, hidden_proposer.py)
through the whole engine, with random-weight heads written in their published layouts
(``random_heads.py``) for tiny random targets (SmolLM2's tokenizer, a 2048-token vocabulary)
and for SmolLM2-135M itself.

The bar is the existing one (tests/engine/test_spec_engine.py): greedy and seeded outputs
equal the plain engine's token for token, alone and in mixed batches with chunked prefill,
prefix-cache hits, preemption and structured output; every target and head block is free
at the end. Seeded sampling at a high temperature makes a random head agree with the
target often but not always (both race the same noise over near-flat distributions), so
accepted and rejected drafts, and the head's KV rollback, are all exercised. The target's
auxiliary hidden states are checked against Hugging Face's ``output_hidden_states``.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil

import pytest
import torch

from pagoda.engine.config import EngineConfig
from pagoda.engine.llm_engine import LLMEngine
from pagoda.engine.sampling_params import SamplingParams
from pagoda.engine.spec_decode.random_heads import add_random_mtp_layers, write_random_eagle3_head

from tests.engine.hf_reference import save_random_model
from tests.engine.test_spec_engine import BLOCKS, GREEDY, SMALL, _prompts, _run, _tokens, make_small_model
from tests.numerics import assert_within, model_error_bound

HOT = [SamplingParams(temperature=50.0, seed=s, max_tokens=20, ignore_eos=True) for s in range(4)]


@pytest.fixture(scope="module")
def paths(tmp_path_factory, smollm2_path):
    root = tmp_path_factory.mktemp("heads")
    target = make_small_model(root / "target", smollm2_path, seed=0)
    mtp = shutil.copytree(target, root / "mtp")
    add_random_mtp_layers(mtp, seed=5)
    qwen3 = save_random_model(root / "qwen3", smollm2_path, 0, "Qwen3Config", **SMALL)
    add_random_mtp_layers(qwen3, seed=6, style="qwen3_next")
    return {"target": target, "mtp": str(mtp), "qwen3": str(qwen3),
            "head": str(write_random_eagle3_head(root / "head", target, seed=3)),
            "head-d2t": str(write_random_eagle3_head(root / "head-d2t", target, seed=4, draft_vocab_size=512,
                                                     own_embeddings=True))}


HEADS = {  # name -> (target, engine overrides)
    "eagle3": ("target", dict(speculative_method="eagle3", speculative_model="head")),
    "eagle3-d2t": ("target", dict(speculative_method="eagle3", speculative_model="head-d2t")),
    "mtp-deepseek": ("mtp", dict(speculative_method="mtp")),
    "mtp-qwen3-next": ("qwen3", dict(speculative_method="mtp")),
}


def _engine(paths, name=None, target="target", **overrides) -> LLMEngine:
    values = dict(model=paths[target], num_gpu_blocks_override=BLOCKS)
    if name is not None:
        target, spec = HEADS[name]
        values["model"] = paths[target]
        values.update(spec)
        if "speculative_model" in spec:
            values["speculative_model"] = paths[spec["speculative_model"]]
    values.update(overrides)
    return LLMEngine(EngineConfig(**values))


@pytest.fixture(scope="module")
def expected(paths):
    """Plain outputs per target: greedy and hot seeded, four prompts each."""
    prompts, out = _prompts(4), {}
    for target in ("target", "mtp", "qwen3"):
        base = _engine(paths, target=target)
        out[target] = (_tokens(_run(base, [(p, GREEDY) for p in prompts])),
                       _tokens(_run(base, list(zip(prompts, HOT)))))
    return prompts, out


@pytest.mark.parametrize("name", sorted(HEADS))
def test_greedy_and_seeded_equal_plain_in_mixed_batches(paths, expected, name):
    prompts, out = expected
    greedy, hot = out[HEADS[name][0]]
    engine = _engine(paths, name, max_num_batched_tokens=32, spec_adaptive=False, num_speculative_tokens=3)
    assert _tokens(_run(engine, [(prompts[1], GREEDY)])) == greedy[1:2]
    steps = []
    mixed = [(p, GREEDY.clone(speculative=False) if i % 2 else GREEDY) for i, p in enumerate(prompts)]
    assert _tokens(_run(engine, mixed, record=steps)) == greedy
    assert any(any(n > 0 for n, _ in step) and any(not sampling for _, sampling in step) for step in steps), \
        "some step must verify drafts next to a prefill chunk"
    before = engine.get_stats()
    assert _tokens(_run(engine, list(zip(prompts, HOT)))) == hot
    stats = engine.get_stats()
    drafted = stats.spec_num_draft_tokens - before.spec_num_draft_tokens
    accepted = stats.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    assert 0 < accepted < drafted, (accepted, drafted)  # both paths of verification, and the head's rollback


def test_adaptive_window_prefix_cache_and_preemption(paths, expected):
    """The adaptive window (the default) and a second round whose prompts hit the prefix
    cache (the head starts past the cached positions: their hidden states were never
    computed), then a cache too small for all requests (preemption by recompute)."""
    prompts, out = expected
    hot = out["target"][1]
    engine = _engine(paths, "eagle3")
    assert _tokens(_run(engine, list(zip(prompts, HOT)))) == hot
    hits = engine.get_stats().prefix_cache_hits
    assert _tokens(_run(engine, list(zip(prompts, HOT)))) == hot
    assert engine.get_stats().prefix_cache_hits > hits
    long_prompts = _prompts(3, seed=8, lengths=(40,))
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = _tokens(_run(_engine(paths), [(p, params) for p in long_prompts]))
    small = _engine(paths, "eagle3", num_gpu_blocks_override=7, enable_prefix_caching=False)
    assert _tokens(_run(small, [(p, params) for p in long_prompts])) == plain
    stats = small.get_stats()
    assert stats.num_preemptions > 0 and stats.spec_num_drafts > 0


def test_aux_hidden_states_equal_hugging_face(paths):
    """The residual stream the target keeps for EAGLE-3 (ids 0 = embeddings, 1, 1 again)
    equals transformers' ``hidden_states[i]`` (the input of layer i) within the derived bound."""
    from transformers import AutoModelForCausalLM

    from pagoda.models.loader import load_model
    from pagoda.models.testing import StepInput, make_kv_caches, run_step

    model = load_model(paths["target"])
    model.aux_layer_ids = (0, 1, 1)
    prompt = _prompts(1, seed=3, lengths=(19,))[0]
    run_step(model, make_kv_caches(model.config, 4, 16), [StepInput(prompt, 0, [1, 2])], 16)
    hf = AutoModelForCausalLM.from_pretrained(paths["target"], dtype=torch.float64).eval()
    with torch.inference_mode():
        states = hf(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    reference = torch.cat([states[0][0], states[1][0], states[1][0]], dim=-1)
    bound = model_error_bound(model.config, len(prompt), torch.float32, reference.abs().max().item())
    assert_within(model.aux_hidden, reference, bound, "auxiliary hidden states")


def test_structured_output_on_smollm2_with_a_matched_head(tmp_path, smollm2_path):
    """A random head matched to the default model (576 hidden, 30 layers: aux ids 2, 15,
    27): constrained and free greedy requests equal the plain engine's."""
    from pagoda.engine.llm import LLM
    from pagoda.engine.sampling_params import GuidedDecodingParams

    head = write_random_eagle3_head(tmp_path / "head", smollm2_path, seed=1, draft_vocab_size=8192)
    regex = GuidedDecodingParams(regex=r"[a-z ]{5,30}\.")
    params = [SamplingParams(max_tokens=12, temperature=0, guided_decoding=regex),
              SamplingParams(max_tokens=8, temperature=0)]
    prompts = [[1, 504, 2931, 314, 253], [1, 1326, 416, 2226]]
    spec = LLM(model=smollm2_path, speculative_method="eagle3", speculative_model=str(head),
               spec_adaptive=False, num_speculative_tokens=2)
    assert spec.engine.runner.model.aux_layer_ids == (2, 15, 27)
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, params)]
    assert spec.engine.get_stats().spec_num_drafts > 0
    del spec
    plain = LLM(model=smollm2_path)
    assert got == [o.outputs[0].token_ids for o in plain.generate(prompts, params)]


def test_acceptance_reaches_the_spec_decode_metrics(paths):
    from types import SimpleNamespace

    from pagoda.serving.metrics import ServingMetrics
    from tests.serving.test_serving_metrics_unit import FakeMetricFamily, value

    engine = _engine(paths, "mtp-deepseek")
    _run(engine, list(zip(_prompts(2), HOT)))
    stats = engine.get_stats()
    FakeMetricFamily.created = {}
    ServingMetrics(SimpleNamespace(MetricFamily=FakeMetricFamily), {}).update_engine(stats)
    assert value("vllm:spec_decode_num_drafts_total") == stats.spec_num_drafts > 0
    assert value("vllm:spec_decode_num_draft_tokens_total") == stats.spec_num_draft_tokens
    assert value("vllm:spec_decode_num_accepted_tokens_total") == stats.spec_num_accepted_tokens > 0


def _edited_head(paths, tmp_path, **fields):
    """A consistent random head whose config.json then claims ``fields``."""
    import json

    folder = write_random_eagle3_head(tmp_path / "bad", paths["target"])
    raw = json.loads((folder / "config.json").read_text())
    raw.update(fields)
    (folder / "config.json").write_text(json.dumps(raw))
    return str(folder)


@pytest.mark.parametrize("fields, message", [
    (dict(vocab_size=4096), "vocab_size 4096 differs from the target's 2048"),
    (dict(target_hidden_size=256), "target_hidden_size 256 differs from the target's hidden_size 128"),
    (dict(eagle_aux_hidden_state_layer_ids=[0, 1, 2]), r"eagle_aux_hidden_state_layer_ids \[0, 1, 2\]"),
    (dict(draft_vocab_size=4096), r"draft_vocab_size 4096 must be in \[1, vocab_size=2048\]"),
    (dict(architectures=["MedusaModel"]), "architectures 'MedusaModel'"),
])
def test_loader_refuses_a_head_that_does_not_fit(paths, tmp_path, fields, message):
    with pytest.raises(ValueError, match=message):
        _engine(paths, speculative_method="eagle3", speculative_model=_edited_head(paths, tmp_path, **fields))


def test_loader_refuses_missing_tensors_and_checkpoints_without_mtp(paths, tmp_path):
    from safetensors.torch import load_file, save_file

    head = write_random_eagle3_head(tmp_path / "no-d2t", paths["target"], draft_vocab_size=512)
    tensors = load_file(head / "model.safetensors")
    del tensors["d2t"]
    save_file(tensors, head / "model.safetensors")
    with pytest.raises(ValueError, match="needs a d2t tensor"):
        _engine(paths, speculative_method="eagle3", speculative_model=str(head))
    del tensors["fc.weight"]
    save_file(tensors, head / "model.safetensors")
    with pytest.raises(ValueError, match="missing tensors fc.weight"):
        _engine(paths, speculative_method="eagle3", speculative_model=str(head))
    with pytest.raises(ValueError, match="no num_nextn_predict_layers"):
        _engine(paths, speculative_method="mtp")
    with pytest.raises(ValueError, match="the default model carries no MTP layers"):
        LLMEngine(EngineConfig(speculative_method="mtp", num_gpu_blocks_override=8))
    with pytest.raises(ValueError, match="needs speculative_model"):
        EngineConfig(speculative_method="eagle3")
    with pytest.raises(ValueError, match="speculative_model is only used with"):
        EngineConfig(speculative_method="ngram", speculative_model="x")


def test_cuda_graphs_and_async_scheduling_fall_back_with_a_logged_reason(paths, caplog):
    from pagoda.engine.runner.model_runner import cuda_graphs_off_reason

    engine = _engine(paths, "eagle3", async_scheduling=True)
    assert "async_scheduling is ignored with speculative decoding" in caplog.text
    assert not engine.executor.is_async and engine.runner.graphs is None
    reason = cuda_graphs_off_reason(engine.config, engine.runner.keeps_hidden, torch.device("cuda"))
    assert "reads the target's hidden states" in reason
    assert cuda_graphs_off_reason(engine.config, False, torch.device("cuda")) is None
    assert cuda_graphs_off_reason(engine.config, True, torch.device("cpu")) is None
    with caplog.at_level(logging.WARNING):
        assert _tokens(_run(engine, [(_prompts(1)[0], GREEDY)]))


def test_bench_spec_heads_forced_acceptance_keeps_outputs(paths, capsys):
    """``pagoda bench spec --method eagle3|mtp`` on the tiny target: every run's outputs equal
    the plain run's (forcing acceptance only substitutes the target's own continuation),
    a forced rate of 1 accepts every draft, and the roofline bound is printed."""
    from pagoda.bench import spec
    from pagoda.bench.spec_heads import roofline_speedup

    assert roofline_speedup(0.0, 4, 0.05) == pytest.approx(1 / 1.2)
    assert roofline_speedup(1.0, 4, 0.0) == 5.0
    for method, model in (("eagle3", paths["target"]), ("mtp", paths["mtp"])):
        assert spec.main(["--method", method, "--model", model, "--max-tokens", "8", "--repeats", "1",
                          "--num-prompts", "1", "--prompt-len", "12", "--accept-rates", "1.0,0.5",
                          "--draft-vocab", "512"]) == 0
        out = capsys.readouterr().out
        rows = [line for line in out.splitlines() if line.startswith("| ") and "ms/step" not in line]
        assert len(rows) == 4 and all(row.endswith("| yes |") for row in rows), out
        assert "| forced a=1.0 |" in out and "| 1.00 |" in out.split("| forced a=1.0 |")[1].split("\n")[0]
        assert "rejected-draft overhead" in out


# ---- the heads' arithmetic against a float64 reference -----------------------------------------

def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _attention_mlp(x, residual, w, p, raw, positions):
    """A Llama decoder layer's attention on input ``x`` (already normed; q/k/v take its width)
    with ``residual``, then post-attention norm and SwiGLU MLP: returns the pre-norm output.
    Rotary embeddings from transformers; causal attention over all rows, float64."""
    import transformers
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    nh, nkv, hd, eps = raw["num_attention_heads"], raw["num_key_value_heads"], raw["head_dim"], raw["rms_norm_eps"]
    T = x.shape[0]
    q = (x @ w[p + "self_attn.q_proj.weight"].T).view(T, nh, hd).transpose(0, 1)[None]
    k = (x @ w[p + "self_attn.k_proj.weight"].T).view(T, nkv, hd).transpose(0, 1)[None]
    v = (x @ w[p + "self_attn.v_proj.weight"].T).view(T, nkv, hd).transpose(0, 1)
    config = transformers.LlamaConfig(hidden_size=raw["hidden_size"], num_attention_heads=nh, num_key_value_heads=nkv,
                                      head_dim=hd, rope_theta=raw.get("rope_theta", 10000.0),
                                      max_position_embeddings=raw["max_position_embeddings"])
    cos, sin = LlamaRotaryEmbedding(config=config)(x[None], positions[None])
    q, k = apply_rotary_pos_emb(q, k, cos.double(), sin.double())
    k, v = k[0].repeat_interleave(nh // nkv, 0), v.repeat_interleave(nh // nkv, 0)
    scores = q[0] @ k.transpose(1, 2) / hd**0.5 + torch.full((T, T), float("-inf"), dtype=x.dtype).triu(1)
    attn = (scores.softmax(-1) @ v).transpose(0, 1).reshape(T, nh * hd) @ w[p + "self_attn.o_proj.weight"].T
    h = attn + residual
    n = _rms(h, w[p + "post_attention_layernorm.weight"], eps)
    gate, up = n @ w[p + "mlp.gate_proj.weight"].T, n @ w[p + "mlp.up_proj.weight"].T
    return (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T + h


def _head_run(head, ids, positions, hidden, kv, query_len):
    """The head over one sequence (cache slots = positions), ``query_len`` new tokens at the end."""
    from pagoda.kernels import AttentionMetadata

    meta = AttentionMetadata.build([query_len], [positions[-1] + 1], [[1, 2, 3]], 16, torch.device("cpu"))
    return head(torch.tensor(ids[-query_len:]), torch.tensor(positions[-query_len:]), hidden, kv, meta)


@pytest.mark.parametrize("kind", ["eagle3-d2t", "mtp-deepseek"])
def test_head_arithmetic_equals_a_float64_reference(paths, kind):
    """A prefill of 20 positions, then one chained step that feeds back the head's pre-norm
    output (through the head's KV cache): logits equal a float64 reference written from
    vLLM's llama_eagle3 / deepseek_mtp definitions, within the derived bound."""
    import json
    from pathlib import Path

    from pagoda.engine.spec_decode.eagle3 import load_eagle3_head, read_tensors
    from pagoda.engine.spec_decode.mtp import load_mtp_head
    from pagoda.models.loader import load_model

    folder = paths["head-d2t"] if kind == "eagle3-d2t" else paths["mtp"]
    target = load_model(paths["target"] if kind == "eagle3-d2t" else paths["mtp"])
    raw = json.loads((Path(folder) / "config.json").read_text())
    raw.setdefault("head_dim", raw["hidden_size"] // raw["num_attention_heads"])
    w = {k: v.double() if v.is_floating_point() else v for k, v in read_tensors(Path(folder)).items()}
    V, H, eps, T = raw["vocab_size"], raw["hidden_size"], raw["rms_norm_eps"], 20
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, V, (T + 1,), generator=gen).tolist()
    positions = list(range(T + 1))
    if kind == "eagle3-d2t":
        head = load_eagle3_head(folder, target, 512, torch.float32, torch.device("cpu"))
        features = torch.randn(T, 3 * H, generator=gen)
        embed, norm, lm_head = w["embed_tokens.weight"], w["norm.weight"], w["lm_head.weight"]
    else:
        head = load_mtp_head(None, folder, target)
        features = torch.randn(T, H, generator=gen)
        p = f"model.layers.{raw['num_hidden_layers']}."
        embed, norm, lm_head = target.embed_tokens.double(), w[p + "shared_head.norm.weight"], target.lm_head.double()
    kv = [tuple(torch.zeros(4, 16, raw["num_key_value_heads"], raw["head_dim"]) for _ in range(2))]
    normed, pre = _head_run(head, ids[:T], positions[:T], head.combine(features), kv, T)
    normed2, _ = _head_run(head, ids, positions, pre[-1:], kv, 1)
    ours = head.compute_logits(torch.cat([normed, normed2]), target.config.vocab_size)

    def reference(hidden):  # hidden [T + 1, H] float64: what enters the head at each position
        e = embed[torch.tensor(ids)]
        if kind == "eagle3-d2t":
            x = torch.cat([_rms(e, w["midlayer.input_layernorm.weight"], eps),
                           _rms(hidden, w["midlayer.hidden_norm.weight"], eps)], -1)
            out = _attention_mlp(x, hidden, w, "midlayer.", raw, torch.tensor(positions))
        else:
            x = torch.cat([_rms(e, w[p + "enorm.weight"], eps), _rms(hidden, w[p + "hnorm.weight"], eps)], -1)
            x = x @ w[p + "eh_proj.weight"].T
            out = _attention_mlp(_rms(x, w[p + "input_layernorm.weight"], eps), x, w, p, raw, torch.tensor(positions))
        logits = _rms(out, norm, eps) @ lm_head.T
        if "d2t" not in w:
            return logits, out
        full = torch.full((T + 1, V), float("-inf"), dtype=torch.float64)
        full[:, torch.arange(logits.shape[1]) + w["d2t"]] = logits
        return full, out

    fused = features.double() @ w["fc.weight"].T if kind == "eagle3-d2t" else features.double()
    _, out = reference(torch.cat([fused, fused[-1:]]))  # the prefill's pre-norm outputs (last row unused)
    expected, _ = reference(torch.cat([fused, out[T - 1 : T]]))
    finite = expected.isfinite()
    assert torch.equal(finite, ours.isfinite()), "the draft vocabulary's ids (d2t)"
    # fc / eh_proj add one reduction of <= 3H terms before the layer: counted as a second layer.
    config = dataclasses.replace(head.config, num_hidden_layers=2)
    bound = model_error_bound(config, T + 1, torch.float32, expected[finite].abs().max().item())
    assert_within(ours[finite], expected[finite], bound, f"{kind} head logits")
