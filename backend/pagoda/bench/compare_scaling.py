"""``pagoda bench offline --compare vllm PYTHON --compare-workload long|concurrency`` (issue 44).

Two workloads beside ``compare_vllm``'s mixed one, both engines in one run, each in a fresh
process (``compare_vllm``'s environment: threads, vLLM's in-process engine core), the same
seeded prompts, greedy, ``ignore_eos``, no prefix caching, a 2 GiB KV cache in both
(``VLLM_CPU_KVCACHE_SPACE=2``, pagoda's ``kv_cache_memory_bytes``; more where the long
workload's ``DECODES`` prompts need it, ``kv_gib_for``), prefill chunks of
``--max-num-batched-tokens`` tokens:

- ``long``: for each prompt length L (``--long-lengths``, default 2048 and 8100: the
  default model's context is 8,192 tokens; a length past the model's is refused unless
  ``--long-context N`` raises it, see ``stretched_model``): TTFT, one
  prompt of L tokens alone (``max_tokens=1``, submit to its token); decode tok/s, ``DECODES``
  prompts of L tokens at once run to ``1 + DECODE_TOKENS`` tokens each (once untimed to half
  that, a warm-up at those shapes), timed step by step: the rate is the tokens the steps made
  after every prompt had its first token, over those steps' time (``steady_decode``), so the
  prefills and any decode overlapped with another prompt's prefill chunks are left out, in
  both engines alike (vLLM's ``LLMEngine.step``, pagoda's). And the process's peak resident
  memory after L.
- ``concurrency``: N sequences of ``PROMPT_TOKENS`` prompt tokens and ``OUTPUT_TOKENS``
  output tokens submitted at once, N in 1, 4, 16, 64: output tok/s; ``plot`` draws both
  engines' curves into a PNG (matplotlib, imported only there).

Beside each wall-clock figure, the same per second of the process's CPU time (all its
threads; the engine runs in-process in both): on a shared machine the wall time follows
the other processes' load, the CPU time much less.

``run_scenarios`` is the measurement, the same code in both processes: the vLLM worker is
its source plus a ``generate`` over vLLM's ``LLMEngine.step``; pagoda's a ``generate`` over
its own ``LLMEngine.step``; each records after every step its time, process CPU time, the
tokens made so far and how many requests have one (the step trace). Model load and a warm-up request are not timed.
"""

from __future__ import annotations

import inspect
import json
import math
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
    """The workload of ``spec["workload"]``; ``generate(prompts, max_tokens) -> (seconds, outputs, steps)``
    runs the prompts at once to ``max_tokens`` each, ``steps`` the trace: after each engine step
    ``(seconds, cpu_seconds, tokens, started)`` since the submit (tokens made by every request so
    far, how many requests have one). Runs in both engines' processes: stdlib only."""
    import random
    import resource
    import time

    def timed(batch: list[list[int]], max_tokens: int) -> tuple[float, float, list[list[int]], list]:
        cpu = time.process_time()  # the engine runs in this process in both: its CPU time, all threads
        seconds, outputs, steps = generate(batch, max_tokens)
        return seconds, time.process_time() - cpu, outputs, steps

    def steady_decode(steps: list, count: int) -> tuple[float, float]:
        """Tokens per second and per CPU second of the steps after every request had a token."""
        start = next(i for i, step in enumerate(steps) if step[3] == count)
        (t0, c0, n0, _), (t1, c1, n1, _) = steps[start], steps[-1]
        return (n1 - n0) / max(t1 - t0, 1e-9), (n1 - n0) / max(c1 - c0, 1e-9)

    def prompts(count: int, length: int, seed: int) -> list[list[int]]:
        rng = random.Random(seed * 1_000_003 + length)
        return [[rng.randrange(1000, spec["vocab"]) for _ in range(length)] for _ in range(count)]

    results: dict = {}
    if spec["workload"] == "long":
        for length in spec["lengths"]:
            ttft, ttft_cpu, _, _ = timed(prompts(1, length, 0), 1)
            batch = prompts(spec["decodes"], length, 1)
            timed(batch, 1 + spec["decode_tokens"] // 2)  # warm-up at these shapes: a first run pays for them
            total, _, outputs, steps = timed(batch, 1 + spec["decode_tokens"])
            rate, rate_cpu = steady_decode(steps, len(batch))
            results[str(length)] = {"ttft_s": ttft, "ttft_cpu_s": ttft_cpu, "total_s": total,
                                    "decode_tokens_per_s": rate, "decode_tokens_per_cpu_s": rate_cpu,
                                    "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
                                    "outputs": outputs}
    else:
        for count in spec["concurrency"]:
            seconds, cpu, outputs, _ = timed(prompts(count, spec["prompt_tokens"], 2), spec["output_tokens"])
            results[str(count)] = {"seconds": seconds, "tokens_per_s": count * spec["output_tokens"] / seconds,
                                   "tokens_per_cpu_s": count * spec["output_tokens"] / max(cpu, 1e-9),
                                   "outputs": outputs}
    return results


def traced_run(prompts: list[list[int]], submit: Callable, engine: Any) -> tuple[float, list[list[int]], list]:
    """Submit the prompts (``submit(request_id, prompt)``) and step ``engine`` (either engine's
    ``LLMEngine``: ``step``, ``has_unfinished_requests``) until idle: (seconds, the outputs in
    prompt order, the step trace of ``run_scenarios``). Runs in both processes: stdlib only."""
    import time

    tag = str(time.monotonic_ns())
    start, cpu, tokens, steps = time.perf_counter(), time.process_time(), {}, []
    for i, prompt in enumerate(prompts):
        submit(f"{tag}-{i}", prompt)
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] = list(out.outputs[0].token_ids)
        steps.append((time.perf_counter() - start, time.process_time() - cpu, sum(map(len, tokens.values())),
                      sum(1 for t in tokens.values() if t)))
    return time.perf_counter() - start, [tokens[f"{tag}-{i}"] for i in range(len(prompts))], steps


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
    return traced_run(prompts, lambda request_id, p: llm.llm_engine.add_request(
        request_id, TokensPrompt(prompt_token_ids=p), params), llm.llm_engine)
