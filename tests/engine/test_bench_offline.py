"""``pagoda bench offline``'s pass through pagoda: its numbers, and the progress bar it draws
unless ``--no-progress`` (issue 45: long benchmark runs show progress, as ``LLM.generate``)."""

from __future__ import annotations

from types import SimpleNamespace

from pagoda.bench.offline import make_pagoda, run_pagoda
from pagoda.bench.workload import WorkItem


def test_a_pass_counts_its_tokens_and_draws_its_progress_only_when_asked(smollm2_path, capsys):
    items = [WorkItem(list(range(1000, 1000 + n)), m) for n, m in ((5, 3), (9, 2), (4, 4))]
    args = SimpleNamespace(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128)
    engine = make_pagoda(smollm2_path, items, args)
    try:
        capsys.readouterr()
        quiet = run_pagoda(engine, items, run=0)
        assert quiet["tokens"] == 3 + 2 + 4 and "Processed prompts" not in capsys.readouterr().err
        shown = run_pagoda(engine, items, run=1, progress=True)
        err = capsys.readouterr().err
    finally:
        engine.shutdown()
    assert shown["tokens"] == 9 and shown["steps"] >= 4
    assert "Processed prompts" in err and "3/3" in err and "output:" in err, err
