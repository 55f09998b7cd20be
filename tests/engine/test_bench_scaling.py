"""``--compare-workload long|concurrency`` (bench/compare_scaling.py): the measurement on a fake
engine (what it times and derives), the refusal of a length past the model's context, the
vLLM script's composition, and the pagoda process's worker on a tiny model (vLLM's run
needs a vLLM venv; the measured tables are in docs/benchmarks.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagoda.bench import compare_scaling


def _fake(calls):
    """An engine whose requests prefill one per second (each its first token), then decode one
    token each per half second together: steps (seconds, cpu, tokens so far, started)."""
    def generate(prompts, max_tokens):
        calls.append((len(prompts), len(prompts[0]), max_tokens))
        count = len(prompts)
        steps = [(1.0 + i, 0.5 + i, i + 1, i + 1) for i in range(count)]
        steps += [(count + 0.5 * j, count + 0.25 * j, count * (1 + j), count) for j in range(1, max_tokens)]
        return steps[-1][0], [[7] * max_tokens for _ in prompts], steps

    return generate


def test_long_times_ttft_and_the_steady_decode_apart():
    calls = []
    spec = {"workload": "long", "vocab": 5000, "lengths": [12], "decodes": 3, "decode_tokens": 4}
    result = compare_scaling.run_scenarios(spec, _fake(calls))["12"]
    # TTFT alone, the batch to half its decode (a warm-up), to all of it (timed step by step)
    assert calls == [(1, 12, 1), (3, 12, 3), (3, 12, 5)]
    # the steady decode starts once all three have a token (t = 3 s, not the prefill steps before)
    assert result["ttft_s"] == 1.0 and result["total_s"] == 5.0
    assert result["decode_tokens_per_s"] == 3 * 4 / 2.0 and result["decode_tokens_per_cpu_s"] == 3 * 4 / 1.5
    assert result["ttft_cpu_s"] >= 0
    assert result["peak_rss_gib"] > 0 and result["outputs"] == [[7] * 5] * 3


def test_concurrency_and_the_refusals(smollm2_path):
    calls = []
    spec = {"workload": "concurrency", "vocab": 5000, "concurrency": [1, 4], "prompt_tokens": 8, "output_tokens": 2}
    result = compare_scaling.run_scenarios(spec, _fake(calls))
    assert calls == [(1, 8, 2), (4, 8, 2)] and result["4"]["tokens_per_s"] == 4 * 2 / 4.5
    table = compare_scaling.format_table(spec, {"pagoda": result, "vllm": result}).splitlines()
    assert len(table) == 4 and table[3].startswith("| 4 | 1.8 (") and "| 1.00x | 4/4 |" in table[3]
    with pytest.raises(ValueError, match=r"--long-lengths: \[8192\] plus 33 output tokens exceed"):
        compare_scaling.make_spec("long", smollm2_path, "float32", 1, [2048, 8192], 2048)
    assert compare_scaling.make_spec("long", smollm2_path, "float32", 1, [2048, 8100], 2048)["max_model_len"] == 8133
    compile(compare_scaling.vllm_script(), "vllm_worker.py", "exec")  # run_scenarios' source travels whole
    with pytest.raises(ValueError, match=r"--long-context: 4096 is below the model's own context of 8192"):
        compare_scaling.make_spec("long", smollm2_path, "float32", 1, [2048], 2048, context=4096)


def test_a_longer_context_is_a_stretched_copy_with_the_cache_it_needs(smollm2_path, tmp_path):
    spec = compare_scaling.make_spec("long", smollm2_path, "float32", 2, [2048, 32000], 2048, context=32768)
    assert spec["context"] == 32768 and spec["trained_context"] == 8192 and spec["max_model_len"] == 32033
    # SmolLM2-135M: 30 layers x 3 KV heads x 64 x K and V x 4 bytes = 46,080 bytes a position; 4 x 32,033 of them
    assert spec["kv_gib"] == 7 == 1 + -(-4 * 32033 * 46080 // 2**30)
    bf16 = compare_scaling.make_spec("long", smollm2_path, "bfloat16", 2, [32000], 2048, context=32768)["kv_gib"]
    assert bf16 == 4 and compare_scaling.make_spec("long", smollm2_path, "float32", 1, [2048], 2048)["kv_gib"] == 2
    copy = Path(compare_scaling.stretched_model(smollm2_path, 32768, str(tmp_path)))
    config, original = (json.loads((d / "config.json").read_text()) for d in (copy, Path(smollm2_path)))
    assert config == {**original, "max_position_embeddings": 32768} and original["max_position_embeddings"] == 8192
    assert {p.name for p in copy.iterdir()} == {p.name for p in Path(smollm2_path).iterdir()}
    weights = copy / "model.safetensors"
    assert weights.is_symlink() and weights.resolve() == (Path(smollm2_path) / "model.safetensors").resolve()


def test_the_pagoda_process_runs_the_workload(tmp_path, model_path, restore_threads):
    spec = {"workload": "long", "model": model_path, "dtype": "float32", "threads": 1, "vocab": 2000,
            "lengths": [40], "decodes": 2, "decode_tokens": 3, "max_num_seqs": 2, "max_model_len": 64,
            "max_num_batched_tokens": 16, "kv_gib": 0.01}  # 16-token chunks: the prompts prefill in pieces
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    compare_scaling.pagoda_worker(str(tmp_path / "spec.json"), str(tmp_path / "out.json"))
    out = json.loads((tmp_path / "out.json").read_text())["40"]
    assert out["ttft_s"] > 0 and out["decode_tokens_per_s"] > 0 and [len(o) for o in out["outputs"]] == [4, 4]
