"""``pagoda bench disagg-live``: do running streams stall when a burst of long prompts arrives?

Measured on real replicas, in one run, for two fleets of the same two replicas behind one
router (``pagoda router`` in this process, the gRPC door, Redis for the prefix index):

* **colocated**: both replicas ``mixed``; the router spreads streams and burst by load, so
  a burst's chunked prefills share steps with the streams' decodes;
* **disaggregated**: r0 ``prefill``, r1 ``decode`` (``role=`` in the router's replica
  list; both listen for KV transfers): every request prefills on r0, then r1 pulls its
  prompt's blocks and decodes (docs/kv_transfer.md).

Each replica (tritonserver, its stub, every thread) is pinned to its own core with
``taskset`` (``--no-pin`` to skip; the router and this client float). ``--streams``
streaming requests with short prompts decode ``--stream-tokens`` tokens each; once every
stream has produced ``--warmup-tokens``, ``--burst`` requests with ``--burst-prompt-tokens``
-token prompts (fresh words each, nothing cached) and ``--burst-max-tokens`` outputs are sent
at once. The inter-token gaps of the streams are split into *before* the burst and *during*
it (from its first request until its last finished); p50 / p99 / max of each, the burst's
TTFT and the number of two-stage requests are printed, one line per fleet.

The claim it checks (issue 30): a prefill burst does not stall streaming on a decode
replica. CPU timings on a shared machine are noisy: compare the two fleets of one run.
"""

from __future__ import annotations

import argparse
import os
import platform
import queue
import random
import subprocess
import tempfile
import threading
import time
from typing import Any, Optional

from pagoda.bench.fleet_harness import percentile, words


def _pin(server: Any, core: int) -> None:
    """Every process (and thread) of a replica's process group onto ``core``."""
    from pagoda.serving import process_tree

    for pid in process_tree.group_members(server.process.pid):
        subprocess.run(["taskset", "-a", "-c", "-p", str(core), str(pid)], capture_output=True, check=False)


def _stream(url: str, prompt: str, max_tokens: int, times: list[float], done: threading.Event,
            errors: list[str]) -> None:
    """One streaming request; appends each response's arrival time to ``times``."""
    import tritonclient.grpc as grpcclient

    from pagoda.serving.launch.client import make_inputs

    client = grpcclient.InferenceServerClient(url)
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    client.async_stream_infer("pagoda", make_inputs(prompt, {"max_tokens": max_tokens, "temperature": 0,
                                                             "ignore_eos": True}))
    try:
        while True:
            result, error = results.get(timeout=600)
            if error is not None:
                errors.append(str(error))
                return
            times.append(time.perf_counter())
            if result.get_response().parameters["triton_final_response"].bool_param:
                return
    finally:
        done.set()
        client.stop_stream()
        client.close()


def _gaps(times: list[float], start: float, end: float, inside: bool) -> list[float]:
    """Inter-token gaps ending inside [start, end] (``inside``) or before ``start``."""
    gaps = []
    for a, b in zip(times, times[1:]):
        if (start <= b <= end) if inside else b < start:
            gaps.append(b - a)
    return gaps


def run_fleet(mode: str, args: argparse.Namespace, log_dir: str) -> dict[str, Any]:
    """One fleet (``colocated`` or ``disaggregated``): start, measure, stop."""
    from pagoda.bench.soak import RedisProcess
    from pagoda.fleet.service import BackgroundRouter, RouterOptions
    from pagoda.serving.launch.launcher import TritonServer, find_free_port
    from pagoda.serving.launch.serve_options import ServeOptions

    rng = random.Random(args.seed)
    redis = RedisProcess(find_free_port(), log_dir)
    redis.start()
    servers: dict[str, TritonServer] = {}
    try:
        for rid in ("r0", "r1"):
            options = ServeOptions(http_port=find_free_port(), grpc_port=find_free_port(),
                                   metrics_port=find_free_port(), max_model_len=args.burst_prompt_tokens + 512,
                                   max_num_seqs=16, kv_cache_memory_bytes=args.kv_cache_mb * 2**20,
                                   startup_timeout_s=600, redis_url=redis.url, replica_id=rid, fleet_model=mode,
                                   engine_args={"kv_transfer_listen": "127.0.0.1:0"})
            servers[rid] = TritonServer(options, log_path=os.path.join(log_dir, f"{mode}-{rid}.log")).start()
        if not args.no_pin:
            for core, server in enumerate(servers.values()):
                _pin(server, core % (os.cpu_count() or 1))
        roles = {"r0": "prefill", "r1": "decode"} if mode == "disaggregated" else {"r0": "mixed", "r1": "mixed"}
        spec = ";".join(f"id={rid},grpc={s.grpc_url},http={s.http_url},metrics={s.options.host}:"
                        f"{s.options.metrics_port},role={roles[rid]}" for rid, s in servers.items())
        options = RouterOptions(model_name="pagoda", replicas=spec, redis_url=redis.url, host="127.0.0.1",
                                http_port=0, grpc_port=0, health_interval_s=0.5, registry_interval_s=0.2)
        with BackgroundRouter(options) as router:
            return _measure(router, args, rng)
    finally:
        for server in servers.values():
            server.stop(grace_s=0)
        redis.stop()


