"""What the engine benchmarks share: their common flags and the machine line they record."""

from __future__ import annotations

import argparse
import os
import platform

import torch


def add_engine_bench_args(parser: argparse.ArgumentParser, repeats: int) -> None:
    """``--model``, ``--repeats``, ``--threads`` and ``--json``, as every engine benchmark takes them."""
    parser.add_argument("--model", default=None, help="model folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--repeats", type=int, default=repeats, help="runs per configuration; the fastest is kept")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--json", default=None, help="also write the results to this file")


def prepare_engine_bench(args: argparse.Namespace) -> str:
    """Apply ``--threads``; the model folder to load (``--model`` or the default model)."""
    from pagoda.models.gguf_import import ensure_default_model

    if args.threads:
        torch.set_num_threads(args.threads)
    return str(args.model or ensure_default_model())


def machine_line() -> str:
    """Processor, cores, torch version and device, for the results."""
    return (f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
            f"{'cuda' if torch.cuda.is_available() else 'cpu'}")
