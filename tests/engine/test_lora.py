"""Multi-LoRA against Hugging Face + PEFT: adapters made with ``peft`` on a random Llama,
served side by side in one batch with the base model, through chunked prefill, prefix
hits and a slot count smaller than the number of adapters; plus the refusals."""

from __future__ import annotations

import json
import re
import threading

import pytest
import torch

from pagoda import SamplingParams
from pagoda.engine.config import EngineConfig
from pagoda.engine.llm_engine import LLMEngine
from pagoda.models import load_model
from pagoda.models.lora import LoRABatch, LoRASlots, load_peft_adapter
from pagoda.models.testing import StepInput, make_kv_caches, run_step
from tests.engine.driving import drain
from tests.engine.hf_reference import make_random_model
from tests.engine.lora_reference import ADAPTERS, make_peft_adapter, peft_greedy, peft_model
from tests.numerics import assert_within, model_error_bound

pytest.importorskip("peft")

MAX_NEW = 6
PROMPTS = {  # the same shared prefix for several adapters: hashes must keep them apart
    "base": list(range(1000, 1037)),
    "attn-qv": list(range(1000, 1037)),
    "all-r4": list(range(2000, 2019)),
    "mlp-rs": list(range(1000, 1033)) + [7, 8, 9],
}


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory, smollm2_path):
    root = tmp_path_factory.mktemp("lora")
    base = str(make_random_model(root / "base", "llama-gqa3-hd64", smollm2_path))
    adapters = {name: str(make_peft_adapter(base, root, name, seed=i)) for i, name in enumerate(ADAPTERS)}
    return base, adapters


@pytest.fixture(scope="module")
def expected(lora_setup):
    """Greedy continuations from HF (base) and HF + PEFT (each adapter)."""
    from tests.engine.hf_reference import HFGreedy

    base, adapters = lora_setup
    out = {"base": HFGreedy(base).generate(PROMPTS["base"], MAX_NEW)}
    for name, path in adapters.items():
        out[name] = peft_greedy(peft_model(base, path), PROMPTS[name], MAX_NEW)
    assert len({tuple(v) for k, v in out.items() if k != "mlp-rs"}) == 3, "adapters must change the output"
    return out


def test_model_logits_with_mixed_adapters_match_peft(lora_setup):
    """One step with tokens of two adapters and of the base model: each row within the
    derived float32 bound of HF + PEFT's logits for its own adapter."""
    base, adapters = lora_setup
    model = load_model(base, dtype=torch.float32)
    slots = LoRASlots(model, num_slots=2, max_rank=16)
    slots.load(0, load_peft_adapter("all-r4", adapters["all-r4"], model.config, 16))
    slots.load(1, load_peft_adapter("attn-qv", adapters["attn-qv"], model.config, 16))
    seqs = {"all-r4": list(range(300, 311)), "base": list(range(500, 507)), "attn-qv": list(range(700, 709))}
    layout = [("all-r4", 0, [0]), ("base", -1, [1]), ("attn-qv", 1, [2])]
    steps = [StepInput(seqs[name], 0, table) for name, _, table in layout]
    caches = make_kv_caches(model.config, num_blocks=4, block_size=16)
    lora = LoRABatch.build([slot for _, slot, _ in layout], [len(s.token_ids) for s in steps], model.device)
    input_ids = torch.tensor([t for s in steps for t in s.token_ids])
    positions = torch.tensor([p for s in steps for p in range(len(s.token_ids))])
    from pagoda.kernels import AttentionMetadata

    meta = AttentionMetadata.build([len(s.token_ids) for s in steps], [len(s.token_ids) for s in steps],
                                   [s.block_table for s in steps], 16, model.device)
    logits = model.compute_logits(model(input_ids, positions, caches, meta, lora))
    start = 0
    for name, _, _ in layout:
        n = len(seqs[name])
        reference = peft_model(base, adapters[name]) if name != "base" else peft_model(base, adapters["all-r4"])
        with torch.inference_mode():
            if name == "base":
                with reference.disable_adapter():
                    ref = reference(torch.tensor([seqs[name]])).logits[0]
            else:
                ref = reference(torch.tensor([seqs[name]])).logits[0]
        bound = 2 * model_error_bound(model.config, n, torch.float32, ref.abs().max().item())
        assert_within(logits[start:start + n], ref, bound, f"{name} logits")
        start += n
    # And the base rows are what the model gives alone, without any LoRA batch (up to the
    # rounding of matmuls blocked differently in a batch of another size).
    plain = run_step(model, make_kv_caches(model.config, 4, 16), [StepInput(seqs["base"], 0, [1])], 16)
    assert_within(logits[11:18], plain, 2 * model_error_bound(model.config, 7, torch.float32,
                                                              plain.abs().max().item()), "base rows")


