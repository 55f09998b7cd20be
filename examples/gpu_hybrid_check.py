"""Hybrid models (Gated DeltaNet + full attention, KV cache groups) through the engine on a GPU.

``gpu_carry/`` (made on a CPU machine by examples/gpu_hybrid_prepare.py, ignored by git, so
given to ``run`` as ``carry``) holds tiny random Qwen3-Next and Qwen3.5 folders, built as
tests/engine/test_hybrid_engine.py builds them, and transformers' greedy tokens for each
prompt on the CPU in float32 (``expected.json``). On the GPU: the four prompts in one batch,
greedy, float32, with CUDA graphs and without, then the same prompts again from the prefix
cache (state checkpoints restored): every output must equal transformers'.
Usage: ``PYTHONPATH=backend python3 examples/gpu_hybrid_check.py``."""

import gc
import json
import sys

import torch

sys.path.insert(0, ".")

from pagoda.engine.config import EngineConfig  # noqa: E402
from pagoda.engine.llm_engine import LLMEngine  # noqa: E402
from pagoda.engine.sampling_params import SamplingParams  # noqa: E402
from tests.engine.driving import greedy_tokens  # noqa: E402

cases = json.load(open("gpu_carry/expected.json"))
failed = 0
for name, case in cases.items():
    for graphs in (True, False):
        engine = LLMEngine(EngineConfig(model=f"gpu_carry/{name}", device="cuda", dtype="float32",
                                        enable_cuda_graphs=graphs, max_num_batched_tokens=32,
                                        gpu_memory_utilization=0.3))
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        first = greedy_tokens(engine, case["prompts"], params, prefix="a")
        second = greedy_tokens(engine, case["prompts"], params, prefix="b")
        stats = engine.get_stats()
        ok = first == case["expected"] and second == case["expected"]
        failed += not ok
        agree = sum(a == e for a, e in zip(first, case["expected"]))
        print(f"{'ok  ' if ok else 'FAIL'} {name} cuda_graphs={graphs}: first pass {agree}/4 equal transformers, "
              f"second pass {sum(a == e for a, e in zip(second, case['expected']))}/4; prefix hits "
              f"{stats.prefix_cache_hits} tokens, state restores {stats.num_state_restores}")
        del engine  # one engine at a time: each takes its share of the device's memory
        gc.collect()
        torch.cuda.empty_cache()
print(f"{4 - failed} of 4 hybrid runs equal transformers' greedy tokens")
