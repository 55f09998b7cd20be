"""What ``pagoda serve`` runs with: ``ServeOptions`` (the flags, ``None`` keeping config.pbtxt's
value) and ``materialize_repository``, which writes them into a copy of the model repository
(pagoda's ``config.pbtxt`` parameters and instance kind, the TensorRT-LLM fronts' transaction
policies). ``launcher.TritonServer`` starts tritonserver over that copy; ``serve_cli`` builds the
options from the command line."""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from pagoda.serving.model_config import rewrite_config_pbtxt
from pagoda.serving.trtllm_front import configure_fronts

MODEL_NAME = "pagoda"


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
    grace_period_s: float = 30.0  # a stop's wait for in-flight requests; below the pod's termination grace
    first_request_timeout_s: float = 300.0  # the startup check's request (a cold first step)
    check_first_request: bool = True
    # Fleet layer: with a Redis URL the replica publishes block events and heartbeats.
    redis_url: Optional[str] = None
    replica_id: Optional[str] = None
    fleet_model: Optional[str] = None  # key namespace (default: the model folder's name)
    advertise_host: Optional[str] = None  # how routers reach this replica (default 127.0.0.1)
    trtllm_decoupled: dict[str, bool] = field(default_factory=dict)  # TensorRT-LLM front -> decoupled
    role: Optional[str] = None  # disaggregated serving: prefill | decode | mixed, in the heartbeat

    def fleet_env(self) -> dict[str, str]:
        """Environment for ``pagoda.fleet.index.publisher.publisher_from_env`` in the model."""
        if not self.redis_url:
            return {}
        env = {"PAGODA_REDIS_URL": self.redis_url, "PAGODA_HTTP_PORT": str(self.http_port),
               "PAGODA_GRPC_PORT": str(self.grpc_port), "PAGODA_METRICS_PORT": str(self.metrics_port)}
        for name, value in (("PAGODA_REPLICA_ID", self.replica_id), ("PAGODA_MODEL_NAME", self.fleet_model),
                            ("PAGODA_ADVERTISE_HOST", self.advertise_host), ("PAGODA_ROLE", self.role)):
            if value:
                env[name] = value
        return env

    def parameter_overrides(self) -> dict[str, Optional[str]]:
        def text(value):
            if value is None:
                return None
            return ("true" if value else "false") if isinstance(value, bool) else str(value)

        numbers = ("block_size", "kv_cache_memory_bytes", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
                   "enable_chunked_prefill", "enable_prefix_caching")
        return {"model": self.model, **{name: text(getattr(self, name)) for name in numbers},
                "device": self.device, "dtype": self.dtype, "quantization": self.quantization, **self.engine_args}


def materialize_repository(source: Path, dest: Path, options: ServeOptions) -> Path:
    """Copy the model repository to ``dest`` with ``options`` written into config.pbtxt."""
    shutil.copytree(source, dest, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    config_path = dest / MODEL_NAME / "config.pbtxt"
    ranks = int(options.engine_args.get("tensor_parallel_size", 1)) * int(options.engine_args.get(
        "pipeline_parallel_size", 1))
    kind = ("KIND_MODEL" if ranks > 1  # TP or PP: the engine places its ranks
            else {"cuda": "KIND_GPU", "cpu": "KIND_CPU"}.get(options.device or ""))
    config_path.write_text(rewrite_config_pbtxt(config_path.read_text(), options.parameter_overrides(), kind))
    configure_fronts(dest, options.trtllm_decoupled)
    return dest
