"""``pagoda bench throughput``: offline high-concurrency throughput, greedy vs sampled.

Every request is submitted at once to one ``LLMEngine``, which is stepped until it is
idle; the same workload then runs again with other sampling settings ("mixes"):

* ``greedy``: temperature 0;
* ``sampled``: temperature 0.8, top_p 0.95, unseeded;
* ``seeded``: the same, with a seed on every other request.

All requests use ``ignore_eos``, so every mix generates exactly the same tokens' worth of
work. Reported per mix: wall time, output and total (prompt + output) tokens/s, steps,
the median step, and each stage's share of the summed step time: ``schedule``
(``Scheduler.schedule``), ``forward`` (``ModelRunner.compute_logits``, synchronised on a GPU so
the device time lands here), ``sampler`` (``Sampler.__call__``, which ends in the step's
one device-to-host read) and ``rest`` (outputs, detokenization, bookkeeping). The stages
are timed by wrapping those three calls on the engine's objects; the engine is unchanged.
With ``--repeats N`` the mixes run in N alternating rounds and each mix's fastest run is
reported, which damps load drift on a shared machine.

Defaults by device:

* CPU: the default model (SmolLM2-135M), 64 requests, prompts 16-64 tokens, outputs
  8-48 tokens: each mix takes well under a minute on one thread.
* GPU: the Llama-3-8B shape with seeded random bf16 weights (``load_format="dummy"``, as
  ``pagoda bench kernels`` builds it), 800 requests, prompts 64-1,024, outputs 32-512,
  ``max_num_seqs`` 256: the workload of issue 12's H100 table.

``--small`` uses the tiny random config of ``bench/kernels_e2e.py`` on any device (tests).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

MIXES = ("greedy", "sampled", "seeded")
_STAGES = ("schedule", "forward", "sampler")


@dataclass(frozen=True)
class Request:
    prompt_token_ids: list[int]
    max_tokens: int


def make_requests(num_requests: int, prompt_len: tuple[int, int], output_len: tuple[int, int], vocab_size: int,
                  seed: int = 0) -> list[Request]:
    """Uniform prompt and output lengths; prompt ids avoid the lowest 10% of the vocabulary
    (special and byte tokens)."""
    rng = random.Random(seed)
    low = vocab_size // 10
    return [Request([rng.randrange(low, vocab_size) for _ in range(rng.randint(*prompt_len))],
                    rng.randint(*output_len)) for _ in range(num_requests)]


def sampling_params(mix: str, index: int, max_tokens: int):
    from pagoda.engine.sampling_params import SamplingParams

    if mix == "greedy":
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    seed = index if mix == "seeded" and index % 2 == 0 else None
    return SamplingParams(temperature=0.8, top_p=0.95, seed=seed, max_tokens=max_tokens, ignore_eos=True)


@dataclass
class StageClock:
    """Seconds spent in each wrapped stage since the last ``reset``."""

    device: torch.device
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(_STAGES, 0.0))

    def reset(self) -> None:
        self.seconds = dict.fromkeys(_STAGES, 0.0)

    def timed(self, stage: str, fn, sync: bool = False):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            result = fn(*args, **kwargs)
            if sync and self.device.type == "cuda":
                torch.cuda.synchronize()
            self.seconds[stage] += time.perf_counter() - start
            return result
        return wrapper


class _TimedSampler:
    """Stands in for the engine's sampler: times ``__call__``, forwards everything else."""

    def __init__(self, sampler, clock: StageClock) -> None:
        self._sampler = sampler
        self._call = clock.timed("sampler", sampler.__call__)

    def __call__(self, *args, **kwargs):
        return self._call(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._sampler, name)


def _owner(engine, name: str):
    """The object holding ``name``: the engine, or a part it delegates to (engine core,
    executor, runner, the runner's step sampler)."""
    runner = getattr(engine, "runner", None)
    for holder in (engine, getattr(engine, "engine_core", None), getattr(engine, "core", None),
                   getattr(engine, "executor", None), getattr(runner, "step_sampler", None), runner):
        if holder is not None and name in vars(holder):
            return holder
    raise AttributeError(f"bench throughput: cannot find the engine's {name}")


def instrument(engine, device: torch.device) -> StageClock:
    clock = StageClock(device)
    scheduler = getattr(_owner(engine, "scheduler"), "scheduler")
    scheduler.schedule = clock.timed("schedule", scheduler.schedule)
    runner = getattr(_owner(engine, "runner"), "runner")
    # A step's forward is the runner's two halves (ModelRunner.forward, then finish_logits).
    runner.forward = clock.timed("forward", runner.forward, sync=True)
    runner.finish_logits = clock.timed("forward", runner.finish_logits, sync=True)
    holder = _owner(engine, "sampler")
    setattr(holder, "sampler", _TimedSampler(getattr(holder, "sampler"), clock))
    return clock


def run_mix(engine, clock: StageClock, requests: list[Request], mix: str) -> dict:
    """Submit every request with ``mix``'s settings, step until idle, and measure."""
    for i, request in enumerate(requests):
        engine.add_request(f"{mix}-{i}", request.prompt_token_ids, sampling_params(mix, i, request.max_tokens))
    clock.reset()
    step_seconds, num_output = [], 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        step_start = time.perf_counter()
        outputs = engine.step()
        step_seconds.append(time.perf_counter() - step_start)
        num_output += sum(len(out.outputs[0].token_ids) for out in outputs if out.finished)
    wall = time.perf_counter() - start
    num_prompt = sum(len(r.prompt_token_ids) for r in requests)
    total_step = sum(step_seconds)
    shares = {stage: clock.seconds[stage] / total_step for stage in _STAGES}
    shares["rest"] = max(0.0, 1.0 - sum(shares.values()))
    return {"mix": mix, "wall_s": wall, "output_tokens": num_output, "prompt_tokens": num_prompt,
            "output_tok_s": num_output / wall, "total_tok_s": (num_output + num_prompt) / wall,
            "steps": len(step_seconds), "step_p50_ms": 1e3 * statistics.median(step_seconds), "shares": shares,
            "stage_s": dict(clock.seconds, step=total_step)}


