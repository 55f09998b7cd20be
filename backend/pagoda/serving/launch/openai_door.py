"""The replica's own OpenAI door: ``pagoda serve`` answers ``/v1`` on port 9000 by default.

Triton's OpenAI frontend and vLLM serve OpenAI from the same process as the engine; a
``pagoda serve`` user should not have to learn about routers first. The door is the
router's OpenAI code (``pagoda.fleet.api.openai_api``), run as a child process ``pagoda
router`` over this one replica (static ``--replicas``, no Redis, no gRPC door), so every
OpenAI behaviour — completions, chat, streaming with usage, logprobs, structured output,
``/v1/models`` and ``/v1/models/{id}``, ``/health``, LoRA adapters by name (learned from the
replica), run-time LoRA loading when ``--allow-runtime-lora`` — is the router's, and the
two never drift. The child also answers the router's Triton HTTP routes and ``/metrics``.

Life cycle: started after tritonserver is ready, considered up once its ``/health`` is 200
(it has probed the replica); ``pagoda serve`` restarts it if it dies (``ensure_running``),
and stops it (SIGTERM, then SIGKILL) before draining tritonserver. It dies with its parent
(``process_tree.spawn``). Its output goes to ``pagoda serve``'s stdout and stderr.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Optional, Sequence

from pagoda.serving import process_tree

DEFAULT_PORT = 9000


class OpenAIDoor:
    """Args:
        port: the door's HTTP port (all interfaces).
        model_dir: the model folder (its tokenizer and chat template; its name is the model's).
        grpc_url / http_url / metrics_url: the replica's addresses (``host:port``).
        allow_runtime_lora: pass ``--allow-runtime-lora`` (the replica allows it too).
        model_name: the OpenAI model name (default: the router's, ``$PAGODA_MODEL_NAME`` or the
            folder's name).
        parsers: ``--reasoning-parser`` and ``--tool-call-parser`` for the door (``None``: detected).
        response_store: keep Responses API turns (``--response-store``; in the door's memory).
        router_args: more ``pagoda router`` flags (image fetching: ``--allowed-media-domains``, ...).
    """

    def __init__(self, port: int, model_dir: str, grpc_url: str, http_url: str, metrics_url: str,
                 allow_runtime_lora: bool = False, model_name: Optional[str] = None,
                 parsers: tuple[Optional[str], Optional[str]] = (None, None), response_store: bool = False,
                 router_args: Sequence[str] = ()) -> None:
        self.port = port
        self.model_dir = model_dir
        self.command = [
            sys.executable, "-m", "pagoda.cli", "router", "--model-dir", model_dir,
            "--replicas", f"id=local,grpc={grpc_url},http={http_url},metrics={metrics_url}",
            "--http-port", str(port), "--no-grpc", "--health-interval", "1",
        ]
        self.command += ["--allow-runtime-lora"] if allow_runtime_lora else []
        self.command += ["--model-name", model_name] if model_name else []
        for flag, name in zip(("--reasoning-parser", "--tool-call-parser"), parsers):
            self.command += [flag, name] if name else []
        self.command += ["--response-store"] if response_store else []
        self.command += list(router_args)
        self.process: Optional[subprocess.Popen] = None
        self.num_restarts = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self, timeout_s: float = 60.0) -> "OpenAIDoor":
        """Start the child and wait until it routes to the replica; raises ``RuntimeError`` if it cannot."""
        env = dict(os.environ)
        env.pop("PAGODA_REDIS_URL", None)  # the door is for this replica only
        self.process = process_tree.spawn(self.command, env=env, stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            code = self.process.poll()
            if code is not None:
                raise RuntimeError(f"the OpenAI door (port {self.port}) exited with code {code} while starting "
                                   "(its error is above; --openai-port 0 turns it off)")
            if self._healthy():
                return self
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"the OpenAI door (port {self.port}) was not healthy within {timeout_s:g} s")

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def ensure_running(self) -> Optional[str]:
        """Restart the child if it died; returns what happened (for the log), or None."""
        if self.process is None or self.process.poll() is None:
            return None
        code = self.process.returncode
        self.num_restarts += 1
        try:
            self.start()
        except RuntimeError as exc:
            return f"the OpenAI door exited with code {code}; restarting it failed: {exc}"
        return f"the OpenAI door exited with code {code}; restarted it"

    def stop(self, timeout_s: float = 5.0) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def model_dir_for(model: Optional[str]) -> str:
    """The model folder ``pagoda serve`` serves: ``--model``, else the default SmolLM2 import."""
    if model:
        return str(Path(model).resolve())
    from pagoda.models.gguf_import import default_model_dir

    return str(default_model_dir())
