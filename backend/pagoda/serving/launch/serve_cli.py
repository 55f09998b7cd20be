"""The ``pagoda serve`` command line: flags (``serve_flags``) -> ``ServeOptions`` -> a supervised ``TritonServer``.

Lifecycle (see ``launcher`` and ``process_tree`` for the mechanisms):

- bad engine settings are refused before anything starts; so are numpy 2 in the stub's
  environment and ports already in use;
- the endpoints are printed only after one request went through the whole path;
- while serving, a dead Python-backend stub (tritonserver alone would keep answering
  READY while failing every request) is restarted by restarting tritonserver on the same
  ports (it runs without model control: no client, and not the launcher, can load or
  unload a model), not ready meanwhile, at most ``--max-stub-restarts`` times in 10
  minutes; beyond that, or if tritonserver itself died, the replica stops with a message
  and exit code 1, so an orchestrator restarts it and no router keeps it;
- SIGTERM or Ctrl-C drains: the engine stops taking requests and finishes those in flight
  for up to ``--grace-period`` seconds, the model finalizes, tritonserver exits, and every
  process in its group is gone when we return; a second signal kills at once;
- SIGKILL of this process takes tritonserver with it (parent-death signal);
- ``--nodes M --node-rank R --leader-address HOST:PORT``: one replica over M nodes. Node 0 is
  the server above (its engine opens the group's store on PORT); a node with R > 0 starts no
  server and only runs its ranks of node 0's engine (``engine.parallel.node``), exiting when
  they end (non-zero if one failed).
"""

from __future__ import annotations

import argparse
import collections
import os
import signal
import sys
import threading
import time
from typing import Optional

from pagoda.serving.launch.launcher import TritonServer
from pagoda.serving.launch.serve_flags import (check_engine_args, check_nodes, make_parser, media_args,
                                              options_from_args)
from pagoda.serving.launch.serve_options import MODEL_NAME
from pagoda.serving.trtllm_front import FRONT_MODELS
from pagoda.serving.launch.openai_door import OpenAIDoor, model_dir_for
from pagoda.serving.media_fetch import media_env

HEALTH_INTERVAL_S = 0.5
STUB_RESTART_WINDOW_S = 600.0
def serve_worker_node(args: argparse.Namespace) -> int:
    """``--node-rank R > 0``: run this node's ranks of the leader's engine until the group stops
    (``engine.parallel.node``); no tritonserver, no Redis, no ports of its own."""
    import logging

    from pagoda.engine.parallel.node import run_node

    logging.basicConfig(level=logging.INFO, format="pagoda serve: %(message)s")
    try:
        code = run_node(args.leader_address, args.node_rank, args.nodes,
                        tensor_parallel_size=args.tensor_parallel_size,
                        pipeline_parallel_size=args.pipeline_parallel_size)
    except (ValueError, RuntimeError) as exc:
        print(f"pagoda serve: {exc}", file=sys.stderr, flush=True)
        return 1
    print(f"pagoda serve: node {args.node_rank}'s ranks ended (exit code {code})", file=sys.stderr, flush=True)
    return code


