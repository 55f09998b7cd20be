"""The ``pagoda serve`` flags: the parser (``make_parser``), their translation into
``ServeOptions`` (``options_from_args``: the engine fields into config.pbtxt parameters,
``--lora`` into ``lora_modules``, the TensorRT-LLM fronts' transaction policy) and the checks
that refuse a bad value before anything starts, naming the flag (``check_engine_args`` runs the
engine's own config validation, ``check_nodes`` the multi-node layout). ``serve_cli`` runs what
they describe."""

from __future__ import annotations

import argparse
from pathlib import Path

from pagoda.engine.kv_transfer.registry import KV_CONNECTOR_BACKENDS
from pagoda.serving.launch.openai_door import DEFAULT_PORT as DEFAULT_OPENAI_PORT
from pagoda.serving.launch.serve_options import ServeOptions
from pagoda.serving.media_fetch import media_flags
from pagoda.serving.model_config import engine_config_from_parameters
from pagoda.serving.trtllm_front import FRONT_MODELS

# Flags whose value goes into config.pbtxt as the EngineConfig field of the same name.
ENGINE_FLAGS = ("scheduling_policy", "speculative_method", "speculative_model", "num_speculative_tokens",
                "cpu_offload_bytes", "kv_disk_dir", "kv_disk_bytes", "kv_shared_dir", "kv_write_through",
                "preemption_mode",
                "default_max_tokens", "gpu_memory_utilization",
                "max_waiting_requests", "max_waiting_prompt_tokens", "max_queue_delay_s", "kv_cache_dtype",
                "tensor_parallel_size", "pipeline_parallel_size", "generation_config", "long_prefill_token_threshold",
                "cpu_threads_bind")


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
    p.add_argument("--long-prefill-token-threshold", type=int,
                   help="chunked prefill: at most this many tokens of one prompt per step (vLLM's; 0: off)")
    p.add_argument("--cpu-threads-bind", help="CPU: bind torch's threads, one per CPU ('0-3', '0,2' or auto; "
                   "vLLM's VLLM_CPU_OMP_THREADS_BIND); default unbound, for a machine shared with other work")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="vLLM's spelling (--no-enable-prefix-caching turns it off)")
    p.add_argument("--gpu-memory-utilization", type=float, help="fraction of GPU memory the engine may use")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"))
    p.add_argument("--dtype", choices=("auto", "float32", "float16", "bfloat16"))
    p.add_argument("--generation-config", choices=("auto", "none"),
                   help="sampling defaults for what a request leaves unset: the model's generation_config.json "
                        "(auto, the default, as vLLM) or SamplingParams' own (none)")
    p.add_argument("--quantization", choices=("int8", "fp8", "w8a8"),
                   help="int8 or fp8 (e4m3; CUDA sm_89+ or CPU emulation): 8-bit weights of the linear layers; "
                        "w8a8 (CPU): int8 weights and per-token int8 activations")
    p.add_argument("--kv-cache-dtype", choices=("auto", "fp8_e4m3"),
                   help="KV cache storage: auto (the model dtype) or fp8_e4m3 (twice the tokens of bf16)")
    p.add_argument("--scheduling-policy", choices=("fcfs", "priority"))
    p.add_argument("--speculative-method", choices=("ngram", "draft", "eagle3", "mtp"),
                   help="speculative decoding by default for every request (see docs/speculative.md)")
    p.add_argument("--speculative-model",
                   help="draft: a draft model folder; eagle3: the EAGLE-3 head's folder; mtp: a folder with the "
                        "MTP block (default: the model's own checkpoint)")
    p.add_argument("--num-speculative-tokens", type=int, help="largest speculative window k")
    p.add_argument("--tensor-parallel-size", type=int,
                   help="ranks (devices) in the replica: the model instance becomes KIND_MODEL (docs/parallelism.md)")
    p.add_argument("--pipeline-parallel-size", type=int,
                   help="pipeline stages the layers are cut into (times --tensor-parallel-size ranks, one "
                        "device each); KIND_MODEL as above (docs/parallelism.md)")
    p.add_argument("--nodes", type=int, default=1,
                   help="nodes the replica's ranks (tensor x pipeline parallel size) span, the same number on each "
                        "(docs/parallelism.md; 1: this node holds them all)")
    p.add_argument("--node-rank", type=int, default=0,
                   help="with --nodes > 1: this node's place; 0 runs the server and the engine (rank 0), "
                        "1..nodes-1 run only their ranks, no server (a LeaderWorkerSet worker pod)")
    p.add_argument("--leader-address", metavar="HOST:PORT",
                   help="with --nodes > 1: node 0's address; it opens the group's store on PORT, "
                        "the other nodes connect to HOST:PORT")
    p.add_argument("--cpu-offload-bytes", type=int, help="size of the CPU tier of the KV cache (0: off)")
    p.add_argument("--kv-disk-dir", help="disk tier of the KV cache below the CPU tier: a node-local directory "
                   "(needs --cpu-offload-bytes and --kv-disk-bytes); a restart with it serves its prefixes")
    p.add_argument("--kv-disk-bytes", type=int, help="size cap of --kv-disk-dir's block files")
    p.add_argument("--kv-shared-dir", help="shared tier of the KV cache: a directory several replicas mount "
                   "(a PVC, NFS); blocks named by content hash, read by any replica")
    p.add_argument("--kv-write-through", action="store_const", const="true",
                   help="with --kv-disk-dir/--kv-shared-dir: write a full block when its last request ends, not only "
                        "when the device evicts it (a hot prefix reaches the shared tier at once)")
    p.add_argument("--preemption-mode", choices=("auto", "recompute", "swap"))
    p.add_argument("--max-waiting-requests", type=int,
                   help="admission control: refuse new requests (overload error) past this many waiting")
    p.add_argument("--max-waiting-prompt-tokens", type=int,
                   help="admission control: refuse new requests past this many waiting prompt tokens")
    p.add_argument("--max-queue-delay-s", type=float,
                   help="admission control: refuse new requests that the replica's measured capacity says would "
                        "wait longer than this for a slot (default 30; 0: off)")
    p.add_argument("--lora", action="append", default=[], metavar="NAME=PATH",
                   help="serve a PEFT LoRA adapter under NAME (repeatable; requests pick it with lora_name)")
    p.add_argument("--reasoning-parser", metavar="NAME",
                   help="the OpenAI door's reasoning parser (pagoda router --reasoning-parser; default: from the "
                        "chat template)")
    p.add_argument("--tool-call-parser", metavar="NAME",
                   help="the OpenAI door's tool-call parser (pagoda router --tool-call-parser; default: from the "
                        "chat template)")
    p.add_argument("--response-store", action="store_true",
                   help="the OpenAI door keeps Responses API turns in memory for previous_response_id "
                        "(pagoda router --response-store)")
    p.add_argument("--allow-runtime-lora", action="store_true",
                   help="accept LoRA control requests that load/unload adapters at run time (lora_action; "
                        "`pagoda lora`; turns LoRA on). Only for trusted clients: a load reads any folder "
                        "the server can read")
    p.add_argument("--no-vllm-metrics", action="store_true",
                   help="report no vllm: metric series, only pagoda: ones (the vLLM backend's "
                        "REPORT_CUSTOM_METRICS=false)")
    p.add_argument("--output-dialect", choices=("pagoda", "vllm"),
                   help="default shape of the logprobs and finish_reason outputs: vllm (Triton's vLLM "
                        "backend: per-token {id: {logprob, rank, decoded_token}}, null unless logprobs is set, "
                        "'None' before the end; the default) or pagoda (per-token {token_id, logprob, rank, "
                        "top_logprobs}, '' before the end; pagoda's router asks for it per request)")
    p.add_argument("--trtllm-decoupled", choices=("true", "false"),
                   help="TensorRT-LLM's decoupled_mode for its front models ensemble, tensorrt_llm_bls and "
                        "tensorrt_llm (LLM API): true streams, false (the shipped default) serves unary infer()")
    p.add_argument("--engine-arg", action="append", default=[], metavar="FIELD=VALUE",
                   help="any other EngineConfig field, e.g. --engine-arg spec_adaptive=false (repeatable)")
    p.add_argument("--model-repository", help="a model repository to use instead of the shipped one")
    p.add_argument("--log-verbose", type=int, default=0)
    p.add_argument("--redis-url", help="publish block events and heartbeats to this Redis (fleet layer)")
    p.add_argument("--replica-id", help="with --redis-url: this replica's id (default: host name)")
    p.add_argument("--fleet-model", help="with --redis-url: Redis key namespace (default: model folder name)")
    p.add_argument("--advertise-host", help="with --redis-url: host routers use to reach this replica")
    p.add_argument("--kv-events-config", metavar="JSON",
                   help="publish KV-cache events on ZMQ in vLLM's format (llm-d, Dynamo), configured as vLLM's "
                        "--kv-events-config, e.g. '{\"enable_kv_cache_events\": true, \"endpoint\": "
                        "\"tcp://*:5557\", \"replay_endpoint\": \"tcp://*:5558\"}' (docs/fleet.md)")
    p.add_argument("--kv-transfer-listen", metavar="HOST:PORT",
                   help="serve disaggregated prefill/decode: a KV connector listening here (port 0: any) pulls "
                        "and answers pulls of KV blocks named by vLLM's kv_transfer_params (docs/kv_transfer.md)")
    p.add_argument("--kv-transfer-backend", choices=tuple(KV_CONNECTOR_BACKENDS),
                   help="with --kv-transfer-listen: the KV connector that moves the blocks: tcp (default) or nixl "
                        "(UCX: RDMA, NVLink, shared memory; needs the nixl package) (docs/kv_transfer.md)")
    p.add_argument("--role", choices=("mixed", "prefill", "decode"),
                   help="with --redis-url: this replica's role in disaggregated serving, in its heartbeat: routers "
                        "send a prefill replica only first stages and a decode replica only second stages "
                        "(needs --kv-transfer-listen; default mixed)")
    p.add_argument("--default-max-tokens", type=int,
                   help="cap for requests that do not set max_tokens (default: the model repository's, 1024)")
    p.add_argument("--grace-period", type=float, default=30.0, metavar="SECONDS",
                   help="on SIGTERM/Ctrl-C, how long in-flight requests may finish (keep it below "
                        "Kubernetes' terminationGracePeriodSeconds)")
    p.add_argument("--max-stub-restarts", type=int, default=3,
                   help="a dead Python-backend stub is restarted (tritonserver restart, same ports) at most this "
                        "many times in 10 minutes; beyond that (or with 0) the replica stops with exit code 1")
    p.add_argument("--openai-port", type=int, default=DEFAULT_OPENAI_PORT,
                   help="serve the OpenAI API (/v1/completions, /v1/chat/completions, /v1/models, /health) on "
                        f"this port (default {DEFAULT_OPENAI_PORT}; 0: off); the router's OpenAI code over this "
                        "replica")
    p.add_argument("--served-model-name", metavar="NAME",
                   help="the model's name on the OpenAI door and in metrics labels (default: the model folder's "
                        "name, or $PAGODA_MODEL_NAME)")
    media_flags(p)  # the OpenAI door's and the LLM-API model's http(s) image URLs
    p.add_argument("--skip-first-request-check", action="store_true",
                   help="announce the server without sending it one request first")
    return p


