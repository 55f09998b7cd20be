"""``pagoda bench offline``: our engine vs Hugging Face ``generate`` on one fixed workload.

All three systems run the same seeded mixed-length workload (``bench/workload.py``,
greedy, ``ignore_eos``) on the same weights in one process, one after the other:

* pagoda: every request submitted at once, continuously batched;
* HF sequential: one request at a time;
* HF static: batches of ``--hf-batch-size`` requests in arrival order, left-padded; a
  batch runs until its longest request is done. Only each request's own tokens count.

pagoda runs twice by default, synchronous and with ``async_scheduling`` (the host
prepares step N+1 and finishes step N-1 while step N runs); ``--overlap`` picks one.
``--tensor-parallel-size N`` runs ``bench/tensor_parallel.py`` instead: TP=1 vs TP=N
(``--pipeline-parallel-size N``: PP=1 vs PP=N).
``--repeats N`` runs the workload N times per mode on the same two engines, alternating
the modes, and reports each mode's fastest pass (all passes go into ``--json``).
For each it prints the per-step timing from ``EngineStats``: host time inside
``step()``, device time (forward + sampling), device idle time between steps, and the
device-idle share ``idle / (device + idle)``.

Each pass of pagoda's shows ``LLM.generate``'s progress bar on stderr (finished prompts, token
rates; ``engine/progress.py``) unless ``--no-progress``; a finished request costs the bar one
update, no step does.

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


def make_pagoda(model_path: str, items: list[WorkItem], args, async_scheduling: bool = False):
    """An engine for the workload, warmed up by one short request."""
    from pagoda.engine.config import EngineConfig
    from pagoda.engine.llm_engine import LLMEngine
    from pagoda.engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model=model_path, max_num_seqs=args.max_num_seqs,
                                    max_num_batched_tokens=args.max_num_batched_tokens,
                                    max_model_len=args.max_model_len, enable_prefix_caching=False,
                                    async_scheduling=async_scheduling))
    engine.add_request("warmup", items[0].prompt_token_ids[:16], SamplingParams(temperature=0, max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()
    return engine


def run_pagoda(engine, items: list[WorkItem], run: int = 0, progress: bool = False) -> dict:
    """One pass of the workload through ``engine``: throughput, KV waste, step timing
    (``progress``: the offline progress bar over the pass's requests)."""
    from pagoda.engine.progress import NoProgress, Progress
    from pagoda.engine.sampling_params import SamplingParams

    before = engine.get_stats()
    start = time.perf_counter()
    for i, item in enumerate(items):
        engine.add_request(f"{run}-{i}", item.prompt_token_ids,
                           SamplingParams(temperature=0, max_tokens=item.max_tokens, ignore_eos=True))
    num_tokens = 0
    allocated = used = 0
    block_size = engine.config.block_size
    bar = Progress(len(items)) if progress else NoProgress()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                num_tokens += len(out.outputs[0].token_ids)
                bar.finished(out)
        for request in engine.scheduler.running:
            allocated += len(engine.scheduler.kv_cache_manager.get_block_ids(request.request_id)) * block_size
            used += request.num_computed_tokens
    elapsed = time.perf_counter() - start
    bar.close()
    stats = engine.get_stats()
    steps = stats.num_steps - before.num_steps
    timing = {name: (getattr(stats, f"step_{name}") - getattr(before, f"step_{name}")) / max(steps, 1)
              for name in ("host_s", "device_s", "device_idle_s", "wait_s")}
    busy = timing["device_s"] + timing["device_idle_s"]
    return {"tokens": num_tokens, "seconds": elapsed, "tokens_per_s": num_tokens / elapsed,
            "kv_waste": 1 - used / allocated if allocated else 0.0,
            "max_running": stats.max_num_running_seen, "steps": steps,
            "max_model_len": engine.max_model_len, "async_scheduling": engine.core.is_async,
            "per_step": timing, "device_idle_share": timing["device_idle_s"] / busy if busy else 0.0}


def run_pagoda_modes(model_path: str, items: list[WorkItem], args) -> dict:
    """The workload ``args.repeats`` times per mode, the modes alternating (so slow
    phases of a shared machine hit both alike); the fastest pass of each is kept."""
    modes = {"off": (False,), "on": (True,), "both": (False, True)}[args.overlap]
    engines = {mode: make_pagoda(model_path, items, args, mode) for mode in modes}
    best: dict = {}
    try:
        for run in range(args.repeats):
            for mode in modes:
                result = run_pagoda(engines[mode], items, run, progress=not args.no_progress)
                result["all_tokens_per_s"] = best.get(mode, {}).get("all_tokens_per_s", []) + [result["tokens_per_s"]]
                if mode not in best or result["tokens_per_s"] > best[mode]["tokens_per_s"]:
                    best[mode] = result
                else:
                    best[mode]["all_tokens_per_s"] = result["all_tokens_per_s"]
    finally:
        for engine in engines.values():
            engine.shutdown()
    return {("pagoda_async" if mode else "pagoda"): result for mode, result in best.items()}


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
    parser.add_argument("--overlap", choices=("both", "off", "on"), default="both",
                        help="run pagoda synchronous (off), with async_scheduling (on), or both (default)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="passes of the workload per pagoda mode, modes alternating; the fastest is reported")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar of each pass on stderr")
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="N > 1: run the workload at TP=1 and TP=N instead (bench/tensor_parallel.py)")
    parser.add_argument("--pipeline-parallel-size", type=int, default=1,
                        help="N > 1: run the workload at PP=1 and PP=N instead (bench/tensor_parallel.py)")
    parser.add_argument("--pipeline-micro-batches", type=int, default=None,
                        help="with --pipeline-parallel-size N: the PP=N engine's steps in flight (default N; "
                             "1: one step at a time)")
    parser.add_argument("--tp-config", choices=("0.5b", "default"), default="0.5b",
                        help="with --tensor-parallel-size: a ~0.5B random Llama config, or the default model")
    parser.add_argument("--tp-max-tokens", type=int, default=32,
                        help="with --tensor-parallel-size: cap on each request's output tokens")
    parser.add_argument("--compare", nargs=2, metavar=("vllm", "PYTHON"),
                        help="run vLLM's CPU engine (PYTHON: a vLLM venv's interpreter) beside pagoda instead: "
                             "fresh processes, alternating rounds, ratio and identical outputs (bench/compare_vllm.py)")
    parser.add_argument("--compare-rounds", type=int, default=2)
    parser.add_argument("--no-bind", action="store_true",
                        help="with --compare: leave pagoda's threads unbound (vLLM binds its own to cores 0..N-1)")
    parser.add_argument("--dtype", default="float32", help="with --compare: float32 or bfloat16")
    parser.add_argument("--compare-workload", choices=("mixed", "long", "concurrency"), default="mixed",
                        help="with --compare: the mixed workload (default), long prompts (TTFT, decode tok/s, "
                             "memory) or 1-64 concurrent sequences (bench/compare_scaling.py)")
    parser.add_argument("--long-lengths", default="2048,8100",
                        help="with --compare-workload long: prompt lengths, comma-separated")
    parser.add_argument("--long-context", type=int, default=None,
                        help="with --compare-workload long: time prompts past the model's context (8,192 for the "
                             "default model) on a copy of it whose config says this many tokens (weights and RoPE "
                             "unchanged: such rows measure speed, not quality)")
    parser.add_argument("--plot", default=None, help="with --compare-workload concurrency: write a PNG here")
    args = parser.parse_args(argv)
    from pagoda.models.gguf_import import ensure_default_model

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.tensor_parallel_size > 1 or args.pipeline_parallel_size > 1:
        from pagoda.bench import tensor_parallel

        return tensor_parallel.main(args)
    model_path = str(args.model or ensure_default_model())
    items = make_workload(args.num_requests, args.seed)
    if args.compare:
        return _compare(args, model_path, items)
    torch.manual_seed(0)
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}"
    results = {"machine": machine,
               "threads": torch.get_num_threads(), "num_requests": len(items),
               "output_tokens": sum(it.max_tokens for it in items)}
    results.update(run_pagoda_modes(model_path, items, args))
    if "pagoda" not in results:
        results["pagoda"] = results["pagoda_async"]
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


