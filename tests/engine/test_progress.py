"""The offline progress bar (``LLM.generate(use_tqdm=...)``, ``pagoda generate``), as vLLM's.

- a tqdm-like recorder sees one bar per call, every prompt counted once (also while a full
  waiting queue is fed as it drains), the token rates in its postfix, and the bar closed;
- ``use_tqdm=False`` draws nothing; a bad ``use_tqdm`` is a ValueError naming it, nothing queued;
- the real bar in a real terminal: ``pagoda generate --prompts-file`` in tmux, its pane
  captured (``tmux capture-pane``) — and none with ``--no-progress``.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
import uuid

import pytest

from pagoda import LLM, SamplingParams
from pagoda.engine.progress import Progress

GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)


class Recorder:
    """tqdm's interface as ``generate`` uses it, recorded."""

    made: list["Recorder"] = []

    def __init__(self, total, desc, unit, dynamic_ncols):
        self.total, self.desc, self.unit = total, desc, unit
        self.n, self.postfix, self.closed = 0, None, False
        Recorder.made.append(self)

    def update(self, n):
        self.n += n

    def close(self):
        self.closed = True


@pytest.fixture
def recorder():
    Recorder.made = []
    return Recorder


def test_one_bar_counts_every_prompt_through_a_full_queue(model_path, recorder):
    llm = LLM(model=model_path, max_num_seqs=2, max_waiting_requests=2)  # 7 prompts: fed as the queue drains
    outputs = llm.generate([[100 + i] * 8 for i in range(7)], GREEDY, use_tqdm=recorder)
    assert len(outputs) == 7
    (bar,) = recorder.made
    assert (bar.total, bar.n, bar.closed, bar.desc, bar.unit) == (7, 7, True, "Processed prompts", "prompt")
    assert bar.postfix.startswith("est. speed input: ") and bar.postfix.endswith(" toks/s")


def test_rates_are_the_finished_prompts_tokens_over_the_time(model_path, recorder):
    outputs = LLM(model=model_path).generate([[7] * 8, [9] * 12], GREEDY, use_tqdm=False)
    ticks = iter([10.0, 12.0, 14.0])
    progress = Progress(2, recorder, clock=lambda: next(ticks))
    progress.finished(outputs[0])  # 8 prompt + 5 generated tokens in 2 s
    assert recorder.made[0].postfix == "est. speed input: 4.00 toks/s, output: 2.50 toks/s"
    progress.finished(outputs[1])  # 20 + 10 in 4 s
    assert recorder.made[0].postfix == "est. speed input: 5.00 toks/s, output: 2.50 toks/s"
    assert recorder.made[0].n == 2


def test_no_bar_when_off_and_a_bad_value_is_refused(model_path, recorder, capsys):
    llm = LLM(model=model_path)
    llm.generate([[5] * 4], GREEDY, use_tqdm=False)
    assert "Processed prompts" not in capsys.readouterr().err
    with pytest.raises(ValueError, match="use_tqdm"):
        llm.generate([[5] * 4], GREEDY, use_tqdm="yes")
    assert not llm.engine.has_unfinished_requests()
    llm.generate([[5] * 4], GREEDY)  # default: tqdm's own bar on stderr
    assert "Processed prompts: 100%" in capsys.readouterr().err


class _Pane:
    """``command`` running in a fresh tmux server's 160x12 pane, started at once."""

    def __init__(self, command: list[str]) -> None:
        self.tmux, self.socket = shutil.which("tmux"), f"pagoda-test-{uuid.uuid4().hex[:8]}"
        shell = " ".join(f"'{part}'" for part in command) + "; echo PANE-EXIT=$?; sleep 600"
        subprocess.run([self.tmux, "-L", self.socket, "new-session", "-d", "-x", "160", "-y", "12", shell],
                       check=True, timeout=30)

    def text(self, timeout_s: float = 300.0) -> str:
        """The pane's text (history included) once its command exited."""
        deadline = time.monotonic() + timeout_s
        while True:
            capture = [self.tmux, "-L", self.socket, "capture-pane", "-p", "-J", "-S", "-"]  # the history's start
            pane = subprocess.run(capture, capture_output=True, text=True, timeout=30).stdout
            if "PANE-EXIT=" in pane:
                return pane
            assert time.monotonic() < deadline, f"pagoda generate did not finish in {timeout_s} s:\n{pane}"
            time.sleep(0.2)

    def close(self) -> None:
        subprocess.run([self.tmux, "-L", self.socket, "kill-server"], timeout=30)


def test_pagoda_generate_draws_the_bar_in_a_terminal(smollm2_path, tmp_path):
    if shutil.which("tmux") is None:
        pytest.skip("tmux not installed (apt-get install -y tmux)")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("".join(f"Name a colour number {i}:\n" for i in range(6)) + "\n")
    base = [sys.executable, "-m", "pagoda.cli", "generate", "--model", smollm2_path, "--max-tokens", "4",
            "--prompts-file", str(prompts)]
    # Both commands run at once, each in its own terminal: most of each is Python's and torch's
    # start and the model's load, which a second core takes in parallel.
    panes = [_Pane(base)]
    try:
        panes.append(_Pane(base + ["--no-progress"]))
        pane, quiet = (p.text() for p in panes)
    finally:
        for p in panes:
            p.close()
    assert "PANE-EXIT=0" in pane, pane
    bar = [line for line in pane.splitlines() if line.startswith("Processed prompts: 100%")]
    assert bar and "6/6" in bar[-1] and "toks/s" in bar[-1], pane
    assert "PANE-EXIT=0" in quiet and "Processed prompts" not in quiet, quiet
