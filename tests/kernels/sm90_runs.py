"""The sm_90 compile runs of ``test_compile_sm90.py``, started when the session starts and
run in the background (at the lowest CPU priority in a serial session).

Compiling the launch variants for sm_90 (a covering subset: ``sm90_cover.py``) is minutes of
CPU that needs no GPU and no other test: on a 2-core machine the rest of the suite leaves
one core or both idle for much of its time (servers starting, clients waiting on streams,
single-threaded steps). So when the session has selected any of those tests, ``start``
launches the families' runs of ``sm90_compile.py`` at once, one family after another, two
shards each, at ``nice 19``: they take only the cycles the other tests leave, and the
foreground tests keep their speed (the kernel's scheduler gives a nice-19 process ~1.5% of a
core against a nice-0 one). A test then reads its family's output (``rows``), waiting for
what is left of the run; a test run alone (nothing started) runs its family there and then.
``stop`` ends whatever still runs when the session ends. What is compiled does not depend on
when; only when does.

Under pytest-xdist the runs belong to the controller, not to a worker (each worker collects
every test but runs only some: a worker's runs would compile each family once per worker, and
end with that worker's session while the other may still need them): the controller starts
them once its first worker has collected (tests/conftest.py), and writes each family's output
as ``<family>.json`` into the folder it hands every worker (tests/xdist_support.py), with
``started.json``, the families started; a worker's ``rows`` waits for that file. There the
runs take normal priority: two workers leave no idle core, so a nice-19 run would get its
cycles only at the end while the worker that needs it waits (measured: 8 minutes of waiting
in a 36-minute ``-n 2`` run).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

SCRIPT = Path(__file__).with_name("sm90_compile.py")
NUM_SHARDS = 2
SHARD_TIMEOUT_S = 3600.0  # a starved background run may wait long for idle cycles


class _Run:
    """One family's two shards: their (return code, stdout, stderr) once done."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.outputs: list[tuple[int, str, str]] = []


class Sm90Runs:
    def __init__(self, results_dir: Optional[str] = None) -> None:
        self._runs: dict[str, _Run] = {}
        self._lock = threading.Lock()
        self._procs: list[subprocess.Popen] = []
        self._stopped = False
        self._cache = tempfile.mkdtemp(prefix="pagoda-sm90-")
        self._results_dir = results_dir  # the xdist controller's: each family's outputs written there

    def start(self, families: list[str]) -> None:
        """Run ``families`` (in this order) in the background: at the lowest priority beside a
        serial session, at normal priority beside xdist's workers."""
        with self._lock:
            todo = [f for f in dict.fromkeys(families) if f not in self._runs]
            for family in todo:
                self._runs[family] = _Run()
        if todo:
            if self._results_dir is not None:
                _write_json(Path(self._results_dir) / "started.json", list(self._runs))
            # xdist's controller (results_dir): two workers keep both cores busy, so a nice-19 run
            # would get no cycles until the end and the worker waiting for it would idle meanwhile
            lowest = self._results_dir is None
            threading.Thread(target=self._run_all, args=(todo, lowest), daemon=True, name="sm90-compile").start()

    def rows(self, family: str) -> tuple[list[dict], set[int]]:
        """The family's rows (one per variant) and the variant totals its shards reported;
        runs it now (at normal priority) if no background run was started for it. Asserts
        that every shard exited 0."""
        with self._lock:
            run = self._runs.get(family)
            here = run is None
            if here:
                run = self._runs[family] = _Run()
        if here:
            self._run_all([family], background=False)
        run.done.wait()
        rows, totals = [], set()
        for code, stdout, stderr in run.outputs:
            assert code == 0, f"compile script failed ({family}):\n{stderr[-4000:]}"
            for line in stdout.splitlines():
                row = json.loads(line)
                if "total_variants" in row:
                    totals.add(row["total_variants"])
                else:
                    rows.append(row)
        return rows, totals

    def stop(self) -> None:
        """Kill what still runs (a session that ended early) and remove the Triton cache."""
        with self._lock:
            self._stopped = True
            for proc in self._procs:
                if proc.poll() is None:
                    proc.kill()
        shutil.rmtree(self._cache, ignore_errors=True)
        if self._results_dir is not None:
            shutil.rmtree(self._results_dir, ignore_errors=True)

    def _run_all(self, families: list[str], background: bool) -> None:
        for family in families:
            run = self._runs[family]
            try:
                run.outputs = self._run_family(family, background)
            except Exception as exc:  # noqa: BLE001 - reported by the test that reads it
                run.outputs = [(-1, "", f"{type(exc).__name__}: {exc}")]
            finally:
                if self._results_dir is not None:
                    _write_json(Path(self._results_dir) / f"{family}.json", run.outputs)
                run.done.set()

    def _run_family(self, family: str, background: bool) -> list[tuple[int, str, str]]:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env["TRITON_CACHE_DIR"] = os.path.join(self._cache, family)
        env["TRITON_DEFAULT_FP_FUSION"] = "1"  # the default; set to silence triton 3.9's warning
        repo_root = Path(__file__).resolve().parents[2]
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(repo_root), env.get("PYTHONPATH")]))
        procs = []
        for i in range(NUM_SHARDS):
            if self._stopped:
                break
            every = ["--all"] if os.environ.get("PAGODA_SM90_ALL") == "1" else []  # else a covering subset
            procs.append(subprocess.Popen(
                [sys.executable, str(SCRIPT), "--shard", f"{i}/{NUM_SHARDS}", "--families", family, *every],
                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                preexec_fn=(lambda: os.nice(19)) if background else None))
        self._procs += procs
        return [_finish(proc) for proc in procs]


def _finish(proc: subprocess.Popen) -> tuple[int, str, str]:
    stdout, stderr = proc.communicate(timeout=SHARD_TIMEOUT_S)
    return proc.returncode, stdout, stderr


def _write_json(path: Path, value) -> None:
    """Whole or not at all: a reader polling for ``path`` never sees half of it."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)


class ControllerRuns(Sm90Runs):
    """An xdist worker's view: the controller's runs, read from ``results_dir``; a family the
    controller did not start (not in its ``started.json``) runs here."""

    def __init__(self, results_dir: str) -> None:
        super().__init__()
        self._shared = Path(results_dir)

    def rows(self, family: str) -> tuple[list[dict], set[int]]:
        started = self._shared / "started.json"
        if not started.exists() or family not in json.loads(started.read_text()):
            return super().rows(family)
        result = self._shared / f"{family}.json"
        deadline = time.monotonic() + SHARD_TIMEOUT_S
        while not result.exists():
            assert time.monotonic() < deadline, f"the controller's sm_90 run of {family} did not finish"
            time.sleep(1.0)
        with self._lock:
            run = self._runs[family] = _Run()
            run.outputs = [tuple(output) for output in json.loads(result.read_text())]
            run.done.set()
        return super().rows(family)


RUNS: Optional[Sm90Runs] = None


def runs(results_dir: Optional[str] = None, shared_dir: Optional[str] = None) -> Sm90Runs:
    """The session's runs (made on first use): the xdist controller's writing into
    ``results_dir``, a worker's reading the controller's ``shared_dir``, else this process's."""
    global RUNS
    if RUNS is None:
        RUNS = ControllerRuns(shared_dir) if shared_dir else Sm90Runs(results_dir)
    return RUNS
