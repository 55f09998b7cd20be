"""A replica's process lifecycle on a real tritonserver (CPU, default SmolLM2, short outputs).

- ``pagoda serve`` refuses to announce a server whose first request fails, and says why;
- a dead Python-backend stub is reported (tritonserver alone keeps answering READY) and
  tritonserver is restarted on the same ports, not ready meanwhile; out of restarts, the
  replica stops, so nothing keeps routing to it;
- SIGKILL of the launcher leaves no tritonserver or stub, and the ports are free again;
- SIGTERM drains: a request in flight completes, the model finalizes (its Redis goodbye)
  even while a client holds an idle HTTP keep-alive connection, then every process exits;
- a SIGKILLed tritonserver leaves no stub, and the replica's Redis heartbeat expires;
- a non-streaming request without max_tokens whose client left stops at the default cap
  and frees its KV blocks (tritonserver 2.51's HTTP front end does not flag such a
  request as cancelled: see docs/serving.md).
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from pagoda.serving import process_tree
from pagoda.serving.launch import startup_check
from pagoda.serving.launch.launcher import TritonServer, default_model_repository, find_free_port
from pagoda.serving.launch.serve_options import ServeOptions

SMALL = ["--max-model-len", "512", "--max-num-seqs", "4", "--kv-cache-memory-bytes", str(64 * 2**20)]

FAILING_MODEL = '''
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        raise RuntimeError("boom: this backend fails every request")
'''

FAILING_CONFIG = '''
name: "pagoda"
backend: "python"
max_batch_size: 0
input [ { name: "text_input" data_type: TYPE_STRING dims: [ 1 ] },
        { name: "max_tokens" data_type: TYPE_INT32 dims: [ 1 ] optional: true },
        { name: "temperature" data_type: TYPE_FP32 dims: [ 1 ] optional: true } ]
output [ { name: "text_output" data_type: TYPE_STRING dims: [ -1 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
'''


class ServeProcess:
    """``pagoda serve`` as a child process, its output collected by a thread."""

    def __init__(self, *args: str) -> None:
        self.ports = [find_free_port() for _ in range(3)]
        command = [sys.executable, "-m", "pagoda.serving.launch.serve_cli", "--http-port", str(self.ports[0]),
                   "--grpc-port", str(self.ports[1]), "--metrics-port", str(self.ports[2]), "--openai-port", "0",
                   *args]
        self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for raw in iter(self.proc.stdout.readline, b""):
            self.lines.append(raw.decode(errors="replace"))

    @property
    def output(self) -> str:
        return "".join(self.lines)

    @property
    def http(self) -> str:
        return f"127.0.0.1:{self.ports[0]}"

    def wait_serving(self, timeout_s: float = 600) -> None:
        deadline = time.monotonic() + timeout_s
        while "pagoda is serving" not in self.output:
            assert self.proc.poll() is None, f"pagoda serve exited ({self.proc.returncode}):\n{self.output[-4000:]}"
            assert time.monotonic() < deadline, self.output[-4000:]
            time.sleep(0.2)

    def server_pid(self) -> int:
        children = [pid for pid in _pids() if _ppid(pid) == self.proc.pid]
        assert len(children) == 1, children
        return children[0]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)
        self._reader.join(10)

    def stop(self, grace_s: float = 60) -> None:
        """SIGTERM (a clean drain), then ``kill`` whatever is left after ``grace_s``."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(grace_s)
        finally:
            self.kill()


def _pids() -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]


def _ppid(pid: int) -> int:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return -1
    return int(text[text.rfind(")") + 2:].split()[1])


def _stub_pids(server_pid: int) -> list[int]:
    """The stubs of pagoda's model (the TensorRT-LLM fronts' stubs hold no engine)."""
    return process_tree.python_stubs(server_pid, "pagoda")


def _wait_until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(0.1)


