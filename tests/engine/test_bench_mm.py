"""``pagoda bench mm`` (issue 41): an image request's TTFT cold, from the encoder cache and from the
prefix cache, and the encoder's rate, on a tiny random Qwen3-VL; each case checked to be what it
names (a cache that stopped working fails the command)."""

from __future__ import annotations

import json

import pytest

from pagoda.bench import mm


def test_bench_mm_measures_each_case_and_checks_it(tmp_path, capsys):
    pytest.importorskip("PIL")
    out = tmp_path / "mm.json"
    assert mm.main(["--preset", "tiny", "--image-size", "64", "--repeats", "1", "--images", "2",
                    "--text-tokens", "20", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    for row in ("text only", "cold", "encoder hit", "prefix hit", "images/s"):
        assert row in printed, printed
    result = json.loads(out.read_text())
    assert {k: len(v) for k, v in result["ttft_s"].items()} == {"text only": 1, "cold": 1, "encoder hit": 1,
                                                                 "prefix hit": 1}
    assert result["encoder_images_per_s"] > 0 and result["tokens_per_image"] == 4  # 64x64: 2x2 merged patches


def test_a_case_that_did_not_hit_its_cache_fails_the_command():
    mm._check("prefix hit", 0, 64)
    with pytest.raises(RuntimeError, match="'encoder hit' request encoded 1 image"):
        mm._check("encoder hit", 1, 0)
    with pytest.raises(RuntimeError, match="'prefix hit' request encoded 0 image\\(s\\) and hit 0"):
        mm._check("prefix hit", 0, 0)
    with pytest.raises(RuntimeError, match="'cold' request encoded 1 image\\(s\\) and hit 16"):
        mm._check("cold", 1, 16)
