"""``pagoda serve``'s supervisor when the stub dies and tritonserver aborts right after it.

tritonserver 2.51 sometimes aborts (exit code -6) once its Python-backend stub is killed;
the replica must then still name the stub as the cause, with its restart count, and never
try to reload a model on a server that is gone. A fake server, no process.
"""

import threading

from pagoda.serving.launch import serve_cli


class _AbortedServer:
    """Its stub died, then tritonserver aborted: check_health names the stub (launcher order)."""

    def __init__(self):
        self.process = type("P", (), {"poll": staticmethod(lambda: -6)})()
        self.restarts = 0

    def check_health(self):
        return "the Python-backend stub (pid 42) died"

    def is_running(self):
        return False

    def restart_model(self):
        self.restarts += 1


def test_an_aborted_server_is_not_reloaded_and_the_stub_is_named(monkeypatch):
    monkeypatch.setattr(serve_cli, "HEALTH_INTERVAL_S", 0.001)
    server = _AbortedServer()
    why = serve_cli.supervise(server, threading.Event(), max_stub_restarts=3)
    assert why == "the Python-backend stub (pid 42) died; tritonserver exited with code -6"
    assert server.restarts == 0
    why = serve_cli.supervise(server, threading.Event(), max_stub_restarts=0)
    assert why.startswith("the Python-backend stub (pid 42) died (restarted 0 time(s)")
