"""The soak's clients: one function per kind of request, each returning its outcome.

An outcome is one of ``ok``, ``cancelled``, ``refused:<reason>`` (invalid, limit,
unauthenticated, rate, overloaded), ``failed:<reason>`` (a replica killed under the
request) or ``unexpected:<what>`` (an invariant breach: a 5xx other than a replica
failure, a refusal without its reason or ``Retry-After``, a stream with no terminal
answer or two). See ``pagoda.bench.soak`` for the invariants.
"""

from __future__ import annotations

import json
import queue
import random
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any, Callable, Optional

BURST_PROMPT = "Write a short poem about green tea."
_PROMPTS = ("Tell me about green tea.", "What is oolong?", "How long should black tea steep?",
            "Name three tea gardens.", "Why does water temperature matter for tea?")


@dataclass
class Endpoints:
    http: str
    grpc: str
    key: str
    other_key: str
    ttft: Optional[list] = None  # chat streams append their time to the first content here


def _open(url: str, data: bytes, key: Optional[str], timeout: float = 180) -> Any:
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    return urllib.request.urlopen(urllib.request.Request(url, data=data, headers=headers), timeout=timeout)


def _refusal(status: int, headers: Any, body: bytes) -> str:
    """The outcome of a non-200 answer."""
    text = body.decode("utf-8", "replace")
    if status == 429 or (status == 503 and "overloaded:" in text):
        if not headers.get("Retry-After"):
            return "unexpected:refusal_without_retry_after"
        return "refused:rate" if "rate limited" in text else "refused:overloaded"
    if status == 401:
        return "refused:unauthenticated"
    if status == 413 or "server's limit" in text:
        return "refused:limit"
    if status in (400, 404):
        return "refused:invalid"
    if status == 502 or (status == 503 and "no replica" in text):
        return "failed:replica"
    return f"unexpected:http_{status}"


def _post(path: str, body: Any, ep: Endpoints, key: Optional[str] = "default") -> tuple[int, Any, bytes]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    try:
        with _open(f"http://{ep.http}{path}", data, ep.key if key == "default" else key) as response:
            return response.status, response.headers, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers, exc.read()


def _sse_terminal(lines: list[str]) -> str:
    """Outcome of a complete OpenAI SSE answer: exactly one finish or one error, then [DONE]."""
    finishes = errors = 0
    message = ""
    for line in lines:
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[6:])
        if "error" in event:
            errors += 1
            message = str(event["error"].get("message", ""))
        finishes += sum(1 for c in event.get("choices", []) if c.get("finish_reason"))
    if not lines or lines[-1] != "data: [DONE]":
        return "unexpected:stream_without_done"
    if finishes == 1 and errors == 0:
        return "ok"
    if errors == 1 and finishes == 0:
        return "failed:replica" if "failed while streaming" in message else "unexpected:stream_error"
    return f"unexpected:stream_terminals_{finishes}_finish_{errors}_error"


def chat_stream(ep: Endpoints, rng: random.Random, max_tokens: int, cancel: bool = False) -> str:
    body = {"messages": [{"role": "user", "content": rng.choice(_PROMPTS)}], "max_tokens": max_tokens,
            "stream": True, "temperature": 0.7, "seed": rng.randrange(1000)}
    start = time.perf_counter()
    try:
        response = _open(f"http://{ep.http}/v1/chat/completions", json.dumps(body).encode(), ep.key)
    except urllib.error.HTTPError as exc:
        return _refusal(exc.code, exc.headers, exc.read())
    stop_after = rng.randrange(1, max_tokens + 2) if cancel else None
    lines: list[str] = []
    with response:
        for raw in response:
            line = raw.decode().strip()
            if line:
                lines.append(line)
                if ep.ttft is not None and start and '"content":' in line and '"content": ""' not in line:
                    ep.ttft.append(time.perf_counter() - start)
                    start = 0.0
            if stop_after is not None and len(lines) >= stop_after and lines[-1] != "data: [DONE]":
                return "cancelled"  # closing the connection is the cancel
    return _sse_terminal(lines)


def completion(ep: Endpoints, rng: random.Random, max_tokens: int) -> str:
    status, headers, body = _post("/v1/completions", {"prompt": rng.choice(_PROMPTS), "max_tokens": max_tokens}, ep)
    if status != 200:
        return _refusal(status, headers, body)
    choices = json.loads(body)["choices"]
    return "ok" if len(choices) == 1 and choices[0]["finish_reason"] else "unexpected:completion_without_finish"


