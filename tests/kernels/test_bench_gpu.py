"""``pagoda bench gpu`` walked on a CPU: the plan, its time budgets and the report format,
with a fake clock (``--dry-run``); the real runner's timeout and failure handling with tiny
child processes."""

from __future__ import annotations

import json

import pytest
import torch

from pagoda.bench import gpu_suite
from pagoda.bench.gpu_suite import FakeClock, Step, dry_runner, plan, run_suite, subprocess_runner


@pytest.mark.parametrize("quick, budget", [(True, gpu_suite.QUICK_BUDGET_S), (False, gpu_suite.FULL_BUDGET_S)])
def test_dry_run_walks_every_step_within_the_budget(tmp_path, quick, budget):
    out = tmp_path / "report.md"
    argv = ["--device", "cpu", "--dry-run", "--out", str(out)] + (["--quick"] if quick else [])
    assert gpu_suite.main(argv) == 0
    steps = plan(quick)
    assert sum(s.budget_s for s in steps) <= budget
    report = json.loads(out.with_suffix(".json").read_text())
    assert [s["name"] for s in report["steps"]] == [s.name for s in steps]
    assert all(s["status"] in ("ok", "dry run") for s in report["steps"])  # every argv parsed; none skipped
    text = out.read_text()
    for heading in ("## Environment", "## Steps", "## Correctness", "## Speed", "Not measured by this suite yet"):
        assert heading in text
    assert "| attention | speed | dry run |" in text and "| kernels-bf16 | correctness | dry run |" in text
    assert "(dry run)" in text.splitlines()[0]
    names = {s.name for s in steps}
    assert {"greedy-fp32", "attention", "e2e-llama3-8b", "throughput", "served"} <= names
    assert ("quant-llama3-8b" in names) == (not quick)


def test_a_step_that_would_overrun_is_skipped_and_named():
    clock = FakeClock()
    steps = plan(quick=False)
    run = run_suite(steps, 140.0, dry_runner(clock), clock, {"device": "cpu"}, dry_run=True)
    statuses = {r.name: r for r in run.results}
    assert [statuses[n].status for n in ("greedy-fp32", "kernels-bf16", "greedy-bf16")] == ["dry run"] * 3
    skipped = statuses["kernels-fp16"]
    assert skipped.status == "skipped" and skipped.note == "would overrun: needs 30 s, 20 s left"
    assert all(r.status == "skipped" for r in run.results[5:]) and clock.now == 120.0


def test_arguments_a_command_no_longer_takes_fail_the_dry_run():
    clock = FakeClock()
    bad = Step("renamed-flag", "speed", ("pagoda.cli", "bench", "kernels", "--no-such-flag"), 1)
    [result] = run_suite([bad], 10.0, dry_runner(clock), clock, {}, dry_run=True).results
    assert result.status == "failed" and "do not parse" in result.note


def test_real_runner_kills_a_step_at_its_budget_and_reports_failures():
    slow = Step("slow", "speed", ("timeit", "-n", "1", "-r", "1", "import time; time.sleep(30)"), 1.0)
    result = subprocess_runner(slow, slow.budget_s)
    assert result.status == "timed out" and "killed at its budget" in result.note and result.seconds < 10
    broken = Step("broken", "speed", ("pagoda.cli", "bench", "no-such-bench"), 60.0)
    result = subprocess_runner(broken, broken.budget_s)
    assert result.status == "failed" and result.note == "exit code 2" and "usage: pagoda" in result.output


def test_refuses_without_a_gpu_unless_dry(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert gpu_suite.main(["--quick"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_kernel_check_passes_every_family_under_the_interpreter(capsys):
    """The suite's kernel step, at its --small shapes on CPU tensors (TRITON_INTERPRET=1 is set
    for the whole test session): every family within its float64 bound."""
    from pagoda.bench import kernel_check

    assert kernel_check.main(["--device", "cpu", "--small", "--dtype", "float16"]) == 0
    out = capsys.readouterr().out
    assert "16 of 16 cases within their bounds" in out
    for family in ("attention", "kv write", "rms norm", "rotary", "w8a16", "lora"):
        assert f"| {family} |" in out
    with pytest.raises(SystemExit):
        kernel_check.main(["--device", "cpu", "--small", "--families", "attention,nope"])