def build_engine(args, device: torch.device, folder: Path):
    from pagoda.bench.kernels_e2e import LLAMA3_8B, SMALL, raw_config, write_model_folder
    from pagoda.engine.config import EngineConfig
    from pagoda.engine.llm_engine import LLMEngine

    common = dict(device=device.type, max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens,
                  max_model_len=args.max_model_len, enable_prefix_caching=False, seed=args.seed)
    if device.type == "cpu" and not args.small:
        from pagoda.models.gguf_import import ensure_default_model
        return LLMEngine(EngineConfig(model=str(args.model or ensure_default_model()), **common)), "SmolLM2-135M"
    write_model_folder(folder, raw_config(SMALL if args.small else LLAMA3_8B))
    shape = "tiny random config" if args.small else "Llama-3-8B shape, random weights"
    return LLMEngine(EngineConfig(model=str(folder), load_format="dummy", dtype=args.dtype, **common)), shape


def _defaults(args, device: torch.device) -> None:
    gpu = device.type == "cuda" and not args.small
    for name, cpu_value, gpu_value in (("num_requests", 64, 800), ("prompt_len", (16, 64), (64, 1024)),
                                       ("output_len", (8, 48), (32, 512)), ("max_num_seqs", 64, 256),
                                       ("max_num_batched_tokens", 2048, 8192), ("max_model_len", 256, 2048)):
        if getattr(args, name) is None:
            setattr(args, name, gpu_value if gpu else cpu_value)


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pagoda bench throughput", description=__doc__.split("\n")[0])
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--model", default=None, help="model folder on the CPU (default: the default model)")
    p.add_argument("--small", action="store_true", help="tiny random model instead (tests)")
    p.add_argument("--dtype", default="auto", help="dtype of the random-weight model (auto: bf16 on GPU)")
    p.add_argument("--mixes", default=",".join(MIXES), help=f"comma-separated subset of {','.join(MIXES)}")
    p.add_argument("--num-requests", type=int, default=None)
    p.add_argument("--prompt-len", type=int, nargs=2, default=None, metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=None, metavar=("MIN", "MAX"))
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1, help="rounds over the mixes; the fastest run of each is kept")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (CPU)")
    p.add_argument("--json", default=None, help="also write the results to this file")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats: must be >= 1, got {args.repeats}")
    unknown = set(args.mixes.split(",")) - set(MIXES)
    if unknown:
        p.error(f"--mixes: unknown {sorted(unknown)}; choose from {list(MIXES)}")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          "cpu" if args.device == "auto" else args.device)
    _defaults(args, device)
    with tempfile.TemporaryDirectory() as tmp:
        engine, model_name = build_engine(args, device, Path(tmp))
        clock = instrument(engine, device)
        requests = make_requests(args.num_requests, tuple(args.prompt_len), tuple(args.output_len),
                                 engine.model_config.vocab_size, args.seed)
        for mix in args.mixes.split(","):  # warm-up: first-call costs (kernels, graphs) of each path
            run_mix(engine, clock, requests[:2], mix)
        rounds = [[run_mix(engine, clock, requests, mix) for mix in args.mixes.split(",")]
                  for _ in range(args.repeats)]
    # Mixes alternate within each round; the fastest run of each mix is reported (load drifts).
    results = [min(runs, key=lambda r: r["wall_s"]) for runs in zip(*rounds)]
    report = {"machine": _machine(device), "threads": torch.get_num_threads(), "model": model_name,
              "repeats": args.repeats,
              "num_requests": len(requests), "prompt_len": args.prompt_len, "output_len": args.output_len,
              "max_num_seqs": args.max_num_seqs, "mixes": results}
    print_report(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


def _machine(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}"
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}"


def print_report(report: dict) -> None:
    print(f"machine: {report['machine']} ({report['threads']} torch threads); model: {report['model']}")
    print(f"workload: {report['num_requests']} requests, prompts {report['prompt_len']}, outputs "
          f"{report['output_len']}, max_num_seqs {report['max_num_seqs']}, ignore_eos; "
          f"best of {report['repeats']} round(s)")
    print("| mix | wall s | output tok/s | total tok/s | steps | step p50 ms | schedule | forward | sampler | rest |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in report["mixes"]:
        s = r["shares"]
        print(f"| {r['mix']} | {r['wall_s']:.1f} | {r['output_tok_s']:.1f} | {r['total_tok_s']:.1f} | {r['steps']} | "
              f"{r['step_p50_ms']:.1f} | {100 * s['schedule']:.1f}% | {100 * s['forward']:.1f}% | "
              f"{100 * s['sampler']:.1f}% | {100 * s['rest']:.1f}% |")
    by_mix = {r["mix"]: r for r in report["mixes"]}
    if "greedy" in by_mix:
        for mix in ("sampled", "seeded"):
            if mix in by_mix:
                ratio = by_mix[mix]["wall_s"] / by_mix["greedy"]["wall_s"]
                sampler_ms = 1e3 * by_mix[mix]["stage_s"]["sampler"] / by_mix[mix]["steps"]
                print(f"{mix} / greedy wall time: {ratio:.2f}x; sampler {sampler_ms:.1f} ms per step "
                      f"(greedy {1e3 * by_mix['greedy']['stage_s']['sampler'] / by_mix['greedy']['steps']:.1f} ms)")
