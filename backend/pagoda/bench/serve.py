"""``pagoda bench serve``: streaming clients against a running pagoda server.

Drives the server over gRPC (``tritonclient.grpc.aio``, one stream per request) with
``--concurrency`` clients that together work through the fixed seeded workload of
``pagoda bench offline`` (``bench/workload.py``: prompts of 16–256 tokens, outputs of
8–256, greedy, ``ignore_eos``). Each client sends its next request as soon as the previous
one finished (closed loop), so at most ``--concurrency`` requests are in flight.

Measured per request, on the client's clock:
- TTFT: from sending to the first response that carries text;
- ITL: the gaps between consecutive streamed responses (one token each, normally);
- TPOT: (last response - first response) / (output tokens - 1), its mean ITL.

Reported: TTFT p50/p90/p99, ITL p50/p99, output tokens/s (all output tokens over the wall
time from the first send to the last response), request throughput, and goodput: the
share (and rate) of requests whose TTFT <= ``--ttft-slo-ms`` and TPOT <= ``--itl-slo-ms``
(the per-request form of an ITL objective, as vLLM's benchmark defines goodput).

Prompts go as text (the server's ``text_input``): the workload's token ids decoded with
the model's tokenizer; the server reports how many tokens it actually saw.

The load the ecosystem's generators make: ``--random-input-len/--random-output-len/
--random-range-ratio`` (``vllm bench serve --dataset-name random``'s names and uniform
lengths) or ``--synthetic-input-tokens-mean/-stddev`` with ``--output-tokens-mean/-stddev``
(AIPerf's and genai-perf's names, normal lengths); ``--tokenizer`` names the tokenizer
folder as theirs does. ``--endpoint-type openai`` drives an OpenAI door instead
(``--url http://HOST:9000``: streaming ``/v1/completions`` with ``ignore_eos``, usage from
the final chunk), the endpoint those tools measure, so their numbers and these compare.

``--plot FILE`` draws the run's TTFT and end-to-end latency CDFs (``bench.plots.ttft_cdf``).

``--launch`` starts a server with ``pagoda serve``'s launcher on free ports first (and
stops it after), so one command produces the numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import platform
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from pagoda.bench.workload import make_random_workload, make_workload, prompt_text


@dataclass
class RequestResult:
    max_tokens: int
    num_input_tokens: int = 0
    num_output_tokens: int = 0
    ttft_s: Optional[float] = None
    itl_s: list[float] = field(default_factory=list)
    e2e_s: Optional[float] = None
    error: Optional[str] = None

    @property
    def tpot_s(self) -> Optional[float]:
        if self.num_output_tokens < 2 or self.ttft_s is None or self.e2e_s is None:
            return None
        return (self.e2e_s - self.ttft_s) / (self.num_output_tokens - 1)


async def run_one(client: Any, prompt: str, max_tokens: int) -> RequestResult:
    from pagoda.serving.launch.client import stream_generate

    result = RequestResult(max_tokens=max_tokens)
    start = last = time.perf_counter()
    try:
        async for out in stream_generate(client, prompt, {"temperature": 0, "max_tokens": max_tokens,
                                                          "ignore_eos": True},
                                         return_num_input_tokens=True, return_num_output_tokens=True):
            now = time.perf_counter()
            num_new = out.get("num_output_tokens", 0)
            if num_new == 0:
                continue
            if result.ttft_s is None:
                result.ttft_s = now - start
            else:
                result.itl_s.append(now - last)
            last = now
            result.num_output_tokens += num_new
            result.num_input_tokens = out.get("num_input_tokens", result.num_input_tokens)
        result.e2e_s = last - start
    except Exception as exc:  # noqa: BLE001 - a failed request is counted, not fatal
        result.error = str(exc)
    return result


async def run_one_openai(session: Any, url: str, model: str, prompt: str, max_tokens: int) -> RequestResult:
    """One streaming ``/v1/completions`` request (SSE); token counts from the usage chunk."""
    result = RequestResult(max_tokens=max_tokens)
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    start = last = time.perf_counter()
    try:
        async with session.post(f"{url}/v1/completions", json=body) as response:
            if response.status != 200:
                raise RuntimeError(f"HTTP {response.status}: {(await response.text())[:200]}")
            async for raw in response.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    result.num_input_tokens = chunk["usage"]["prompt_tokens"]
                    result.num_output_tokens = chunk["usage"]["completion_tokens"]
                if not any(choice.get("text") for choice in chunk.get("choices", ())):
                    continue
                now = time.perf_counter()
                if result.ttft_s is None:
                    result.ttft_s = now - start
                else:
                    result.itl_s.append(now - last)
                last = now
        result.e2e_s = last - start
    except Exception as exc:  # noqa: BLE001 - a failed request is counted, not fatal
        result.error = str(exc)
    return result


async def run_workload(url: str, prompts: list[tuple[str, int]], concurrency: int,
                       endpoint_type: str = "grpc") -> tuple[list[RequestResult], float]:
    """Run ``prompts`` with ``concurrency`` closed-loop clients; returns results and wall seconds.

    ``endpoint_type``: ``grpc`` (Triton's ``generate_stream`` over gRPC, ``url`` = host:port)
    or ``openai`` (``url`` = http://host:port of an OpenAI door)."""
    if endpoint_type == "openai":
        import aiohttp

        client = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
    else:
        from tritonclient.grpc import aio

        client = aio.InferenceServerClient(url)
    try:
        if endpoint_type == "openai":
            url = url.rstrip("/")
            async with client.get(f"{url}/v1/models") as response:  # the served name, as AIPerf's --model
                model = (await response.json())["data"][0]["id"]
            one = functools.partial(run_one_openai, client, url, model)
        else:
            one = functools.partial(run_one, client)
        await one(prompts[0][0][:64] or "Hi", 2)  # warm-up, not measured
        queue: asyncio.Queue = asyncio.Queue()
        for index, item in enumerate(prompts):
            queue.put_nowait((index, item))
        results: list[Optional[RequestResult]] = [None] * len(prompts)

        async def worker() -> None:
            while True:
                try:
                    index, (prompt, max_tokens) = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                results[index] = await one(prompt, max_tokens)

        start = time.perf_counter()
        await asyncio.gather(*[worker() for _ in range(concurrency)])
        elapsed = time.perf_counter() - start
    finally:
        await client.close()
    return [r for r in results if r is not None], elapsed


def summarize(results: list[RequestResult], elapsed_s: float, ttft_slo_s: float, itl_slo_s: float) -> dict:
    """Latency percentiles, throughput and goodput from per-request results."""
    ok = [r for r in results if r.error is None and r.ttft_s is not None]
    ttft = np.array([r.ttft_s for r in ok]) if ok else np.zeros(1)
    itl = np.array([g for r in ok for g in r.itl_s]) if any(r.itl_s for r in ok) else np.zeros(1)
    good = [r for r in ok if r.ttft_s <= ttft_slo_s and (r.tpot_s is None or r.tpot_s <= itl_slo_s)]
    num_output = sum(r.num_output_tokens for r in ok)

    def ms(values, q):
        return float(np.percentile(values, q) * 1000)

    return {
        "num_requests": len(results),
        "num_failed": len(results) - len(ok),
        "num_output_tokens_short": sum(r.max_tokens - r.num_output_tokens for r in ok),
        "elapsed_s": elapsed_s,
        "num_input_tokens": sum(r.num_input_tokens for r in ok),
        "num_output_tokens": num_output,
        "output_tokens_per_s": num_output / elapsed_s,
        "requests_per_s": len(ok) / elapsed_s,
        "ttft_ms": {"p50": ms(ttft, 50), "p90": ms(ttft, 90), "p99": ms(ttft, 99)},
        "itl_ms": {"p50": ms(itl, 50), "p99": ms(itl, 99)},
        "slo": {"ttft_ms": ttft_slo_s * 1000, "itl_ms": itl_slo_s * 1000},
        "goodput_fraction": len(good) / len(results) if results else 0.0,
        "goodput_requests_per_s": len(good) / elapsed_s,
        "errors": sorted({r.error for r in results if r.error})[:5],
    }


def format_report(summary: dict, args: argparse.Namespace) -> str:
    s = summary
    return "\n".join([
        f"pagoda bench serve: {s['num_requests']} requests (seed {args.seed}), concurrency {args.concurrency}, "
        f"{s['num_failed']} failed",
        f"  tokens      in {s['num_input_tokens']}, out {s['num_output_tokens']}, wall {s['elapsed_s']:.1f} s",
        f"  throughput  {s['output_tokens_per_s']:.1f} output tok/s, {s['requests_per_s']:.2f} req/s",
        f"  TTFT ms     p50 {s['ttft_ms']['p50']:.0f}  p90 {s['ttft_ms']['p90']:.0f}  p99 {s['ttft_ms']['p99']:.0f}",
        f"  ITL ms      p50 {s['itl_ms']['p50']:.1f}  p99 {s['itl_ms']['p99']:.1f}",
        f"  goodput     {100 * s['goodput_fraction']:.0f}% of requests "
        f"({s['goodput_requests_per_s']:.2f} req/s) meet TTFT <= {s['slo']['ttft_ms']:.0f} ms "
        f"and TPOT <= {s['slo']['itl_ms']:.0f} ms",
    ])


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pagoda bench serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default=None,
                   help="the server: gRPC host:port (default 127.0.0.1:8001) or, with --endpoint-type openai, "
                        "http://host:port (default http://127.0.0.1:9000)")
    p.add_argument("--endpoint-type", choices=("grpc", "openai"), default="grpc",
                   help="grpc: Triton generate_stream; openai: streaming /v1/completions")
    p.add_argument("--launch", action="store_true", help="start a server (pagoda serve) on free ports first")
    p.add_argument("--model", "--tokenizer", dest="model",
                   help="tokenizer folder for rendering prompts (default: the default model)")
    lengths = p.add_argument_group("synthetic lengths (default: the fixed mixed workload of bench offline)")
    lengths.add_argument("--random-input-len", type=int, help="vllm bench serve's: mean prompt tokens")
    lengths.add_argument("--random-output-len", type=int, help="vllm bench serve's: mean output tokens")
    lengths.add_argument("--random-range-ratio", type=float, default=0.0,
                         help="vllm bench serve's: lengths uniform in [len*(1-r), len*(1+r)]")
    lengths.add_argument("--synthetic-input-tokens-mean", "--prompt-input-tokens-mean", "--isl",
                         dest="synthetic_input_tokens_mean", type=int, help="AIPerf's / genai-perf's")
    lengths.add_argument("--synthetic-input-tokens-stddev", "--prompt-input-tokens-stddev",
                         dest="synthetic_input_tokens_stddev", type=float, default=0.0)
    lengths.add_argument("--output-tokens-mean", "--prompt-output-tokens-mean", "--osl", dest="output_tokens_mean",
                         type=int, help="AIPerf's / genai-perf's")
    lengths.add_argument("--output-tokens-stddev", "--prompt-output-tokens-stddev", "--osl-stddev",
                         dest="output_tokens_stddev", type=float, default=0.0)
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-output-tokens", type=int, default=None,
                   help="cap every request's output length (quick runs); default: the workload's")
    p.add_argument("--ttft-slo-ms", type=float, default=2000.0)
    p.add_argument("--itl-slo-ms", type=float, default=250.0)
    p.add_argument("--max-num-seqs", type=int, help="with --launch: the engine's max_num_seqs")
    p.add_argument("--json", help="also write the summary as JSON to this path")
    p.add_argument("--plot", help="also draw the TTFT and end-to-end latency CDFs into this PNG")
    return p


