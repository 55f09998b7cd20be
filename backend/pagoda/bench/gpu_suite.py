"""``pagoda bench gpu``: the whole GPU measurement in one command, inside a time budget.

A GPU is lent now and then, for minutes. This command runs, in order, what only a GPU
shows and writes one Markdown report plus a JSON beside it (default
``docs/gpu-runs/<device>-<date>.md``): the environment first, then correctness, then speed.
Each step is one of the project's own commands run as a child process (so one step's CUDA
error or hang cannot take the suite with it) with a time budget; it is killed at its
budget, and a step whose budget no longer fits in what is left of the run is skipped and
reported as such. ``--quick`` is a five-minute plan, the default a ten-minute one; both
need nothing from the network (the Llama-3-8B shape uses dummy weights). Steps:

=====================  ===========  ==============================================================
step                   section      what (the command's own docs say how it measures)
=====================  ===========  ==============================================================
environment            environment  GPU, driver, CUDA, torch, triton, Python (in process)
greedy-fp32 / -bf16    correctness  engine vs Hugging Face greedy agreement, tiny random Llama
                                    (``bench kernels --skip-kernels --small``)
kernels-bf16 / -fp16   correctness  every Triton kernel family vs its float64 reference on CUDA
                                    tensors (``bench kernel-check``)
kv-fp8-accuracy        correctness  fp8 KV cache: logits error and greedy agreement
attention              speed        decode attention % of copy bandwidth at batch 1/8/64 (4k
                                    context), prefill vs SDPA at 1k-8k, fp8-cache decode
e2e-llama3-8b          speed        batch-1 decode (CUDA graphs and eager) vs the HBM roofline,
                                    the mixed workload vs HF, greedy agreement
quant-llama3-8b        speed        int8 / fp8 weights batch-1 decode vs bf16
throughput             speed        greedy / sampled / seeded at 256 sequences, stage shares
served                 speed        ``pagoda serve`` + 64 streams (``bench serve --launch``)
=====================  ===========  ==============================================================

Not steps yet (the report lists them): FP8 ``_scaled_mm`` against a reference (torch's own
kernel; ``bench quant`` times it), the sampler's device guard and seeded reproducibility with async scheduling on and
off on CUDA, and ``bench throughput`` with async scheduling off.

``--dry-run`` (any device, e.g. ``--device cpu``) walks the same plan without running
it: every step's arguments are parsed by its command's own parser, a fake clock advances
by each step's budget, and the report is written in the same format — which is how the
test suite checks the plan, the budgets and the report on a CPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

QUICK_BUDGET_S = 300.0
FULL_BUDGET_S = 600.0
OUTPUT_TAIL_CHARS = 6000


@dataclass(frozen=True)
class Step:
    name: str
    section: str  # environment | correctness | speed
    argv: tuple[str, ...]  # after `python -m`; empty: run in process (environment)
    budget_s: float


@dataclass
class StepResult:
    name: str
    section: str
    status: str  # ok | failed | timed out | skipped | dry run
    budget_s: float
    seconds: float = 0.0
    command: str = ""
    output: str = ""
    note: str = ""


def _bench(*args: str) -> tuple[str, ...]:
    return ("pagoda.cli", "bench", *args)


def plan(quick: bool) -> list[Step]:
    """The steps, in order; their budgets sum to at most the plan's budget."""
    steps = [
        Step("environment", "environment", (), 5),
        # first Triton compiles included: 25 s was not enough on an H200 (2026-11-28; 37 s alone)
        Step("greedy-fp32", "correctness", _bench("kernels", "--skip-kernels", "--small", "--dtype", "float32"), 45),
        Step("kernels-bf16", "correctness", _bench("kernel-check", "--dtype", "bfloat16"), 30),
    ]
    if not quick:
        steps += [
            Step("greedy-bf16", "correctness", _bench("kernels", "--skip-kernels", "--small"), 45),
            Step("kernels-fp16", "correctness", _bench("kernel-check", "--dtype", "float16"), 30),
            Step("kv-fp8-accuracy", "correctness", _bench("kernels", "--kv-accuracy"), 40),
        ]
    attention = ("--batch-sizes", "1,8,64", "--prefill-lens", "1024,4096", "--iters", "10") if quick else \
        ("--batch-sizes", "1,8,64", "--prefill-lens", "1024,2048,4096,8192")
    steps.append(Step("attention", "speed", _bench("kernels", "--skip-e2e", *attention), 35 if quick else 70))
    e2e = ("--skip-hf", "--e2e-requests", "8") if quick else ()
    steps.append(Step("e2e-llama3-8b", "speed", _bench("kernels", "--skip-kernels", *e2e), 65 if quick else 110))
    if not quick:
        steps.append(Step("quant-llama3-8b", "speed", _bench("quant", "--llama3-8b", "--repeats", "1"), 60))
    steps.append(Step("throughput", "speed",
                      _bench("throughput", "--device", "cuda", "--num-requests", "64" if quick else "256"),
                      45 if quick else 80))
    steps.append(Step("served", "speed",
                      _bench("serve", "--launch", "--num-requests", "64", "--concurrency", "64",
                             "--max-output-tokens", "32" if quick else "128", "--max-num-seqs", "64"),
                      55 if quick else 80))
    return steps


