"""``pagoda bench kv-tiers`` on a tiny random Llama and a 32-token prefix: every tier serves it."""

from __future__ import annotations

from pagoda.bench import kv_tiers


def test_every_tier_serves_the_prefix_and_the_table_has_a_row(model_path, capsys, tmp_path):
    # _ttft raises when a tier's hit counter does not grow by the prefix: reaching the table is the check.
    assert kv_tiers.main(["--model", model_path, "--lengths", "32", "--dir", str(tmp_path)]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 32 |")]
    assert len(rows) == 1 and len(rows[0].strip("|").split("|")) == 9
    assert list(tmp_path.iterdir()) == []  # the tiers' files are removed


def test_lengths_off_the_block_grid_are_refused(capsys):
    import pytest

    with pytest.raises(SystemExit):
        kv_tiers.main(["--lengths", "30"])
    assert "--lengths: give positive multiples of 16" in capsys.readouterr().err
