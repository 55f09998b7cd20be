"""``pagoda bench kv-tiers``: a prefix's time to first token from each KV tier, and recomputed.

For each prefix length ``n`` (``--lengths``, default 2048 and 8064 tokens: SmolLM2-135M
takes 8192 positions), a query is the prefix plus 16 new tokens, one output token (greedy),
so its TTFT is the time to get the prefix's KV plus a 16-token prefill. The device pool holds
one query, so a second prompt of the same size evicts the prefix into the CPU tier, which
writes it through to the disk and shared tiers (``engine.kv.file_tier``). Then:

* **cpu**: the same engine, the query: device miss, CPU-tier hit (copy back);
* **device**: the same engine, another query with the prefix: device hit;
* **disk**: a new engine on the same disk directory (a warm restart): every block is read
  from its file, verified, loaded into the CPU tier and copied back;
* **shared**: a new engine with an empty disk directory and the same shared directory
  (another replica): every block comes from the shared tier;
* **recompute**: a new engine without tiers: the whole prefix is prefilled.

Engines keep the serving defaults otherwise (chunked prefill, a 2048-token step budget: an
8k recompute takes four steps). Every engine runs a short warm-up prompt first. Each row checks that the tier served the
prefix (its hit counter grew by the prefix's tokens) and fails otherwise. Files go to a
temporary directory (``--dir`` to choose one: the disk's speed is part of the result),
removed afterwards. Output: the machine, then a markdown table, a row per length as measured
(with the load average then: the machine may be shared).
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import shutil
import tempfile
import time

DEFAULT_LENGTHS = (2048, 8064)
SUFFIX_TOKENS = 16
BLOCK_SIZE = 16


def _engine(model_path: str, n: int, per_block: int, **tiers):
    from pagoda.engine.config import EngineConfig
    from pagoda.engine.llm_engine import LLMEngine

    num_blocks = -(-n // BLOCK_SIZE) + 3  # one query (prefix, suffix, output) and no more: another evicts it
    host = dict(cpu_offload_bytes=2 * (num_blocks + 1) * per_block, preemption_mode="recompute") if tiers else {}
    return LLMEngine(EngineConfig(model=model_path, block_size=BLOCK_SIZE, num_gpu_blocks_override=num_blocks + 1,
                                  max_model_len=n + 64, **host, **tiers))


def _ttft(engine, prompt: list[int], counter: str, expect: int) -> float:
    """Seconds to the first (only) token of ``prompt``; ``counter`` must grow by ``expect`` tokens."""
    from pagoda.engine.sampling_params import SamplingParams

    before = getattr(engine.get_stats(), counter)
    engine.add_request(f"q{time.monotonic_ns()}", prompt, SamplingParams(temperature=0, max_tokens=1,
                                                                          ignore_eos=True))
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    elapsed = time.perf_counter() - start
    grown = getattr(engine.get_stats(), counter) - before
    if grown < expect:
        raise RuntimeError(f"{counter} grew by {grown} tokens, expected {expect}: the tier did not serve the prefix")
    return elapsed


def _warm(engine, vocab: int) -> None:
    _ttft(engine, [(13 * i + 5) % vocab for i in range(64)], "num_prompt_tokens", 0)


def measure(model_path: str, n: int, directory: str, per_block: int, vocab: int) -> dict[str, float]:
    """TTFT seconds of a query with an ``n``-token prefix from each tier (see the module docstring)."""
    rng = random.Random(n)
    prefix = [rng.randrange(100, vocab) for _ in range(n)]
    other = [rng.randrange(100, vocab) for _ in range(n + 3 * BLOCK_SIZE - 1)]  # every device block: evicts the prefix

    def query():
        return prefix + [rng.randrange(100, vocab) for _ in range(SUFFIX_TOKENS)]

    disk, shared = os.path.join(directory, f"disk-{n}"), os.path.join(directory, f"shared-{n}")
    tiers = dict(kv_disk_dir=disk, kv_disk_bytes=4 * n * per_block, kv_shared_dir=shared)
    times = {}
    engine = _engine(model_path, n, per_block, **tiers)
    _warm(engine, vocab)
    _ttft(engine, prefix, "num_prompt_tokens", 0)
    _ttft(engine, other, "num_prompt_tokens", 0)  # evicts the prefix: CPU tier, written to both directories
    times["cpu"] = _ttft(engine, query(), "prefix_cache_hits_host", n)
    times["device"] = _ttft(engine, query(), "prefix_cache_hits", n)
    engine.core.executor.host_kv_cache.file_io.flush()
    engine.shutdown()
    engine = _engine(model_path, n, per_block, **tiers)  # a warm restart
    _warm(engine, vocab)
    times["disk"] = _ttft(engine, query(), "prefix_cache_hits_disk", n)
    engine.shutdown()
    engine = _engine(model_path, n, per_block, kv_disk_dir=disk + "-other", kv_disk_bytes=tiers["kv_disk_bytes"],
                     kv_shared_dir=shared)  # another replica
    _warm(engine, vocab)
    times["shared"] = _ttft(engine, query(), "prefix_cache_hits_shared", n)
    engine.shutdown()
    engine = _engine(model_path, n, per_block)
    _warm(engine, vocab)
    times["recompute"] = _ttft(engine, query(), "num_prompt_tokens", n)
    engine.shutdown()
    return times


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="pagoda bench kv-tiers", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="model folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--lengths", default=",".join(map(str, DEFAULT_LENGTHS)),
                        help="comma-separated prefix lengths in tokens (multiples of 16)")
    parser.add_argument("--dir", default=None, help="where the disk and shared tiers write (default: a temp dir)")
    args = parser.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",") if x]
    if not lengths or any(n < BLOCK_SIZE or n % BLOCK_SIZE for n in lengths):
        parser.error(f"--lengths: give positive multiples of {BLOCK_SIZE}")
    import torch

    from pagoda.engine.config import EngineConfig
    from pagoda.engine.runner.placement import kv_bytes_per_block, resolve_device, resolve_dtype
    from pagoda.models.gguf_import import ensure_default_model
    from pagoda.models.registry import config_from_pretrained

    model_path = str(args.model or ensure_default_model())
    probe = EngineConfig(model=model_path)
    model_config = config_from_pretrained(model_path)
    per_block = kv_bytes_per_block(model_config, BLOCK_SIZE, resolve_dtype(probe, resolve_device(probe)))
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; files under {args.dir or tempfile.gettempdir()}")
    print(f"model: {model_path}; block {BLOCK_SIZE} tokens = {per_block / 2**10:.0f} KiB of KV; "
          f"query = prefix + {SUFFIX_TOKENS} tokens, 1 output token\n")
    tiers = ("device", "cpu", "disk", "shared", "recompute")
    header = " | ".join(f"{t} TTFT ms" for t in tiers)
    print(f"| prefix tokens | {header} | disk / recompute | shared / recompute | load average |", flush=True)
    print("|---:|" + "---:|" * (len(tiers) + 3), flush=True)
    directory = tempfile.mkdtemp(prefix="pagoda-kv-tiers-", dir=args.dir)
    try:
        for n in lengths:  # a row as soon as it is measured: long prefixes take minutes on a CPU
            t = measure(model_path, n, directory, per_block, model_config.vocab_size)
            cells = " | ".join(f"{t[k] * 1e3:.1f}" for k in tiers)
            load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
            print(f"| {n} | {cells} | {t['disk'] / t['recompute']:.2f} | {t['shared'] / t['recompute']:.2f} "
                  f"| {load:.1f} |", flush=True)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
