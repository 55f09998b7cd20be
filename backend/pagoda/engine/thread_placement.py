"""Where the CPU path's threads run: ``EngineConfig.cpu_threads_bind`` (vLLM's
``VLLM_CPU_OMP_THREADS_BIND``).

Unset (the default), torch's OpenMP threads are left to the kernel's scheduler, which is
what a machine shared with other work wants: a bound thread cannot move away from a CPU
another process is using (on the 2-core build box, with a test suite beside it, a bound run
was ~4x slower). On a machine given to the engine, binding each thread to its own CPU keeps
it beside its caches between parallel regions: on the 2-core Xeon VM the mixed benchmark at 2
threads was faster bound in each of five paired runs (median +4%; docs/benchmarks.md).

Values: a CPU list as Linux writes them (``"0-3"``, ``"0,2,4"``, ``"0-1,6"``): one thread per
CPU, in that order, so thread 0 (the thread running the forward) is on the first; or
``"auto"``: the first ``torch.get_num_threads()`` CPUs this process may run on. Every CPU must
be in the process's affinity set (``os.sched_getaffinity``) and appear once; a list is checked
when the config is built (a ``ValueError`` naming ``cpu_threads_bind``), ``"auto"`` when the
engine starts. With tensor or pipeline parallelism each rank would bind the same CPUs, so the
two are refused together.

How: ``ThreadPlacement.ensure`` binds the calling thread's OpenMP team (pagoda's C++
``bind_threads``, ``kernels/csrc/cpu_threads.cpp``) the first time that thread runs a step;
an OpenMP team belongs to the thread that starts its regions, so the binding is made by the
thread that runs the forward (the engine thread, or the async worker thread). This module
imports no torch at import time (``EngineConfig`` validates with it).
"""

from __future__ import annotations

import os
import threading
from typing import Optional

FIELD = "cpu_threads_bind"


def parse_cpu_list(spec: str) -> tuple[int, ...]:
    """``"0-3,6"`` -> ``(0, 1, 2, 3, 6)``, each CPU checked against this process's affinity.

    Raises:
        ValueError: naming ``cpu_threads_bind``: not a CPU list, a CPU repeated, or one this
            process may not run on.
    """
    cpus: list[int] = []
    try:
        for part in spec.split(","):
            low, _, high = part.strip().partition("-")
            first, last = int(low), int(high) if high else int(low)
            if first < 0 or last < first:
                raise ValueError
            cpus.extend(range(first, last + 1))
    except ValueError:
        raise ValueError(f"{FIELD}: must be 'auto' or a CPU list such as '0-3' or '0,2,4', got {spec!r}") from None
    if len(set(cpus)) != len(cpus):
        raise ValueError(f"{FIELD}: each CPU may appear once, got {spec!r}")
    allowed = os.sched_getaffinity(0)
    outside = [cpu for cpu in cpus if cpu not in allowed]
    if outside:
        raise ValueError(f"{FIELD}: CPU {outside[0]} is not one this process may run on "
                         f"(allowed: {sorted(allowed)}), got {spec!r}")
    return tuple(cpus)


def check_spec(spec: Optional[str]) -> None:
    """``EngineConfig``'s check: None, ``"auto"`` or a valid CPU list (``parse_cpu_list``)."""
    if spec is not None and spec != "auto":
        parse_cpu_list(spec)


class ThreadPlacement:
    """Binds each thread that runs steps, once (module docstring)."""

    def __init__(self, spec: str) -> None:
        self.spec = spec
        self.cpus: Optional[tuple[int, ...]] = None  # resolved on the first bind
        self._bound = threading.local()

    def resolve(self) -> tuple[int, ...]:
        """The CPUs, thread t on ``cpus[t]`` (``"auto"``: the first torch-thread-count allowed CPUs)."""
        if self.cpus is None:
            if self.spec == "auto":
                import torch

                self.cpus = tuple(sorted(os.sched_getaffinity(0))[:torch.get_num_threads()])
            else:
                self.cpus = parse_cpu_list(self.spec)
        return self.cpus

    def ensure(self) -> None:
        """Bind the calling thread's team, the first time this thread runs a step."""
        if getattr(self._bound, "done", False):
            return
        from pagoda.kernels import cpu_native

        placed = cpu_native.bind_threads(list(self.resolve()))
        assert placed == list(self.cpus), f"threads on CPUs {placed}, asked {list(self.cpus)}"
        self._bound.done = True
