"""``pagoda bench offline``: our engine vs Hugging Face ``generate`` on one fixed workload.

All three systems run the same seeded mixed-length workload (``bench/workload.py``,
greedy, ``ignore_eos``) on the same weights in one process, one after the other:

* pagoda: every request submitted at once, continuously batched;
* HF sequential: one request at a time;
* HF static: batches of ``--hf-batch-size`` requests in arrival order, left-padded; a
  batch runs until its longest request is done. Only each request's own tokens count.

Reported: output tokens/s of each and the ratios, and KV waste — allocated but unused
token slots over allocated slots, averaged over engine steps — for our paged cache vs
contiguous per-request allocation at ``max_model_len`` (what a static KV cache reserves).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch

from pagoda.bench.workload import WorkItem, make_workload


def run_pagoda(model_path: str, items: list[WorkItem], args) -> dict:
    from pagoda.engine.config import EngineConfig
    from pagoda.engine.llm_engine import LLMEngine
    from pagoda.engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model=model_path, max_num_seqs=args.max_num_seqs,
                                    max_num_batched_tokens=args.max_num_batched_tokens,
                                    max_model_len=args.max_model_len, enable_prefix_caching=False))
    engine.add_request("warmup", items[0].prompt_token_ids[:16], SamplingParams(temperature=0, max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()
    start = time.perf_counter()
    for i, item in enumerate(items):
        engine.add_request(str(i), item.prompt_token_ids,
                           SamplingParams(temperature=0, max_tokens=item.max_tokens, ignore_eos=True))
    num_tokens = 0
    allocated = used = 0
    block_size = engine.config.block_size
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                num_tokens += len(out.outputs[0].token_ids)
        for request in engine.scheduler.running:
            allocated += len(engine.scheduler.kv_cache_manager.get_block_ids(request.request_id)) * block_size
            used += request.num_computed_tokens
    elapsed = time.perf_counter() - start
    stats = engine.get_stats()
    return {"tokens": num_tokens, "seconds": elapsed, "tokens_per_s": num_tokens / elapsed,
            "kv_waste": 1 - used / allocated if allocated else 0.0,
            "max_running": stats.max_num_running_seen, "steps": stats.num_steps,
            "max_model_len": engine.max_model_len}


def final_allocation_waste(items: list[WorkItem], block_size: int, max_model_len: int) -> tuple[float, float]:
    """Waste of each request's final (largest) allocation: paged vs contiguous.

    A finished request holds KV for ``prompt + output - 1`` tokens (the last sampled
    token is never fed back); paged allocation rounds that up to whole blocks, contiguous
    allocation reserves ``max_model_len``.
    """
    used = sum(len(it.prompt_token_ids) + it.max_tokens - 1 for it in items)
    paged = sum(-(-(len(it.prompt_token_ids) + it.max_tokens - 1) // block_size) * block_size for it in items)
    return 1 - used / paged, 1 - used / (max_model_len * len(items))


def contiguous_waste(items: list[WorkItem], max_model_len: int) -> float:
    """Waste of reserving ``max_model_len`` slots per request for its whole life.

    Time-weighted like the paged figure: a request alive for ``m`` decode steps holds
    ``max_model_len`` slots each step while using ``prompt + k`` of them at step ``k``.
    """
    used = allocated = 0
    for item in items:
        p, m = len(item.prompt_token_ids), item.max_tokens
        used += sum(p + k for k in range(1, m + 1))
        allocated += max_model_len * m
    return 1 - used / allocated


def run_hf(model_path: str, items: list[WorkItem], batch_size: int) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    pad = model.config.eos_token_id if isinstance(model.config.eos_token_id, int) else 0
    with torch.inference_mode():
        model.generate(torch.tensor([items[0].prompt_token_ids[:16]]), max_new_tokens=2, do_sample=False,
                       pad_token_id=pad)
        start = time.perf_counter()
        num_tokens = 0
        for b in range(0, len(items), batch_size):
            batch = items[b : b + batch_size]
            width = max(len(it.prompt_token_ids) for it in batch)
            ids = torch.full((len(batch), width), pad, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, it in enumerate(batch):
                ids[row, width - len(it.prompt_token_ids):] = torch.tensor(it.prompt_token_ids)
                mask[row, width - len(it.prompt_token_ids):] = 1
            steps = max(it.max_tokens for it in batch)
            model.generate(ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps,
                           do_sample=False, pad_token_id=pad)
            num_tokens += sum(it.max_tokens for it in batch)
        elapsed = time.perf_counter() - start
    return {"tokens": num_tokens, "seconds": elapsed, "tokens_per_s": num_tokens / elapsed}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="pagoda bench offline", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="model folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hf-batch-size", type=int, default=8)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads for every system (default: torch's own choice)")
    parser.add_argument("--skip-hf", action="store_true", help="only run pagoda")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args(argv)
    from pagoda.models.gguf_import import ensure_default_model

    if args.threads:
        torch.set_num_threads(args.threads)
    model_path = str(args.model or ensure_default_model())
    items = make_workload(args.num_requests, args.seed)
    torch.manual_seed(0)
    results = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
               "threads": torch.get_num_threads(), "num_requests": len(items),
               "output_tokens": sum(it.max_tokens for it in items)}
    results["pagoda"] = run_pagoda(model_path, items, args)
    max_len = results["pagoda"]["max_model_len"]
    results["pagoda"]["kv_waste_contiguous"] = contiguous_waste(items, max_len)
    results["pagoda"]["kv_waste_final"], results["pagoda"]["kv_waste_final_contiguous"] = \
        final_allocation_waste(items, 16, max_len)
    if not args.skip_hf:
        results["hf_sequential"] = run_hf(model_path, items, 1)
        results["hf_static"] = run_hf(model_path, items, args.hf_batch_size)
    _print_table(results, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


def _print_table(results: dict, args) -> None:
    ours = results["pagoda"]
    print(f"machine: {results['machine']} ({results['threads']} torch threads)")
    print(f"workload: {results['num_requests']} requests, {results['output_tokens']} output tokens, seed {args.seed}")
    print(f"| system | output tokens/s | seconds | pagoda speedup |")
    print(f"|---|---|---|---|")
    print(f"| pagoda (continuous batching) | {ours['tokens_per_s']:.1f} | {ours['seconds']:.1f} | 1.00x |")
    for key, label in (("hf_sequential", "HF generate, sequential"),
                       ("hf_static", f"HF generate, static batches of {args.hf_batch_size}")):
        if key in results:
            r = results[key]
            print(f"| {label} | {r['tokens_per_s']:.1f} | {r['seconds']:.1f} | {ours['tokens_per_s'] / r['tokens_per_s']:.2f}x |")
    print(f"KV waste (allocated but unused slots / allocated), paged blocks of 16 vs contiguous at "
          f"max_model_len={ours['max_model_len']}:")
    print(f"  averaged over engine steps: paged {100 * ours['kv_waste']:.2f}% vs contiguous "
          f"{100 * ours['kv_waste_contiguous']:.2f}%")
    print(f"  final allocation per request: paged {100 * ours['kv_waste_final']:.2f}% vs contiguous "
          f"{100 * ours['kv_waste_final_contiguous']:.2f}%  (max running {ours['max_running']}, {ours['steps']} steps)")