def _engine(base: str, adapters: dict, **overrides) -> LLMEngine:
    config = dict(model=base, enable_lora=True, max_loras=2, max_lora_rank=16, lora_modules=adapters,
                  max_num_batched_tokens=24, block_size=16)  # chunked prefill beside decodes
    config.update(overrides)
    return LLMEngine(EngineConfig(**config))


def _run(engine: LLMEngine, requests: dict[str, tuple[list[int], str | None]]) -> dict[str, list[int]]:
    greedy = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    for request_id, (prompt, lora) in requests.items():
        engine.add_request(request_id, prompt, greedy, lora_name=lora)
    return {rid: out.outputs[0].token_ids for rid, out in drain(engine).items()}


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_one_batch_of_three_adapters_and_the_base_model_matches_hf_peft(lora_setup, expected, async_scheduling):
    """Three adapters + base in one engine with 2 slots: the scheduler holds the third
    adapter back until a slot frees; every output is token-identical to HF (+ PEFT), also
    with async scheduling (slots are filled inside the overlapped device job)."""
    base, adapters = lora_setup
    engine = _engine(base, adapters, async_scheduling=async_scheduling)
    requests = {name: (PROMPTS[name], None if name == "base" else name) for name in PROMPTS}
    tokens = _run(engine, requests)
    assert tokens == expected
    assert engine.runner.lora.num_slot_loads >= 3, "the third adapter must have been swapped into a slot"
    stats = engine.get_stats()
    assert stats.num_free_blocks == stats.num_blocks and stats.kv_cache_usage == 0.0  # nothing leaked


def test_prefix_hits_stay_within_one_adapter(lora_setup, expected):
    """After one adapter's request, the same prompt with the same adapter reuses its full
    blocks, while the base model and another adapter sharing that prefix reuse nothing."""
    base, adapters = lora_setup
    engine = _engine(base, adapters, max_loras=3)
    assert _run(engine, {"warm": (PROMPTS["attn-qv"], "attn-qv")})["warm"] == expected["attn-qv"]
    greedy = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    engine.add_request("same", PROMPTS["attn-qv"], greedy, lora_name="attn-qv")
    engine.add_request("base", PROMPTS["base"], greedy)
    engine.add_request("other", PROMPTS["mlp-rs"], greedy, lora_name="mlp-rs")
    cached, tokens = {}, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                cached[out.request_id], tokens[out.request_id] = out.num_cached_tokens, out.outputs[0].token_ids
    assert cached == {"same": 32, "base": 0, "other": 0}
    assert tokens == {"same": expected["attn-qv"], "base": expected["base"], "other": expected["mlp-rs"]}


def test_unknown_adapter_and_lora_off_are_clear_errors(lora_setup):
    base, adapters = lora_setup
    engine = _engine(base, {"attn-qv": adapters["attn-qv"]})
    with pytest.raises(ValueError, match=r"unknown adapter 'nope'; loaded adapters: attn-qv"):
        engine.add_request("x", [5, 6, 7], SamplingParams(max_tokens=2), lora_name="nope")
    assert not engine.has_unfinished_requests()
    plain = LLMEngine(EngineConfig(model=base))
    with pytest.raises(ValueError, match="serves no LoRA adapters"):
        plain.add_request("x", [5, 6, 7], SamplingParams(max_tokens=2), lora_name="attn-qv")
    with pytest.raises(ValueError, match="already loaded"):
        engine.add_lora("attn-qv", adapters["attn-qv"])
    engine.add_request("busy", [5, 6, 7], SamplingParams(max_tokens=2), lora_name="attn-qv")
    with pytest.raises(ValueError, match="in use"):
        engine.remove_lora("attn-qv")
    while engine.has_unfinished_requests():
        engine.step()
    engine.remove_lora("attn-qv")
    assert engine.list_loras() == []


