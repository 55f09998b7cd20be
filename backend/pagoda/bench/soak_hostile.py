"""``pagoda bench soak --hostile``: one tenant's abuse mixed into normal traffic, and whether
another tenant feels it.

The run has two phases of ``duration_s / 2`` each on the same fleet:

1. **quiet**: the normal clients alone (tenant A; the soak's usual mix of streams,
   completions, gRPC, bad inputs and over-limit requests);
2. **hostile**: the same normal clients, plus ``hostile_clients`` clients of tenant H
   sending, at random: grammar bombs (a 40-field JSON schema of length-bounded strings,
   streamed, half of them abandoned as soon as the answer starts), a 3 MB prompt (past the
   router's character cap) and a 900k-character one (under the cap: tokenized by the
   router, then refused by the replica as longer than the context), an 8 MB gRPC message
   (past the receive limit), LoRA churn during guided traffic (the admin key loads an
   adapter, tenant H sends a guided request on it while the admin unloads it, then it
   is unloaded), and a LoRA load with a tenant key (403); and Redis emptied under the
   traffic (``FLUSHALL`` at 30% of the phase, killed and restarted empty at 70%).

Reported per tenant: TTFT p50/p99 of the normal chat streams in each phase, and the ratio of
tenant A's hostile-phase p99 to its quiet-phase p99 (a violation above ``max_ttft_ratio``,
1.5 by default), and each replica's RSS drift over the hostile phase alone (from warm, so
warm-up allocations do not count), beside the usual invariants (one terminal answer per
request, no unexpected 5xx, no leaked KV block, RSS drift from ready). Tenant H's outcomes must all be refusals
with a reason or successes; a 5xx or a lost gRPC request is unexpected.
"""

from __future__ import annotations

import json
import queue
import random
import threading
import time
import urllib.error
from pathlib import Path
from typing import Any, Callable

from pagoda.bench.soak_clients import Endpoints, _open, _post, _refusal

HOSTILE_KEY = "sk-soak-hostile"
ADMIN_KEY = "sk-soak-admin"
KEY_LINES = [f"{HOSTILE_KEY} tenant-h", f"{ADMIN_KEY} tenant-admin admin"]
ADAPTER = "churn"


def engine_args() -> dict[str, str]:
    """Replica settings the hostile mix needs (run-time LoRA)."""
    return {"enable_lora": "true", "allow_runtime_lora": "true", "max_lora_rank": "8"}


def write_adapter(folder: Path, model_dir: str) -> Path:
    """A random rank-4 adapter for the served model (the churned one)."""
    from pagoda.bench.lora import write_random_adapter
    from pagoda.models.registry import config_from_pretrained

    return write_random_adapter(folder, config_from_pretrained(model_dir), rank=4, seed=7)


def grammar_bomb_schema(fields: int = 40) -> dict[str, Any]:
    """The issue's bomb: many length-bounded string fields (costly to compile as a grammar)."""
    properties = {f"field_{i}": {"type": "string", "minLength": 3 + i % 7, "maxLength": 40 + 13 * i}
                  for i in range(fields)}
    return {"type": "object", "properties": properties, "required": sorted(properties)}


def _outcome(status: int, headers: Any, body: bytes) -> str:
    return "ok" if status == 200 else _refusal(status, headers, body)


def grammar_bomb(ep: Endpoints, rng: random.Random, max_tokens: int) -> str:
    body = {"messages": [{"role": "user", "content": "Fill the form."}], "max_tokens": max_tokens, "stream": True,
            "response_format": {"type": "json_schema", "json_schema": {"name": "bomb",
                                                                       "schema": grammar_bomb_schema()}}}
    try:
        response = _open(f"http://{ep.http}/v1/chat/completions", json.dumps(body).encode(), HOSTILE_KEY)
    except urllib.error.HTTPError as exc:
        return _refusal(exc.code, exc.headers, exc.read())
    with response:
        if rng.random() < 0.5:
            return "cancelled"  # abandoned: the connection closes as the answer starts
        response.read()
    return "ok"


