"""``pagoda bench offline --tensor-parallel-size N``: one workload at TP=1 and at TP=N, in one run.

``--pipeline-parallel-size N`` does the same for pipeline parallelism (PP=1 vs PP=N, the rows
labelled PP; the two flags do not combine), and prints the PP=N engine's micro-batches and the
steps it had in flight (``core.batch_queue``; ``--pipeline-micro-batches M`` sets them, 1: one
step at a time, to compare against the default N). Under PP the "broadcast" is the same step
broadcast (``StepSender``); the stages' hand-overs and the logits' return are part of the
device time.

The model is a random Llama config big enough that compute dominates (``--tp-config``:
``0.5b`` by default, ~0.49B parameters: hidden 1024, 24 layers, intermediate 4096, 16
query / 8 KV heads, SmolLM2's 49152-token vocabulary, tied head; seeded weights through
``load_format="dummy"``, SmolLM2's tokenizer), or ``default`` (SmolLM2-135M itself);
``--model FOLDER`` runs a checkpoint instead (e.g. Llama-3.1-70B at TP=8 on one node). Each
engine runs the seeded offline workload (``bench/workload.py``: greedy, ``ignore_eos``)
after a warm-up request, synchronously; the two engines run one after the other, never
at once.

Reported per TP size: output tokens/s, the per-step host/device timing of
``EngineStats``, and for TP=N the broadcast cost: rank 0's host time in
``StepSender.send`` (packing the step's deltas, the copy, the one collective) per step,
and its share of the step's device time (the job's wall time, the broadcast included).
The greedy outputs of the two runs are compared token for token and the count of equal
requests printed. On CPU each rank gets ``cores / N`` torch threads, the TP=1 engine all
of them; on a shared machine the figures are indicative only.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

CONFIGS = {"0.5b": dict(hidden_size=1024, num_hidden_layers=24, intermediate_size=4096, num_attention_heads=16,
                        num_key_value_heads=8, head_dim=64)}


def _model_folder(name: str, work: Path) -> str:
    from pagoda.models.gguf_import import ensure_default_model

    default = Path(ensure_default_model())
    if name == "default":
        return str(default)
    raw = json.loads((default / "config.json").read_text())
    raw.update(CONFIGS[name])
    raw.pop("pagoda_gguf_import_version", None)
    folder = work / f"random-{name}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(raw))
    for tokenizer_file in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(default / tokenizer_file, folder / tokenizer_file)
    return str(folder)


def _run_workload(engine, items) -> dict:
    """One pass: output tokens/s and the per-step means of ``EngineStats``' timing."""
    from pagoda.engine.sampling_params import SamplingParams

    before = engine.get_stats()
    start = time.perf_counter()
    for i, item in enumerate(items):
        engine.add_request(str(i), item.prompt_token_ids,
                           SamplingParams(temperature=0, max_tokens=item.max_tokens, ignore_eos=True))
    num_tokens = 0
    while engine.has_unfinished_requests():
        num_tokens += sum(len(out.outputs[0].token_ids) for out in engine.step() if out.finished)
    elapsed = time.perf_counter() - start
    stats = engine.get_stats()
    steps = stats.num_steps - before.num_steps
    timing = {name: (getattr(stats, f"step_{name}") - getattr(before, f"step_{name}")) / max(steps, 1)
              for name in ("host_s", "device_s")}
    return {"tokens": num_tokens, "seconds": elapsed, "tokens_per_s": num_tokens / elapsed, "steps": steps,
            "per_step": timing}


def _run_size(path: str, items, args, tp: int, field: str = "tensor_parallel_size") -> dict:
    from pagoda.engine.config import EngineConfig
    from pagoda.engine.llm_engine import LLMEngine
    from pagoda.engine.sampling_params import SamplingParams

    load_format = "safetensors" if args.model or args.tp_config == "default" else "dummy"
    threads = torch.get_num_threads()
    micro_batches = getattr(args, "pipeline_micro_batches", None)
    if field == "pipeline_parallel_size" and tp > 1 and micro_batches is not None:
        field_values = {field: tp, "pipeline_micro_batches": micro_batches}
    else:
        field_values = {field: tp}
    engine = LLMEngine(EngineConfig(model=path, load_format=load_format, **field_values,
                                    max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                                    max_model_len=args.max_model_len, enable_prefix_caching=False))
    try:
        engine.add_request("warmup", items[0].prompt_token_ids[:16], SamplingParams(temperature=0, max_tokens=2))
        while engine.has_unfinished_requests():
            engine.step()
        sender = engine.runner.step_sender
        before = (sender.total_s, sender.steps) if sender is not None else (0.0, 0)
        outputs: dict = {}
        recording = _Recording(engine, outputs)
        result = _run_workload(recording, items)
        if recording.decode_steps:
            result["decode_steps"] = recording.decode_steps
            result["decode_device_ms_per_step"] = 1e3 * recording.decode_device_s / recording.decode_steps
            result["decode_broadcast_us_per_step"] = 1e6 * recording.decode_broadcast_s / recording.decode_steps
            result["decode_broadcast_share"] = recording.decode_broadcast_s / max(recording.decode_device_s, 1e-12)
        if sender is not None:
            steps = sender.steps - before[1]
            result["broadcast_us_per_step"] = 1e6 * (sender.total_s - before[0]) / max(steps, 1)
            result["broadcast_share_of_device_step"] = (result["broadcast_us_per_step"] * 1e-6
                                                        / max(result["per_step"]["device_s"], 1e-12))
            result["broadcast_overflows"] = sender.overflows
        result["outputs"] = outputs
        result["torch_threads_rank0"] = torch.get_num_threads()
        result["micro_batches"] = engine.config.micro_batches
        issued = [in_flight for kind, _, in_flight in getattr(engine.core, "step_events", ()) if kind == "issue"]
        result["max_steps_in_flight"] = getattr(engine.core, "max_in_flight", 1)
        result["mean_steps_in_flight"] = sum(issued) / len(issued) if issued else 1.0
        return result
    finally:
        engine.shutdown()
        torch.set_num_threads(threads)