def _compare(args, model_path: str, items: list[WorkItem]) -> int:
    from pagoda.bench import compare_vllm

    if args.compare[0] != "vllm":
        raise SystemExit(f"pagoda bench offline: --compare knows vllm, got {args.compare[0]!r}")
    missing = compare_vllm.vllm_available(args.compare[1])
    if missing:
        print(f"pagoda bench offline --compare vllm: skipped: {missing}")
        return 0
    threads = args.threads or torch.get_num_threads()
    if args.compare_workload != "mixed":
        return _compare_scaling(args, model_path, threads)
    result = compare_vllm.compare(args.compare[1], model_path, items, threads, args.dtype, args.compare_rounds,
                                  {"max_model_len": args.max_model_len, "max_num_seqs": args.max_num_seqs,
                                   "max_num_batched_tokens": args.max_num_batched_tokens}, bind=not args.no_bind)
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}; "
          f"{len(items)} requests, seed {args.seed}, best of {args.compare_rounds} alternating rounds")
    print("| threads | dtype | pagoda tok/s | vLLM tok/s | pagoda / vLLM | identical outputs |")
    print("|---|---|---|---|---|---|")
    print(compare_vllm.format_result(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


def _compare_scaling(args, model_path: str, threads: int) -> int:
    from pagoda.bench import compare_scaling

    spec = compare_scaling.make_spec(args.compare_workload, model_path, args.dtype, threads,
                                     [int(n) for n in args.long_lengths.split(",")], args.max_num_batched_tokens,
                                     args.long_context)
    spec["bind"] = not args.no_bind
    results = compare_scaling.compare(args.compare[1], spec)
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}"
    print(f"machine: {machine}; {args.compare_workload}, {args.dtype}, {threads} threads, "
          f"KV cache {spec['kv_gib']} GiB in each engine")
    if spec.get("context"):
        trained = spec["trained_context"]
        print(f"model: a copy of {os.path.basename(model_path)} whose config says {spec['context']} tokens of "
              f"context (its own: {trained}); rows past {trained} measure speed, not quality")
    print(compare_scaling.format_table(spec, results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"spec": {k: v for k, v in spec.items() if k != "model"}, "results": results}, f, indent=2)
    if args.plot and args.compare_workload == "concurrency":
        try:
            compare_scaling.plot(results, f"{args.dtype}, {threads} threads, {machine}", args.plot)
        except ImportError as exc:  # the measurement stands (and is in --json); only the picture needs it
            print(f"--plot: not drawn, {exc} (pip install matplotlib)")
    return 0


def _print_table(results: dict, args) -> None:
    ours = results["pagoda"]
    print(f"machine: {results['machine']} ({results['threads']} torch threads)")
    print(f"workload: {results['num_requests']} requests, {results['output_tokens']} output tokens, seed {args.seed}")
    print(f"| system | output tokens/s | seconds | pagoda speedup |")
    print(f"|---|---|---|---|")
    label = "pagoda (continuous batching)" + (", async scheduling" if ours["async_scheduling"] else "")
    print(f"| {label} | {ours['tokens_per_s']:.1f} | {ours['seconds']:.1f} | 1.00x |")
    if "pagoda_async" in results and results["pagoda_async"] is not ours:
        r = results["pagoda_async"]
        print(f"| pagoda, async scheduling (overlap) | {r['tokens_per_s']:.1f} | {r['seconds']:.1f} | "
              f"{ours['tokens_per_s'] / r['tokens_per_s']:.2f}x "
              f"(async: {r['tokens_per_s'] / ours['tokens_per_s']:.2f}x "
              f"the synchronous engine) |")
    for key, label in (("hf_sequential", "HF generate, sequential"),
                       ("hf_static", f"HF generate, static batches of {args.hf_batch_size}")):
        if key in results:
            r = results[key]
            print(f"| {label} | {r['tokens_per_s']:.1f} | {r['seconds']:.1f} "
                  f"| {ours['tokens_per_s'] / r['tokens_per_s']:.2f}x |")
    print(f"KV waste (allocated but unused slots / allocated), paged blocks of 16 vs contiguous at "
          f"max_model_len={ours['max_model_len']}:")
    print(f"  averaged over engine steps: paged {100 * ours['kv_waste']:.2f}% vs contiguous "
          f"{100 * ours['kv_waste_contiguous']:.2f}%")
    print(f"  final allocation per request: paged {100 * ours['kv_waste_final']:.2f}% vs contiguous "
          f"{100 * ours['kv_waste_final_contiguous']:.2f}%  (max running {ours['max_running']}, {ours['steps']} steps)")
    _print_step_timing(results)


def _print_step_timing(results: dict) -> None:
    print("per engine step (ms): host = engine host work in step(); device = copies + forward + sampling;")
    print("idle = device waiting for the host; wait = host blocked on the device")
    print("| pagoda | host | device | device idle | host wait | device idle share |")
    print("|---|---|---|---|---|---|")
    for key, label in (("pagoda", "synchronous"), ("pagoda_async", "async scheduling")):
        r = results.get(key)
        if r is None or (key == "pagoda" and r["async_scheduling"]):
            continue
        t = r["per_step"]
        print(f"| {label} | {1e3 * t['host_s']:.2f} | {1e3 * t['device_s']:.2f} | {1e3 * t['device_idle_s']:.2f} | "
              f"{1e3 * t['wait_s']:.2f} | {100 * r['device_idle_share']:.1f}% |")
