"""`pagoda serve`: run the real ``tritonserver`` over our model repository.

The binary comes from the ``nvidia-pytriton`` wheel (Triton 2.51 with the Python backend).
Used directly, without PyTriton's own model proxy, it needs (see shared ENVIRONMENT.md):

1. a backend directory whose ``python/`` holds ``libtriton_python.so``,
   ``triton_python_backend_utils.py`` and the stub built for this Python;
2. the wheel's ``nvidia_pytriton.libs`` on ``LD_LIBRARY_PATH``;
3. this interpreter's ``bin/`` first on ``PATH``: the stub takes ``sys.path`` from the
   first ``python3`` it finds, so the model sees this environment's packages (pagoda).

``TritonServer`` materializes a temporary work dir with that backend directory and a copy
of ``model_repository/`` whose ``config.pbtxt`` parameters carry the chosen engine
settings, starts the server in its own session (so a terminal's Ctrl-C reaches only us),
waits until the server and the model are READY, and stops it with SIGINT (then SIGKILL
after a grace period). It is a context manager, which tests use as a fixture.

The default model is imported (GGUF -> safetensors, once) here, before the server starts,
so the backend's model load only reads a ready folder.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from pagoda.serving.model_config import engine_config_from_parameters, rewrite_config_pbtxt

MODEL_NAME = "pagoda"
STUB_NAME = "triton_python_backend_stub"


def default_model_repository() -> Path:
    """The repository shipped with the source tree (``<repo>/model_repository``)."""
    env = os.environ.get("PAGODA_MODEL_REPOSITORY")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[3] / "model_repository"


@dataclass
class TritonPaths:
    binary: Path
    libs: Path
    python_backend: Path  # holds libtriton_python.so and triton_python_backend_utils.py
    stub: Path


def find_tritonserver() -> TritonPaths:
    """Locate the tritonserver shipped in the ``nvidia-pytriton`` wheel.

    Raises:
        RuntimeError: the wheel is not installed, or has no stub for this Python.
    """
    try:
        import pytriton
    except ImportError:
        raise RuntimeError("pagoda serve needs nvidia-pytriton: pip install 'pagoda[serve]'") from None
    root = Path(pytriton.__file__).resolve().parent / "tritonserver"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    paths = TritonPaths(
        binary=root / "bin" / "tritonserver",
        libs=root.parent.parent / "nvidia_pytriton.libs",
        python_backend=root / "backends" / "python",
        stub=root / "python_backend_stubs" / version / STUB_NAME,
    )
    for path in (paths.binary, paths.python_backend, paths.stub):
        if not path.exists():
            raise RuntimeError(f"tritonserver from nvidia-pytriton is incomplete: {path} is missing")
    return paths


def make_backend_dir(paths: TritonPaths, dest: Path) -> Path:
    """Build a ``--backend-directory`` with the Python backend and this Python's stub."""
    python_dir = dest / "python"
    python_dir.mkdir(parents=True, exist_ok=True)
    for name in ("libtriton_python.so", "triton_python_backend_utils.py"):
        shutil.copy2(paths.python_backend / name, python_dir / name)
    shutil.copy2(paths.stub, python_dir / STUB_NAME)
    return dest


@dataclass
class ServeOptions:
    """What ``pagoda serve`` accepts; ``None`` keeps the value in config.pbtxt."""

    model: Optional[str] = None
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    host: str = "127.0.0.1"  # where the launcher probes readiness (the server binds all interfaces)
    block_size: Optional[int] = None
    kv_cache_memory_bytes: Optional[int] = None
    max_model_len: Optional[int] = None
    max_num_seqs: Optional[int] = None
    max_num_batched_tokens: Optional[int] = None
    enable_chunked_prefill: Optional[bool] = None
    enable_prefix_caching: Optional[bool] = None
    device: Optional[str] = None
    dtype: Optional[str] = None
    quantization: Optional[str] = None
    # Any other EngineConfig field, as config.pbtxt parameter text (--engine-arg and the
    # scheduling / speculative / offload flags land here); validated by EngineConfig.
    engine_args: dict[str, str] = field(default_factory=dict)
    model_repository: Optional[str] = None
    log_verbose: int = 0
    startup_timeout_s: float = 900.0
    # Fleet layer: with a Redis URL the replica publishes block events and heartbeats.
    redis_url: Optional[str] = None
    replica_id: Optional[str] = None
    fleet_model: Optional[str] = None  # key namespace (default: the model folder's name)
    advertise_host: Optional[str] = None  # how routers reach this replica (default 127.0.0.1)

    def fleet_env(self) -> dict[str, str]:
        """Environment for ``pagoda.fleet.publisher.publisher_from_env`` in the model."""
        if not self.redis_url:
            return {}
        env = {"PAGODA_REDIS_URL": self.redis_url, "PAGODA_HTTP_PORT": str(self.http_port),
               "PAGODA_GRPC_PORT": str(self.grpc_port), "PAGODA_METRICS_PORT": str(self.metrics_port)}
        for name, value in (("PAGODA_REPLICA_ID", self.replica_id), ("PAGODA_MODEL_NAME", self.fleet_model),
                            ("PAGODA_ADVERTISE_HOST", self.advertise_host)):
            if value:
                env[name] = value
        return env

    def parameter_overrides(self) -> dict[str, Optional[str]]:
        def text(value):
            if value is None:
                return None
            return ("true" if value else "false") if isinstance(value, bool) else str(value)

        return {
            "model": self.model,
            "block_size": text(self.block_size),
            "kv_cache_memory_bytes": text(self.kv_cache_memory_bytes),
            "max_model_len": text(self.max_model_len),
            "max_num_seqs": text(self.max_num_seqs),
            "max_num_batched_tokens": text(self.max_num_batched_tokens),
            "enable_chunked_prefill": text(self.enable_chunked_prefill),
            "enable_prefix_caching": text(self.enable_prefix_caching),
            "device": self.device,
            "dtype": self.dtype,
            "quantization": self.quantization,
            **self.engine_args,
        }


