"""A real two-replica fleet for the routing benchmarks, and the client-side probes they share.

``two_replicas`` starts two ``tritonserver`` replicas (ids r0, r1) publishing block events
and heartbeats to one Redis namespace; ``one_request`` sends one gRPC streaming request
and returns its TTFT; ``metric`` sums a Prometheus counter of one replica. Used by
``bench.routing_real`` and ``bench.routing_bursts``.
"""

from __future__ import annotations

import contextlib
import os
import queue
import random
import threading
import time
import urllib.request
from typing import Any, Sequence


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def words(rng: random.Random, count: int) -> str:
    vocabulary = ("tea", "leaf", "water", "green", "black", "steep", "minute", "cup", "aroma", "garden", "spring",
                  "harvest", "oolong", "roast", "pot", "temperature", "mountain", "mist", "flavor", "sweet")
    return " ".join(rng.choice(vocabulary) for _ in range(count))


@contextlib.contextmanager
def two_replicas(redis_url: str, namespace: str, kv_cache_memory_bytes: int, log_dir: str):
    """Two replicas publishing to ``redis_url`` under ``namespace`` (ids r0, r1)."""
    from pagoda.serving.launch.launcher import TritonServer, find_free_port
    from pagoda.serving.launch.serve_options import ServeOptions

    servers, saved = [], dict(os.environ)
    try:
        for rid in ("r0", "r1"):
            options = ServeOptions(http_port=find_free_port(), grpc_port=find_free_port(),
                                   metrics_port=find_free_port(), max_model_len=2048, max_num_seqs=8,
                                   kv_cache_memory_bytes=kv_cache_memory_bytes, startup_timeout_s=600,
                                   redis_url=redis_url, replica_id=rid, fleet_model=namespace)
            os.environ["PAGODA_HEARTBEAT_INTERVAL_S"] = "0.2"  # no ServeOptions field
            server = TritonServer(options, log_path=os.path.join(log_dir, f"{rid}.log"))
            thread = threading.Thread(target=server.start, daemon=True)
            thread.start()
            servers.append((rid, server))
            while server.process is None and thread.is_alive():
                time.sleep(0.01)  # until its Popen has copied this replica's environment
            os.environ.clear()
            os.environ.update(saved)
        deadline = time.monotonic() + 600
        while not all(is_ready(s) for _, s in servers):
            if time.monotonic() > deadline:
                raise RuntimeError("replicas did not become ready")
            time.sleep(0.5)
        yield dict(servers)
    finally:
        os.environ.clear()
        os.environ.update(saved)
        for _, server in servers:
            server.stop()


def is_ready(server: Any) -> bool:
    return http_ready(server.http_url)


def http_ready(address: str) -> bool:
    """Whether pagoda's model answers ready on the HTTP ``address`` (a replica's or a router's)."""
    try:
        with urllib.request.urlopen(f"http://{address}/v2/models/pagoda/ready", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def metric(server: Any, name: str) -> float:
    text = urllib.request.urlopen(f"http://{server.options.host}:{server.options.metrics_port}/metrics",
                                  timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def one_request(url: str, prompt: str, salt: str, max_tokens: int) -> float:
    """Send one streaming request; return its TTFT in seconds (raises on error)."""
    import tritonclient.grpc as grpcclient

    from pagoda.serving.launch.client import make_inputs

    client = grpcclient.InferenceServerClient(url)
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    start = time.perf_counter()
    client.async_stream_infer("pagoda", make_inputs(prompt, {"max_tokens": max_tokens, "temperature": 0,
                                                             "cache_salt": salt}))
    ttft = None
    try:
        while True:
            result, error = results.get(timeout=300)
            if error is not None:
                raise RuntimeError(str(error))
            ttft = ttft if ttft is not None else time.perf_counter() - start
            if result.get_response().parameters["triton_final_response"].bool_param:
                return ttft
    finally:
        client.stop_stream()
        client.close()