def big_prompt(ep: Endpoints, rng: random.Random, max_tokens: int) -> str:
    size = rng.choice([3 * 2**20, 900_000])
    try:
        return _outcome(*_post("/v1/completions", {"prompt": "tea " * (size // 4), "max_tokens": 2}, ep, HOSTILE_KEY))
    except (ConnectionError, urllib.error.URLError, TimeoutError) as exc:  # which of the two, for the report
        return f"unexpected:connection {type(exc).__name__} ({size}-character prompt)"


def grpc_oversized(ep: Endpoints, rng: random.Random, max_tokens: int) -> str:
    import tritonclient.grpc as grpcclient

    from pagoda.serving.launch.client import make_inputs

    client = grpcclient.InferenceServerClient(ep.grpc)
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)),
                        headers={"authorization": f"Bearer {HOSTILE_KEY}"})
    try:
        client.async_stream_infer("pagoda", make_inputs("x" * (8 * 2**20), {"max_tokens": 2}))
        _, error = results.get(timeout=60)
    except queue.Empty:
        return "unexpected:grpc_oversized_no_answer"
    finally:
        client.stop_stream()
        client.close()
    text = str(error)
    if error is not None and ("RESOURCE_EXHAUSTED" in text or "larger than" in text or "limit" in text):
        return "refused:limit"
    return f"unexpected:grpc_oversized {text[:80]}"


def lora_churn(ep: Endpoints, rng: random.Random, max_tokens: int, adapter_path: str = "") -> str:
    """Load, a guided request on the adapter racing its unload, unload: every answer is a
    success or a refusal with a reason (an unload while in use is refused)."""
    outcomes = [_outcome(*_post("/v1/load_lora_adapter", {"lora_name": ADAPTER, "lora_path": adapter_path},
                                ep, ADMIN_KEY))]
    guided = {"model": ADAPTER, "messages": [{"role": "user", "content": "Yes or no?"}], "max_tokens": max_tokens,
              "guided_choice": ["yes", "no"]}
    racing: list[str] = []
    request = threading.Thread(target=lambda: racing.append(_outcome(*_post("/v1/chat/completions", guided, ep,
                                                                             HOSTILE_KEY))))
    request.start()
    time.sleep(rng.random() * 0.3)
    outcomes.append(_outcome(*_post("/v1/unload_lora_adapter", {"lora_name": ADAPTER}, ep, ADMIN_KEY)))
    request.join(180)
    outcomes += racing or ["unexpected:guided_lora_no_answer"]
    outcomes.append(_outcome(*_post("/v1/unload_lora_adapter", {"lora_name": ADAPTER}, ep, ADMIN_KEY)))
    bad = [o for o in outcomes if o.startswith("unexpected")]
    return bad[0] if bad else "ok"


def tenant_lora_load(ep: Endpoints, rng: random.Random, max_tokens: int, adapter_path: str = "") -> str:
    status, headers, body = _post("/v1/load_lora_adapter", {"lora_name": "mine", "lora_path": adapter_path}, ep,
                                  HOSTILE_KEY)
    return "refused:forbidden" if status == 403 else f"unexpected:tenant_lora_load_{status}"


def actions(adapter_path: str) -> list[tuple[str, Callable[..., str], int]]:
    """(name, action, weight) of the hostile tenant's mix."""
    churn = lambda ep, rng, m: lora_churn(ep, rng, m, adapter_path)  # noqa: E731
    tenant_load = lambda ep, rng, m: tenant_lora_load(ep, rng, m, adapter_path)  # noqa: E731
    return [("grammar_bomb", grammar_bomb, 3), ("big_prompt", big_prompt, 2), ("grpc_oversized", grpc_oversized, 1),
            ("lora_churn", churn, 2), ("tenant_lora_load", tenant_load, 1)]


def redis_losses(fleet: Any, phase_s: float, start: float, stop: threading.Event, faults: list[str]) -> None:
    """FLUSHALL at 30% of the hostile phase, a kill and empty restart at 70%."""
    stop.wait(max(0.0, start + 0.3 * phase_s - time.monotonic()))
    import redis

    redis.Redis.from_url(fleet.redis.url).flushall()
    faults.append("Redis FLUSHALL (hostile phase)")
    stop.wait(max(0.0, start + 0.7 * phase_s - time.monotonic()))
    fleet.redis.stop()
    time.sleep(1.0)
    fleet.redis.start()
    faults.append("Redis killed and restarted empty (hostile phase)")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def run_phases(fleet: Any, config: Any, report: Any, traffic: Callable[..., None],
               rss_mb: Callable[[int], float]) -> None:
    """The quiet phase, then the hostile one (module docstring); fills ``report``.

    ``traffic(endpoints, config, start, report)`` is the soak's normal closed-loop traffic;
    ``rss_mb(pid)`` a replica's resident memory (tritonserver and its stub)."""
    from collections import Counter
    from dataclasses import replace

    phase_s = config.duration_s / 2
    phase = replace(config, duration_s=phase_s, max_requests=config.max_requests // 2)
    ttft: dict[str, list[float]] = {}
    for name in ("quiet", "hostile"):
        ttft[name] = []
        endpoints = replace(fleet.endpoints(), ttft=ttft[name])
        start = time.monotonic()
        stop = threading.Event()
        threads = []
        if name == "hostile":
            report.hostile = Counter()
            threads = [threading.Thread(target=_hostile_client, args=(endpoints, config, i, start, phase_s, report,
                                                                      str(fleet.adapter_path)))
                       for i in range(config.hostile_clients)]
            threads.append(threading.Thread(target=redis_losses, args=(fleet, phase_s, start, stop, report.faults)))
        if name == "hostile":  # RSS once warm: the hostile phase's own drift is reported too
            rss_warm = {rid: rss_mb(server.process.pid) for rid, server in fleet.servers.items()}
        for thread in threads:
            thread.start()
        traffic(endpoints, phase, start, report)
        stop.set()
        for thread in threads:
            thread.join()
    for rid, server in fleet.servers.items():
        if rss_warm.get(rid):
            drift = 100 * (rss_mb(server.process.pid) / rss_warm[rid] - 1)
            report.tenants[f"replica {rid} hostile phase"] = {"rss_drift_pct": round(drift, 1)}
    for name, values in ttft.items():
        report.tenants[f"tenant-a {name}"] = {"streams": len(values), "ttft_p50_s": percentile(values, 0.5),
                                              "ttft_p99_s": percentile(values, 0.99)}
    quiet, hostile = (report.tenants[f"tenant-a {n}"]["ttft_p99_s"] for n in ("quiet", "hostile"))
    ratio = hostile / quiet if quiet > 0 else float("nan")
    report.tenants["tenant-a hostile/quiet"] = {"ttft_p99_ratio": ratio}
    if not ratio <= config.max_ttft_ratio:
        report.violations.append(f"tenant A's TTFT p99 grew {ratio:.2f}x with the hostile tenant "
                                 f"(at most {config.max_ttft_ratio}x)")
    unexpected = {k: v for k, v in report.hostile.items() if " unexpected" in k}
    if unexpected:
        report.violations.append(f"unexpected hostile outcomes: {unexpected}")


def _hostile_client(endpoints: Endpoints, config: Any, index: int, start: float, phase_s: float, report: Any,
                    adapter_path: str) -> None:
    rng = random.Random(config.seed * 7919 + index)
    mix = [a for a in actions(adapter_path) if not config.hostile_actions or a[0] in config.hostile_actions]
    while time.monotonic() - start < phase_s:
        name, action, _ = rng.choices(mix, weights=[w for _, _, w in mix])[0]
        try:
            outcome = action(endpoints, rng, config.max_tokens)
        except (ConnectionError, urllib.error.URLError, TimeoutError) as exc:
            outcome = f"unexpected:connection {type(exc).__name__}"
        report.hostile[f"{name} {outcome}"] += 1
