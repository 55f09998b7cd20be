"""``pagoda bench throughput`` on a tiny random model on the CPU: every mix runs to the
end, generates the workload's exact token count, and the stage shares are measured."""

from __future__ import annotations

import json

import pytest

from pagoda.bench import throughput
from pagoda.cli import main as cli_main


def test_tiny_cpu_run_reports_every_mix(tmp_path, capsys, restore_threads):
    out = tmp_path / "tput.json"
    argv = ["bench", "throughput", "--small", "--device", "cpu", "--threads", "1", "--num-requests", "6",
            "--prompt-len", "8", "20", "--output-len", "3", "9", "--max-num-seqs", "4", "--repeats", "2",
            "--json", str(out)]
    assert cli_main(argv) == 0
    report = json.loads(out.read_text())
    requests = throughput.make_requests(6, (8, 20), (3, 9), vocab_size=512)
    assert [r["mix"] for r in report["mixes"]] == list(throughput.MIXES)
    for result in report["mixes"]:
        assert result["output_tokens"] == sum(r.max_tokens for r in requests)  # ignore_eos: exact
        assert result["prompt_tokens"] == sum(len(r.prompt_token_ids) for r in requests)
        shares = result["shares"]
        assert all(shares[s] > 0 for s in ("schedule", "forward", "sampler"))
        assert sum(shares.values()) == pytest.approx(1.0)
    printed = capsys.readouterr().out
    assert "| sampled |" in printed and "seeded / greedy wall time" in printed


def test_seeded_mix_seeds_every_other_request_and_bad_mix_is_refused():
    params = [throughput.sampling_params("seeded", i, 5) for i in range(4)]
    assert [p.seed for p in params] == [0, None, 2, None]
    assert all(p.temperature == 0.8 and p.top_p == 0.95 for p in params)
    assert throughput.sampling_params("greedy", 0, 5).is_greedy
    with pytest.raises(SystemExit):
        throughput.parse_args(["--mixes", "greedy,beam"])
    with pytest.raises(SystemExit):
        throughput.parse_args(["--repeats", "0"])
