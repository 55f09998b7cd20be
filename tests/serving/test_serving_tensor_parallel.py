"""``pagoda serve --tensor-parallel-size 2`` through a real tritonserver (gloo on CPU): the
answer equals the offline engine's at TP=1, the rank-1 worker is a child of the model's
stub, and SIGKILL of tritonserver or of the stub takes the worker with it (and the stub
with tritonserver, as today's process tree does); the launcher's stop leaves nothing of
the group."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from pagoda import LLM, SamplingParams
from pagoda.serving import process_tree
from pagoda.serving.launch.launcher import ServeOptions, TritonServer, find_free_port

from tests.serving.test_serving_triton_server import http_post

pytestmark = pytest.mark.server
PROMPT = "The three primary colors are"
GREEDY = {"temperature": 0, "max_tokens": 10, "ignore_eos": True}


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                text = (entry / "stat").read_text()
            except OSError:
                continue
            if int(text[text.rfind(")") + 2:].split()[1]) == pid:
                out.append(int(entry.name))
    return out


def _alive(pids) -> list[int]:
    alive = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            alive.append(pid)
    return alive


@pytest.mark.parametrize("victim", ["tritonserver", "stub"])
def test_tensor_parallel_serving_equals_offline_and_dies_whole(tmp_path, smollm2_path, victim):
    options = ServeOptions(http_port=find_free_port(), grpc_port=find_free_port(), metrics_port=find_free_port(),
                           max_model_len=512, startup_timeout_s=600, engine_args={"tensor_parallel_size": "2"})
    with TritonServer(options, log_path=str(tmp_path / "server.log")) as server:
        status, answer = http_post(server, "/v2/models/pagoda/generate", {
            "text_input": PROMPT, "exclude_input_in_output": True, "sampling_parameters": json.dumps(GREEDY)})
        assert status == 200, answer
        offline = LLM(smollm2_path).generate([PROMPT], SamplingParams(**GREEDY))[0].outputs[0].text
        assert answer["text_output"] == offline
        [stub] = process_tree.python_stubs(server.process.pid, "pagoda")
        workers = _children(stub)
        assert workers, "the rank-1 worker runs under the pagoda stub"
        server_pid = server.process.pid
        os.kill(server_pid if victim == "tritonserver" else stub, signal.SIGKILL)
        gone = [stub, *workers]  # the pagoda stub ends itself when orphaned (process_tree.ParentWatch)
        deadline = time.monotonic() + 30
        while _alive(gone) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(gone), f"left behind after SIGKILL of the {victim}: {_alive(gone)}"
    assert not process_tree.group_members(server_pid)


def test_a_killed_worker_fails_the_requests_naming_its_rank_and_ends_the_stub(tmp_path):
    """SIGKILL of the rank-1 worker: the next request fails with an error naming the rank,
    and the stub ends itself, so the launcher's health check names the dead stub (``pagoda
    serve`` then reloads the model with new workers, not ready meanwhile)."""
    options = ServeOptions(http_port=find_free_port(), grpc_port=find_free_port(), metrics_port=find_free_port(),
                           max_model_len=512, startup_timeout_s=600, engine_args={"tensor_parallel_size": "2"})
    with TritonServer(options, log_path=str(tmp_path / "server.log")) as server:
        [stub] = process_tree.python_stubs(server.process.pid, "pagoda")
        [worker] = [pid for pid in _children(stub)
                    if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]  # not the resource tracker
        os.kill(worker, signal.SIGKILL)
        status, answer = http_post(server, "/v2/models/pagoda/generate", {
            "text_input": PROMPT, "sampling_parameters": json.dumps(GREEDY)})
        assert status != 200 and "rank 1" in answer["error"] and "TensorParallelWorkerDied" in answer["error"]
        deadline = time.monotonic() + 30
        while server.check_health() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "stub" in (server.check_health() or ""), server.check_health()
