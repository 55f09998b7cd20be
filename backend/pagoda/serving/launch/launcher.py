"""`pagoda serve`: run the real ``tritonserver`` over our model repository.

The binary comes from the ``nvidia-pytriton`` wheel (Triton 2.51 with the Python backend)
or NVIDIA's container (``triton_install``). Used directly, without PyTriton's own model
proxy, it needs:

1. a backend directory whose ``python/`` holds ``libtriton_python.so``,
   ``triton_python_backend_utils.py`` and the stub built for this Python;
2. the wheel's ``nvidia_pytriton.libs`` (or the install's ``lib``) on ``LD_LIBRARY_PATH``;
3. this interpreter's ``bin/`` first on ``PATH``: the stub takes ``sys.path`` from the
   first ``python3`` it finds, so the model sees this environment's packages (pagoda).

``TritonServer`` materializes a temporary work dir with that backend directory and a copy
of ``model_repository/`` (pagoda's model, whose ``config.pbtxt`` carries the engine
settings, and the TensorRT-LLM fronts, ``trtllm_front``; the options and their writing into it
are ``serve_options``), then:
- refuses to start when the stub's numpy is 2.x or a port is taken (clear messages);
- starts the server in its own process group with a parent-death signal, so it never
  outlives the launcher (``process_tree``), and waits until the server and every model are READY;
- sends one small request through the whole path (``startup_check``) and raises, naming
  the cause when the log shows it, if that fails: a server is never announced unanswered;
- while serving, ``check_health`` reports a dead server or a dead stub of pagoda's model
  (tritonserver 2.51 keeps answering READY after its stub died); ``restart_model`` then
  restarts tritonserver on the same ports (there is no load API to reload the model with);
- runs without model control (``--model-control-mode=none``): tritonserver loads every model
  of the repository at start, and any client may make the read-only repository calls (index,
  model metadata and config, readiness) on HTTP and gRPC, while tritonserver refuses every
  load and unload ("explicit model load / unload is not allowed if polling is enabled", HTTP
  503 / gRPC UNAVAILABLE), so no client can replace the model's files, i.e. run code, or take
  the model away. tritonserver 2.51's restricted-API groups could not do this: the
  ``model-repository`` group holds index, load and unload together;
- stops by draining (the engine loop refuses new requests and finishes those in flight,
  up to ``grace_period_s``: see ``engine_loop``), asking the model to finalize itself
  (``finalize_request``: engine and fleet publisher stopped, up to ``FINALIZE_TIMEOUT_S``;
  neither wait outlives the model's stub: a dead one, e.g. after a parallel worker died,
  answers nothing), then SIGINT (tritonserver unloads its models, finalize again being a no-op, and exits),
  then SIGKILL to the whole process group, even if tritonserver already exited, so no stub
  is left behind, and removes its stubs' ``/dev/shm`` regions (a killed server leaves them).
  tritonserver's own exit timeout is neither the drain nor the finalize: it first waits for
  open HTTP connections, and an idle keep-alive one uses all of it (tritonserver then logs
  "Exit timeout expired" and exits with code 1, after the model has finalized).

It is a context manager (tests' fixture); the CLI is ``serve_cli``. The default model is
imported (GGUF -> safetensors, once) before the server starts: the model load reads a folder.
"""

from __future__ import annotations

import collections
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Optional

from pagoda.serving import finalize_request, process_tree
from pagoda.serving.launch import startup_check
from pagoda.serving.launch.serve_options import MODEL_NAME, ServeOptions, materialize_repository
from pagoda.serving.trtllm_front import FRONT_MODELS
from pagoda.serving.launch.triton_install import (TritonPaths, default_model_repository, find_tritonserver,
                                                  make_backend_dir)

# tritonserver's exit: idle HTTP connections first, then the models' unload (already finalized).
# 5 s: the unload of the four models' stubs takes ~2.5 s on an idle 2-core box, and took over 2 s
# after a 1 s connection wait on a loaded one (3 s then expired before the unload ended).
EXIT_TIMEOUT_S = 5
FINALIZE_TIMEOUT_S = 30.0  # the model's finalize after the drain