def test_runtime_load_off_thread_then_register_between_steps(lora_setup, expected):
    """The server's run-time path: ``load_lora`` (file I/O, fusing) on another thread while
    a request of another adapter runs, ``register_lora`` between two steps; the running
    request and the new adapter's request both match PEFT; the name cannot be taken twice."""
    base, adapters = lora_setup
    engine = _engine(base, {"attn-qv": adapters["attn-qv"]})
    greedy = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    engine.add_request("qv", PROMPTS["attn-qv"], greedy, lora_name="attn-qv")
    outputs = list(engine.step())
    loaded = {}
    thread = threading.Thread(target=lambda: loaded.update(adapter=engine.load_lora("all-r4", adapters["all-r4"])))
    thread.start()
    outputs += engine.step()
    thread.join()
    assert engine.list_loras() == ["attn-qv"], "a loaded adapter is not served before it is registered"
    engine.register_lora(loaded["adapter"])
    assert engine.lora_paths() == {"all-r4": adapters["all-r4"], "attn-qv": adapters["attn-qv"]}
    engine.add_request("r4", PROMPTS["all-r4"], greedy, lora_name="all-r4")
    while engine.has_unfinished_requests():
        outputs += engine.step()
    tokens = {o.request_id: o.outputs[0].token_ids for o in outputs if o.finished}
    assert tokens == {"qv": expected["attn-qv"], "r4": expected["all-r4"]}
    with pytest.raises(ValueError, match="already loaded"):
        engine.load_lora("all-r4", adapters["all-r4"])
    with pytest.raises(ValueError, match="already loaded"):
        engine.register_lora(loaded["adapter"])
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        LLMEngine(EngineConfig(model=base)).load_lora("x", adapters["all-r4"])


def test_bad_adapter_folders_are_refused_with_the_reason(lora_setup, tmp_path):
    base, adapters = lora_setup
    engine = _engine(base, {})
    # A missing folder and an existing one without an adapter read alike (no existence probe).
    with pytest.raises(ValueError, match="no PEFT adapter") as empty:
        engine.add_lora("empty", str(tmp_path))
    with pytest.raises(ValueError, match="no PEFT adapter") as missing:
        engine.add_lora("empty", str(tmp_path / "nowhere"))
    assert str(empty.value).replace(str(tmp_path), "P") == str(missing.value).replace(str(tmp_path / "nowhere"), "P")
    with pytest.raises(ValueError, match="exceeds max_lora_rank 8"):
        _engine(base, {}, max_lora_rank=8).add_lora("big", adapters["mlp-rs"])
    bad = tmp_path / "embed"
    bad.mkdir()
    (bad / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8}))
    from safetensors.torch import save_file

    save_file({"base_model.model.model.embed_tokens.lora_A.weight": torch.zeros(4, 8)},
              str(bad / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match="only decoder-layer projections"):
        engine.add_lora("embed", str(bad))
    other = tmp_path / "other-model"
    other.mkdir()
    (other / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8}))
    save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 99),
               "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(384, 4)},
              str(other / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match="another model"):
        engine.add_lora("other", str(other))
    # NaN or absurd weights (issue 25 defect 7) are refused before they reach any request.
    import shutil

    from safetensors.torch import load_file
    for label, value, message in (("nan", float("nan"), "NaN or infinite"), ("huge", 1e6, "magnitude 1e\\+06")):
        poisoned = tmp_path / label
        shutil.copytree(adapters["attn-qv"], poisoned)
        weights = load_file(str(poisoned / "adapter_model.safetensors"))
        key = sorted(weights)[0]
        weights[key][0, 0] = value
        save_file(weights, str(poisoned / "adapter_model.safetensors"))
        with pytest.raises(ValueError, match=message) as info:
            engine.add_lora(label, str(poisoned))
        assert key in str(info.value)
    # Configs that are not PEFT's shape, and rank 0, named (were AttributeError / ZeroDivisionError).
    for label, config, weights_rank, message in (
            ("listed", [{"r": 4}], 4, "adapter_config.json must be a JSON object, got a JSON array"),
            ("alpha", {"r": 4, "lora_alpha": "8"}, 4, "lora_alpha must be a number, got '8'"),
            ("pattern", {"r": 4, "lora_alpha": 8, "rank_pattern": {"q_proj": 0}}, 4,
             "rank_pattern.q_proj must be a positive integer, got 0"),
            ("rank0", {"r": 4, "lora_alpha": 8}, 0, "q_proj has rank 0")):
        folder = tmp_path / label
        shutil.copytree(adapters["attn-qv"], folder)
        (folder / "adapter_config.json").write_text(json.dumps(config))
        save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(weights_rank, 576),
                   "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(576, weights_rank)},
                  str(folder / "adapter_model.safetensors"))
        with pytest.raises(ValueError, match=re.escape(message)):
            engine.add_lora(label, str(folder))
    assert engine.list_loras() == []
    with pytest.raises(ValueError, match="speculative decoding with LoRA"):
        EngineConfig(model=base, enable_lora=True, speculative_method="ngram")
    with pytest.raises(ValueError, match="enable_lora is False"):
        EngineConfig(model=base, lora_modules={"a": "/x"})


