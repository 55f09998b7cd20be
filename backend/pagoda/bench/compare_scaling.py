"""``pagoda bench offline --compare vllm PYTHON --compare-workload long|concurrency`` (issue 44).

Two workloads beside ``compare_vllm``'s mixed one, both engines in one run, each in a fresh
process (``compare_vllm``'s environment: threads, vLLM's in-process engine core), the same
seeded prompts, greedy, ``ignore_eos``, no prefix caching, a 2 GiB KV cache in both
(``VLLM_CPU_KVCACHE_SPACE=2``, pagoda's ``kv_cache_memory_bytes``), prefill chunks of
``--max-num-batched-tokens`` tokens:

- ``long``: for each prompt length L (``--long-lengths``, default 2048 and 8100: the
  default model's context is 8,192 tokens; a length past the model's is refused): TTFT, one
  prompt of L tokens alone (``max_tokens=1``, submit to its token); decode tok/s, ``DECODES``
  prompts of L tokens at once run to ``1 + DECODE_TOKENS / 2`` tokens each (once untimed, a
  warm-up at those shapes), then again, and to ``1 + DECODE_TOKENS``:
  ``DECODES * (DECODE_TOKENS / 2) / (T - S)`` with T and S those runs' times. The difference
  cancels the prefills, the first tokens and the first half of the decode, so an engine that
  overlaps decodes with the other prompts' prefill chunks is measured on its
  steady decode alone (a difference against a separate ``max_tokens=1`` prefill run, as
  before, credited such overlap to the decode). Where the decode costs less than the runs'
  noise (vLLM at 2k tokens on the 2-core Xeon) the rate comes out negative: not measured by
  this workload (docs/benchmarks.md). And the process's peak resident memory after L.
- ``concurrency``: N sequences of ``PROMPT_TOKENS`` prompt tokens and ``OUTPUT_TOKENS``
  output tokens submitted at once, N in 1, 4, 16, 64: output tok/s; ``plot`` draws both
  engines' curves into a PNG (matplotlib, imported only there).

Beside each wall-clock figure, the same per second of the process's CPU time (all its
threads; the engine runs in-process in both): on a shared machine the wall time follows
the other processes' load, the CPU time much less.

``run_scenarios`` is the measurement, the same code in both processes: the vLLM worker is
its source plus a ``generate`` over ``LLM.generate``; pagoda's a ``generate`` over
``LLMEngine.step``. Model load and a warm-up request are not timed.
"""

from __future__ import annotations

import inspect
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

from pagoda.bench import compare_vllm

DECODES, DECODE_TOKENS = 4, 32
PROMPT_TOKENS, OUTPUT_TOKENS, CONCURRENCY = 128, 64, (1, 4, 16, 64)
KV_GIB = 2


def run_scenarios(spec: dict, generate: Callable) -> dict:
    """The workload of ``spec["workload"]``; ``generate(prompts, max_tokens) -> (seconds, outputs)``
    runs the prompts at once to ``max_tokens`` each. Runs in both engines' processes: stdlib only."""
    import random
    import resource
    import time

    def timed(batch: list[list[int]], max_tokens: int) -> tuple[float, float, list[list[int]]]:
        cpu = time.process_time()  # the engine runs in this process in both: its CPU time, all threads
        seconds, outputs = generate(batch, max_tokens)
        return seconds, time.process_time() - cpu, outputs

    def prompts(count: int, length: int, seed: int) -> list[list[int]]:
        rng = random.Random(seed * 1_000_003 + length)
        return [[rng.randrange(1000, spec["vocab"]) for _ in range(length)] for _ in range(count)]

    results: dict = {}
    if spec["workload"] == "long":
        for length in spec["lengths"]:
            ttft, ttft_cpu, _ = timed(prompts(1, length, 0), 1)
            batch, half = prompts(spec["decodes"], length, 1), spec["decode_tokens"] // 2
            timed(batch, 1 + half)  # warm-up at these shapes: a first run paid for it (vLLM's went negative)
            short, short_cpu, _ = timed(batch, 1 + half)
            total, total_cpu, outputs = timed(batch, 1 + spec["decode_tokens"])
            decoded = spec["decodes"] * (spec["decode_tokens"] - half)
            results[str(length)] = {"ttft_s": ttft, "ttft_cpu_s": ttft_cpu, "short_s": short, "total_s": total,
                                    "decode_tokens_per_s": decoded / (total - short),
                                    "decode_tokens_per_cpu_s": decoded / max(total_cpu - short_cpu, 1e-9),
                                    "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
                                    "outputs": outputs}
    else:
        for count in spec["concurrency"]:
            seconds, cpu, outputs = timed(prompts(count, spec["prompt_tokens"], 2), spec["output_tokens"])
            results[str(count)] = {"seconds": seconds, "tokens_per_s": count * spec["output_tokens"] / seconds,
                                   "tokens_per_cpu_s": count * spec["output_tokens"] / max(cpu, 1e-9),
                                   "outputs": outputs}
    return results


