"""``pagoda bench router-request``: what one long-prompt request costs through the router.

A real replica (tritonserver, the default model) and ``pagoda router`` in front of it, both
started from this interpreter's tree; each request carries a long text prompt (``--chars``,
200,000 by default) and asks for one token with ``truncate_prompt_tokens`` (so the replica's
work is the prompt's tokenization, not its prefill). Each prompt goes three ways: the OpenAI
door's ``/v1/completions`` through the router, Triton's gRPC stream through the router, and
the same gRPC request straight to the replica; the last two's difference is what the router
adds per request.
The replicas' ``pagoda:prompts_tokenized_total`` says which requests the replica tokenized
(a router that sends the token ids it made for routing spares the replica that work).

Only client-side APIs are used, so the same command measures any tree: run it with each
tree's interpreter (``/path/to/tree/.venv/bin/python -m pagoda.bench.router_request``) to
compare them; docs/benchmarks.md has both runs and the machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any, Iterator, Optional

from pagoda.bench.fleet_harness import http_ready, metric


def _words(rng: random.Random, chars: int) -> str:
    vocabulary = ("tea", "leaf", "water", "green", "black", "steep", "minute", "cup", "aroma", "garden", "spring",
                  "harvest", "oolong", "roast", "pot", "temperature", "mountain", "mist", "flavor", "sweet")
    text = []
    size = 0
    while size < chars:
        word = rng.choice(vocabulary)
        text.append(word)
        size += len(word) + 1
    return " ".join(text)[:chars]


@contextlib.contextmanager
def _fleet(log_dir: str) -> Iterator[tuple[Any, str, str]]:
    """One replica and a router in front of it: (replica, router HTTP address, router gRPC address)."""
    from pagoda.serving.launch.launcher import TritonServer, find_free_port
    from pagoda.serving.launch.serve_options import ServeOptions

    options = ServeOptions(http_port=find_free_port(), grpc_port=find_free_port(), metrics_port=find_free_port(),
                           max_model_len=2048, max_num_seqs=4, startup_timeout_s=600)
    replica = TritonServer(options, log_path=os.path.join(log_dir, "replica.log"))
    replica.start()
    http_port, grpc_port = find_free_port(), find_free_port()
    spec = f"id=r0,grpc={replica.grpc_url},http={replica.http_url}"
    router = subprocess.Popen([sys.executable, "-m", "pagoda.cli", "router", "--replicas", spec, "--policy",
                               "least_loaded", "--http-port", str(http_port), "--grpc-port", str(grpc_port)],
                              stdout=open(os.path.join(log_dir, "router.log"), "w"), stderr=subprocess.STDOUT)
    try:
        address = f"127.0.0.1:{http_port}"
        deadline = time.monotonic() + 120
        while not http_ready(address):
            if router.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the router did not become ready (log: {log_dir}/router.log)")
            time.sleep(0.2)
        yield replica, address, f"127.0.0.1:{grpc_port}"
    finally:
        router.terminate()
        router.wait(30)
        replica.stop()


def _openai(address: str, prompt: str) -> float:
    """Seconds for one ``/v1/completions`` request (one token) at ``address``."""
    body = json.dumps({"prompt": prompt, "max_tokens": 1, "temperature": 0, "truncate_prompt_tokens": 64}).encode()
    request = urllib.request.Request(f"http://{address}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=300) as response:
        json.loads(response.read())
    return time.perf_counter() - start


def _grpc(address: str, prompt: str) -> float:
    """Seconds for one Triton gRPC streaming request (one token) at ``address``."""
    import queue

    import numpy as np
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(address)
    done: queue.Queue = queue.Queue()
    inputs = []
    for name, value, dtype in (("text_input", [prompt.encode()], "BYTES"), ("stream", [True], "BOOL"),
                               ("sampling_parameters", [json.dumps({"max_tokens": 1, "temperature": 0,
                                                                    "truncate_prompt_tokens": 64}).encode()],
                                "BYTES")):
        tensor = grpcclient.InferInput(name, [1], dtype)
        tensor.set_data_from_numpy(np.array(value, dtype=np.object_ if dtype == "BYTES" else bool))
        inputs.append(tensor)
    client.start_stream(callback=lambda result, error: done.put(error), stream_timeout=300)
    start = time.perf_counter()
    client.async_stream_infer("pagoda", inputs, enable_empty_final_response=True)
    while True:
        error = done.get(timeout=300)
        if error is not None:
            raise RuntimeError(str(error))
        if done.empty():
            break
    elapsed = time.perf_counter() - start
    client.stop_stream()
    client.close()
    return elapsed


def _tokenized(replica: Any) -> float:
    return metric(replica, "pagoda:prompts_tokenized_total")


def run(chars: int, requests: int, seed: int = 0) -> dict[str, Any]:
    """Per path (OpenAI through the router, gRPC through the router, gRPC straight to the
    replica): the median and best seconds per request and the prompts the replica tokenized."""
    rng = random.Random(seed)
    results: dict[str, Any] = {"chars": chars, "requests": requests}
    with tempfile.TemporaryDirectory() as log_dir, _fleet(log_dir) as (replica, router_http, router_grpc):
        paths = {"openai_router": (_openai, router_http), "grpc_router": (_grpc, router_grpc),
                 "grpc_direct": (_grpc, replica.grpc_url)}
        _openai(router_http, "warm up " * 10)
        _grpc(replica.grpc_url, "warm up " * 10)
        times: dict[str, list[float]] = {path: [] for path in paths}
        tokenized = dict.fromkeys(paths, 0.0)
        for _ in range(requests):
            prompt = _words(rng, chars)
            for path, (send, address) in paths.items():
                before = _tokenized(replica)
                times[path].append(send(address, prompt))
                tokenized[path] += _tokenized(replica) - before
        for path, values in times.items():
            results[path] = {"median_s": statistics.median(values), "min_s": min(values),
                             "replica_tokenized": tokenized[path]}
        results["router_adds_s"] = results["grpc_router"]["median_s"] - results["grpc_direct"]["median_s"]
    return results


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="pagoda bench router-request", description=__doc__.split("\n\n")[0])
    parser.add_argument("--chars", type=int, default=200_000, help="prompt length in characters")
    parser.add_argument("--requests", type=int, default=5, help="requests per door and path")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    results = run(args.chars, args.requests)
    print(json.dumps(results, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