def _measure(router: Any, args: argparse.Namespace, rng: random.Random) -> dict[str, Any]:
    url = router.grpc_url
    streams = [[] for _ in range(args.streams)]
    finished = [threading.Event() for _ in range(args.streams)]
    errors: list[str] = []
    threads = [threading.Thread(target=_stream, daemon=True,
                                args=(url, f"Stream {i}: tell a long story about {words(rng, 6)}.",
                                      args.stream_tokens, streams[i], finished[i], errors))
               for i in range(args.streams)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 600
    while any(len(t) < args.warmup_tokens for t in streams) and not errors and time.monotonic() < deadline:
        time.sleep(0.01)
    burst_times = [[] for _ in range(args.burst)]
    burst_done = [threading.Event() for _ in range(args.burst)]
    start = time.perf_counter()
    burst = [threading.Thread(target=_stream, daemon=True,
                              args=(url, words(rng, args.burst_prompt_tokens), args.burst_max_tokens,
                                    burst_times[i], burst_done[i], errors)) for i in range(args.burst)]
    for thread in burst:
        thread.start()
    for thread in burst:
        thread.join(600)
    end = time.perf_counter()
    streams_alive = sum(not f.is_set() for f in finished)
    for thread in threads:
        thread.join(600)
    before = [g for t in streams for g in _gaps(t, start, end, inside=False)]
    during = [g for t in streams for g in _gaps(t, start, end, inside=True)]
    ttfts = [t[0] - start for t in burst_times if t]
    ms = lambda values, q: round(1e3 * percentile(values, q), 1)  # noqa: E731
    return {"itl_before_p50_ms": ms(before, 0.5), "itl_before_p99_ms": ms(before, 0.99),
            "itl_during_p50_ms": ms(during, 0.5), "itl_during_p99_ms": ms(during, 0.99),
            "itl_during_max_ms": round(1e3 * max(during, default=float("nan")), 1), "gaps_during": len(during),
            "burst_s": round(end - start, 2), "burst_ttft_p50_s": round(percentile(ttfts, 0.5), 2),
            "streams_covering_burst": streams_alive,
            "two_stage": router.run(lambda: router.service.router.num_two_stage), "errors": errors[:3]}


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="pagoda bench disagg-live", description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=3)
    p.add_argument("--stream-tokens", type=int, default=400, help="each stream's output (it must outlast the burst)")
    p.add_argument("--warmup-tokens", type=int, default=20)
    p.add_argument("--burst", type=int, default=3)
    p.add_argument("--burst-prompt-tokens", type=int, default=1500, help="words per burst prompt (~1 token each)")
    p.add_argument("--burst-max-tokens", type=int, default=4)
    p.add_argument("--kv-cache-mb", type=int, default=1024)
    p.add_argument("--fleets", default="colocated,disaggregated")
    p.add_argument("--no-pin", action="store_true", help="do not pin each replica to its own core")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    os.environ.setdefault("PAGODA_HEARTBEAT_INTERVAL_S", "0.2")
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; replicas pinned: "
          f"{not args.no_pin}; {args.streams} streams of {args.stream_tokens} tokens, a burst of {args.burst} "
          f"{args.burst_prompt_tokens}-word prompts")
    with tempfile.TemporaryDirectory(prefix="pagoda-disagg-live-") as log_dir:
        for mode in args.fleets.split(","):
            result = run_fleet(mode, args, log_dir)
            print(f"{mode:14s} " + ", ".join(f"{k} {v}" for k, v in result.items()), flush=True)
    return 0