def materialize_repository(source: Path, dest: Path, options: ServeOptions) -> Path:
    """Copy the model repository to ``dest`` with ``options`` written into config.pbtxt."""
    shutil.copytree(source, dest, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    config_path = dest / MODEL_NAME / "config.pbtxt"
    kind = {"cuda": "KIND_GPU", "cpu": "KIND_CPU"}.get(options.device or "")
    config_path.write_text(rewrite_config_pbtxt(config_path.read_text(), options.parameter_overrides(), kind))
    return dest


def find_free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TritonServer:
    """A running tritonserver over a materialized pagoda model repository.

    Args:
        options: ports and engine settings.
        log_path: where server output goes; ``None`` inherits this process's stdout/stderr.
    """

    def __init__(self, options: ServeOptions, log_path: Optional[str] = None) -> None:
        self.options = options
        self.log_path = log_path
        self.workdir: Optional[Path] = None
        self.process: Optional[subprocess.Popen] = None
        self._log_file = None

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
        """Start the server and wait until it and the model are READY.

        Raises:
            RuntimeError: the server exited or did not become ready in time (the message
                carries the tail of its log when a log file is used).
        """
        paths = find_tritonserver()
        if self.options.model is None:
            from pagoda.models.gguf_import import ensure_default_model

            self.options.model = str(ensure_default_model())
        self.workdir = Path(tempfile.mkdtemp(prefix="pagoda-serve-"))
        backend_dir = make_backend_dir(paths, self.workdir / "backends")
        source = Path(self.options.model_repository) if self.options.model_repository else default_model_repository()
        repository = materialize_repository(source, self.workdir / "model_repository", self.options)
        env = dict(os.environ)
        env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(paths.libs), env.get("LD_LIBRARY_PATH")) if p)
        env["PATH"] = os.pathsep.join((str(Path(sys.executable).parent), env.get("PATH", "")))
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.update(self.options.fleet_env())
        command = [
            str(paths.binary),
            f"--model-repository={repository}",
            f"--backend-directory={backend_dir}",
            f"--http-port={self.options.http_port}",
            f"--grpc-port={self.options.grpc_port}",
            f"--metrics-port={self.options.metrics_port}",
            "--allow-gpu-metrics=false",
            "--exit-timeout-secs=15",
            f"--log-verbose={self.options.log_verbose}",
        ]
        output = None
        if self.log_path is not None:
            self._log_file = open(self.log_path, "ab")
            output = self._log_file
        self.process = subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT if output else None,
                                        start_new_session=True)
        try:
            self._wait_ready(self.options.startup_timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        url = f"http://{self.http_url}/v2/models/{MODEL_NAME}/ready"
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

    def _log_tail(self, num_chars: int = 4000) -> str:
        if self.log_path is None:
            return ""
        try:
            return "\n--- tritonserver log tail ---\n" + Path(self.log_path).read_text(errors="replace")[-num_chars:]
        except OSError:
            return ""

    def is_running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, grace_s: float = 30.0) -> Optional[int]:
        """Stop the server: SIGINT, then SIGKILL to its process group after ``grace_s``.

        Returns:
            The server's exit code (``None`` if it was never started).
        """
        code = None
        if self.process is not None:
            if self.process.poll() is None:
                self.process.send_signal(signal.SIGINT)
                try:
                    self.process.wait(grace_s)
                except subprocess.TimeoutExpired:
                    try:
                        os.killpg(self.process.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    self.process.wait()
            code = self.process.returncode
            self.process = None
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None
        return code

    def __enter__(self) -> "TritonServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pagoda serve", description="Serve a model on Triton Inference Server.")
    p.add_argument("--model", help="Hugging Face folder (safetensors); default: SmolLM2-135M-Instruct")
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=8001)
    p.add_argument("--metrics-port", type=int, default=8002)
    p.add_argument("--block-size", type=int)
    p.add_argument("--kv-cache-memory-bytes", type=int, help="KV cache budget on CPU")
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--max-num-seqs", type=int)
    p.add_argument("--max-num-batched-tokens", type=int)
    p.add_argument("--no-chunked-prefill", action="store_true")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"))
    p.add_argument("--dtype", choices=("auto", "float32", "float16", "bfloat16"))
    p.add_argument("--quantization", choices=("int8",), help="int8: weight-only int8 linear layers")
    p.add_argument("--scheduling-policy", choices=("fcfs", "priority"))
    p.add_argument("--speculative-method", choices=("ngram", "draft"),
                   help="speculative decoding by default for every request (see docs/speculative.md)")
    p.add_argument("--speculative-model", help="with --speculative-method draft: a draft model folder")
    p.add_argument("--num-speculative-tokens", type=int, help="largest speculative window k")
    p.add_argument("--cpu-offload-bytes", type=int, help="size of the CPU tier of the KV cache (0: off)")
    p.add_argument("--preemption-mode", choices=("auto", "recompute", "swap"))
    p.add_argument("--engine-arg", action="append", default=[], metavar="FIELD=VALUE",
                   help="any other EngineConfig field, e.g. --engine-arg spec_adaptive=false (repeatable)")
    p.add_argument("--model-repository", help="a model repository to use instead of the shipped one")
    p.add_argument("--log-verbose", type=int, default=0)
    p.add_argument("--redis-url", help="publish block events and heartbeats to this Redis (fleet layer)")
    p.add_argument("--replica-id", help="with --redis-url: this replica's id (default: host name)")
    p.add_argument("--fleet-model", help="with --redis-url: Redis key namespace (default: model folder name)")
    p.add_argument("--advertise-host", help="with --redis-url: host routers use to reach this replica")
    return p