def test_unload_is_refused_while_a_request_waits_outside_the_scheduler(lora_setup):
    """Issue 25 defect 1: a request waiting for its grammar (or an n > 1 sibling held for
    child 0's prompt) uses its adapter as much as a running one: ``remove_lora`` answers
    "in use" and the request then runs to the end with its adapter."""
    from pagoda.engine.guided import GuidedDecodingParams

    base, adapters = lora_setup
    engine = _engine(base, {"attn-qv": adapters["attn-qv"], "all-r4": adapters["all-r4"]})
    guided = SamplingParams(temperature=0, max_tokens=4, guided_decoding=GuidedDecodingParams(regex="[a-z]{1,3}x"))
    engine.add_request("g", PROMPTS["attn-qv"], guided, lora_name="attn-qv")
    assert not engine.scheduler.requests, "the guided request waits for its grammar outside the scheduler"
    with pytest.raises(ValueError, match=r"adapter 'attn-qv' is in use"):
        engine.remove_lora("attn-qv")
    held = SamplingParams(temperature=0, max_tokens=3, n=2, ignore_eos=True)
    engine.add_request("pair", PROMPTS["all-r4"], held, lora_name="all-r4")
    assert engine.core.num_pending == 1, "sibling 1 is held until child 0's prompt is computed"
    engine.abort_request("pair")  # child 0 leaves the scheduler at once; nothing of "pair" stays held
    engine.add_request("pair2", PROMPTS["all-r4"], held, lora_name="all-r4")
    with pytest.raises(ValueError, match=r"adapter 'all-r4' is in use"):
        engine.remove_lora("all-r4")
    finals = drain(engine)
    assert finals["g"].outputs[0].finish_reason in ("stop", "length") and finals["g"].error is None
    assert [c.finish_reason for c in finals["pair2"].outputs] == ["length", "length"]
    engine.remove_lora("attn-qv")  # nothing uses it any more
    engine.remove_lora("all-r4")
    assert engine.list_loras() == []


def test_an_adapter_gone_under_a_waiting_request_fails_only_that_request(lora_setup, expected):
    """Should an adapter vanish under a request waiting for its grammar anyway (here: the
    manager's registry edited behind the engine's check), that one request ends with an
    error naming the adapter; the step does not raise and the other requests finish."""
    from pagoda.engine.guided import GuidedDecodingParams

    base, adapters = lora_setup
    engine = _engine(base, {"attn-qv": adapters["attn-qv"], "all-r4": adapters["all-r4"]})
    greedy = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    engine.add_request("other", PROMPTS["all-r4"], greedy, lora_name="all-r4")
    engine.add_request("base", PROMPTS["base"], greedy)
    guided = SamplingParams(temperature=0, max_tokens=4, guided_decoding=GuidedDecodingParams(regex="[a-z]{1,3}x"))
    engine.add_request("g", PROMPTS["attn-qv"], guided, lora_name="attn-qv")
    engine.runner.lora.remove("attn-qv")
    finals = drain(engine)
    assert finals["g"].error is not None and "'attn-qv'" in finals["g"].error and "unloaded" in finals["g"].error
    assert finals["other"].outputs[0].token_ids == expected["all-r4"]
    assert finals["base"].outputs[0].token_ids == expected["base"]
    stats = engine.get_stats()
    assert stats.num_free_blocks == stats.num_blocks