def supervise(server: TritonServer, stop_requested: threading.Event, max_stub_restarts: int,
              door: Optional[OpenAIDoor] = None) -> Optional[str]:
    """Watch the server until a stop is requested (returns None) or it cannot serve (returns
    why). A dead stub is restarted by restarting tritonserver (``restart_model``), at most
    ``max_stub_restarts`` times in ``STUB_RESTART_WINDOW_S``; a dead OpenAI door is restarted."""
    restarts: "collections.deque[float]" = collections.deque()
    while not stop_requested.wait(HEALTH_INTERVAL_S):
        door_news = door.ensure_running() if door is not None else None
        if door_news is not None:
            print(f"pagoda serve: {door_news}", file=sys.stderr, flush=True)
        problem = server.check_health()
        if problem is None:
            continue
        now = time.monotonic()
        while restarts and now - restarts[0] > STUB_RESTART_WINDOW_S:
            restarts.popleft()
        if len(restarts) >= max_stub_restarts:
            return f"{problem} (restarted {len(restarts)} time(s) in the last {STUB_RESTART_WINDOW_S:.0f} s)"
        if not server.is_running():  # e.g. tritonserver aborted after its stub died: an orchestrator restarts us
            return f"{problem}; tritonserver exited with code {server.process.poll()}"
        print(f"pagoda serve: {problem}; restarting it (tritonserver restart; not ready meanwhile) ...",
              file=sys.stderr, flush=True)
        restarts.append(now)
        try:
            server.restart_model()
        except RuntimeError as exc:
            return f"{problem}; the restart failed: {exc}"
        print("pagoda serve: the stub was restarted; serving again", file=sys.stderr, flush=True)
    return None


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point of ``pagoda serve``; returns the process exit code."""
    parser = make_parser()
    args = parser.parse_args(argv)
    if args.grace_period < 0:
        parser.error("--grace-period: must be >= 0")
    if args.max_stub_restarts < 0:
        parser.error("--max-stub-restarts: must be >= 0")
    check_nodes(args, parser)
    if args.node_rank > 0:
        return serve_worker_node(args)
    options = options_from_args(args)
    check_engine_args(options, parser)
    if not 0 <= args.openai_port <= 65535:
        parser.error("--openai-port: must be a port number, or 0 for no OpenAI door")
    server = TritonServer(options)
    door: Optional[OpenAIDoor] = None
    stop_requested, force = threading.Event(), threading.Event()
    starting = [True]

    def on_signal(signum, frame):
        if stop_requested.is_set():
            force.set()  # a second signal: stop waiting for in-flight requests
            return
        stop_requested.set()
        if starting[0]:
            raise KeyboardInterrupt

    # Install both explicitly: a launcher started in the background inherits SIGINT ignored.
    previous = {signum: signal.signal(signum, on_signal) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        # The LLM-API model's stub reads the fetch settings from its environment (media_fetch.fetcher_from_env).
        os.environ.update(media_env(args.allowed_media_domains, args.media_fetch_timeout, args.max_media_bytes))
        server.start()
        if args.openai_port:
            door = OpenAIDoor(args.openai_port, model_dir_for(options.model), server.grpc_url, server.http_url,
                              f"{options.host}:{options.metrics_port}", allow_runtime_lora=args.allow_runtime_lora,
                              model_name=args.served_model_name, parsers=(args.reasoning_parser,
                                                                          args.tool_call_parser),
                              response_store=args.response_store, router_args=media_args(args)).start()
        starting[0] = False
        trtllm_mode = "decoupled (streaming)" if args.trtllm_decoupled == "true" else "unary infer()"
        print(f"pagoda is serving model '{MODEL_NAME}' ({options.model})\n"
              f"  HTTP    http://{server.http_url}/v2/models/{MODEL_NAME}/generate_stream\n"
              f"  gRPC    {server.grpc_url}\n"
              f"  metrics {server.metrics_url}\n"
              f"  OpenAI  {door.url if door is not None else 'off'}\n"
              f"  TensorRT-LLM models {', '.join(FRONT_MODELS)}: {trtllm_mode}\n"
              "Ctrl-C to stop.", flush=True)
        problem = supervise(server, stop_requested, args.max_stub_restarts, door)
        if door is not None:
            door.stop()
        if problem is not None:
            print(f"pagoda serve: {problem}; stopping the replica", file=sys.stderr, flush=True)
            server.stop(grace_s=0)
            return 1
        print(f"stopping tritonserver: draining in-flight requests (up to {options.grace_period_s:g} s) ...",
              file=sys.stderr, flush=True)
        code = server.stop(force=force)
        print(f"tritonserver stopped (exit code {code})", file=sys.stderr, flush=True)
        return 0
    except KeyboardInterrupt:
        print("pagoda serve: interrupted while starting; stopping tritonserver", file=sys.stderr, flush=True)
        _stop_all(server, door)
        return 130
    except RuntimeError as exc:
        print(f"pagoda serve: {exc}", file=sys.stderr, flush=True)
        _stop_all(server, door)
        return 1
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _stop_all(server: TritonServer, door: Optional[OpenAIDoor]) -> None:
    if door is not None:
        door.stop()
    server.stop(grace_s=0)


if __name__ == "__main__":
    sys.exit(main())