class _Recording:
    """The engine, with each finished request's tokens kept (to compare the two runs) and,
    at TP > 1, the device time and broadcast time of the pure decode steps summed."""

    def __init__(self, engine, outputs: dict) -> None:
        self._engine, self._outputs = engine, outputs
        self.decode_steps, self.decode_device_s, self.decode_broadcast_s = 0, 0.0, 0.0

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def step(self):
        sender = self._engine.runner.step_sender
        before = self._engine.get_stats().step_device_s if sender is not None else 0.0
        outs = self._engine.step()
        if sender is not None and sender.last_is_decode:
            self.decode_steps += 1
            self.decode_device_s += self._engine.get_stats().step_device_s - before
            self.decode_broadcast_s += sender.last_s
        for out in outs:
            if out.finished:
                self._outputs[out.request_id] = list(out.outputs[0].token_ids)
        return outs


def _mode(args) -> tuple[str, str, int]:
    """(EngineConfig field, label, size): pipeline parallelism when asked for, else tensor."""
    if getattr(args, "pipeline_parallel_size", 1) > 1:
        if args.tensor_parallel_size > 1:
            raise SystemExit("pagoda bench offline: --tensor-parallel-size and --pipeline-parallel-size each compare "
                             "one size against 1; pass one of them")
        return "pipeline_parallel_size", "PP", args.pipeline_parallel_size
    return "tensor_parallel_size", "TP", args.tensor_parallel_size


def main(args) -> int:
    """Run TP=1 then TP=``args.tensor_parallel_size`` (or PP: ``_mode``; arguments parsed by ``bench.offline``)."""
    field, label, size = _mode(args)
    from pagoda.bench.workload import make_workload

    items = [dataclasses.replace(item, max_tokens=min(item.max_tokens, args.tp_max_tokens))
             for item in make_workload(args.num_requests, args.seed)]
    with tempfile.TemporaryDirectory() as work:
        path = args.model or _model_folder(args.tp_config, Path(work))
        results = {"machine": f"{os.cpu_count()} cores, torch {torch.__version__}",
                   "model": args.model or args.tp_config,
                   "num_requests": len(items), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        for tp in (1, size):
            results[f"tp{tp}"] = _run_size(path, items, args, tp, field)
    base, other = results["tp1"], results[f"tp{size}"]
    same = sum(base["outputs"][k] == other["outputs"].get(k) for k in base["outputs"])
    results["speedup"] = other["tokens_per_s"] / base["tokens_per_s"]
    results["identical_outputs"] = f"{same}/{len(base['outputs'])}"
    results["mode"] = label
    _print(results, size, label)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


def _print(results: dict, tp: int, label: str = "TP") -> None:
    """The table; ``label``: TP or PP (the results keep the keys ``tp1`` and ``tpN`` for both)."""
    print(f"machine: {results['machine']}; model: {results['model']}; {results['num_requests']} requests")
    print(f"torch threads: {label}=1 {results['tp1']['torch_threads_rank0']}, "
          f"{label}={tp} {results[f'tp{tp}']['torch_threads_rank0']} per rank")
    print(f"| {label} | output tokens/s | steps | host ms/step | device ms/step | broadcast µs/step "
          "| broadcast share |")
    print("|---|---|---|---|---|---|---|")
    for size in (1, tp):
        r = results[f"tp{size}"]
        t = r["per_step"]
        bcast = (f"{r['broadcast_us_per_step']:.0f} | {100 * r['broadcast_share_of_device_step']:.2f}%"
                 if "broadcast_us_per_step" in r else "- | -")
        print(f"| {size} | {r['tokens_per_s']:.1f} | {r['steps']} | {1e3 * t['host_s']:.2f} | "
              f"{1e3 * t['device_s']:.2f} | {bcast} |")
    r = results[f"tp{tp}"]
    if label == "PP":
        print(f"PP={tp} micro-batches: {r['micro_batches']} (steps in flight: at most {r['max_steps_in_flight']}, "
              f"{r['mean_steps_in_flight']:.2f} on average as each step was issued)")
    if "decode_steps" in r:
        print(f"{label}={tp} decode steps only ({r['decode_steps']}): "
              f"device {r['decode_device_ms_per_step']:.2f} ms/step, "
              f"broadcast {r['decode_broadcast_us_per_step']:.0f} µs/step "
              f"= {100 * r['decode_broadcast_share']:.2f}% of it")
    print(f"{label}={tp} vs {label}=1 speedup: {results['speedup']:.2f}x; greedy outputs identical: "
          f"{results['identical_outputs']}")
