"""``cpu_threads_bind`` (engine/thread_placement.py, kernels/csrc/cpu_threads.cpp): the thread
that runs the steps and its OpenMP workers bound one per CPU, outputs unchanged; bad values
refused naming the field.

The engine here runs with async scheduling, so the binding is made by its worker thread (which
ends with ``shutdown``), and torch's thread count is restored after: the test process's own
threads stay unbound for the tests after this one.
"""

from __future__ import annotations

import os

import pytest
import torch

from pagoda.engine.config import EngineConfig
from pagoda.engine.llm_engine import LLMEngine
from pagoda.engine.sampling_params import SamplingParams
from pagoda.engine.thread_placement import parse_cpu_list
from pagoda.kernels import cpu_native

from tests.engine.test_spec_engine import make_small_model


@pytest.fixture(scope="module")
def model(tmp_path_factory, smollm2_path):
    return make_small_model(tmp_path_factory.mktemp("bind") / "m", smollm2_path, seed=5)


def pinned_threads() -> dict[int, int]:
    """Thread id -> its CPU, for this process's threads allowed on exactly one CPU."""
    pinned = {}
    for tid in os.listdir(f"/proc/{os.getpid()}/task"):
        try:
            allowed = os.sched_getaffinity(int(tid))
        except OSError:  # ended meanwhile
            continue
        if len(allowed) == 1:
            pinned[int(tid)] = next(iter(allowed))
    return pinned


def generate(model: str, bind) -> list[list[int]]:
    engine = LLMEngine(EngineConfig(model=model, async_scheduling=True, max_num_batched_tokens=64, max_model_len=256,
                                    cpu_threads_bind=bind))
    prompts = [[5 + i, 17, 29 + i, 3] * (2 + i) for i in range(3)]
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    outputs = {}
    try:
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = out.outputs[0].token_ids
        generate.pinned = pinned_threads()  # while the worker thread (joined by shutdown) lives
    finally:
        engine.shutdown()
    return [outputs[str(i)] for i in range(len(prompts))]


@pytest.mark.skipif(cpu_native.build() is not None, reason="pagoda's C++ CPU kernels did not build")
def test_bound_threads_run_one_per_cpu_and_the_outputs_do_not_change(model):
    cpus = sorted(os.sched_getaffinity(0))[:2]
    threads, before, main_cpus = torch.get_num_threads(), pinned_threads(), os.sched_getaffinity(0)
    try:
        bound = generate(model, ",".join(map(str, reversed(cpus))))  # thread 0 on the last CPU
        pinned = {tid: cpu for tid, cpu in generate.pinned.items() if tid not in before}
    finally:
        torch.set_num_threads(threads)
    # one thread per CPU, each alone on its CPU: the step's thread and its OpenMP worker(s)
    assert sorted(pinned.values()) == cpus, pinned
    assert os.sched_getaffinity(0) == main_cpus  # this (the test's) thread did not run the steps: unbound
    assert bound == generate(model, None)


def test_cpu_lists_are_read_as_linux_writes_them():
    cpu = min(os.sched_getaffinity(0))
    assert parse_cpu_list(f"{cpu}") == (cpu,)
    assert parse_cpu_list(",".join(map(str, sorted(os.sched_getaffinity(0))))) == tuple(sorted(os.sched_getaffinity(0)))
    if {0, 1} <= os.sched_getaffinity(0):
        assert parse_cpu_list("0-1") == (0, 1) and parse_cpu_list("1,0") == (1, 0)


@pytest.mark.parametrize("spec, words", [
    ("x", "must be 'auto' or a CPU list"), ("1-0", "must be 'auto' or a CPU list"), ("-1", "must be 'auto'"),
    ("", "must be 'auto'"), ("0,0", "each CPU may appear once"), ("4095", "is not one this process may run on"),
])
def test_bad_cpu_lists_are_refused_naming_the_field(spec, words):
    with pytest.raises(ValueError, match="cpu_threads_bind") as refused:
        EngineConfig(cpu_threads_bind=spec)
    assert words in str(refused.value)


def test_binding_with_parallel_ranks_is_refused():
    with pytest.raises(ValueError, match="cpu_threads_bind: not supported with tensor_parallel_size > 1"):
        EngineConfig(cpu_threads_bind="auto", tensor_parallel_size=2)


def test_the_serve_flag_reaches_the_engine_config():
    from pagoda.serving.launch import serve_flags
    from pagoda.serving.model_config import engine_config_from_parameters

    assert "cpu_threads_bind" in serve_flags.ENGINE_FLAGS
    assert serve_flags.make_parser().parse_args(["--cpu-threads-bind", "0-1"]).cpu_threads_bind == "0-1"
    cpu = str(min(os.sched_getaffinity(0)))
    assert engine_config_from_parameters({"cpu_threads_bind": {"string_value": cpu}}).cpu_threads_bind == cpu
    with pytest.raises(ValueError, match="cpu_threads_bind"):
        engine_config_from_parameters({"cpu_threads_bind": {"string_value": "0,0"}})
