"""``pagoda bench moe`` runs on CPU on a tiny layer (the speeds are not asserted) and records its rows."""

from __future__ import annotations

import json

import torch

from pagoda.bench import moe as bench_moe
from pagoda.models.moe import group_by_expert, route


def test_bench_moe_prints_and_records_a_row_per_token_count(capsys, tmp_path):
    out_json = tmp_path / "moe.json"
    assert bench_moe.main(["--device", "cpu", "--tokens", "1,5", "--experts", "4", "--top-k", "2", "--hidden", "32",
                           "--inter", "16", "--repeats", "1", "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert "| tokens | experts hit | sparse tok/s | dense tok/s | dense / sparse |" in out
    rows = json.loads(out_json.read_text())["rows"]
    assert [r["tokens"] for r in rows] == [1, 5] and rows[0]["active_experts"] == 2
    assert all(r["sparse_tok_s"] > 0 and r["dense_tok_s"] > 0 for r in rows)


def test_dense_baseline_equals_the_sparse_path():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 32, generator=gen)
    w13, w2 = torch.randn(4, 32, 32, generator=gen), torch.randn(4, 32, 16, generator=gen)
    weights, ids = route(torch.randn(6, 4, generator=gen), 2, True)
    groups = group_by_expert(ids, weights, 4)
    sparse = bench_moe.reference_moe.moe_experts(x, groups.order, groups.weights, groups.offsets, w13, w2, 2)
    assert torch.allclose(bench_moe.dense_all_experts(x, ids, weights, w13, w2), sparse, atol=1e-4)
