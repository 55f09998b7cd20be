"""``pagoda bench lora`` runs end to end on a tiny workload (the numbers are not asserted)."""

from __future__ import annotations

from pagoda.bench import lora as bench_lora


def test_bench_lora_prints_a_row_per_adapter_count(capsys, smollm2_path):
    assert bench_lora.main(["--num-requests", "3", "--prompt-len", "8", "--output-len", "2", "--adapters", "1,2",
                            "--repeats", "1", "--rank", "8", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "| base |" in out and "| 1 adapters |" in out and "| 2 adapters |" in out
