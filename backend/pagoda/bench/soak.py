"""``pagoda bench soak``: a router over two real replicas and a real Redis, under mixed
traffic and injected faults, with invariants checked at the end.

Setup (everything on 127.0.0.1, started and stopped here): a ``redis-server``, two
``tritonserver`` replicas (default SmolLM2 on CPU, ``--max-num-seqs`` /
``--max-waiting-requests`` as given) publishing to it, and ``pagoda router`` in this
process with two tenants' API keys.

Traffic: ``num_clients`` closed-loop clients, for ``duration_s`` or ``max_requests``
requests in all (whichever ends first), each request one of: an OpenAI chat stream, an
OpenAI stream dropped after a random number of events (a cancel), an OpenAI
completion, a Triton gRPC stream, a Triton HTTP generate, a bad input (malformed JSON, a
JSON array, unknown field, ``"stream": "yes"``, ``role: "wizard"``, a wrong key), and an
over-limit request (``max_tokens``/``n`` past the cap, a 5 MB body).

Faults (``pagoda.bench.soak_faults``): on a timeline, Redis killed and restarted (at 25%),
replica r1 killed with SIGKILL (at 45%) and started again; with ``--kill-replica-every S``, a
replica killed every S seconds in turn (the hostile mode too), and then no request may fail
(the router migrates them). ``--queue-size-per-tenant N`` turns the router's flow control on
(tenant queues, docs/reliability.md).

Invariants (``Report.violations`` lists every breach; the command exits 1 on any):
- every request got exactly one terminal answer: a finish (``finish_reason`` once per
  choice, or the gRPC final flag once) or one clear error, never both, never neither;
- outcomes are only: ok, refused with a 4xx naming the reason (invalid input, limit,
  unauthenticated, rate limited, overloaded with ``Retry-After``), cancelled by the client,
  or failed because a replica was killed under it (502 / an error event naming it);
  any other 5xx is unexpected;
- after the traffic, every replica is idle with its KV cache empty (blocks back to the
  baseline: ``vllm:kv_cache_usage_perc`` 0, nothing running or waiting);
- replica RSS drift (tritonserver + its stub, from when the replica became ready, or
  ready again after its restart, to the end) is printed; over ``max_rss_drift``
  (default 10%) it is a violation.

Hostile (``--hostile``, ``pagoda.bench.soak_hostile``): the traffic runs in two phases of
half the duration, quiet and then with a hostile tenant's mix (grammar bombs, huge prompts
and gRPC messages, LoRA churn during guided traffic, Redis emptied twice) instead of the
fault timeline above; tenant A's TTFT p99 in the two phases is compared (a violation past
``--max-ttft-ratio``, 1.5), and every hostile request must end in a success or a refusal
with its reason.

Burst (``--burst N``, the 10x-load check): N streaming requests at once, straight to
replica r0 (Triton HTTP ``generate_stream``) and then through the router (OpenAI): how
many were admitted, how fast the rest were refused, the admitted requests' TTFT p50/p99,
and that every router refusal was 429 with ``Retry-After``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from pagoda.bench import soak_faults, soak_hostile
from pagoda.bench.soak_clients import BURST_PROMPT, Endpoints, run_action, stream_ttft

KEYS = {"sk-soak-tenant-a": "tenant-a", "sk-soak-tenant-b": "tenant-b"}


@dataclass
class SoakConfig:
    duration_s: float = 60.0
    max_requests: int = 400
    num_clients: int = 4
    max_num_seqs: int = 8
    max_waiting_requests: int = 16
    max_tokens: int = 12
    burst: int = 0
    faults: bool = True
    max_rss_drift: float = 0.10
    seed: int = 0
    hostile: bool = False  # two phases, the second with a hostile tenant (pagoda.bench.soak_hostile)
    hostile_clients: int = 1
    hostile_actions: tuple[str, ...] = ()  # a subset of soak_hostile.actions' names (empty: all)
    max_ttft_ratio: float = 1.5  # tenant A's TTFT p99, hostile phase / quiet phase
    kill_every_s: float = 0.0  # a replica killed every this many seconds (soak_faults.periodic_kills); 0: off
    queue_size_per_tenant: int = 0  # the router's flow control (its tenant queues' bound); 0: off
    log_dir: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="pagoda-soak-"))


@dataclass
class Report:
    outcomes: Counter = field(default_factory=Counter)
    faults: list[str] = field(default_factory=list)
    replicas: dict[str, dict[str, float]] = field(default_factory=dict)
    burst: dict[str, dict[str, float]] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    hostile: Counter = field(default_factory=Counter)  # the hostile tenant's "<action> <outcome>" counts
    tenants: dict[str, dict[str, float]] = field(default_factory=dict)  # TTFT per tenant and phase

    def format(self) -> str:
        sent = sum(self.outcomes.values())
        refused = {k: v for k, v in self.outcomes.items() if k.startswith("refused")}
        failed = {k: v for k, v in self.outcomes.items() if k.startswith("failed")}
        lines = [f"requests sent      {sent} in {self.wall_s:.0f} s",
                 f"admitted           {sent - sum(refused.values())}",
                 f"  ok               {self.outcomes.get('ok', 0)}",
                 f"  cancelled        {self.outcomes.get('cancelled', 0)}",
                 f"  failed           {sum(failed.values())}  {dict(sorted(failed.items()))}",
                 f"refused            {sum(refused.values())}  {dict(sorted(refused.items()))}",
                 f"unexpected         {sum(v for k, v in self.outcomes.items() if k.startswith('unexpected'))}",
                 "faults injected    " + ("; ".join(self.faults) or "none")]
        for rid, values in sorted(self.replicas.items()):
            lines.append(f"replica {rid}         " + ", ".join(f"{k} {v:g}" for k, v in values.items()))
        for name, values in self.tenants.items():
            lines.append(f"{name:<18} " + ", ".join(f"{k} {v:.3g}" for k, v in values.items()))
        if self.hostile:
            lines.append("hostile tenant     " + json.dumps(dict(sorted(self.hostile.items()))))
        for where, values in self.burst.items():
            lines.append(f"burst via {where:<8} " + ", ".join(f"{k} {v:.3g}" for k, v in values.items()))
        lines.append("invariants         " + ("all hold" if not self.violations else "VIOLATED:"))
        lines += [f"  - {v}" for v in self.violations]
        return "\n".join(lines)


class RedisProcess:
    """A disposable redis-server child on a fixed port (no persistence), killed by pid."""

    def __init__(self, port: int, workdir: str) -> None:
        self.port, self.workdir, self.proc = port, workdir, None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--dir", self.workdir],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        import socket

        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.02)
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


def _rss_mb(pid: int) -> float:
    """Resident memory of ``pid`` and its children (the Python backend stub), in MiB."""
    pids = [pid] + [int(p) for p in os.listdir("/proc") if p.isdigit() and _ppid(int(p)) == pid]
    total = 0.0
    for p in pids:
        try:
            with open(f"/proc/{p}/status") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024
        except (OSError, StopIteration):
            pass
    return total


def _ppid(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


def _metric(server: Any, name: str) -> float:
    text = urllib.request.urlopen(server.metrics_url, timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


class Fleet:
    """Redis + two replicas + the router, with the fault operations the soak uses."""

    def __init__(self, config: SoakConfig) -> None:
        from pagoda.serving.launch.launcher import find_free_port
        from pagoda.serving.launch.serve_options import ServeOptions

        self.config = config
        self.redis = RedisProcess(find_free_port(), config.log_dir)
        extra = soak_hostile.engine_args() if config.hostile else {}
        self.options = {rid: ServeOptions(
            http_port=find_free_port(), grpc_port=find_free_port(), metrics_port=find_free_port(),
            max_model_len=1024, max_num_seqs=config.max_num_seqs, startup_timeout_s=600, replica_id=rid,
            engine_args={"max_waiting_requests": str(config.max_waiting_requests), **extra}, fleet_model="soak")
            for rid in ("r0", "r1")}
        self.adapter_path: Optional[Path] = None
        self.servers: dict[str, Any] = {}
        self.rss_start: dict[str, float] = {}  # MiB when each replica (re)started serving
        self.router: Any = None

    def start(self) -> None:
        from pagoda.fleet.gate.flow_control import FlowOptions
        from pagoda.fleet.service import BackgroundRouter, RouterOptions

        self.redis.start()
        for rid, options in self.options.items():
            options.redis_url = self.redis.url
        threads = [threading.Thread(target=self.start_replica, args=(rid,)) for rid in self.options]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        missing = [rid for rid in self.options if rid not in self.servers]
        if missing:
            raise RuntimeError(f"replicas {missing} did not start; logs in {self.config.log_dir}")
        keys = os.path.join(self.config.log_dir, "keys.txt")
        with open(keys, "w") as f:
            f.writelines(f"{key} {tenant}\n" for key, tenant in KEYS.items())
            if self.config.hostile:
                f.writelines(f"{line}\n" for line in soak_hostile.KEY_LINES)
                from pagoda.serving.launch.openai_door import model_dir_for

                adapter_dir = Path(self.config.log_dir) / "adapter"
                self.adapter_path = soak_hostile.write_adapter(adapter_dir, model_dir_for(None))
        spec = ";".join(f"id={rid},grpc={s.grpc_url},http={s.http_url}" for rid, s in self.servers.items())
        flow = FlowOptions(queue_size=self.config.queue_size_per_tenant) if self.config.queue_size_per_tenant else None
        self.router = BackgroundRouter(RouterOptions(
            replicas=spec, redis_url=self.redis.url, model_name="soak", host="127.0.0.1", http_port=0, grpc_port=0,
            health_interval_s=0.5, registry_interval_s=0.5, api_keys_file=keys,
            allow_runtime_lora=self.config.hostile, flow=flow)).__enter__()

    def start_replica(self, rid: str) -> None:
        from pagoda.serving.launch.launcher import TritonServer

        server = TritonServer(self.options[rid], log_path=os.path.join(self.config.log_dir, f"{rid}.log"))
        server.start()
        self.servers[rid] = server
        self.rss_start[rid] = _rss_mb(server.process.pid)

    def kill_replica(self, rid: str) -> None:
        server = self.servers.pop(rid)
        os.killpg(server.process.pid, signal.SIGKILL)  # the whole group: tritonserver and its stub
        server.stop()

    def endpoints(self) -> Endpoints:
        return Endpoints(self.router.http_url, self.router.grpc_url, next(iter(KEYS)), list(KEYS)[1])

    def stop(self) -> None:
        if self.router is not None:
            self.router.__exit__()
        for server in self.servers.values():
            server.stop()
        self.redis.stop()


def run_soak(config: SoakConfig, fleet: Optional[Fleet] = None) -> Report:
    """Run the soak; returns the report (see the module docstring)."""
    report = Report()
    own = fleet is None
    fleet = fleet or Fleet(config)
    try:
        if own:
            fleet.start()
        if config.burst:
            report.burst = run_burst(fleet, config.burst)
        start = time.monotonic()
        stop = threading.Event()
        injectors = [soak_faults.periodic_kills] if config.kill_every_s else []
        if config.faults and not config.hostile:  # the hostile phases lose Redis their own way
            injectors.append(soak_faults.timeline)
        faults = [threading.Thread(target=f, args=(fleet, config, start, report, stop), daemon=True) for f in injectors]
        for thread in faults:
            thread.start()
        if config.hostile:
            soak_hostile.run_phases(fleet, config, report, _traffic, _rss_mb)
        else:
            _traffic(fleet.endpoints(), config, start, report)
        stop.set()
        for thread in faults:
            thread.join()  # a restart in progress completes
        report.wall_s = time.monotonic() - start
        _check_replicas(fleet, fleet.rss_start, config, report)
        soak_faults.check_nothing_failed(config, report)
    finally:
        if own:
            fleet.stop()
    return _finish(report)


def _finish(report: Report) -> Report:
    unexpected = {k: v for k, v in report.outcomes.items() if k.startswith("unexpected")}
    if unexpected:
        report.violations.append(f"unexpected outcomes: {unexpected}")
    return report


def _traffic(endpoints: Endpoints, config: SoakConfig, start: float, report: Report) -> None:
    lock = threading.Lock()
    counter = iter(range(config.max_requests))

    def client(index: int) -> None:
        rng = random.Random(config.seed * 1000 + index)
        while time.monotonic() - start < config.duration_s:
            with lock:
                if next(counter, None) is None:
                    return
            outcome = run_action(endpoints, rng, config.max_tokens)
            with lock:
                report.outcomes[outcome] += 1

    threads = [threading.Thread(target=client, args=(i,)) for i in range(config.num_clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _check_replicas(fleet: Fleet, rss_start: dict[str, float], config: SoakConfig, report: Report) -> None:
    deadline = time.monotonic() + 60
    for rid, server in sorted(fleet.servers.items()):
        while time.monotonic() < deadline and (_metric(server, "vllm:num_requests_running")
                                               + _metric(server, "vllm:num_requests_waiting")) > 0:
            time.sleep(0.2)
        values = {"running": _metric(server, "vllm:num_requests_running"),
                  "waiting": _metric(server, "vllm:num_requests_waiting"),
                  "kv_cache_usage": _metric(server, "vllm:kv_cache_usage_perc"),
                  "rss_mb": round(_rss_mb(server.process.pid), 1)}
        if rid in rss_start and rss_start[rid] > 0:
            values["rss_drift_pct"] = round(100 * (values["rss_mb"] / rss_start[rid] - 1), 1)
            if values["rss_drift_pct"] > 100 * config.max_rss_drift:
                report.violations.append(f"replica {rid}: RSS grew {values['rss_drift_pct']}%")
        report.replicas[rid] = values
        if values["running"] or values["waiting"] or values["kv_cache_usage"]:
            report.violations.append(f"replica {rid} not back to baseline: {values}")


# Long enough that a burst's requests are all in flight at once (with 16 tokens, replicas on
# oneDNN-packed weights finished the first ones before the router had sent the last).
BURST_MAX_TOKENS = 64


def run_burst(fleet: Fleet, n: int) -> dict[str, dict[str, float]]:
    """N streaming requests at once, at replica r0 directly and through the router."""
    from concurrent.futures import ThreadPoolExecutor

    replica = fleet.servers["r0"]
    body = {"text_input": BURST_PROMPT, "max_tokens": BURST_MAX_TOKENS, "temperature": 0, "stream": True,
            "ignore_eos": True}
    chat = {"messages": [{"role": "user", "content": BURST_PROMPT}], "max_tokens": BURST_MAX_TOKENS, "temperature": 0,
            "stream": True, "ignore_eos": True}
    targets = {"replica": (f"http://{replica.http_url}/v2/models/pagoda/generate_stream", body, None),
               "router": (f"http://{fleet.router.http_url}/v1/chat/completions", chat, next(iter(KEYS)))}
    results = {}
    for where, (url, payload, key) in targets.items():
        with ThreadPoolExecutor(n) as pool:
            outcomes = list(pool.map(lambda _: stream_ttft(url, payload, key), range(n)))
        admitted = sorted(o[1] for o in outcomes if o[0] == 200)
        refused = sorted(o[1] for o in outcomes if o[0] != 200)
        pct = lambda xs, q: xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")  # noqa: E731
        results[where] = {"sent": n, "admitted": len(admitted), "refused": len(refused),
                          "refusal_p99_s": pct(refused, 0.99), "ttft_p50_s": pct(admitted, 0.5),
                          "ttft_p99_s": pct(admitted, 0.99),
                          "refused_with_retry_after": sum(1 for o in outcomes if o[0] != 200 and o[2])}
        time.sleep(2.0)  # let the admitted finish before the next target
    return results


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="pagoda bench soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=120.0, help="seconds of traffic (bounded by --max-requests)")
    p.add_argument("--max-requests", type=int, default=2000)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-waiting-requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=12)
    p.add_argument("--burst", type=int, default=200, help="the 10x-load check: requests at once (0: skip)")
    p.add_argument("--no-faults", action="store_true")
    p.add_argument("--hostile", action="store_true",
                   help="a quiet phase, then a hostile tenant's phase (grammar bombs, huge prompts and gRPC messages, "
                        "LoRA churn, Redis emptied); compares tenant A's TTFT p99 across them")
    p.add_argument("--hostile-clients", type=int, default=1)
    p.add_argument("--hostile-actions", default="",
                   help="comma-separated subset of grammar_bomb,big_prompt,grpc_oversized,lora_churn,tenant_lora_load "
                        "(default: all), e.g. to find which one a replica's RSS grows with")
    p.add_argument("--max-ttft-ratio", type=float, default=1.5)
    p.add_argument("--kill-replica-every", type=float, default=0.0, metavar="S",
                   help="SIGKILL a replica every S seconds (r0, r1, ...; each restarted): no request may fail")
    p.add_argument("--queue-size-per-tenant", type=int, default=0,
                   help="the router's flow control: tenant queues of this bound (0: off)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    config = SoakConfig(duration_s=args.duration, max_requests=args.max_requests, num_clients=args.clients,
                        max_num_seqs=args.max_num_seqs, max_waiting_requests=args.max_waiting_requests,
                        max_tokens=args.max_tokens, burst=args.burst, faults=not args.no_faults, seed=args.seed,
                        hostile=args.hostile, hostile_clients=args.hostile_clients,
                        hostile_actions=tuple(a for a in args.hostile_actions.split(",") if a),
                        max_ttft_ratio=args.max_ttft_ratio, kill_every_s=args.kill_replica_every,
                        queue_size_per_tenant=args.queue_size_per_tenant)
    print(f"pagoda bench soak: {json.dumps({k: v for k, v in vars(args).items()})}; logs in {config.log_dir}",
          flush=True)
    report = run_soak(config)
    print(report.format())
    return 1 if report.violations else 0
