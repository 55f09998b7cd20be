"""A real redis-server per test module (ENVIRONMENT.md recipe), restartable for fault tests.

The server listens on 127.0.0.1 on a free port, keeps nothing on disk (``--save ''
--appendonly no``), runs as a child process and is stopped by its pid. Tests skip cleanly where the binary is
missing (CI installs it in setup).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """One redis-server process; ``stop()``/``start()`` keep the same port."""

    def __init__(self, binary: str, workdir: Path) -> None:
        self.binary = binary
        self.workdir = workdir
        self.port = _free_port()
        self.pid: int | None = None
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        # Not --daemonize: as our child it is reaped (and known gone) the moment it dies.
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.workdir), "--logfile", str(self.workdir / "redis.log")],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.pid = self.proc.pid
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"redis-server did not answer on port {self.port}")
            time.sleep(0.005)

    def stop(self) -> None:
        """SIGKILL by pid (the data is disposable) and reap it."""
        if self.pid is None:
            return
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=10)
        self.pid = None

    def client(self):
        """A fail-fast client (no retries), as the fleet layer builds them."""
        from pagoda.fleet.index.prefix_index import make_redis_client

        return make_redis_client(self.url)


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed (apt-get install -y redis-server)")
    pytest.importorskip("redis")
    server = RedisServer(binary, tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def redis_client(redis_server):
    """A client on a flushed database; restarts the server if a test left it stopped."""
    if redis_server.pid is None:
        redis_server.start()
    client = redis_server.client()
    client.flushall()
    client.script_flush()
    yield client
    client.close()


def count_round_trips(client):
    """Make ``client`` count network round trips in ``client.round_trips``: one per
    command sent on its own, one per pipeline ``execute``."""

    class _Counting(type(client)):
        def execute_command(self, *args, **options):
            self.round_trips += 1
            return super().execute_command(*args, **options)

        def pipeline(self, *args, **kwargs):
            pipe = super().pipeline(*args, **kwargs)
            execute, owner = pipe.execute, self

            def counted(*a, **k):
                owner.round_trips += 1
                return execute(*a, **k)

            pipe.execute = counted
            return pipe

    client.__class__ = _Counting
    client.round_trips = 0
    return client
