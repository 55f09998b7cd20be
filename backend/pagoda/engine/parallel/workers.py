"""The tensor- or pipeline-parallel workers of one engine: ranks 1..N-1, one spawned process each.

N is ``EngineConfig.world_size`` (``tensor_parallel_size`` x ``pipeline_parallel_size``). The
machinery is the same for both; only what each worker's ``ModelRunner`` does with the group
differs (``tp=``: its shard of every layer; ``pp=``: its stage's layers,
``models.pipeline_parallel``; both: its shard of its stage's layers, ``group.make_groups``),
and the error that names a dead rank says which.

Life cycle (``TensorParallelWorkers``), as vLLM's multiprocessing executor and SGLang's TP
workers run theirs:

1. ``start``: rank 0 (the engine's process) opens the group's ``TCPStore`` on a free
   port, spawns one process per other rank (``worker_main``; ``spawn``, never ``fork``: the
   parent may hold CUDA and threads), then joins the group itself. Each worker builds
   its own ``ModelRunner`` (the same seeded or loaded weights, sharded for its rank) and
   enters its loop: receive a step, run the forward, repeat. The step arrives by broadcast,
   or, with several steps in flight (``EngineConfig.micro_batches``), from the previous
   stage (``step_wire.PipelinePath``).
2. A worker dies with the engine: a watcher thread waits on the parent's process
   sentinel (a pipe that closes when the parent dies, however it dies, SIGKILL
   included) and ends the worker with ``os._exit``; daemonic processes are also
   terminated by multiprocessing when the parent exits normally.
3. A worker that dies makes the next step fail with ``TensorParallelWorkerDied`` naming
   its rank, pid and exit code: ``check`` runs before every step (a non-blocking
   ``waitpid`` per worker), and a collective that fails is re-read as that error when a
   worker is found dead (``explain``).
4. ``stop``: broadcast the stop message, join; whatever is still alive after the grace
   period is killed.

On CPU each rank runs ``cpu_count // L`` intra-op threads (L: the ranks on its node; rank 0
included, until ``stop``), so the ranks share the cores instead of oversubscribing them.

Several nodes (``tensor_parallel_nodes = M``, docs/parallelism.md): rank 0 opens the store on
the port of ``tensor_parallel_leader`` instead of a free one (the store listens on every
interface), publishes the group's settings under ``GROUP_KEY`` for the other nodes, and
spawns only its own node's ranks 1..L-1 (L = N / M). Node m's ranks m*L..(m+1)*L-1 are
started there by ``node.run_node`` (``pagoda serve --node-rank m``) and join the same store;
rank r uses ``cuda:(r % L)``. ``check`` sees only this node's workers: a rank on another node
that dies shows as a failed collective, and its node's process exits non-zero.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import shutil
import sys
import threading
import traceback
from multiprocessing.connection import wait
from typing import Optional

import torch
import torch.distributed as dist

from pagoda.engine.config import EngineConfig
from pagoda.engine.parallel.group import ProcessGroup, make_groups
from pagoda.engine.parallel.step_wire import StepReceiver, StepSender, capacity_for, make_path
from pagoda.engine.runner.host_kv_cache import HostKVCache, measure_prefill_s_per_token
from pagoda.engine.runner.kv_allocation import copy_state_slots
from pagoda.engine.runner.model_runner import ModelRunner
from pagoda.engine.runner.placement import resolve_device
from pagoda.models.config import ModelConfig

logger = logging.getLogger(__name__)

_HOST = "127.0.0.1"
_STOP_GRACE_S = 10.0
GROUP_KEY = "pagoda-tp/group"  # (EngineConfig, ModelConfig, model path), pickled: read by the other nodes


class TensorParallelWorkerDied(RuntimeError):
    """A tensor- or pipeline-parallel worker process is gone; the engine cannot step any more."""


def parallel_kind(config: EngineConfig) -> str:
    """How the worker processes of ``config`` are named in errors and logs."""
    return "pipeline-parallel" if config.pipeline_parallel_size > 1 else "tensor-parallel"


def runner_groups(config: EngineConfig, group: ProcessGroup) -> dict:
    """``ModelRunner``'s keywords for this rank of the world ``group``: ``tp=`` and/or ``pp=``
    (``group.make_groups``; a collective among the stage's ranks under TP x PP)."""
    return make_groups(group, config.tensor_parallel_size, config.pipeline_parallel_size,
                       config.tensor_parallel_timeout_s)


def share_cpu_threads(size: int) -> None:
    """On CPU, give this rank its share of the cores."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))


class TensorParallelWorkers:
    """Ranks 1..N-1 of one engine, and rank 0's ``group``. Use ``start``."""

    def __init__(self, processes: list, group: ProcessGroup, store: dist.TCPStore) -> None:
        self.processes = processes  # index i: rank i + 1
        self.group = group
        self._store = store
        self.sender: Optional[StepSender] = None  # set by the executor once its runner exists
        self.threads = torch.get_num_threads()  # rank 0's before start; restored by kill()
        self.kind = "tensor-parallel"  # or "pipeline-parallel" (parallel_kind), for errors

    @classmethod
    def start(cls, config: EngineConfig, model_config: ModelConfig, model_path: str,
              device: torch.device) -> "TensorParallelWorkers":
        size, nodes = config.world_size, config.tensor_parallel_nodes
        port = 0 if nodes == 1 else int(str(config.tensor_parallel_leader).rpartition(":")[2])
        store = dist.TCPStore(_HOST, port, size, is_master=True, wait_for_workers=False,
                              timeout=_timedelta(config.tensor_parallel_timeout_s))
        if nodes > 1:
            store.set(GROUP_KEY, pickle.dumps((config, model_config, model_path)))
        processes = spawn_ranks(range(1, size // nodes), _HOST, store.port, config, model_config, model_path)
        workers = cls(processes, None, store)  # type: ignore[arg-type]
        workers.kind = parallel_kind(config)
        if device.type == "cpu":
            share_cpu_threads(size // nodes)
        try:
            workers.group = workers._join(ProcessGroup, 0, size, store, device, config.tensor_parallel_timeout_s)
        except BaseException:
            workers.kill()
            raise
        logger.info("%s: %d ranks (%s), workers %s", workers.kind, size, "nccl" if device.type == "cuda" else "gloo",
                    [p.pid for p in processes])
        return workers

    def _join(self, make, *args) -> ProcessGroup:
        """Form the group on a helper thread while watching the workers: one that dies
        before joining (a bad model folder, an import error) is named at once."""
        result: dict = {}

        def form() -> None:
            try:
                result["group"] = make(*args)
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                result["error"] = exc

        thread = threading.Thread(target=form, name="pagoda-tp-join", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(timeout=0.1)
            if thread.is_alive():
                self.check()
        if "error" in result:
            self.explain(result["error"])
            raise RuntimeError(f"{self.kind}: the group did not form: {result['error']}") from result["error"]
        return result["group"]

    def check(self) -> None:
        """Raise ``TensorParallelWorkerDied`` if a worker has exited."""
        for rank, process in enumerate(self.processes, start=1):
            if process.exitcode is not None:
                raise TensorParallelWorkerDied(
                    f"{self.kind} worker rank {rank} (pid {process.pid}) exited with code {process.exitcode}; "
                    "the engine cannot run steps any more")

    def explain(self, exc: BaseException) -> None:
        """After a failed collective: raise ``TensorParallelWorkerDied`` from ``exc`` if a worker died."""
        for process in self.processes:
            process.join(timeout=0.5)
        try:
            self.check()
        except TensorParallelWorkerDied as died:
            raise died from exc

    def stop(self) -> None:
        """Stop the workers (a stop message, then join; kill what is left)."""
        try:
            self.check()
            if self.sender is not None:
                self.sender.stop()
                self.group.flush()
        except Exception as exc:  # noqa: BLE001 - a dead or wedged group: kill below
            logger.warning("%s: stopping the workers: %s", self.kind, exc)
        for process in self.processes:
            process.join(timeout=_STOP_GRACE_S)
        self.kill()

    def kill(self) -> None:
        """Kill what is still alive and give rank 0 its torch threads back."""
        for process in self.processes:
            if process.is_alive():
                process.kill()
                process.join(timeout=_STOP_GRACE_S)
        torch.set_num_threads(self.threads)


def spawn_ranks(ranks: range, host: str, port: int, config: EngineConfig, model_config: ModelConfig,
                model_path: str) -> list:
    """Start one worker process per rank in ``ranks``, joining the store at ``host:port``."""
    context = multiprocessing.get_context("spawn")
    context.set_executable(_python_executable())
    processes = []
    for rank in ranks:
        process = context.Process(target=worker_main, name=f"pagoda-tp-rank{rank}", daemon=True,
                                  args=(rank, host, port, config, model_config, model_path))
        process.start()
        processes.append(process)
    return processes


def _python_executable() -> str:
    """The interpreter for the workers: this process's, unless this process is not a python
    binary (Triton's Python-backend stub embeds the interpreter); ``PAGODA_PYTHON`` wins."""
    exe = sys.executable
    if os.environ.get("PAGODA_PYTHON"):
        return os.environ["PAGODA_PYTHON"]
    if exe and os.path.basename(exe).startswith("python"):
        return exe
    return shutil.which("python3") or exe


def _timedelta(seconds: float):
    import datetime
    return datetime.timedelta(seconds=seconds)


def _exit_with_parent() -> None:
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        wait([parent.sentinel])
        os._exit(0)

    threading.Thread(target=watch, name="pagoda-tp-parent-watch", daemon=True).start()


def _load_adapter(runner: ModelRunner, name: str, path: str) -> None:
    """An adapter rank 0 announced (new, or re-registered under its name): load this rank's slices."""
    if name in runner.lora.adapters:
        runner.lora.remove(name)
    runner.lora.add(name, path)


def worker_main(rank: int, host: str, port: int, config: EngineConfig, model_config: ModelConfig,
                model_path: str) -> None:
    """One worker's whole life: join the group, build the runner, run the steps it receives."""
    _exit_with_parent()
    try:
        size, local = config.world_size, config.world_size // config.tensor_parallel_nodes
        device = resolve_device(config)
        if device.type == "cuda":
            torch.cuda.set_device(rank % local)
            device = torch.device("cuda", rank % local)
        else:
            share_cpu_threads(local)
        store = dist.TCPStore(host, port, size, is_master=False, timeout=_timedelta(config.tensor_parallel_timeout_s))
        group = ProcessGroup(rank, size, store, device, config.tensor_parallel_timeout_s)
        runner = ModelRunner(config, model_config, model_path, **runner_groups(config, group))
        receiver = StepReceiver(group, capacity_for(config.max_num_seqs, config.max_num_batched_tokens), device,
                                on_adapter=lambda name, path: _load_adapter(runner, name, path),
                                path=make_path(group, config.micro_batches, runner.group, runner.tp),
                                num_groups=runner.kv_layout.num_groups,
                                copy_states=lambda pairs: copy_state_slots(runner.state_caches, pairs))
        if config.cpu_offload_bytes:  # the same collectives, in the same order, as rank 0's _make_host_tier
            receiver.host = HostKVCache.for_runner(runner, config.cpu_offload_bytes)
            if config.preemption_mode == "auto" and config.prefill_s_per_token is None:
                measure_prefill_s_per_token(runner)  # rank 0's calibrate runs this forward
        while (inputs := receiver.recv()) is not None:
            if inputs:
                runner.compute_logits(inputs)
            receiver.finish()  # state checkpoints, after the forward
        group.flush()  # the stop message forwarded down the pipeline, the last logits
    except BaseException:  # noqa: BLE001 - the parent sees the exit code and names this rank
        traceback.print_exc()
        os._exit(1)
