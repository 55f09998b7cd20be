"""``pagoda bench kv-transfer``: moving a prefix's KV between replicas vs recomputing it.

Two processes on this machine, each with its own engine on the same model (default
SmolLM2-135M-Instruct): the sender (this process) and a receiver (a spawned child,
listening on loopback, polling its connector every millisecond as a serving loop
would). For each of ``--repeats`` fresh random prompts of ``--prefix-tokens`` tokens:

* recompute: the sender prefills the prompt (one request, ``max_tokens=1``): its TTFT is
  what a replica pays to compute the prefix itself;
* transfer of the prompt's full blocks until they are in the receiver's prefix cache, over
  the ``--backend`` connector (``tcp``, default, or ``nixl``: the same control connection,
  the bytes read over NIXL/UCX; ``engine.kv_transfer.registry``):
  ``--mode pull`` (default): the receiver calls ``pull`` and waits for its ``receive``
  result while the sender's loop polls; ``--mode push``: the sender calls ``send`` and
  waits for DONE. Per-request latency and MB/s of KV payload;
* pulled TTFT: the receiver then serves the same prompt (``max_tokens=1``): its TTFT with
  the prefix cached, and its first token, which must equal the sender's.

Prints a markdown table (medians over repeats, every run listed) and the machine. CPU
numbers are noisy on a shared machine: each process uses ``--threads`` torch threads.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import random
import statistics
import time

from pagoda.engine.kv_transfer.registry import KV_CONNECTOR_BACKENDS


def _ttft(engine, request_id: str, prompt: list[int]) -> tuple[float, int, list[int]]:
    from pagoda.engine.sampling_params import SamplingParams
    start = time.perf_counter()
    engine.add_request(request_id, prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final = out
    return time.perf_counter() - start, final.num_cached_tokens, list(final.outputs[0].token_ids)


def _make_engine(model, threads: int):
    import torch
    from pagoda.engine.config import EngineConfig
    from pagoda.engine.llm_engine import LLMEngine
    torch.set_num_threads(threads)
    return LLMEngine(EngineConfig(model=model, kv_cache_memory_bytes=1 << 30))


def _receiver(conn, model, threads: int, backend: str) -> None:
    from pagoda.engine.kv_transfer.registry import make_kv_connector
    engine = _make_engine(model, threads)
    connector = make_kv_connector(backend, engine, listen="127.0.0.1:0")
    conn.send(connector.address)
    try:
        while True:
            connector.poll()
            if conn.poll(0.001):
                command = conn.recv()
                if command is None:
                    return
                request_id, prompt, pull_from = command
                pulled = _pull(connector, pull_from, prompt, engine) if pull_from else (0.0, 0)
                memory = getattr(connector, "memory", None)  # the nixl connector's: bytes READ over NIXL
                conn.send((*pulled, *_ttft(engine, request_id, prompt), memory.num_bytes_read if memory else 0))
    finally:
        connector.close()


def _pull(connector, peer: str, prompt: list[int], engine) -> tuple[float, int]:
    from pagoda.contracts.block_hash import hash_prompt_blocks
    start = time.perf_counter()
    transfer_id = connector.pull(peer, hash_prompt_blocks(prompt, engine.config.block_size, engine.model_id))
    return _finish(connector, transfer_id, start)


def _finish(connector, transfer_id: str, start: float) -> tuple[float, int]:
    while True:
        for result in connector.poll():
            if result.transfer_id == transfer_id:
                if not result.ok:
                    raise RuntimeError(f"transfer failed: {result.error}")
                return time.perf_counter() - start, result.num_bytes
        time.sleep(0.0005)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="pagoda bench kv-transfer", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="model folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--prefix-tokens", type=int, default=1536, help="prompt length in tokens")
    parser.add_argument("--repeats", type=int, default=3, help="fresh prompts, each measured once")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--mode", choices=("pull", "push"), default="pull",
                        help="pull: the receiver asks for the blocks; push: the sender sends them")
    parser.add_argument("--backend", choices=tuple(KV_CONNECTOR_BACKENDS), default="tcp",
                        help="the KV connector on both sides (nixl needs the nixl package)")
    args = parser.parse_args(argv)
    if args.prefix_tokens < 16 or args.repeats < 1:
        parser.error("--prefix-tokens must be >= 16 and --repeats >= 1")
    from pagoda.contracts.block_hash import hash_prompt_blocks
    from pagoda.engine.kv_transfer.registry import make_kv_connector
    from pagoda.models.gguf_import import ensure_default_model

    model = str(args.model or ensure_default_model())
    parent, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=_receiver, args=(child, model, args.threads, args.backend),
                                           daemon=True)
    proc.start()
    try:
        engine = _make_engine(model, args.threads)
        connector = make_kv_connector(args.backend, engine, listen="127.0.0.1:0")
        peer = parent.recv()
        rows = _measure(engine, connector, parent, peer, args, hash_prompt_blocks)
        connector.close()
    finally:
        parent.send(None)
        proc.join(timeout=30)
    _report(rows, args, engine)
    return 0


def _measure(engine, connector, pipe, peer, args, hash_prompt_blocks) -> list[dict]:
    rng = random.Random(0)
    _ttft(engine, "warm-up", [rng.randrange(1000, 30000) for _ in range(64)])
    pipe.send(("warm-up", [rng.randrange(1000, 30000) for _ in range(64)], None))
    pipe.recv()
    rows = []
    for i in range(args.repeats):
        prompt = [rng.randrange(1000, 30000) for _ in range(args.prefix_tokens)]
        recompute_s, _, token = _ttft(engine, f"r{i}", prompt)
        hashes = hash_prompt_blocks(prompt, engine.config.block_size, engine.model_id)
        if args.mode == "push":
            start = time.perf_counter()
            push = _finish(connector, connector.send(peer, hashes), start)
        pipe.send((f"r{i}", prompt, connector.address if args.mode == "pull" else None))
        while not pipe.poll(0.0005):
            connector.poll()  # the sender's engine loop: answers the pull, unpins when done
        connector.poll()
        transfer_s, num_bytes, pulled_ttft_s, cached, pulled_token, nixl_bytes = pipe.recv()
        if args.mode == "push":
            transfer_s, num_bytes = push
        assert pulled_token == token, f"run {i}: first token {pulled_token} after transfer, {token} recomputed"
        rows.append(dict(recompute_s=recompute_s, transfer_s=transfer_s, num_bytes=num_bytes,
                         mb_per_s=num_bytes / transfer_s / 1e6, pulled_ttft_s=pulled_ttft_s,
                         num_blocks=len(hashes), cached_tokens=cached, nixl_bytes=nixl_bytes))
    return rows


def _report(rows: list[dict], args, engine) -> None:
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"torch threads per process: {args.threads}; backend {args.backend}; mode {args.mode}; "
          f"model {engine.model_id}, "
          f"KV {engine.runner.kv_caches[0][0].dtype}, block_size {engine.config.block_size}")
    print("\n| run | blocks | MB | transfer ms | MB/s | recompute TTFT ms | transfer + pulled TTFT ms "
          "| cached tokens |")
    print("|---|---|---|---|---|---|---|---|")
    for i, r in enumerate(rows):
        print(f"| {i} | {r['num_blocks']} | {r['num_bytes'] / 1e6:.1f} | {r['transfer_s'] * 1e3:.1f} | "
              f"{r['mb_per_s']:.0f} | {r['recompute_s'] * 1e3:.0f} | "
              f"{(r['transfer_s'] + r['pulled_ttft_s']) * 1e3:.0f} | {r['cached_tokens']} |")
    med = {k: statistics.median(r[k] for r in rows) for k in ("transfer_s", "mb_per_s", "recompute_s",
                                                               "pulled_ttft_s")}
    print(f"\nmedian: transfer {med['transfer_s'] * 1e3:.1f} ms ({med['mb_per_s']:.0f} MB/s), "
          f"recompute {med['recompute_s'] * 1e3:.0f} ms, pulled TTFT {med['pulled_ttft_s'] * 1e3:.0f} ms "
          f"(+ transfer = {(med['transfer_s'] + med['pulled_ttft_s']) * 1e3:.0f} ms); "
          f"the receiver READ {rows[-1]['nixl_bytes'] / 1e6:.1f} MB over NIXL in all")