def engine_args_from(args: argparse.Namespace) -> dict[str, str]:
    """The engine fields given by dedicated flags and ``--engine-arg FIELD=VALUE``."""
    values = {name: str(getattr(args, name)) for name in
              ("scheduling_policy", "speculative_method", "speculative_model", "num_speculative_tokens",
               "cpu_offload_bytes", "preemption_mode") if getattr(args, name) is not None}
    for item in args.engine_arg:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise SystemExit(f"pagoda serve: --engine-arg must look like FIELD=VALUE, got {item!r}")
        values[name.strip()] = value.strip()
    return values


def options_from_args(args: argparse.Namespace) -> ServeOptions:
    return ServeOptions(
        model=args.model, http_port=args.http_port, grpc_port=args.grpc_port, metrics_port=args.metrics_port,
        block_size=args.block_size, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_chunked_prefill=False if args.no_chunked_prefill else None,
        enable_prefix_caching=False if args.no_prefix_caching else None,
        device=args.device, dtype=args.dtype, quantization=args.quantization, engine_args=engine_args_from(args),
        model_repository=args.model_repository,
        log_verbose=args.log_verbose, redis_url=args.redis_url, replica_id=args.replica_id,
        fleet_model=args.fleet_model, advertise_host=args.advertise_host)


def check_engine_args(options: ServeOptions, parser: argparse.ArgumentParser) -> None:
    """Refuse bad engine settings here, with the field's name, not inside tritonserver."""
    parameters = {name: {"string_value": value} for name, value in options.parameter_overrides().items()
                  if value is not None and name != "model"}
    try:
        engine_config_from_parameters(parameters)
    except ValueError as exc:
        parser.error(str(exc))


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point of ``pagoda serve``; returns the process exit code."""
    parser = make_parser()
    options = options_from_args(parser.parse_args(argv))
    check_engine_args(options, parser)
    server = TritonServer(options)

    def on_signal(signum, frame):
        raise KeyboardInterrupt

    # Install both explicitly: a launcher started in the background inherits SIGINT ignored.
    previous = {signum: signal.signal(signum, on_signal) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.start()
        print(f"pagoda is serving model '{MODEL_NAME}' ({options.model})\n"
              f"  HTTP    http://{server.http_url}/v2/models/{MODEL_NAME}/generate_stream\n"
              f"  gRPC    {server.grpc_url}\n"
              f"  metrics {server.metrics_url}\n"
              "Ctrl-C to stop.", flush=True)
        while server.is_running():
            time.sleep(0.5)
        print("tritonserver exited on its own", file=sys.stderr)
        return server.stop() or 1
    except KeyboardInterrupt:
        print("stopping tritonserver ...", file=sys.stderr, flush=True)
        server.stop()
        return 0
    except RuntimeError as exc:
        print(f"pagoda serve: {exc}", file=sys.stderr)
        server.stop()
        return 1
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


if __name__ == "__main__":
    sys.exit(main())