def _is_ready(address: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{address}/v2/health/ready", timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _metric(metrics_port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def _ports_free(ports) -> bool:
    try:
        process_tree.check_ports_free(ports)
    except RuntimeError:
        return False
    return True


# ---------------------------------------------------------------- no server needed
def test_known_causes_are_named():
    crash = ("terminate called after throwing an instance of 'pybind11::error_already_set'\n  what():  error: "
             "unpack_from requires a buffer of at least 1094795589 bytes\nAt:\n  <path> deserialize_bytes_tensor")
    assert "numpy>=2" in startup_check.diagnose(crash)
    assert startup_check.diagnose("all fine") is None
    with pytest.raises(startup_check.StartupCheckError, match=r"numpy 2.1.3 .* numpy<2"):
        startup_check.check_numpy_version("2.1.3")
    startup_check.check_numpy_version("1.26.4")


def test_a_taken_port_is_refused_naming_it():
    with socket.socket() as holder:
        holder.bind(("0.0.0.0", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(RuntimeError, match=rf"port {port} is already in use \(held by pid {os.getpid()}"):
            process_tree.check_ports_free([port])


def test_a_port_is_never_handed_out_twice(monkeypatch):
    """The kernel may give a just-closed port again (a fleet test once got one port for a
    server's gRPC and metrics listeners): find_free_port skips ports it handed out before."""
    from pagoda.serving.launch import launcher

    given = iter([41001, 41001, 41001, 41002])

    class Socket:  # the kernel's bind-to-0 answer, scripted: the same port thrice, then another
        def __init__(self, *args):
            self.port = next(given)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def bind(self, address):
            pass

        def getsockname(self):
            return ("127.0.0.1", self.port)

    monkeypatch.setattr(launcher, "_handed_out", set())
    monkeypatch.setattr(launcher.socket, "socket", Socket)
    assert [launcher.find_free_port(), launcher.find_free_port()] == [41001, 41002]


def test_a_stop_beside_a_failing_starts_stop_is_not_broken(monkeypatch):
    """A start that fails stops its server; the fixture that started it may stop it at the same
    time (tests/fleet/test_migration_e2e.py's did): one stop waits for the other, neither fails."""
    server = TritonServer(ServeOptions(http_port=0, grpc_port=0, metrics_port=0))
    server.process = process_tree.spawn(["sleep", "60"], start_new_session=True)  # as _spawn does
    kill_group, other, errors = process_tree.kill_group, [], []

    def second_stop_meanwhile(pid):  # the other stop arrives while this one kills the group
        if not other:
            other.append(threading.Thread(target=lambda: _record(errors, server.stop, grace_s=0)))
            other[0].start()
            other[0].join(1.0)
        return kill_group(pid)

    monkeypatch.setattr(process_tree, "kill_group", second_stop_meanwhile)
    code = server.stop(grace_s=0)
    other[0].join(10.0)
    assert code == -signal.SIGKILL and not other[0].is_alive() and errors == [] and server.process is None


def _record(errors: list, fn, **kwargs) -> None:
    try:
        fn(**kwargs)
    except Exception as exc:  # noqa: BLE001 - the test asserts there was none
        errors.append(exc)


def test_a_child_spawned_from_a_short_lived_thread_outlives_the_thread_not_the_process():
    # The parent-death signal follows the forking thread: spawn() forks from a long-lived one.
    children = []
    thread = threading.Thread(target=lambda: children.append(process_tree.spawn(["sleep", "60"])))
    thread.start()
    thread.join()
    time.sleep(0.3)
    assert process_tree.is_alive(children[0].pid)
    children[0].kill()
    children[0].wait()
    # ... and dies with its process: a parent SIGKILLed takes its spawned child along.
    script = ("import sys, time; from pagoda.serving import process_tree; "
              "print(process_tree.spawn(['sleep', '60']).pid, flush=True); time.sleep(60)")
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    child_pid = int(parent.stdout.readline())
    assert process_tree.is_alive(child_pid)
    parent.kill()
    parent.wait()
    _wait_until(lambda: not process_tree.is_alive(child_pid), 5, "the orphan gets SIGKILL")


def test_orphaned_shared_memory_regions_are_swept_and_live_ones_kept(tmp_path):
    """A killed launcher's server leaves its stubs' regions: the next start removes those no
    process maps, but never a mapped (live) one, a young one, or another program's."""
    import mmap

    old = time.time() - 600
    for name in ("pagoda_dead_1", "pagoda_live_1", "pagoda_young_1", "other_program_1"):
        (tmp_path / name).write_bytes(b"\0" * 4096)
        if name != "pagoda_young_1":
            os.utime(tmp_path / name, (old, old))
    with open(tmp_path / "pagoda_live_1", "r+b") as live, mmap.mmap(live.fileno(), 4096):
        assert process_tree.sweep_orphan_shm_regions("pagoda_", tmp_path) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other_program_1", "pagoda_live_1", "pagoda_young_1"]
    assert process_tree.remove_shm_regions("pagoda_live_", tmp_path) == 1


def test_nvidias_container_tritonserver_is_found_without_pytriton(tmp_path, monkeypatch):
    from pagoda.serving.launch import triton_install

    for name in ("bin/tritonserver", "backends/python/libtriton_python.so",
                 "backends/python/triton_python_backend_utils.py", "backends/python/triton_python_backend_stub"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    monkeypatch.setitem(sys.modules, "pytriton", None)  # import pytriton -> ImportError
    monkeypatch.setenv("PAGODA_TRITONSERVER_DIR", str(tmp_path))
    paths = triton_install.find_tritonserver()
    assert paths.binary == tmp_path / "bin" / "tritonserver" and paths.libs == tmp_path / "lib"
    assert paths.stub == tmp_path / "backends" / "python" / "triton_python_backend_stub"
    monkeypatch.setenv("PAGODA_TRITONSERVER_DIR", str(tmp_path / "missing"))
    with pytest.raises(RuntimeError, match="needs tritonserver"):
        triton_install.find_tritonserver()


# ------------------------------------------------------------------ real servers
@pytest.mark.server
def test_serve_refuses_to_announce_a_server_whose_first_request_fails(tmp_path):
    repository = tmp_path / "repo"
    (repository / "pagoda" / "1").mkdir(parents=True)
    (repository / "pagoda" / "config.pbtxt").write_text(FAILING_CONFIG)
    (repository / "pagoda" / "1" / "model.py").write_text(FAILING_MODEL)
    serve = ServeProcess("--model-repository", str(repository), "--grace-period", "2")
    try:
        code = serve.proc.wait(300)
    finally:
        serve.kill()
    assert code == 1, serve.output[-3000:]
    assert "pagoda is serving" not in serve.output
    assert "tritonserver is READY but cannot serve: the first request failed" in serve.output
    assert "boom: this backend fails every request" in serve.output
    assert _ports_free(serve.ports)


@pytest.mark.server
def test_a_dead_stub_is_restarted_not_ready_meanwhile_then_the_replica_stops_when_out_of_restarts():
    """The first stub killed is a TensorRT-LLM front's (``ensemble``: supervised as pagoda's own,
    its requests failed "not healthy" until a manual restart), the second pagoda's own."""
    serve = ServeProcess(*SMALL, "--max-stub-restarts", "1")
    try:
        serve.wait_serving()
        server_pid = serve.server_pid()
        (first_stub,) = process_tree.python_stubs(server_pid, "ensemble")
        assert _is_ready(serve.http)
        os.kill(first_stub, signal.SIGKILL)
        # tritonserver alone would stay READY; the launcher restarts it: not ready meanwhile.
        _wait_until(lambda: not _is_ready(serve.http), 10, "not ready after the stub died")
        _wait_until(lambda: "the stub was restarted; serving again" in serve.output, 300, "restart")
        assert _is_ready(serve.http)
        status, text = _generate(serve.http, {"text_input": "Hello", "max_tokens": 2})
        assert status == 200 and "text_output" in text
        new_server_pid = serve.server_pid()  # a new tritonserver, on the same ports
        assert new_server_pid != server_pid and not process_tree.group_members(server_pid)
        (second_stub,) = _stub_pids(new_server_pid)
        (new_front_stub,) = process_tree.python_stubs(new_server_pid, "ensemble")
        assert new_front_stub != first_stub
        os.kill(second_stub, signal.SIGKILL)  # out of restarts: the replica stops
        code = serve.proc.wait(60)
    finally:
        serve.kill()
    assert code == 1
    assert f"the Python-backend stub (pid {first_stub}) died; restarting it" in serve.output
    assert f"the Python-backend stub (pid {second_stub}) died (restarted 1 time(s)" in serve.output
    assert not _is_ready(serve.http)
    assert not process_tree.group_members(new_server_pid)
    assert _ports_free(serve.ports)


@pytest.mark.server
def test_sigkill_of_the_launcher_leaves_no_process_and_frees_the_ports():
    serve = ServeProcess(*SMALL, "--no-vllm-metrics")
    try:
        serve.wait_serving()
        # --no-vllm-metrics (the vLLM backend's REPORT_CUSTOM_METRICS=false): pagoda: series only.
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{serve.ports[2]}/metrics", timeout=5).read().decode()
        assert "pagoda:engine_steps_total" in metrics and "vllm:" not in metrics
        server_pid = serve.server_pid()
        assert _stub_pids(server_pid)
        serve.proc.send_signal(signal.SIGKILL)
        serve.proc.wait(10)
        _wait_until(lambda: not process_tree.group_members(server_pid), 10, "tritonserver and its stub gone")
        _wait_until(lambda: _ports_free(serve.ports), 10, "ports free")
    finally:
        serve.kill()
        # Never leave an orphan behind, whatever failed above.
        process_tree.kill_group(server_pid) if "server_pid" in locals() else None


def _stream(address: str, body: dict, events: list, first_token: threading.Event) -> None:
    request = urllib.request.Request(f"http://{address}/v2/models/pagoda/generate_stream",
                                     data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        for line in response:
            line = line.decode().strip()
            if line.startswith("data:"):
                events.append(json.loads(line[len("data:"):]))
                first_token.set()


def _generate(address: str, body: dict) -> tuple[int, str]:
    """(HTTP status, body text) of a non-streaming request; status -1 when refused at connect."""
    request = urllib.request.Request(f"http://{address}/v2/models/pagoda/generate", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()
    except (urllib.error.URLError, OSError) as exc:
        return -1, str(exc)


@pytest.mark.server
def test_sigterm_completes_the_request_in_flight_then_exits_cleanly(redis_server):
    from pagoda.contracts import redis_keys as keys

    serve = ServeProcess(*SMALL, "--grace-period", "60", "--redis-url", redis_server.url, "--replica-id", "leaver",
                         "--fleet-model", "lifecycle")
    redis = redis_server.client()
    drain_flag, heartbeat = keys.drain_key("lifecycle", "leaver"), keys.heartbeat_key("lifecycle", "leaver")
    try:
        serve.wait_serving()
        server_pid = serve.server_pid()
        events: list = []
        first_token = threading.Event()
        body = {"text_input": "Count to one hundred:", "max_tokens": 48, "temperature": 0.0, "stream": True,
                "sampling_parameters": json.dumps({"ignore_eos": True}), "return_num_output_tokens": True}
        client = threading.Thread(target=_stream, args=(serve.http, body, events, first_token))
        client.start()
        # An idle keep-alive connection (a client's pool) must not hold the exit.
        idle = http.client.HTTPConnection("127.0.0.1", serve.ports[0], timeout=30)
        idle.request("GET", "/v2/health/live")
        assert idle.getresponse().read() is not None
        assert first_token.wait(120), serve.output[-3000:]
        serve.proc.send_signal(signal.SIGTERM)
        # Routers send a draining replica nothing new: it sets its Redis drain flag.
        _wait_until(lambda: redis.exists(drain_flag), 5, "drain flag set")
        late = _generate(serve.http, {"text_input": "Hello", "max_tokens": 2})  # arrives while draining
        client.join(300)
        code = serve.proc.wait(120)
        idle.close()
    finally:
        serve.kill()
    assert code == 0, serve.output[-3000:]
    assert late[0] != 200 and ("draining" in late[1] or "unknown model" in late[1] or late[0] == -1), late
    assert not redis.exists(drain_flag) and not redis.exists(heartbeat)  # deregistered, flag cleared
    redis.close()
    assert not client.is_alive()
    text = "".join(e["text_output"] for e in events)
    assert sum(e["num_output_tokens"][0] if isinstance(e["num_output_tokens"], list) else e["num_output_tokens"]
               for e in events) == 48, events[-1]
    assert text
    # The model finalized before tritonserver's exit (the Redis goodbye above): tritonserver
    # itself spends its whole exit timeout waiting for the idle connection, then exits
    # without its own unload (docs/serving.md, "The drain").
    assert "Exit timeout expired" in serve.output and "tritonserver stopped (exit code 1)" in serve.output
    assert not process_tree.group_members(server_pid)
    assert _ports_free(serve.ports)


@pytest.mark.server
def test_after_the_finalize_requests_get_the_draining_error_and_tritonserver_exits_cleanly(tmp_path):
    """Between the model's finalize (the launcher's request) and tritonserver's exit, a request
    is answered with the draining error instead of hanging; with no idle connection,
    tritonserver then unloads the finalized model itself and exits 0."""
    from pagoda.serving import finalize_request

    options = ServeOptions(http_port=find_free_port(), grpc_port=find_free_port(), metrics_port=find_free_port(),
                           max_model_len=512, max_num_seqs=4, kv_cache_memory_bytes=64 * 2**20, grace_period_s=5)
    server = TritonServer(options, log_path=str(tmp_path / "server.log"))
    server.start()
    try:
        drain = server.workdir / "drain"
        for request, done in ((drain, Path(f"{drain}.done")),
                              (Path(f"{drain}{finalize_request.REQUEST_SUFFIX}"),
                               Path(f"{drain}{finalize_request.DONE_SUFFIX}"))):
            request.touch()
            _wait_until(done.exists, 30, f"{done.name} written by the model")
        status, text = _generate(server.http_url, {"text_input": "Hello", "max_tokens": 2})
        assert status == 400 and "draining (shutting down)" in text, (status, text)
    finally:
        code = server.stop()
    log = (tmp_path / "server.log").read_text(errors="replace")
    assert code == 0 and "Exit timeout expired" not in log, log[-3000:]
    assert "successfully unloaded 'pagoda'" in log


@pytest.fixture
def redis_server(tmp_path):
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed (apt-get install -y redis-server)")
    pytest.importorskip("redis")
    from tests.fleet.conftest import RedisServer

    server = RedisServer(binary, tmp_path)
    server.start()
    yield server
    server.stop()


@pytest.mark.server
def test_a_sigkilled_server_leaves_no_stub_and_its_heartbeat_expires(redis_server, monkeypatch, tmp_path):
    from pagoda.contracts import redis_keys as keys

    monkeypatch.setenv("PAGODA_HEARTBEAT_TTL_S", "3.0")
    options = ServeOptions(http_port=find_free_port(), grpc_port=find_free_port(), metrics_port=find_free_port(),
                           max_model_len=512, max_num_seqs=4, kv_cache_memory_bytes=64 * 2**20,
                           engine_args={"default_max_tokens": "24"}, redis_url=redis_server.url,
                           replica_id="victim", fleet_model="lifecycle", grace_period_s=5)
    server = TritonServer(options, log_path=str(tmp_path / "server.log"))
    client = redis_server.client()
    heartbeat = keys.heartbeat_key("lifecycle", "victim")
    with server:
        _wait_until(lambda: client.exists(heartbeat), 30, "first heartbeat")
        # A non-streaming request with no token limit (max_tokens null, as the router sends
        # an OpenAI request without one) whose client leaves at once: it runs to the
        # default cap (24 tokens), then its blocks are free again.
        body = json.dumps({"text_input": "Tell me a very long story about dragons.",
                           "sampling_parameters": json.dumps({"ignore_eos": True, "max_tokens": None})}).encode()
        tokens_before = _metric(options.metrics_port, "vllm:generation_tokens_total")
        with socket.create_connection(("127.0.0.1", options.http_port)) as sock:
            sock.sendall(b"POST /v2/models/pagoda/generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        _wait_until(lambda: _metric(options.metrics_port, "vllm:generation_tokens_total") - tokens_before >= 24
                    and _metric(options.metrics_port, "vllm:num_requests_running") == 0, 60, "capped")
        time.sleep(0.5)
        assert _metric(options.metrics_port, "vllm:generation_tokens_total") - tokens_before == 24
        assert _metric(options.metrics_port, "vllm:kv_cache_usage_perc") == 0
        server_pid = server.process.pid
        stubs = _stub_pids(server_pid)
        assert len(stubs) == 1
        regions = list(Path("/dev/shm").glob(f"{server.shm_prefix}*"))  # this server's stubs' shared memory
        assert regions
        os.kill(server_pid, signal.SIGKILL)  # the server alone; the launcher does nothing yet
        _wait_until(lambda: not process_tree.is_alive(stubs[0]), 5, "the orphaned stub exits")
        _wait_until(lambda: not client.exists(heartbeat), 3.0 + 2, "heartbeat key expired")
        assert "stub died" in server.check_health() or "exited" in server.check_health()
    assert not process_tree.group_members(server_pid)
    assert not [r for r in regions if r.exists()], "the killed server's /dev/shm regions are removed by the stop"
    client.close()