_handed_out: set[int] = set()
_ports_lock = threading.Lock()


def find_free_port() -> int:
    """A TCP port free on 127.0.0.1 now, and never one this process was given before: the
    kernel may hand a just-closed port out again, and a server once got the same port for its
    gRPC and metrics listeners (tritonserver refused to start)."""
    with _ports_lock:
        while True:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            if port not in _handed_out:
                _handed_out.add(port)
                return port


class TritonServer:
    """A running tritonserver over a materialized pagoda model repository.

    Args:
        options: ports and engine settings.
        log_path: where server output goes; ``None`` copies it to this process's stdout
            (and keeps a tail, so failures can name their cause).
    """

    def __init__(self, options: ServeOptions, log_path: Optional[str] = None) -> None:
        self.options = options
        self.log_path = log_path
        self.workdir: Optional[Path] = None
        self.process: Optional[subprocess.Popen] = None
        self._stopping = threading.RLock()  # one stop at a time (a failed start stops too)
        self.stub_pids: list[int] = []
        self._log_file = None
        self._log_tail_lines: "collections.deque[str]" = collections.deque(maxlen=400)
        self._log_pump: Optional[threading.Thread] = None
        self.shm_prefix = f"pagoda_{secrets.token_hex(6)}_"  # its stubs' /dev/shm regions

    @property
    def http_url(self) -> str:
        return f"{self.options.host}:{self.options.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.options.host}:{self.options.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.options.host}:{self.options.metrics_port}/metrics"

    def start(self) -> "TritonServer":
        """Start the server, wait until it and the model are READY, check one request.

        Raises:
            RuntimeError: numpy 2 in the stub's environment, a port in use, the server
                exited or was not ready in time, or the first request failed (a
                ``startup_check.StartupCheckError``, with the cause when it is known).
        """
        paths = find_tritonserver()
        if self.options.model is None:
            from pagoda.models.gguf_import import ensure_default_model

            self.options.model = str(ensure_default_model())
        env = self._server_env(paths)
        startup_check.check_numpy_version(startup_check.stub_numpy_version(env))
        process_tree.check_ports_free((self.options.http_port, self.options.grpc_port, self.options.metrics_port))
        process_tree.sweep_orphan_shm_regions()  # left by a killed launcher's server
        self.workdir = Path(tempfile.mkdtemp(prefix="pagoda-serve-"))
        env["PAGODA_DRAIN_FILE"] = str(self.workdir / "drain")
        backend_dir = make_backend_dir(paths, self.workdir / "backends")
        source = Path(self.options.model_repository) if self.options.model_repository else default_model_repository()
        repository = materialize_repository(source, self.workdir / "model_repository", self.options)
        try:
            self._spawn(paths, backend_dir, repository, env)
            self._wait_ready(self.options.startup_timeout_s)
            self.stub_pids = self._find_stubs()
            if self.options.check_first_request:
                self._check_first_request()
        except BaseException:
            self.stop(grace_s=0)
            raise
        return self

    def _server_env(self, paths: TritonPaths) -> dict[str, str]:
        env = dict(os.environ)
        env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(paths.libs), env.get("LD_LIBRARY_PATH")) if p)
        env["PATH"] = os.pathsep.join((str(Path(sys.executable).parent), env.get("PATH", "")))
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.update(self.options.fleet_env())
        return env

    def _spawn(self, paths: TritonPaths, backend_dir: Path, repository: Path, env: dict[str, str]) -> None:
        command = [
            str(paths.binary),
            f"--model-repository={repository}",
            f"--backend-directory={backend_dir}",
            f"--http-port={self.options.http_port}",
            f"--grpc-port={self.options.grpc_port}",
            f"--metrics-port={self.options.metrics_port}",
            "--allow-gpu-metrics=false",
            # Every config.pbtxt is complete and no model defines auto_complete_config: with
            # auto-complete on, the Python backend starts a stub per model only to ask it, importing
            # each model.py (pagoda's: torch and the engine) twice; ~5 s of a ~13 s start on 2 cores.
            "--disable-auto-complete-config",
            # The drain and the model's finalize come first (stop()); the exit timeout then
            # bounds tritonserver's wait for idle keep-alive connections and the unload.
            f"--exit-timeout-secs={EXIT_TIMEOUT_S}",
            # Every model of the repository (pagoda and the TensorRT-LLM fronts) loads at start;
            # clients may read the repository index, and no one may load or unload.
            "--model-control-mode=none",
            f"--log-verbose={self.options.log_verbose}",
            f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
        ]
        if self.log_path is not None:
            self._log_file = open(self.log_path, "ab")
            output = self._log_file
        else:
            output = subprocess.PIPE
        # Own process group: a terminal's Ctrl-C reaches only us, and we drain. The
        # parent-death signal keeps that group from outliving us (process_tree).
        self.process = process_tree.spawn(command, env=env, stdout=output, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, start_new_session=True)
        if self.log_path is None:
            self._log_pump = threading.Thread(target=self._pump_log, args=(self.process.stdout,),
                                              name="pagoda-serve-log", daemon=True)
            self._log_pump.start()

    def _pump_log(self, stream) -> None:
        """Copy the server's output to our stdout, keeping a tail for diagnoses."""
        for raw in iter(stream.readline, b""):
            line = raw.decode(errors="replace")
            self._log_tail_lines.append(line)
            try:
                sys.stdout.write(line)
                sys.stdout.flush()
            except (OSError, ValueError):
                pass
        stream.close()

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        url = f"http://{self.http_url}/v2/health/ready"  # every model of the repository READY
        while time.monotonic() < deadline:
            code = self.process.poll()
            if code is not None:
                raise RuntimeError(f"tritonserver exited with code {code} before READY{self._log_tail()}")
            try:
                with urllib.request.urlopen(url, timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(0.5)
        raise RuntimeError(f"tritonserver not READY after {timeout_s:.0f} s{self._log_tail()}")

    def _check_first_request(self) -> None:
        try:
            startup_check.send_first_request(self.http_url, MODEL_NAME, self.options.first_request_timeout_s)
        except startup_check.StartupCheckError as exc:
            time.sleep(0.5)  # let the server log the stub's last words
            cause = startup_check.diagnose(self.log_text())
            message = f"tritonserver is READY but cannot serve: {exc}"
            if cause:
                message += f"\ncause: {cause}"
            raise startup_check.StartupCheckError(message + self._log_tail()) from None

    def _find_stubs(self) -> list[int]:
        """The stubs to supervise: pagoda's, and the TensorRT-LLM fronts' (they hold no engine, but
        a dead one fails every request to its model until tritonserver restarts)."""
        if self.process is None:
            return []
        pgid = self.process.pid
        return [pid for name in (MODEL_NAME, *FRONT_MODELS) for pid in process_tree.python_stubs(pgid, name)]

    def log_text(self, num_chars: int = 20000) -> str:
        """The end of the server's output (empty if it is not kept)."""
        if self.log_path is None:
            return "".join(self._log_tail_lines)[-num_chars:]
        if self._log_file is not None:
            self._log_file.flush()
        try:
            return Path(self.log_path).read_text(errors="replace")[-num_chars:]
        except OSError:
            return ""

    def _log_tail(self, num_chars: int = 4000) -> str:  # "" when the log is already on our stdout
        return "" if self.log_path is None else "\n--- tritonserver log tail ---\n" + self.log_text(num_chars)

    def is_running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def check_health(self) -> Optional[str]:
        """What is wrong with a started server, or ``None`` when it can serve.

        tritonserver 2.51 keeps reporting READY after its Python-backend stub died (every
        request then fails with "Stub process ... is not healthy"), so the stub's pid is
        watched here. A dead stub is named first even when tritonserver exited too: 2.51 may
        abort (code -6) right after its stub is killed; only a stub that logged it was
        orphaned (``process_tree.ORPHANED_STUB_MESSAGE``) left because tritonserver died.
        """
        if self.process is None:
            return "tritonserver is not running"
        code = self.process.poll()
        dead = [pid for pid in self.stub_pids if not process_tree.is_alive(pid)]
        if dead and (code is None or process_tree.ORPHANED_STUB_MESSAGE not in self.log_text()):
            cause = startup_check.diagnose(self.log_text())
            return (f"the Python-backend stub (pid {', '.join(map(str, dead))}) died"
                    + (f": {cause}" if cause and "stub died" not in cause else ""))
        if code is not None:
            return f"tritonserver exited with code {code}"
        return None

    def restart_model(self) -> None:
        """Restart tritonserver, on the same ports, after its stub died: a new stub, checked with
        one request. There is no load API to reload the model with (``--model-control-mode=none``);
        nothing is left to drain or finalize. Meanwhile the ports refuse connections (not ready).

        Raises:
            RuntimeError: the server did not start, get READY or answer again (the log's tail
                and the cause when it is known are in the message); it is stopped then.
        """
        self.stop(grace_s=0)
        self.start()

    def stop(self, grace_s: Optional[float] = None, force: Optional[threading.Event] = None) -> Optional[int]:
        """Drain and stop: the engine takes no new requests and finishes those in flight
        (up to ``grace_s``), the model finalizes (up to ``FINALIZE_TIMEOUT_S``), then SIGINT
        (tritonserver waits at most ``EXIT_TIMEOUT_S`` for idle connections and its unload),
        then SIGKILL to the whole group.

        Args:
            grace_s: how long in-flight requests may take (default: the options' grace
                period); 0 kills at once.
            force: when set (a second Ctrl-C), stop waiting and kill.

        Returns:
            tritonserver's exit code (``None`` if it was never started).
        """
        with self._stopping:
            return self._stop(grace_s, force)

    def _stop(self, grace_s: Optional[float], force: Optional[threading.Event]) -> Optional[int]:
        code = None
        if self.process is not None:
            if grace_s is None:
                grace_s = self.options.grace_period_s
            if self.process.poll() is None and grace_s > 0:
                drain = self.workdir / "drain"  # PAGODA_DRAIN_FILE
                self._ask_and_wait(drain, Path(f"{drain}.done"), grace_s, force)
                if Path(f"{drain}{finalize_request.WATCHED_SUFFIX}").exists():  # else only the exit finalizes
                    self._ask_and_wait(Path(f"{drain}{finalize_request.REQUEST_SUFFIX}"),
                                       Path(f"{drain}{finalize_request.DONE_SUFFIX}"), FINALIZE_TIMEOUT_S, force)
                self.process.send_signal(signal.SIGINT)
                self._wait_exit(EXIT_TIMEOUT_S + 10.0, force)
            # Always, even when tritonserver is gone: its stub may not be.
            left = process_tree.kill_group(self.process.pid)
            if left:
                print(f"pagoda serve: processes {left} survived SIGKILL", file=sys.stderr)
            self.process.wait()
            code = self.process.returncode
            self.process = None
            process_tree.remove_shm_regions(self.shm_prefix)  # left behind by a killed server
        if self._log_pump is not None:
            self._log_pump.join(5.0)
            self._log_pump = None
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None
        return code

    def _wait_exit(self, timeout_s: float, force: Optional[threading.Event]) -> None:
        deadline = time.monotonic() + timeout_s
        while self.process.poll() is None and time.monotonic() < deadline:
            if force is not None and force.is_set():
                return
            time.sleep(0.1)

    def _ask_and_wait(self, request: Path, done: Path, timeout_s: float, force: Optional[threading.Event]) -> None:
        """Create ``request`` (a file the model watches: the drain, the finalize) and wait until the
        model creates ``done``, for at most ``timeout_s``, while tritonserver runs, the model's
        stub lives (a dead one answers nothing: a worker's death ends it) and ``force`` is unset."""
        try:
            request.touch()
        except OSError:
            return
        deadline = time.monotonic() + timeout_s
        next_stub_check = 0.0
        while not done.exists() and time.monotonic() < deadline and self.process.poll() is None:
            if force is not None and force.is_set():
                return
            if time.monotonic() >= next_stub_check:
                if not process_tree.python_stubs(self.process.pid, MODEL_NAME):
                    return
                next_stub_check = time.monotonic() + 0.5
            time.sleep(0.05)

    def __enter__(self) -> "TritonServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