def media_args(args: argparse.Namespace) -> list[str]:
    """The OpenAI door's (a ``pagoda router`` child's) image-fetching flags, as given."""
    if not args.allowed_media_domains:
        return []
    return ["--allowed-media-domains", args.allowed_media_domains, "--media-fetch-timeout",
            str(args.media_fetch_timeout), "--max-media-bytes", str(args.max_media_bytes)]


def engine_args_from(args: argparse.Namespace) -> dict[str, str]:
    """The engine fields given by dedicated flags and ``--engine-arg FIELD=VALUE``."""
    values = {name: str(getattr(args, name)) for name in ENGINE_FLAGS if getattr(args, name) is not None}
    for item in args.engine_arg:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise SystemExit(f"pagoda serve: --engine-arg must look like FIELD=VALUE, got {item!r}")
        values[name.strip()] = value.strip()
    if args.nodes > 1:
        values.update(tensor_parallel_nodes=str(args.nodes), tensor_parallel_leader=args.leader_address or "")
    if args.lora:
        values.update(enable_lora="true", lora_modules=lora_modules_text(args.lora))
    if args.allow_runtime_lora:
        values.update(enable_lora="true", allow_runtime_lora="true")
    if args.served_model_name:
        values["served_model_name"] = args.served_model_name
    if args.kv_events_config is not None:
        from pagoda.serving.kv_event_stream import KVEventsConfig

        try:
            KVEventsConfig.from_json(args.kv_events_config, "--kv-events-config")
        except ValueError as error:
            raise SystemExit(f"pagoda serve: {error}") from None
        values["kv_events_config"] = args.kv_events_config
    if args.kv_transfer_listen:
        from pagoda.engine.kv_transfer.connector import parse_peer

        listen = args.kv_transfer_listen
        try:
            parse_peer(listen if not listen.endswith(":0") else listen[:-2] + ":1")
        except ValueError as error:
            raise SystemExit(f"pagoda serve: --kv-transfer-listen: {error}") from None
        values["kv_transfer_listen"] = listen
    if args.role in ("prefill", "decode") and not args.kv_transfer_listen:
        # without a connector the decode stage cannot pull the prompt's KV: it would recompute it
        raise SystemExit(f"pagoda serve: --role {args.role} needs --kv-transfer-listen HOST:PORT (a {args.role} "
                         "replica moves the prompt's KV blocks through its connector)")
    if args.kv_transfer_backend:
        if not args.kv_transfer_listen:
            raise SystemExit("pagoda serve: --kv-transfer-backend needs --kv-transfer-listen HOST:PORT")
        values["kv_transfer_backend"] = args.kv_transfer_backend
    if args.no_vllm_metrics:
        values["REPORT_CUSTOM_METRICS"] = "false"
    if args.output_dialect:
        values["output_dialect"] = args.output_dialect
    return values


