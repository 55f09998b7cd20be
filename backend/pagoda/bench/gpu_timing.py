"""GPU timing for the kernel benchmarks: CUDA-graph and eager medians, device copy bandwidth.

Used by ``bench.kernels`` (and, through it, ``bench.kernels_tune``) and by
``bench.kernels_e2e`` for the roofline; CUDA only.
"""

from __future__ import annotations

import statistics
from typing import Callable

import torch


def time_graph_us(calls: list[Callable[[], object]], iters: int, repeats: int = 4) -> float:
    """Median microseconds per call, from CUDA-graph replays of ``repeats`` rounds of calls."""
    for call in calls:  # compile and load the kernels outside the capture
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            for call in calls:
                call()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / (repeats * len(calls)))
    return statistics.median(times)


def time_eager_ms(call: Callable[[], object], iters: int) -> float:
    call()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth_gbs(iters: int) -> float:
    """Device copy bandwidth: bytes read + written per second by ``dst.copy_(src)``, 1 GiB."""
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda").fill_(1)
    dst = torch.empty_like(src)
    ms = time_eager_ms(lambda: dst.copy_(src), iters)
    return 2 * src.numel() / (ms * 1e-3) / 1e9