'''


def pagoda_worker(spec_path: str, out_path: str) -> None:
    """Runs in a fresh pagoda process (``python -m pagoda.bench.compare_scaling SPEC OUT``)."""
    spec = json.loads(Path(spec_path).read_text())
    engine = compare_vllm.engine_for(spec)
    from pagoda.engine.sampling_params import SamplingParams

    def generate(prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]], list]:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        return traced_run(prompts, lambda request_id, prompt: engine.add_request(request_id, prompt, params), engine)

    generate([[1000 + i for i in range(16)]], 2)  # warm-up, not timed
    Path(out_path).write_text(json.dumps(run_scenarios(spec, generate)))
    engine.shutdown()


def vllm_script() -> str:
    """The vLLM process's script: ``VLLM_WORKER``, then ``traced_run``'s and ``run_scenarios``' own source."""
    return (VLLM_WORKER + "\n" + inspect.getsource(traced_run) + "\n" + inspect.getsource(run_scenarios) + "\n"
            "json.dump(run_scenarios(spec, generate), open(sys.argv[2], 'w'))\n")


def make_spec(workload: str, model: str, dtype: str, threads: int, lengths: list[int],
              max_num_batched_tokens: int, context: int | None = None) -> dict[str, Any]:
    """The workers' spec; a long-context length past the model's context (or ``context``, the
    one ``stretched_model`` gives it) is refused."""
    config = json.loads((Path(model) / "config.json").read_text())
    trained = config.get("max_position_embeddings", 2048)
    spec: dict[str, Any] = {"workload": workload, "model": model, "dtype": dtype, "threads": threads,
                            "vocab": config["vocab_size"], "max_num_batched_tokens": max_num_batched_tokens,
                            "kv_gib": KV_GIB}
    if workload == "long":
        if context is not None and context < trained:
            raise ValueError(f"--long-context: {context} is below the model's own context of {trained} tokens")
        limit = context or trained
        too_long = [n for n in lengths if n + 1 + DECODE_TOKENS > limit]
        if too_long:
            hint = "" if context else " (--long-context N raises it)"
            raise ValueError(f"--long-lengths: {too_long} plus {1 + DECODE_TOKENS} output tokens exceed the "
                             f"model's context of {limit} tokens{hint}")
        spec.update(lengths=lengths, decodes=DECODES, decode_tokens=DECODE_TOKENS, max_num_seqs=DECODES,
                    max_model_len=max(lengths) + 1 + DECODE_TOKENS, trained_context=trained)
        spec["kv_gib"] = kv_gib_for(model, dtype, DECODES * spec["max_model_len"])
        if context is not None and context > trained:
            spec["context"] = context
    else:
        spec.update(concurrency=list(CONCURRENCY), prompt_tokens=PROMPT_TOKENS, output_tokens=OUTPUT_TOKENS,
                    max_num_seqs=max(CONCURRENCY), max_model_len=PROMPT_TOKENS + OUTPUT_TOKENS)
    return spec


def kv_gib_for(model: str, dtype: str, tokens: int) -> int:
    """Whole GiB of KV cache (at least ``KV_GIB``) for ``tokens`` positions of ``model`` in ``dtype``
    (the engine's own ``kv_bytes_per_block``), with a spare GiB: both engines get that budget, so
    neither preempts."""
    import torch

    from pagoda.engine.runner.placement import kv_bytes_per_block
    from pagoda.models.registry import config_from_pretrained

    per_token = kv_bytes_per_block(config_from_pretrained(model), 1, getattr(torch, dtype))
    return max(KV_GIB, math.ceil(tokens * per_token / 2**30) + 1)


def stretched_model(model: str, context: int, into: str) -> str:
    """A copy of ``model``'s directory in ``into`` whose ``config.json`` says a context of ``context``
    tokens (``max_position_embeddings``), every other file a link to the original: both engines
    load it, so prompts past the model's trained context can be timed. The weights and RoPE are
    unchanged, so positions past that context are computed as any other but are not what the
    model learned: rows measured on it are about speed, not quality (both engines compute the
    same thing; their outputs are still compared)."""
    source, target = Path(model), Path(into) / (Path(model).name + f"-context-{context}")
    target.mkdir(parents=True)
    for item in source.iterdir():
        if item.name != "config.json":
            (target / item.name).symlink_to(item.resolve())
    config = json.loads((source / "config.json").read_text())
    config["max_position_embeddings"] = context
    (target / "config.json").write_text(json.dumps(config, indent=2))
    return str(target)


def compare(python: str, spec: dict[str, Any], timeout_s: float = 3600) -> dict[str, Any]:
    """Both engines on ``spec``'s workload, pagoda first, each in a fresh process."""
    with tempfile.TemporaryDirectory(prefix="pagoda-scaling-") as tmp:
        if spec.get("context"):
            spec = {**spec, "model": stretched_model(spec["model"], spec["context"], tmp)}
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