VLLM_WORKER = r'''from __future__ import annotations
import json, sys, time
spec = json.load(open(sys.argv[1]))
import torch
torch.set_num_threads(spec["threads"])
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
llm = LLM(model=spec["model"], dtype=spec["dtype"], max_model_len=spec["max_model_len"],
          max_num_seqs=spec["max_num_seqs"], max_num_batched_tokens=spec["max_num_batched_tokens"],
          enable_prefix_caching=False, seed=0)
llm.generate([TokensPrompt(prompt_token_ids=[1000 + i for i in range(16)])],
             SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)

def generate(prompts, max_tokens):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - start, [list(o.outputs[0].token_ids) for o in outs]
'''


def pagoda_worker(spec_path: str, out_path: str) -> None:
    """Runs in a fresh pagoda process (``python -m pagoda.bench.compare_scaling SPEC OUT``)."""
    import time

    spec = json.loads(Path(spec_path).read_text())
    engine = compare_vllm.engine_for(spec)
    from pagoda.engine.sampling_params import SamplingParams

    calls = [0]

    def generate(prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
        calls[0] += 1
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        outputs: dict[str, list[int]] = {}
        start = time.perf_counter()
        for i, prompt in enumerate(prompts):
            engine.add_request(f"{calls[0]}-{i}", prompt, params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = list(out.outputs[0].token_ids)
        return time.perf_counter() - start, [outputs[f"{calls[0]}-{i}"] for i in range(len(prompts))]

    generate([[1000 + i for i in range(16)]], 2)  # warm-up, not timed
    Path(out_path).write_text(json.dumps(run_scenarios(spec, generate)))
    engine.shutdown()


def vllm_script() -> str:
    """The vLLM process's script: ``VLLM_WORKER``, then ``run_scenarios``'s own source."""
    return (VLLM_WORKER + "\n" + inspect.getsource(run_scenarios) + "\n"
            "json.dump(run_scenarios(spec, generate), open(sys.argv[2], 'w'))\n")


def make_spec(workload: str, model: str, dtype: str, threads: int, lengths: list[int],
              max_num_batched_tokens: int) -> dict[str, Any]:
    """The workers' spec; a long-context length past the model's context is refused."""
    config = json.loads((Path(model) / "config.json").read_text())
    context = config.get("max_position_embeddings", 2048)
    spec: dict[str, Any] = {"workload": workload, "model": model, "dtype": dtype, "threads": threads,
                            "vocab": config["vocab_size"], "max_num_batched_tokens": max_num_batched_tokens,
                            "kv_gib": KV_GIB}
    if workload == "long":
        too_long = [n for n in lengths if n + 1 + DECODE_TOKENS > context]
        if too_long:
            raise ValueError(f"--long-lengths: {too_long} plus {1 + DECODE_TOKENS} output tokens exceed the "
                             f"model's context of {context} tokens")
        spec.update(lengths=lengths, decodes=DECODES, decode_tokens=DECODE_TOKENS, max_num_seqs=DECODES,
                    max_model_len=max(lengths) + 1 + DECODE_TOKENS)
    else:
        spec.update(concurrency=list(CONCURRENCY), prompt_tokens=PROMPT_TOKENS, output_tokens=OUTPUT_TOKENS,
                    max_num_seqs=max(CONCURRENCY), max_model_len=PROMPT_TOKENS + OUTPUT_TOKENS)
    return spec


def compare(python: str, spec: dict[str, Any], timeout_s: float = 3600) -> dict[str, Any]:
    """Both engines on ``spec``'s workload, pagoda first, each in a fresh process."""
    with tempfile.TemporaryDirectory(prefix="pagoda-scaling-") as tmp:
        spec_path = os.path.join(tmp, "spec.json")
        Path(spec_path).write_text(json.dumps(spec))
        worker = os.path.join(tmp, "vllm_worker.py")
        Path(worker).write_text(vllm_script())
        env = compare_vllm.worker_env(spec["threads"], spec["kv_gib"])
        results = {}
        for name, command in (("pagoda", [sys.executable, "-m", "pagoda.bench.compare_scaling", spec_path]),
                              ("vllm", [python, worker, spec_path])):
            out_path = os.path.join(tmp, f"{name}.json")
            results[name] = compare_vllm.run_worker(command + [out_path], env, out_path, timeout_s)
    return results


def format_table(spec: dict[str, Any], results: dict[str, Any]) -> str:
    """The markdown table of one workload's results, and how many outputs agree."""
    pagoda, vllm = results["pagoda"], results["vllm"]
    lines = []
    for key in pagoda:
        p, v = pagoda[key], vllm[key]
        same = sum(a == b for a, b in zip(p["outputs"], v["outputs"]))
        if spec["workload"] == "long":
            lines.append(f"| {key} | {p['ttft_s']:.2f} ({p['ttft_cpu_s']:.2f}) | "
                         f"{v['ttft_s']:.2f} ({v['ttft_cpu_s']:.2f}) | "
                         f"{p['decode_tokens_per_s']:.1f} ({p['decode_tokens_per_cpu_s']:.1f}) | "
                         f"{v['decode_tokens_per_s']:.1f} ({v['decode_tokens_per_cpu_s']:.1f}) | "
                         f"{p['peak_rss_gib']:.2f} | {v['peak_rss_gib']:.2f} | {same}/{len(p['outputs'])} |")
        else:
            lines.append(f"| {key} | {p['tokens_per_s']:.1f} ({p['tokens_per_cpu_s']:.1f}) | "
                         f"{v['tokens_per_s']:.1f} ({v['tokens_per_cpu_s']:.1f}) | "
                         f"{p['tokens_per_s'] / v['tokens_per_s']:.2f}x | {same}/{len(p['outputs'])} |")
    if spec["workload"] == "long":
        head = ("| prompt tokens | TTFT pagoda, s (CPU s) | TTFT vLLM, s (CPU s) | decode tok/s pagoda (per CPU s) | "
                "decode tok/s vLLM (per CPU s) | peak RSS pagoda (GiB) | peak RSS vLLM (GiB) | identical outputs |\n"
                "|---|---|---|---|---|---|---|---|")
    else:
        head = ("| concurrent sequences | pagoda tok/s (per CPU s) | vLLM tok/s (per CPU s) | pagoda / vLLM | "
                "identical outputs |\n|---|---|---|---|---|")
    return head + "\n" + "\n".join(lines)


def plot(results: dict[str, Any], title: str, path: str) -> None:
    """Both engines' output tokens per second and per CPU second against concurrent sequences
    (log-scaled x), two panels, into ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure, panels = pyplot.subplots(1, 2, figsize=(10, 4), dpi=100)
    for axes, key, label in ((panels[0], "tokens_per_s", "output tokens/s"),
                             (panels[1], "tokens_per_cpu_s", "output tokens per process CPU second")):
        for name, legend in (("pagoda", "pagoda"), ("vllm", "vLLM")):
            counts = [int(k) for k in results[name] if key in results[name][k]]
            axes.plot(counts, [results[name][str(c)][key] for c in counts], marker="o", label=legend)
        axes.set_xscale("log", base=2)
        axes.set_xticks(counts, [str(c) for c in counts])
        axes.set_xlabel("concurrent sequences")
        axes.set_ylabel(label)
        axes.grid(True, alpha=0.3)
        axes.legend()
    figure.suptitle(title, fontsize=9)
    figure.tight_layout()
    figure.savefig(path)


if __name__ == "__main__":  # a pagoda process: python -m pagoda.bench.compare_scaling SPEC OUT
    pagoda_worker(sys.argv[1], sys.argv[2])