def triton_http(ep: Endpoints, rng: random.Random, max_tokens: int) -> str:
    status, headers, body = _post("/v2/models/pagoda/generate", {"text_input": rng.choice(_PROMPTS),
                                                                 "max_tokens": max_tokens}, ep)
    if status != 200:
        return _refusal(status, headers, body)
    return "ok" if "text_output" in json.loads(body) else "unexpected:generate_without_text"


def grpc_stream(ep: Endpoints, rng: random.Random, max_tokens: int) -> str:
    import tritonclient.grpc as grpcclient

    from pagoda.serving.launch.client import make_inputs

    client = grpcclient.InferenceServerClient(ep.grpc)
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)),
                        headers={"authorization": f"Bearer {ep.key}"})
    try:
        client.async_stream_infer("pagoda", make_inputs(rng.choice(_PROMPTS), {"max_tokens": max_tokens}))
        result, error = results.get(timeout=180)
        while error is None and not result.get_response().parameters["triton_final_response"].bool_param:
            result, error = results.get(timeout=180)
    finally:
        client.stop_stream()
        client.close()
    if error is None:
        return "ok"
    text = str(error)
    if "overloaded:" in text:
        return "refused:overloaded"
    if "rate limited" in text:
        return "refused:rate"
    return "failed:replica" if "failed" in text and "replica" in text else f"unexpected:grpc_error {text[:80]}"


_BAD = [
    ("/v1/chat/completions", b"{not json", "default"),
    ("/v2/models/pagoda/generate", b"[1, 2]", "default"),
    ("/v2/models/pagoda/generate", {"text_input": 5}, "default"),
    ("/v2/models/pagoda/generate", {"text_input": "hi", "stream": "yes"}, "default"),
    ("/v2/models/pagoda/generate", {"text_input": "hi", "frobnicate": 1}, "default"),
    ("/v2/models/pagoda/generate", {"text_input": "hi", "temperature": "x"}, "default"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "default"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [10**9]}, "default"),
    ("/v1/completions", {"prompt": "hi"}, "sk-not-a-key"),
]
_OVER = [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10**6}),
    ("/v1/completions", {"prompt": "hi", "n": 100}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * (5 * 2**20)}]}),
]


def bad_input(ep: Endpoints, rng: random.Random, max_tokens: int) -> str:
    path, body, key = rng.choice(_BAD)
    status, headers, answer = _post(path, body, ep, key)
    outcome = _refusal(status, headers, answer) if status != 200 else "unexpected:bad_input_accepted"
    return outcome if outcome in ("refused:invalid", "refused:unauthenticated") else f"unexpected:bad_{outcome}"


def over_limit(ep: Endpoints, rng: random.Random, max_tokens: int) -> str:
    path, body = rng.choice(_OVER)
    status, headers, answer = _post(path, body, ep)
    outcome = _refusal(status, headers, answer) if status != 200 else "unexpected:over_limit_accepted"
    return outcome if outcome == "refused:limit" else f"unexpected:over_{outcome}"


ACTIONS: list[tuple[Callable[..., str], int]] = [
    (chat_stream, 3), (lambda ep, rng, m: chat_stream(ep, rng, m, cancel=True), 2), (completion, 2),
    (grpc_stream, 2), (triton_http, 1), (bad_input, 1), (over_limit, 1)]


def run_action(ep: Endpoints, rng: random.Random, max_tokens: int) -> str:
    """One request of a random kind; its outcome (connection errors are failures)."""
    action = rng.choices([a for a, _ in ACTIONS], weights=[w for _, w in ACTIONS])[0]
    try:
        return action(ep, rng, max_tokens)
    except (ConnectionError, urllib.error.URLError, TimeoutError) as exc:
        return f"unexpected:connection {type(exc).__name__}"


def stream_ttft(url: str, body: dict, key: Optional[str]) -> tuple[int, float, bool]:
    """(status, seconds to the first event or to the refusal, refusal had Retry-After)."""
    start = time.perf_counter()
    try:
        with _open(url, json.dumps(body).encode(), key, timeout=600) as response:
            response.readline()
            first = time.perf_counter() - start
            response.read()
            return response.status, first, False
    except urllib.error.HTTPError as exc:
        exc.read()
        return exc.code, time.perf_counter() - start, bool(exc.headers.get("Retry-After"))
