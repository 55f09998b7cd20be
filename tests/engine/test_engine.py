"""Engine behaviour on a tiny random model: prefix caching, salts, n > 1, stops, aborts, seeds, bad input."""

from __future__ import annotations

import random

import pytest

from pagoda import LLM, SamplingParams
from pagoda.contracts.request_options import RequestOptions
from pagoda.engine.config import EngineConfig
from pagoda.engine.llm_engine import LLMEngine
from pagoda.engine.request import EngineRequest

from tests.engine.driving import drain
from tests.engine.hf_reference import make_random_model


def test_prefix_hit_computes_only_the_suffix(model_path):
    rng = random.Random(1)
    prefix = [rng.randrange(1000, 30000) for _ in range(512)]
    first = prefix + [rng.randrange(1000, 30000) for _ in range(20)]
    second = prefix + [rng.randrange(1000, 30000) for _ in range(37)]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    engine = LLMEngine(EngineConfig(model=model_path))
    engine.add_request("a", first, greedy)
    drain(engine)
    computed_before = engine.get_stats().prefix_cache_hits
    engine.add_request("b", second, greedy)
    out = drain(engine)["b"]
    assert out.num_cached_tokens == 512
    assert engine.get_stats().prefix_cache_hits - computed_before == 512

    cold = LLMEngine(EngineConfig(model=model_path, enable_prefix_caching=False))
    cold.add_request("b", second, greedy)
    assert drain(cold)["b"].outputs[0].token_ids == out.outputs[0].token_ids


def test_cache_salt_isolates_tenants(model_path):
    prompt = list(range(2000, 2100))
    greedy = SamplingParams(temperature=0, max_tokens=4)
    engine = LLMEngine(EngineConfig(model=model_path))
    engine.add_request("t1", prompt, greedy, cache_salt="tenant-1")
    drain(engine)
    engine.add_request("t2", prompt, greedy, cache_salt="tenant-2")
    assert drain(engine)["t2"].num_cached_tokens == 0
    engine.add_request("t1-again", prompt, greedy, cache_salt="tenant-1")
    assert drain(engine)["t1-again"].num_cached_tokens == 96


def test_n_greater_than_one_shares_prompt_blocks(model_path):
    engine = LLMEngine(EngineConfig(model=model_path))
    prompt = list(range(3000, 3070))
    engine.add_request("n", prompt, SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=10, ignore_eos=True))
    out = drain(engine)["n"]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 10 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1, "seeded children must not all coincide"
    # Children 1 and 2 hit the 4 full prompt blocks child 0 computed.
    assert engine.get_stats().prefix_cache_hits == 2 * 64
    assert engine.get_stats().num_free_blocks == engine.get_stats().num_blocks


def test_the_envelope_and_the_keyword_form_run_the_same_request(model_path):
    """``add(EngineRequest)`` is the seam; ``add_request`` builds the same envelope."""
    engine = LLMEngine(EngineConfig(model=model_path))
    params = SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=6, ignore_eos=True)
    engine.add(EngineRequest("env", list(range(4000, 4040)), params,
                             RequestOptions(priority=1, cache_salt="t", timeout=3600.0), arrival_time=100.0))
    engine.add_request("kw", list(range(4000, 4040)), params, arrival_time=100.0, priority=1, cache_salt="t",
                       timeout=3600.0)
    children = {r.request_id: r for r in engine.scheduler.requests.values()}
    assert children["env#0"].arrival_time == 100.0 and children["env#0"].priority == 1
    assert children["env#0"].cache_salt == "t" and children["env#0"].adapter_id is None
    outputs = drain(engine)
    assert [c.token_ids for c in outputs["env"].outputs] == [c.token_ids for c in outputs["kw"].outputs]
    with pytest.raises(ValueError, match="already in use"):
        engine.add(EngineRequest("dup", [5, 6]))
        engine.add(EngineRequest("dup", [5, 6]))


@pytest.mark.parametrize("family", ["llama", "qwen3-moe", "gpt-oss-window8"])  # MoE: tokens regroup per expert
def test_seeded_request_reproduces_in_any_batch(model_path, family, tmp_path, smollm2_path):
    if family != "llama":  # the other families' random models (tests/engine/hf_reference.py)
        model_path = str(make_random_model(tmp_path / family, family, smollm2_path))
    llm = LLM(model=model_path)
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=12, ignore_eos=True)
    alone = llm.generate([list(range(500, 540))], params)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True) for n in (3, 20, 7)]
    batch = llm.generate([list(range(100, 130)), list(range(500, 540)), list(range(700, 790)), [5, 6, 7]],
                         [others[0], params, others[1], others[2]])
    assert batch[1].outputs[0].token_ids == alone


