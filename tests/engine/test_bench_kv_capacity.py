"""``pagoda bench kv-capacity``: the allocator's arithmetic per family, grouped vs uniform."""

from __future__ import annotations

import torch

from pagoda.bench import kv_capacity
from pagoda.engine.kv.layout import group_layers


def _table(capsys) -> dict[str, list[str]]:
    rows = [line.strip("|").split("|") for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    return {cells[0].strip(): [c.strip() for c in cells[1:]] for cells in rows[1:] if cells[0].strip() != "family"}


def test_grouped_holds_more_where_layers_differ_and_the_same_where_they_do_not(capsys):
    assert kv_capacity.main(["--budget-gib", "8", "--contexts", "8192,32768",
                             "--families", "llama-3.1-8b,mistral-7b-v0.1,gemma-3-27b"]) == 0
    table = _table(capsys)
    # columns: layers, tokens grouped, tokens uniform, seqs@8k grouped, uniform, seqs@32k grouped, uniform
    llama, mistral, gemma = table["llama-3.1-8b"], table["mistral-7b-v0.1"], table["gemma-3-27b"]
    assert llama[0] == "32 full_attention" and llama[1] == llama[2] and llama[3:5] == [llama[3]] * 2
    assert mistral[1] == "inf" and mistral[2] != "inf"  # every layer windowed: a sequence stops growing
    assert int(mistral[5]) == int(mistral[3]) > int(mistral[6])  # the same seqs at 8k and 32k, grouped
    assert gemma[0] == "10 full_attention, 52 sliding_window"
    assert all(int(g) > int(u) for g, u in ((gemma[3], gemma[4]), (gemma[5], gemma[6])))


def test_tokens_and_seqs_follow_the_block_arithmetic():
    specs = kv_capacity.family_specs(kv_capacity.FAMILIES["llama-3.1-8b"], torch.bfloat16)
    layout = group_layers(specs, 16)
    assert layout.block_bytes == 16 * 32 * 2 * 8 * 128 * 2  # a 16-token block of 32 layers' K and V, bf16
    budget = 1000 * layout.block_bytes
    assert kv_capacity.max_tokens(layout, budget, 2048) == 16_000
    assert kv_capacity.max_seqs(layout, budget, 8192, 2048) == 1000 // 512


def test_hybrid_families_hold_four_times_the_tokens_and_price_a_checkpoint(capsys):
    """Three of every four layers keep a fixed state: ~4x the tokens of one block kind, and a
    checkpoint costs one sequence's state (vLLM's common page: a 528-token block for Qwen3.5)."""
    assert kv_capacity.main(["--budget-gib", "8", "--contexts", "8192", "--families", "qwen3.5-27b",
                             "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    rows = [line.strip("|").split("|") for line in out.splitlines() if line.startswith("| qwen3.5-27b")]
    capacity, state = [[c.strip() for c in row] for row in rows]
    assert capacity[1] == "8 full_attention, 24 mamba"
    assert 3.9 < float(capacity[2].rstrip("k")) / float(capacity[3].rstrip("k")) < 4.1
    assert state[1] == "24" and state[2] == "49.1 MiB" and state[-1] == "528"