def lora_modules_text(items: list[str]) -> str:
    """``--lora NAME=PATH`` flags as the ``lora_modules`` parameter (``name=/abs/path,...``)."""
    adapters = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise SystemExit(f"pagoda serve: --lora must look like NAME=PATH, got {item!r}")
        adapters[name.strip()] = str(Path(path.strip()).resolve())
    if any("," in p or "=" in p for p in adapters.values()):
        raise SystemExit("pagoda serve: --lora paths must not contain ',' or '='")
    return ",".join(f"{n}={p}" for n, p in adapters.items())


def options_from_args(args: argparse.Namespace) -> ServeOptions:
    return ServeOptions(
        model=args.model, http_port=args.http_port, grpc_port=args.grpc_port, metrics_port=args.metrics_port,
        block_size=args.block_size, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_chunked_prefill=False if args.no_chunked_prefill else None,
        enable_prefix_caching=False if args.no_prefix_caching else args.enable_prefix_caching,
        device=args.device, dtype=args.dtype, quantization=args.quantization, engine_args=engine_args_from(args),
        model_repository=args.model_repository,
        log_verbose=args.log_verbose, redis_url=args.redis_url, replica_id=args.replica_id,
        fleet_model=args.fleet_model, advertise_host=args.advertise_host, role=args.role,
        grace_period_s=args.grace_period,
        check_first_request=not args.skip_first_request_check,
        trtllm_decoupled=({} if args.trtllm_decoupled is None else
                          dict.fromkeys(FRONT_MODELS, args.trtllm_decoupled == "true")))


def check_engine_args(options: ServeOptions, parser: argparse.ArgumentParser) -> None:
    """Refuse bad engine settings here, with the field's name, not inside tritonserver."""
    parameters = {name: {"string_value": value} for name, value in options.parameter_overrides().items()
                  if value is not None and name != "model"}
    try:
        engine_config_from_parameters(parameters)
    except ValueError as exc:
        parser.error(str(exc))


def check_nodes(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Refuse an impossible multi-node layout, naming the flag."""
    if args.nodes < 1:
        parser.error(f"--nodes: must be >= 1, got {args.nodes}")
    if not 0 <= args.node_rank < args.nodes:
        parser.error(f"--node-rank: must be 0..{args.nodes - 1} with --nodes {args.nodes}, got {args.node_rank}")
    if args.nodes > 1 and not args.leader_address:
        parser.error("--leader-address: needed with --nodes > 1 (node 0's HOST:PORT)")
    if args.nodes == 1 and args.leader_address:
        parser.error("--leader-address: only with --nodes > 1")
