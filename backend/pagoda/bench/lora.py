"""``pagoda bench lora``: throughput with 1, 4 and 16 LoRA adapters in a batch vs the base model.

One engine with ``enable_lora`` (slots for the most adapters measured) runs the same
workload — ``--num-requests`` prompts of ``--prompt-len`` tokens, ``--output-len`` greedy
tokens each (``ignore_eos``), all submitted at once — several times: requests naming no
adapter (the base model), then requests spread round-robin over 1, 4 and 16 adapters.
Adapters are random, written in PEFT's format (``adapter_config.json`` +
``adapter_model.safetensors``, targets q/k/v/o/gate/up/down) at ``--rank``. Runs are
interleaved ``--repeats`` times and the best of each kept, so the ratios come from one
process on one machine. Printed: output tokens/s and the ratio to the base model.

Defaults: the default model on CPU (small workload); ``--model`` / ``--device cuda`` for a
GPU, where the Triton BGMV kernels serve the adapters.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import torch

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_random_adapter(folder: Path, model_config, rank: int, seed: int) -> Path:
    """A random LoRA adapter for ``model_config`` in PEFT's on-disk format."""
    from safetensors.torch import save_file

    from pagoda.models.lora import target_shapes

    gen = torch.Generator().manual_seed(seed)
    shapes = target_shapes(model_config)
    tensors = {}
    for layer in range(model_config.num_hidden_layers):
        for target in TARGETS:
            module = "self_attn" if target.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            out_f, in_f = shapes[target]
            prefix = f"base_model.model.model.layers.{layer}.{module}.{target}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_f, generator=gen) / in_f**0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_f, rank, generator=gen) * 0.01
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS)}))
    return folder


def run_once(engine, prompts: list[list[int]], adapters: list, output_len: int) -> float:
    """Seconds to finish every request; ``adapters[i]`` is request i's adapter (or None)."""
    from pagoda.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    for i, (prompt, lora) in enumerate(zip(prompts, adapters)):
        engine.add_request(f"r{time.monotonic_ns()}-{i}", prompt, params, lora_name=lora)
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="pagoda bench lora", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--adapters", default="1,4,16", help="adapter counts to measure")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, help="torch CPU threads")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    counts = [int(c) for c in args.adapters.split(",")]
    if not counts or min(counts) < 1:
        parser.error("--adapters: positive counts, e.g. 1,4,16")

    from pagoda.engine.config import EngineConfig
    from pagoda.engine.llm_engine import LLMEngine

    with tempfile.TemporaryDirectory() as tmp:
        engine = LLMEngine(EngineConfig(model=args.model, device=args.device, enable_lora=True,
                                        max_loras=max(counts), max_lora_rank=args.rank,
                                        max_cpu_loras=max(max(counts), 1), max_num_seqs=args.num_requests))
        for i in range(max(counts)):
            engine.add_lora(f"a{i}", str(write_random_adapter(Path(tmp) / f"a{i}", engine.model_config,
                                                                args.rank, seed=i)))
        gen = torch.Generator().manual_seed(0)
        vocab = engine.model_config.vocab_size
        prompts = [torch.randint(100, vocab - 1, (args.prompt_len,), generator=gen).tolist()
                   for _ in range(args.num_requests)]
        variants = {"base": [None] * len(prompts)}
        for n in counts:
            variants[f"{n} adapters"] = [f"a{i % n}" for i in range(len(prompts))]
        run_once(engine, prompts[:2], [None, "a0"], 2)  # warm-up
        best = {name: float("inf") for name in variants}
        for _ in range(args.repeats):
            for name, adapters in variants.items():
                best[name] = min(best[name], run_once(engine, prompts, adapters, args.output_len))
    tokens = args.num_requests * args.output_len
    print(f"# pagoda bench lora — {platform.processor() or platform.machine()}, "
          f"device {engine.runner.device}, threads {torch.get_num_threads()}, pid {os.getpid()}")
    print(f"{args.num_requests} requests x ({args.prompt_len} prompt + {args.output_len} output) tokens, "
          f"rank {args.rank}, best of {args.repeats}\n")
    print("| batch | output tok/s | vs base |\n|---|---|---|")
    for name, seconds in best.items():
        print(f"| {name} | {tokens / seconds:.1f} | {best['base'] / seconds:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
