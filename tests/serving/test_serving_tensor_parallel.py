"""A parallel replica through a real tritonserver (gloo on CPU), each test run for
``pagoda serve --tensor-parallel-size 2`` and for ``--pipeline-parallel-size 2``:

- with tritonclient (gRPC), the greedy and the seeded answers equal the offline engine's
  on one device (TP=1, PP=1);
- the rank-1 worker is a child of the model's stub, and SIGKILL of ``pagoda serve``, of
  tritonserver or of the stub leaves no process behind (tritonserver, stub, worker); at
  PP=2 (workers spawned by the same code) only tritonserver's SIGKILL is repeated;
- a SIGKILLed worker fails the next request with an error naming its rank and its kind of
  parallelism, and the stub ends itself, so the replica turns not ready.

The stub runs the pagoda package that its Python finds (the repository's editable
install), not a test's ``PYTHONPATH``: these tests exercise the engine and serving code of
that install.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from pathlib import Path

import pytest

from pagoda import LLM, SamplingParams
from pagoda.serving import process_tree
from pagoda.serving.launch.client import stream_generate
from pagoda.serving.launch.launcher import TritonServer, find_free_port
from pagoda.serving.launch.serve_options import ServeOptions

from tests.serving.test_serving_lifecycle import SMALL, ServeProcess

pytestmark = pytest.mark.server
PROMPT = "The three primary colors are"
SAMPLINGS = {"greedy": {"temperature": 0, "max_tokens": 10, "ignore_eos": True},
             "seeded": {"temperature": 0.9, "top_p": 0.95, "seed": 1234, "max_tokens": 10, "ignore_eos": True}}
LAYOUTS = {"tp2": "tensor_parallel_size", "pp2": "pipeline_parallel_size"}  # each at 2
KINDS = {"tp2": "tensor-parallel", "pp2": "pipeline-parallel"}  # as the worker-death error names them


@pytest.fixture(scope="module")
def offline_texts(smollm2_path):
    """The offline engine's answers on one device, the reference for every layout."""
    llm = LLM(smollm2_path)
    return {name: llm.generate([PROMPT], SamplingParams(**params))[0].outputs[0].text
            for name, params in SAMPLINGS.items()}


def _served_texts(grpc_url: str) -> dict[str, str]:
    """Each of ``SAMPLINGS`` sent once with ``tritonclient.grpc.aio`` (non-streaming)."""
    from tritonclient.grpc import aio

    async def one(params: dict) -> str:
        client = aio.InferenceServerClient(grpc_url)
        try:
            texts = [out["text_output"] async for out in stream_generate(
                client, PROMPT, params, stream=False, exclude_input_in_output=True)]
        finally:
            await client.close()
        return "".join(texts)

    return {name: asyncio.run(one(params)) for name, params in SAMPLINGS.items()}


def _options(layout: str) -> ServeOptions:
    return ServeOptions(http_port=find_free_port(), grpc_port=find_free_port(), metrics_port=find_free_port(),
                        max_model_len=512, startup_timeout_s=600, engine_args={LAYOUTS[layout]: "2"})


@contextlib.contextmanager
def _replica(tmp_path: Path, layout: str, launcher: bool):
    """A served replica of ``layout``: yields (gRPC address, tritonserver pid, launcher pid),
    the launcher being ``pagoda serve`` in a child process when ``launcher``, else this
    process (``TritonServer``)."""
    if launcher:
        serve = ServeProcess(*SMALL, "--" + LAYOUTS[layout].replace("_", "-"), "2")
        try:
            serve.wait_serving()
            yield f"127.0.0.1:{serve.ports[1]}", serve.server_pid(), serve.proc.pid
        finally:
            serve.kill()
    else:
        with TritonServer(_options(layout), log_path=str(tmp_path / "server.log")) as server:
            yield server.grpc_url, server.process.pid, os.getpid()


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


# Every victim for TP; PP spawns its workers the same way (engine.parallel), so one victim
# there: each case is a server start (~45 s on 2 cores).
CASES = [("tp2", "pagoda serve"), ("tp2", "tritonserver"), ("tp2", "stub"), ("pp2", "tritonserver")]


@pytest.mark.parametrize("layout,victim", CASES)
def test_parallel_serving_equals_offline_and_dies_whole(tmp_path, offline_texts, layout, victim):
    with _replica(tmp_path, layout, launcher=victim == "pagoda serve") as (grpc_url, server_pid, launcher_pid):
        assert _served_texts(grpc_url) == offline_texts
        [stub] = process_tree.python_stubs(server_pid, "pagoda")
        workers = _children(stub)
        assert workers, "the rank-1 worker runs under the pagoda stub"
        # the pagoda stub ends itself when orphaned (process_tree.ParentWatch); without its
        # launcher, tritonserver and every process of its group go too
        gone = [stub, *workers] + (process_tree.group_members(server_pid) if victim == "pagoda serve" else [])
        victim_pid = {"pagoda serve": launcher_pid, "tritonserver": server_pid, "stub": stub}[victim]
        os.kill(victim_pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while _alive(gone) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(gone), f"left behind after SIGKILL of the {victim}: {_alive(gone)}"
    assert not process_tree.group_members(server_pid)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_killed_worker_fails_the_requests_naming_its_rank_and_ends_the_stub(tmp_path, layout):
    """SIGKILL of the rank-1 worker: the next request (tritonclient gRPC) fails with an error
    naming the rank and the kind of parallelism, and the stub ends itself, so the launcher's
    health check names the dead stub (``pagoda serve`` then reloads the model with new
    workers, not ready meanwhile)."""
    from tritonclient.utils import InferenceServerException

    with TritonServer(_options(layout), log_path=str(tmp_path / "server.log")) as server:
        [stub] = process_tree.python_stubs(server.process.pid, "pagoda")
        [worker] = [pid for pid in _children(stub)
                    if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]  # not the resource tracker
        os.kill(worker, signal.SIGKILL)
        with pytest.raises(InferenceServerException) as failed:
            _served_texts(server.grpc_url)
        message = str(failed.value)
        assert f"{KINDS[layout]} worker rank 1 (pid {worker})" in message, message
        assert "TensorParallelWorkerDied" in message, message
        deadline = time.monotonic() + 30
        while server.check_health() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "stub" in (server.check_health() or ""), server.check_health()