def test_stop_string_truncates_and_reports(model_path):
    llm = LLM(model=model_path)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    full = llm.generate([list(range(900, 930))], greedy)[0].outputs[0]
    stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 3]
    assert stop.strip(), "need a visible stop string"
    cut = llm.generate([list(range(900, 930))], greedy.clone(stop=[stop]))[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == full.text[: full.text.index(stop)]
    kept = llm.generate([list(range(900, 930))], greedy.clone(stop=[stop], include_stop_str_in_output=True))[0]
    assert kept.outputs[0].text == full.text[: full.text.index(stop) + len(stop)]


def test_stop_token_ids_and_max_tokens(model_path):
    llm = LLM(model=model_path)
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    full = llm.generate([list(range(1900, 1930))], greedy)[0].outputs[0]
    assert full.finish_reason == "length" and len(full.token_ids) == 16
    stop_id = full.token_ids[5]
    first = full.token_ids.index(stop_id)
    out = llm.generate([list(range(1900, 1930))], greedy.clone(stop_token_ids=[stop_id]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    assert out.token_ids == full.token_ids[: first + 1]


def test_streaming_deltas_add_up(model_path):
    engine = LLMEngine(EngineConfig(model=model_path))
    engine.add_request("s", list(range(40, 80)), SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    text, ids, last = "", [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            text += out.outputs[0].delta_text
            ids += out.outputs[0].delta_token_ids
            last = out
    assert last.finished and text == last.outputs[0].text and ids == last.outputs[0].token_ids
    m = last.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time <= m.finished_time
    assert len(m.inter_token_latencies) == 9


def test_abort_frees_blocks_and_reports(model_path):
    engine = LLMEngine(EngineConfig(model=model_path))
    for i in range(4):
        engine.add_request(f"r{i}", list(range(100 + i, 160 + i)), SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(3):
        engine.step()
    engine.abort_request(["r1", "r3", "unknown"])
    finals = drain(engine)
    assert finals["r1"].outputs[0].finish_reason == "abort"
    assert finals["r3"].outputs[0].finish_reason == "abort"
    assert finals["r0"].outputs[0].finish_reason == "length"
    stats = engine.get_stats()
    assert stats.num_free_blocks == stats.num_blocks and stats.num_running == 0 and stats.num_waiting == 0


def test_bad_requests_raise_and_leave_nothing_behind(model_path):
    engine = LLMEngine(EngineConfig(model=model_path, max_model_len=256))
    with pytest.raises(ValueError, match="prompt"):
        engine.add_request("e", "", SamplingParams())
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add_request("v", [1, 2, 10**9], SamplingParams())
    with pytest.raises(ValueError, match="max_model_len|256"):
        engine.add_request("long", list(range(1000, 1300)), SamplingParams(max_tokens=8))
    with pytest.raises(ValueError, match="max_model_len|256"):
        engine.add_request("long2", list(range(1000, 1200)), SamplingParams(max_tokens=100))
    engine.add_request("ok", [5, 6, 7], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("ok", [5, 6, 7], SamplingParams(max_tokens=2))
    finals = drain(engine)
    assert list(finals) == ["ok"]
    assert engine.get_stats().num_free_blocks == engine.get_stats().num_blocks


def test_a_prompt_that_cannot_fit_is_refused_before_it_is_encoded(model_path, monkeypatch):
    """A text prompt longer than max_model_len x the most characters one token covers cannot
    fit: refused without encoding it (the serving loop tokenizes on the caller's thread, and
    a 900k-character prompt took ~0.5 s of encoding). The bound is exact for byte-level BPE:
    every text has at least len(text) / max_chars_per_token tokens."""
    engine = LLMEngine(EngineConfig(model=model_path, max_model_len=256))
    per_token = engine.tokenizer.max_chars_per_token()
    assert per_token is not None and per_token > 1
    rng = random.Random(0)
    pieces = ["tea", " ", "\n", "é", "中文", "1234", "<|im_start|>", "  ", "🍵", "ab" * 20]
    for _ in range(50):
        text = "".join(rng.choice(pieces) for _ in range(rng.randrange(1, 60)))
        assert len(engine.tokenizer.encode(text)) * per_token >= len(text)
    encoded = []
    real = engine.tokenizer.encode
    monkeypatch.setattr(engine.tokenizer, "encode", lambda text, *a, **k: encoded.append(len(text)) or real(text))
    with pytest.raises(ValueError, match=f"cannot fit max_model_len 256 .*{per_token} characters"):
        engine.add_request("huge", "x" * (256 * per_token + 1), SamplingParams(max_tokens=2))
    assert encoded == []
    with pytest.raises(ValueError, match="max_model_len"):  # under the bound: encoded, then refused by count
        engine.add_request("long", "tea " * 300, SamplingParams(max_tokens=2))
    assert encoded == [1200]
    ids = engine.tokenize_prompt("Hello there")
    engine.add(EngineRequest("pre", "Hello there", SamplingParams(max_tokens=2), prompt_token_ids=ids))
    assert encoded == [1200, 11]  # the pre-tokenized prompt is not encoded again
    assert list(drain(engine)) == ["pre"]
    assert engine.get_stats().num_free_blocks == engine.get_stats().num_blocks


def test_stats_report_recent_time_to_first_token(model_path):
    """Every request's TTFT lands in the 30 s window behind EngineStats.ttft_p90 (the fleet
    heartbeat's); old samples leave it."""
    from pagoda.engine.stats import LatencyWindow

    engine = LLMEngine(EngineConfig(model=model_path))
    for i in range(3):
        engine.add_request(f"r{i}", [5, 6, 7 + i], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    drain(engine)
    stats = engine.get_stats()
    assert len(stats.recent_ttfts) == 3 and stats.ttft_p90 == max(stats.recent_ttfts) > 0

    window = LatencyWindow(window_s=30.0, clock=lambda: 100.0)
    for when, latency in ((50.0, 9.0), (80.0, 1.0), (90.0, 2.0), (95.0, 3.0)):
        window.observe(latency, when)
    assert window.samples() == [1.0, 2.0, 3.0] and window.quantile(0.9) == 3.0 and window.quantile(0.5) == 2.0
    assert LatencyWindow().quantile(0.9) == 0.0
    clock = [100.0]
    window = LatencyWindow(clock=lambda: clock[0])
    window.observe(1.0, 99.0)
    assert window.p90_snapshot() == (1.0, (1.0,))
    window.observe(5.0, 100.0)
    assert window.p90_snapshot() == (1.0, (1.0,)), "recomputed at most every 0.5 s"
    clock[0] = 100.5
    assert window.p90_snapshot() == (5.0, (1.0, 5.0))