def workload_from_args(args: argparse.Namespace) -> list:
    """The fixed workload, or synthetic lengths in vLLM's or AIPerf's terms (never both)."""
    vllm_style = args.random_input_len is not None or args.random_output_len is not None
    aiperf_style = args.synthetic_input_tokens_mean is not None or args.output_tokens_mean is not None
    if vllm_style and aiperf_style:
        raise SystemExit("pagoda bench serve: --random-* (vllm bench serve) and --synthetic-input-tokens-*/"
                         "--output-tokens-* (AIPerf) describe the same lengths: give one set")
    if vllm_style:
        return make_random_workload(args.num_requests, args.seed, args.random_input_len or 1024,
                                    args.random_output_len or 128, args.random_range_ratio)
    if aiperf_style:
        return make_random_workload(args.num_requests, args.seed, args.synthetic_input_tokens_mean or 550,
                                    args.output_tokens_mean or 128, input_stddev=args.synthetic_input_tokens_stddev,
                                    output_stddev=args.output_tokens_stddev)
    return make_workload(args.num_requests, args.seed)


def main(argv: Optional[list[str]] = None) -> int:
    args = make_parser().parse_args(argv)
    from pagoda.models.gguf_import import ensure_default_model
    from pagoda.models.tokenizer import Tokenizer

    model = args.model or str(ensure_default_model())
    tokenizer = Tokenizer.from_pretrained(model)
    items = workload_from_args(args)
    prompts = [(prompt_text(item, tokenizer), min(item.max_tokens, args.max_output_tokens or item.max_tokens))
               for item in items]
    server = door = None
    if args.launch:
        from pagoda.serving.launch.launcher import TritonServer, find_free_port
        from pagoda.serving.launch.serve_options import ServeOptions

        server = TritonServer(ServeOptions(model=args.model, http_port=find_free_port(), grpc_port=find_free_port(),
                                           metrics_port=find_free_port(), max_num_seqs=args.max_num_seqs),
                              log_path=os.path.join(tempfile.gettempdir(), "pagoda-bench-serve.log"))
        print(f"starting tritonserver (log: {server.log_path}) ...", file=sys.stderr, flush=True)
        server.start()
        args.url = server.grpc_url
        if args.endpoint_type == "openai":  # pagoda serve's door, over the launched replica
            from pagoda.serving.launch.openai_door import OpenAIDoor, model_dir_for

            door = OpenAIDoor(find_free_port(), model_dir_for(args.model), server.grpc_url, server.http_url,
                              f"{server.options.host}:{server.options.metrics_port}").start()
            args.url = f"http://127.0.0.1:{door.port}"
    args.url = args.url or ("http://127.0.0.1:9000" if args.endpoint_type == "openai" else "127.0.0.1:8001")
    try:
        results, elapsed = asyncio.run(run_workload(args.url, prompts, args.concurrency, args.endpoint_type))
    finally:
        if door is not None:
            door.stop()
        if server is not None:
            server.stop()
    summary = summarize(results, elapsed, args.ttft_slo_ms / 1000, args.itl_slo_ms / 1000)
    summary["config"] = {"url": args.url, "endpoint_type": args.endpoint_type, "concurrency": args.concurrency,
                         "seed": args.seed,
                         "num_requests": args.num_requests, "max_output_tokens": args.max_output_tokens,
                         "machine": f"{platform.machine()} {platform.processor() or ''}".strip()}
    print(format_report(summary, args))
    if args.plot:
        _plot(results, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    return 0 if summary["num_failed"] == 0 else 1


def _plot(results: list[RequestResult], args: argparse.Namespace) -> None:
    """``--plot``: the latency CDFs of this run (``bench.plots.ttft_cdf``)."""
    from pagoda.bench import plots

    problem = plots.missing_matplotlib()
    if problem:
        print(problem)  # the report above stands; only the picture needs matplotlib
        return
    done = [r for r in results if r.error is None]
    plots.ttft_cdf({"TTFT": [r.ttft_s for r in done if r.ttft_s is not None],
                    "end-to-end": [r.e2e_s for r in done if r.e2e_s is not None]}, args.plot,
                   f"pagoda bench serve: {len(done)} requests, concurrency {args.concurrency}, "
                   f"{args.endpoint_type} at {args.url}")
    print(f"wrote {args.plot}")


if __name__ == "__main__":
    sys.exit(main())
