"""``pagoda bench offload``: restoring a preempted request's KV by swap vs by recompute.

One engine with a CPU tier (``cpu_offload_bytes`` sized for the longest context,
``preemption_mode="auto"``, so the cost model is calibrated at start exactly as in
serving). For each context length ``n`` (``--lengths``, default 128..2048 tokens):

* swap: one device -> host copy of the ``ceil(n / block_size)`` blocks plus the host ->
  device copy back (``HostKVCache.swap_out`` + ``swap_in``, batched per layer), what a
  swapped request pays in total;
* recompute: one prefill of ``n`` tokens through the runner (a single request, as a
  recomputed request is prefilled again), what a request preempted by recompute pays;
* the calibrated cost model's predictions of both and the mode ``auto`` would pick.

Each timing is the best of ``--repeats`` runs; both run in one process, alternately, on
the same blocks. Output is a markdown table plus the machine and the calibrated model.
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import torch

DEFAULT_LENGTHS = (128, 256, 512, 1024, 2048)


def _best(fn, repeats: int, sync) -> float:
    best = float("inf")
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="pagoda bench offload", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="model folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--lengths", default=",".join(map(str, DEFAULT_LENGTHS)),
                        help="comma-separated context lengths in tokens")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per measurement (best kept)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args(argv)
    lengths = sorted(int(x) for x in args.lengths.split(",") if x)
    if not lengths or lengths[0] < 1:
        parser.error("--lengths: give positive token counts")
    if args.threads:
        torch.set_num_threads(args.threads)
    from pagoda.engine.config import EngineConfig
    from pagoda.engine.runner.host_kv_cache import PrefillItem
    from pagoda.engine.llm_engine import LLMEngine
    from pagoda.engine.runner.placement import kv_bytes_per_block, resolve_device, resolve_dtype
    from pagoda.models.registry import config_from_pretrained
    from pagoda.models.gguf_import import ensure_default_model

    model_path = str(args.model or ensure_default_model())
    block_size = 16
    num_blocks = -(-lengths[-1] // block_size)
    probe = EngineConfig(model=model_path)
    device = resolve_device(probe)
    per_block = kv_bytes_per_block(config_from_pretrained(model_path), block_size, resolve_dtype(probe, device))
    engine = LLMEngine(EngineConfig(model=model_path, block_size=block_size, cpu_offload_bytes=num_blocks * per_block,
                                    max_num_batched_tokens=max(2048, lengths[-1]),
                                    max_model_len=max(2048, lengths[-1] + 1),
                                    enable_prefix_caching=False))
    runner, host = engine.runner, engine.host_kv_cache
    cost = engine.scheduler.host_tier.cost_model
    if runner.num_blocks - 1 < num_blocks:
        parser.error(f"the device cache has {runner.num_blocks - 1} blocks; {lengths[-1]} tokens need {num_blocks}")
    sync = (lambda: torch.cuda.synchronize(runner.device)) if runner.device.type == "cuda" else (lambda: None)
    vocab = engine.model_config.vocab_size

    rows = []
    for n in lengths:
        nb = -(-n // block_size)
        device_ids = list(range(1, nb + 1))
        item = PrefillItem([(31 * i + 7) % vocab for i in range(n)], device_ids)
        runner.compute_logits([item])  # warm-up at this shape
        out_pairs = [(d, h) for h, d in enumerate(device_ids)]
        in_pairs = [(h, d) for d, h in out_pairs]
        swap_s = _best(lambda: (host.swap_out(out_pairs), host.swap_in(in_pairs)), args.repeats, sync)
        recompute_s = _best(lambda: runner.compute_logits([item]), args.repeats, sync)
        rows.append((n, nb, nb * per_block / 2**20, swap_s, recompute_s, cost.swap_cost(nb), cost.recompute_cost(n),
                     "swap" if cost.prefers_swap(n, nb) else "recompute"))

    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, device {runner.device}, KV dtype {runner.dtype}")
    print(f"model: {model_path}; block {block_size} tokens = {per_block / 2**10:.0f} KiB of KV")
    print(f"calibrated cost model: copy bandwidth {cost.copy_bandwidth_bytes_per_s / 1e9:.2f} GB/s, "
          f"copy latency {cost.copy_latency_s * 1e3:.3f} ms, prefill {cost.prefill_s_per_token * 1e6:.1f} us/token\n")
    print("| context tokens | blocks | KV MiB | swap out+in ms | recompute ms | recompute / swap "
          "| model swap ms | model recompute ms | auto picks |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for n, nb, mib, swap_s, rec_s, m_swap, m_rec, pick in rows:
        print(f"| {n} | {nb} | {mib:.1f} | {swap_s * 1e3:.2f} | {rec_s * 1e3:.1f} | {rec_s / swap_s:.0f}x "
              f"| {m_swap * 1e3:.2f} | {m_rec * 1e3:.1f} | {pick} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
