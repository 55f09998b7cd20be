"""``pagoda bench offline --compare vllm PYTHON`` (bench/compare_vllm.py): the skip note when
no vLLM is there, and the pagoda round's worker on a tiny model, with the bf16 comparison's
Hugging Face reference (vLLM's round needs a vLLM venv; the measured comparison is in
docs/benchmarks.md)."""

from __future__ import annotations

import json

from pagoda.bench import compare_vllm
from pagoda.bench.offline import main


def test_without_vllm_the_comparison_is_skipped_with_a_note(capsys, tmp_path):
    assert main(["--compare", "vllm", str(tmp_path / "no-python"), "--num-requests", "2"]) == 0
    assert "skipped: no vLLM interpreter" in capsys.readouterr().out
    assert compare_vllm.vllm_available("/bin/false") is not None  # exists but cannot import vllm


def test_the_pagoda_round_times_the_workload_and_returns_every_output(tmp_path, model_path, restore_threads):
    items = [{"prompt": [100 + i for i in range(20 + 7 * k)], "max_tokens": 3 + k} for k in range(3)]
    spec = {"model": model_path, "dtype": "float32", "threads": 1, "max_model_len": 256, "max_num_seqs": 8,
            "max_num_batched_tokens": 256, "items": items}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    compare_vllm.pagoda_worker(str(tmp_path / "spec.json"), str(tmp_path / "out.json"))
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["seconds"] > 0 and [len(o) for o in out["outputs"]] == [3, 4, 5]
    # The bf16 comparison's reference, Hugging Face greedy with EOS not stopping, here in
    # fp32 where the two must agree token for token.
    from pagoda.bench.workload import WorkItem

    work = [WorkItem(prompt_token_ids=it["prompt"], max_tokens=it["max_tokens"]) for it in items]
    reference = compare_vllm.hf_greedy(model_path, "float32", work, 1)
    assert compare_vllm.agreement(out["outputs"], reference) == (3, 4.0)
    assert compare_vllm.agreement([[1, 2, 3]], [[1, 2, 4]]) == (0, 2.0)


def test_the_token_hash_changes_with_any_token():
    assert compare_vllm.output_hash([[1, 2], [3]]) == compare_vllm.output_hash([[1, 2], [3]])
    assert compare_vllm.output_hash([[1, 2], [3]]) != compare_vllm.output_hash([[1, 2], [4]])
    assert compare_vllm.output_hash([[1, 2], [3]]) != compare_vllm.output_hash([[1], [2, 3]])
