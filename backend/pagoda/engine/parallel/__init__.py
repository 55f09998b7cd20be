"""Tensor and pipeline parallelism inside one replica (docs/parallelism.md): ``make_executor``.

One scheduler and one sampler, on rank 0 (the engine's own process); ranks 1..N-1 are
spawned workers that hold their shard of the model and of the KV cache and run the same
forward on each step rank 0 broadcasts (``step_wire``: one packed int64 tensor per step,
the scheduler's deltas). Only rank 0 sees logits (gathered from the vocabulary shards) and
samples; nothing else comes back. With ``tensor_parallel_size == 1`` this is
``runner.executor.make_executor`` unchanged.

Pipeline parallelism (``pipeline_parallel_size = N``) reuses all of it — the spawn, the
store, the group, the step broadcast, the death checks — with each rank's runner holding
one stage of the layers instead of a shard of each (``models.pipeline_parallel``): hidden
states go rank to rank by point-to-point sends, the last stage sends the logits to rank 0,
which samples. With several steps in flight (``EngineConfig.micro_batches``, ``core.batch_queue``)
the step travels down the stages instead of by broadcast (``step_wire.PipelinePath``).
Both at once: each stage is a tensor-parallel group of its own
(``group.make_groups``). Across nodes (``tensor_parallel_nodes``) the
other nodes' ranks are started by ``node.run_node`` (``pagoda serve --node-rank R``).

This package sits above ``engine.runner`` (it builds the runner's executor with a group
and workers); the runner never imports it.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from pagoda.engine.config import EngineConfig
from pagoda.engine.parallel.step_wire import StepSender, capacity_for, make_path
from pagoda.engine.parallel.workers import (TensorParallelWorkerDied, TensorParallelWorkers, parallel_kind,
                                            runner_groups)
from pagoda.engine.runner import executor as single
from pagoda.engine.runner.placement import resolve_device
from pagoda.models.config import ModelConfig
from pagoda.models.pipeline_parallel import check_stages
from pagoda.models.tensor_parallel import check_divisible

__all__ = ["TensorParallelWorkerDied", "make_executor"]


def make_executor(config: EngineConfig, model_config: ModelConfig, model_path: str,
                  make_grammar_backend: Optional[Callable[[], Any]] = None) -> single.Executor:
    """The device side for ``config``: one device, or rank 0 of ``tensor_parallel_size`` ranks.

    Raises:
        ValueError: a model dimension the ranks cannot split (named), or fewer CUDA devices than
            ranks, before any worker starts.
        RuntimeError: the group did not form, or a worker died while the model loaded.
    """
    size = config.world_size
    if size == 1:
        return single.make_executor(config, model_config, model_path, make_grammar_backend)
    if config.pipeline_parallel_size > 1:
        check_stages(model_config, config.pipeline_parallel_size)
    if config.tensor_parallel_size > 1:
        check_divisible(model_config, config.tensor_parallel_size)
    device = resolve_device(config)
    local = size // config.tensor_parallel_nodes  # this node's ranks
    if device.type == "cuda" and torch.cuda.device_count() < local:
        raise ValueError(f"{parallel_kind(config)} size {size} over {config.tensor_parallel_nodes} node(s): only "
                         f"{torch.cuda.device_count()} CUDA devices are visible for this node's {local} ranks "
                         "(one per rank; check CUDA_VISIBLE_DEVICES)")
    workers = TensorParallelWorkers.start(config, model_config, model_path, device)
    try:
        executor = single.make_executor(config, model_config, model_path, make_grammar_backend,
                                        parallel=workers, **runner_groups(config, workers.group))
    except Exception as exc:
        try:
            workers.explain(exc)  # a worker that died while loading is named
        finally:
            workers.kill()
        raise
    capacity = capacity_for(config.max_num_seqs, config.max_num_batched_tokens)
    runner = executor.runner
    adapters = runner.lora.adapters if runner.lora is not None else None
    workers.sender = runner.step_sender = StepSender(workers.group, capacity, runner.device, adapters,
                                                     path=make_path(workers.group, config.micro_batches,
                                                                    runner.group, runner.tp))
    return executor
