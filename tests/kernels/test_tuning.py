"""Tuned launch shapes as data: the sweep picks the fastest candidate per shape family
(a fake timer stands in for the GPU), writes the device's JSON, and ``choose_config``
reads it back -- falling back to the built-in rules for families the file lacks."""

from __future__ import annotations

import json

import pytest
import torch

from pagoda.kernels import attention_config, tuning
from pagoda.kernels.attention_config import choose_config, family_key, load_table


def fake_timer(fam: tuning.Family, entry: dict) -> float:
    """Deterministic 'time': decode likes 128-key splits and 8 warps, prefill 128-row tiles
    with 3 stages; one candidate raises like an out-of-resources compile would."""
    if entry.get("num_stages") == 4:
        raise RuntimeError("out of shared memory")
    if fam.phase == "decode":
        split_cost = abs(entry["split_len"] - (128 if fam.batch <= 4 else 0)) / 64
        return 10 + split_cost + abs(entry["num_warps"] - 8) + entry["block_n"] / 64 + entry["num_stages"] / 10
    return (100 + abs(entry["block_m"] - 128) + abs(entry["num_stages"] - 3) + entry["num_warps"] / 8
            + entry["block_n"] / 64)


def test_sweep_picks_the_fastest_and_logs_failures():
    fams = tuning.default_families("bf16", 32, 8, 128, 4096, 2048, quick=False)
    log = []
    winners = tuning.sweep(fams, fake_timer, quick=False, log=log.append)
    assert set(winners) == {f.key for f in fams}
    b1 = winners[family_key("decode", "bf16", 128, 4, 1)]
    assert (b1["split_len"], b1["num_warps"], b1["block_n"], b1["num_stages"]) == (128, 8, 32, 2)
    assert winners[family_key("decode", "bf16", 128, 4, 64)]["split_len"] == 0
    prefill = winners[family_key("prefill", "bf16", 128, 4)]
    assert (prefill["block_m"], prefill["num_stages"], prefill["num_warps"], prefill["block_n"]) == (128, 3, 4, 32)
    assert any("out of shared memory" in line for line in log)
    quick = tuning.sweep(tuning.default_families("bf16", 32, 8, 128, 4096, 2048, quick=True), fake_timer, quick=True,
                         log=lambda s: None)
    assert len(quick) == len(tuning.QUICK_DECODE_BATCHES) + 1


def test_table_round_trip_drives_choose_config(tmp_path, monkeypatch):
    monkeypatch.setattr(attention_config, "CONFIG_DIR", tmp_path)
    load_table.cache_clear()
    name = "NVIDIA H100 80GB HBM3"
    fams = tuning.default_families("bf16", 32, 8, 128, 4096, 2048, quick=True)
    path = tuning.write_table(name, tuning.sweep(fams, fake_timer, True, log=lambda s: None), {"quick": True})
    assert path == tmp_path / "NVIDIA_H100_80GB_HBM3.json"
    # A second sweep of another dtype merges into the same file.
    tuning.write_table(name, {family_key("prefill", "fp16", 64, 1): dict(block_m=64, block_n=32, num_warps=4,
                                                                          num_stages=2)}, {})
    table = load_table(name)
    assert family_key("prefill", "bf16", 128, 4) in table and family_key("prefill", "fp16", 64, 1) in table
    # Decode at batch 1 (bucket 1): 128-key slices over 4096 keys (--quick sweeps 4 warps only).
    cfg = choose_config(1, 1, 32, 8, 1, 4096, 132, head_dim=128, dtype_name="bf16", table=table)
    assert (cfg.num_splits, cfg.num_warps, cfg.block_q) == (32, 4, 4)
    # Batch 3 falls in bucket 4; a long context caps the slice count.
    assert choose_config(3, 3, 32, 8, 1, 131072, 132, head_dim=128, dtype_name="bf16",
                         table=table).num_splits == attention_config.MAX_SPLITS
    # Prefill: the tuned 128-row tile; short chunks still shrink it.
    long = choose_config(2048, 1, 32, 8, 2048, 2048, 132, head_dim=128, dtype_name="bf16", table=table)
    assert (long.block_q * 4, long.num_stages) == (128, 3)
    assert choose_config(8, 1, 32, 8, 8, 64, 132, head_dim=128, dtype_name="bf16", table=table).block_q == 8
    # Families the file lacks (other head size, fp32) keep the built-in rules.
    for kw in (dict(head_dim=64, dtype_name="bf16"), dict(head_dim=128, dtype_name="fp32")):
        size = 4 if kw["dtype_name"] == "fp32" else 2
        assert choose_config(1, 1, 32, 8, 1, 4096, 132, size, table=table, **kw) == \
            choose_config(1, 1, 32, 8, 1, 4096, 132, size, table={}, **kw)
    load_table.cache_clear()


def test_broken_or_missing_file_means_builtin_rules(tmp_path, monkeypatch):
    monkeypatch.setattr(attention_config, "CONFIG_DIR", tmp_path)
    load_table.cache_clear()
    assert load_table("Some GPU") == {}
    (tmp_path / "Broken_GPU.json").write_text("{not json")
    assert load_table("Broken GPU") == {}
    (tmp_path / "Odd_GPU.json").write_text(json.dumps({"families": []}))
    assert load_table("Odd GPU") == {}
    load_table.cache_clear()


def test_candidates_are_valid_shapes():
    for phase in ("decode", "prefill"):
        full, quick = tuning.candidates(phase, False), tuning.candidates(phase, True)
        assert all(c in full for c in quick) and len(full) == len({json.dumps(c) for c in full})
        for c in full:
            assert c["block_n"] & (c["block_n"] - 1) == 0 and c["num_warps"] in (2, 4, 8)
            if phase == "prefill":
                assert c["block_m"] in (64, 128)


def test_tune_refuses_without_gpu(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    from pagoda.cli import main

    assert main(["bench", "kernels", "--tune", "--quick"]) == 2
    err = capsys.readouterr().err
    assert "--tune" in err and "CUDA GPU" in err and "nothing was written" in err
