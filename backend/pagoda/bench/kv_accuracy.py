"""``pagoda bench kernels --kv-accuracy``: what an fp8 (e4m3) KV cache costs in accuracy.

Two models: the default model (SmolLM2-135M-Instruct, real weights) and a random Llama
(the bench's ``--small`` shape, seeded dummy weights). For each, the same weights run with
the cache in the model dtype and with ``kv_cache_dtype="fp8_e4m3"`` (per-tensor scale
1.0):

* free-running greedy: the engine generates ``--kv-accuracy-tokens`` tokens per prompt
  with each cache; the table gives the identical prefix per prompt;
* teacher-forced logits: each prompt plus the full-precision cache's greedy continuation
  goes through the model in one step (every position's attention reads K/V back from the
  cache), and the logits of every position are compared: max and mean absolute
  difference, the logits' standard deviation for scale, and the share of positions whose
  argmax agrees (the same context, so one early divergence does not hide the rest).

Runs on CPU (fp32 model, the torch references) or a GPU (``--device cuda``: bf16, the
Triton kernels). Also prints the largest |K| and |V| the default model writes, against
e4m3's saturation at 448.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from pagoda.bench import kernels_e2e

PROMPTS = (
    "The history of the printing press begins in",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Photosynthesis converts light energy into chemical energy. In plants, the process",
    "Dear team, thank you for the quick turnaround on the report. Before we publish it,",
)
BLOCK_SIZE = 16


def _engines(model: str, args: argparse.Namespace, **extra):
    from pagoda.engine.config import EngineConfig
    from pagoda.engine.llm_engine import LLMEngine

    common = dict(model=model, device=args.device, dtype=args.dtype, enable_cuda_graphs=False,
                  kv_cache_memory_bytes=64 * 2**20, gpu_memory_utilization=0.5, **extra)
    return [LLMEngine(EngineConfig(**common, kv_cache_dtype=kind)) for kind in ("auto", "fp8_e4m3")]


def _teacher_forced(model, tokens: list[int], fp8: bool) -> torch.Tensor:
    from pagoda.models.testing import StepInput, make_kv_caches, run_step

    blocks = -(-len(tokens) // BLOCK_SIZE)
    caches = make_kv_caches(model.config, blocks, BLOCK_SIZE, dtype=model.dtype, device=str(model.device))
    if fp8:
        caches = [(k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)) for k, v in caches]
    return run_step(model, caches, [StepInput(tokens, 0, list(range(blocks)))], BLOCK_SIZE).float()


def _greedy(engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from pagoda.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[int(out.request_id)] = list(out.outputs[0].token_ids)
    return [done[i] for i in range(len(prompts))]


def _kv_magnitudes(model, tokens: list[int]) -> tuple[float, float]:
    """Largest |K| and |V| written to the cache for ``tokens`` (hooks on write_kv)."""
    from pagoda import kernels

    seen = [0.0, 0.0]
    real = kernels.write_kv

    def spy(k, v, *rest, **kw):
        seen[0], seen[1] = max(seen[0], k.abs().max().item()), max(seen[1], v.abs().max().item())
        return real(k, v, *rest, **kw)

    kernels.write_kv = spy
    try:
        _teacher_forced(model, tokens, fp8=False)
    finally:
        kernels.write_kv = real
    return seen[0], seen[1]


def _model_rows(name: str, engines, prompts: list[list[int]], max_tokens: int) -> list[str]:
    full, fp8 = engines
    ours, theirs = _greedy(full, prompts, max_tokens), _greedy(fp8, prompts, max_tokens)
    max_err, sum_err, count, agree, positions, std = 0.0, 0.0, 0, 0, 0, 0.0
    for prompt, continuation in zip(prompts, ours):
        # The full-precision cache's own greedy text: the contexts a user would see.
        a = _teacher_forced(full.runner.model, prompt + continuation, fp8=False)
        b = _teacher_forced(fp8.runner.model, prompt + continuation, fp8=True)
        diff = (a - b).abs()
        max_err, sum_err, count = max(max_err, diff.max().item()), sum_err + diff.sum().item(), count + diff.numel()
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        positions += a.shape[0]
        std = max(std, a.std().item())
    prefixes = [next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), len(p)) for p, q in zip(ours, theirs)]
    return [f"| {name} | {positions} | {max_err:.3g} | {sum_err / count:.3g} | {std:.3g} | "
            f"{100 * agree / positions:.1f}% | {sum(p == max_tokens for p in prefixes)}/{len(prompts)} "
            f"({', '.join(map(str, prefixes))} of {max_tokens}) |"]


def run(args: argparse.Namespace) -> list[str]:
    if args.device == "cuda" and not torch.cuda.is_available():
        return ["--kv-accuracy --device cuda needs a CUDA GPU; use --device cpu"]
    from pagoda.models.gguf_import import ensure_default_model

    max_tokens = getattr(args, "kv_accuracy_tokens", 32)
    lines = [f"### FP8 (e4m3, scale 1.0) KV cache vs the {args.dtype} cache, device {args.device}\n",
             "| model | positions | max abs logit err | mean abs logit err | logit std | top-1 agreement "
             "(teacher-forced) | greedy identical (free-running, prefix lengths) |",
             "|---|---:|---:|---:|---:|---:|---|"]
    default = _engines(str(ensure_default_model()), args)
    tok = default[0].tokenizer
    prompts = [tok.encode(p) for p in PROMPTS]
    lines += _model_rows("SmolLM2-135M-Instruct", default, prompts, max_tokens)
    k_max, v_max = _kv_magnitudes(default[0].runner.model, prompts[0] + prompts[2])
    del default
    with tempfile.TemporaryDirectory() as tmp:
        kernels_e2e.write_model_folder(Path(tmp), kernels_e2e.raw_config(kernels_e2e.SMALL))
        engines = _engines(tmp, args, load_format="dummy")
        gen = torch.Generator().manual_seed(1)
        vocab = engines[0].runner.model.config.vocab_size
        rand_prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (12, 40, 64, 100)]
        lines += _model_rows("random Llama (--small shape)", engines, rand_prompts, max_tokens)
    lines += ["", f"Largest |K| / |V| the default model writes (two prompts): {k_max:.3g} / {v_max:.3g} "
              "(e4m3 saturates at 448 with scale 1.0)"]
    return lines