NOT_YET = [
    "FP8 _scaled_mm against a reference (torch's own kernel; bench quant times it)",
    "the sampler's device guard and seeded reproducibility with async scheduling on and off, on CUDA",
    "bench throughput with async scheduling off (forward share and sampler ms per step, both ways)",
]


def parse_step_args(step: Step) -> None:
    """Parse ``step``'s arguments with its command's own parser (raises ``SystemExit`` / ``ValueError``)."""
    if not step.argv:
        return
    if step.argv[:2] != ("pagoda.cli", "bench"):
        raise ValueError(f"{step.name}: not a bench command: {step.argv}")
    bench, args = step.argv[2], list(step.argv[3:])
    if bench == "kernels":
        from pagoda.bench.kernels import parse_args
    elif bench == "throughput":
        from pagoda.bench.throughput import parse_args
    elif bench == "serve":
        from pagoda.bench.serve import make_parser

        parse_args = make_parser().parse_args
    elif bench == "quant":
        from pagoda.bench.quant import make_parser

        parse_args = make_parser().parse_args
    elif bench == "kernel-check":
        from pagoda.bench.kernel_check import make_parser

        parse_args = make_parser().parse_args
    else:
        raise ValueError(f"{step.name}: no parser known for bench {bench!r}")
    parse_args(args)


def environment(device: str) -> dict[str, str]:
    """What the report names first: the device and the software under test."""
    info = {"python": platform.python_version(), "machine": platform.machine(), "device": device}
    try:
        import torch

        info["torch"] = torch.__version__
        info["cuda"] = str(torch.version.cuda)
        if device == "cuda" and torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            info["gpu"] = props.name
            info["gpu_memory_gib"] = f"{props.total_memory / 2**30:.1f}"
            info["compute_capability"] = f"{props.major}.{props.minor}"
    except ImportError:
        info["torch"] = "not installed"
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = "not installed"
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        if smi.returncode == 0:
            info["driver"] = smi.stdout.strip().splitlines()[0]
    except (OSError, subprocess.TimeoutExpired):
        pass
    return info


Runner = Callable[[Step, float], StepResult]


def subprocess_runner(step: Step, timeout_s: float) -> StepResult:
    """Run ``python -m <argv>``; killed at ``timeout_s``."""
    command = [sys.executable, "-m", *step.argv]
    result = StepResult(step.name, step.section, "ok", step.budget_s, command=" ".join(command[2:]))
    start = time.monotonic()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s,
                              env={**os.environ, "TRITON_INTERPRET": "0"})
        result.output = (done.stdout + done.stderr)[-OUTPUT_TAIL_CHARS:]
        if done.returncode != 0:
            result.status, result.note = "failed", f"exit code {done.returncode}"
    except subprocess.TimeoutExpired as exc:
        text = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        result.output = text[-OUTPUT_TAIL_CHARS:]
        result.status, result.note = "timed out", f"killed at its budget ({timeout_s:.0f} s)"
    result.seconds = time.monotonic() - start
    return result


class FakeClock:
    """Monotonic seconds that move only when told (the dry run's clock)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def dry_runner(clock: FakeClock) -> Runner:
    """Parses each step's arguments, runs nothing, and lets the step take its whole budget."""

    def run(step: Step, timeout_s: float) -> StepResult:
        result = StepResult(step.name, step.section, "dry run", step.budget_s,
                            command=" ".join(step.argv), output="(dry run: arguments parsed, nothing executed)")
        try:
            parse_step_args(step)
        except (SystemExit, ValueError) as exc:
            result.status, result.note = "failed", f"its arguments do not parse: {exc}"
        clock.now += min(step.budget_s, timeout_s)
        result.seconds = min(step.budget_s, timeout_s)
        return result

    return run


