"""``FinalizeWatch``: the launcher's finalize request, through a file (``serving.finalize_request``).

The model's finalize runs once, on the watch's thread, only after the request file appears;
the done file appears only after it returned (also when it raised); the finalize may stop
the watch that runs it; the watch announces itself at start (the launcher asks only then). The whole protocol on a
real tritonserver: the SIGTERM test of tests/serving/test_serving_lifecycle.py.
"""

from __future__ import annotations

import threading
from pathlib import Path

from pagoda.serving.finalize_request import DONE_SUFFIX, REQUEST_SUFFIX, WATCHED_SUFFIX, FinalizeWatch


def test_finalize_runs_once_after_the_request_then_the_done_file_appears(tmp_path: Path):
    drain = str(tmp_path / "drain")
    calls = []
    finished = threading.Event()

    def finalize():
        calls.append((threading.current_thread().name, Path(drain + DONE_SUFFIX).exists()))
        watch.stop()  # the model's finalize stops its own watch: no self-join
        finished.set()

    watch = FinalizeWatch(drain, finalize, interval_s=0.01).start()
    assert Path(drain + WATCHED_SUFFIX).exists()  # the launcher will ask
    assert not finished.wait(0.1) and calls == []  # nothing asked yet
    Path(drain + REQUEST_SUFFIX).touch()
    assert finished.wait(5)
    watch.stop()  # tritonserver's own finalize, later: returns at once
    assert calls == [("pagoda-finalize-watch", False)]  # done only after finalize returned
    assert Path(drain + DONE_SUFFIX).exists()


def test_a_failing_finalize_still_marks_the_request_done(tmp_path: Path):
    drain = str(tmp_path / "drain")

    def finalize():
        raise RuntimeError("the engine would not stop")

    watch = FinalizeWatch(drain, finalize, interval_s=0.01).start()
    Path(drain + REQUEST_SUFFIX).touch()
    watch._thread.join(5)
    assert not watch._thread.is_alive()
    assert Path(drain + DONE_SUFFIX).exists()  # the launcher stops waiting instead of timing out


def test_stopped_before_any_request_it_never_finalizes(tmp_path: Path):
    drain = str(tmp_path / "drain")
    calls = []
    watch = FinalizeWatch(drain, lambda: calls.append(1), interval_s=0.01).start()
    watch.stop()
    Path(drain + REQUEST_SUFFIX).touch()
    assert not watch._thread.is_alive() and calls == [] and not Path(drain + DONE_SUFFIX).exists()