@dataclass
class SuiteRun:
    environment: dict[str, str]
    budget_s: float
    results: list[StepResult] = field(default_factory=list)
    dry_run: bool = False

    @property
    def seconds(self) -> float:
        return sum(r.seconds for r in self.results)


def run_suite(steps: list[Step], budget_s: float, runner: Runner, clock: Callable[[], float],
              env: dict[str, str], dry_run: bool = False) -> SuiteRun:
    """Run ``steps`` in order within ``budget_s`` (see the module doc for the skip rule)."""
    run = SuiteRun(env, budget_s, dry_run=dry_run)
    start = clock()
    for step in steps:
        left = budget_s - (clock() - start)
        if not step.argv:
            run.results.append(StepResult(step.name, step.section, "ok", step.budget_s, note="in process"))
            continue
        if step.budget_s > left:
            note = f"would overrun: needs {step.budget_s:.0f} s, {max(left, 0):.0f} s left"
            run.results.append(StepResult(step.name, step.section, "skipped", step.budget_s,
                                          command=" ".join(step.argv), note=note))
            continue
        run.results.append(runner(step, step.budget_s))
    return run


def render_markdown(run: SuiteRun) -> str:
    title = run.environment.get("gpu") or run.environment.get("device", "?")
    lines = [f"# pagoda bench gpu: {title}{' (dry run)' if run.dry_run else ''}", "",
             f"Budget {run.budget_s:.0f} s; steps took {run.seconds:.0f} s.", "", "## Environment", "",
             "| key | value |", "|---|---|", *(f"| {k} | {v} |" for k, v in run.environment.items()), ""]
    lines += ["## Steps", "", "| step | section | status | seconds | budget | note |", "|---|---|---|---|---|---|"]
    lines += [f"| {r.name} | {r.section} | {r.status} | {r.seconds:.0f} | {r.budget_s:.0f} | {r.note} |"
              for r in run.results]
    lines += ["", "Not measured by this suite yet:", "", *(f"- {item}" for item in NOT_YET), ""]
    for section in ("correctness", "speed"):
        lines += [f"## {section.capitalize()}", ""]
        for r in (r for r in run.results if r.section == section):
            lines += [f"### {r.name}: {r.status}", "", f"`python -m {r.command}`" if r.command else "", ""]
            if r.output:
                lines += ["```", r.output.rstrip(), "```", ""]
    return "\n".join(lines)


def default_report_path(env: dict[str, str]) -> Path:
    device = (env.get("gpu") or env.get("device", "device")).lower().replace(" ", "-")
    return Path("docs/gpu-runs") / f"{device}-{datetime.date.today().isoformat()}.md"


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="pagoda bench gpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help=f"the {QUICK_BUDGET_S / 60:.0f}-minute plan")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--dry-run", action="store_true", help="walk the plan without running it (any device)")
    p.add_argument("--budget", type=float, default=None, help="seconds for the whole run (default: the plan's)")
    p.add_argument("--out", default=None, help="report path (.md; a .json is written beside it)")
    args = p.parse_args(argv)
    if args.device == "cuda" and not args.dry_run:
        import torch

        if not torch.cuda.is_available():
            print("pagoda bench gpu: needs a CUDA GPU (use --dry-run to walk the plan here)", file=sys.stderr)
            return 2
    budget = args.budget or (QUICK_BUDGET_S if args.quick else FULL_BUDGET_S)
    env = environment(args.device)
    if args.dry_run:
        clock = FakeClock()
        run = run_suite(plan(args.quick), budget, dry_runner(clock), clock, env, dry_run=True)
    else:
        run = run_suite(plan(args.quick), budget, subprocess_runner, time.monotonic, env)
    out = Path(args.out) if args.out else (None if args.dry_run else default_report_path(env))
    text = render_markdown(run)
    if out is None:
        print(text)
    else:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        out.with_suffix(".json").write_text(json.dumps(
            {"environment": env, "budget_s": budget, "dry_run": run.dry_run,
             "steps": [asdict(r) for r in run.results]}, indent=2))
        print(f"report: {out} (and {out.with_suffix('.json').name})")
    return 0 if all(r.status in ("ok", "dry run", "skipped") for r in run.results) else 1
