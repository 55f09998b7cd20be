"""The ranks of one non-leader node of a multi-node replica: ``pagoda serve --node-rank R``.

A replica over M nodes is one engine whose N ranks (``world_size``: tensor x pipeline
parallel) are spread L = N / M per node, in rank order (docs/parallelism.md): with
``pipeline_parallel_size = M`` and L tensor-parallel ranks per stage, each node is one stage. Node 0 runs the engine
(rank 0: scheduler, sampler, the server) and its own ranks 1..L-1 (``workers.TensorParallelWorkers``); it opens the
group's ``TCPStore`` on the leader address's port and publishes the group's settings there
(``workers.GROUP_KEY``: the engine config, model config and model path, so every node runs
exactly rank 0's settings and no flag can disagree).

``run_node`` on node R: connect to the store (retrying until the timeout: the leader may start
later), read the settings, spawn ranks R*L..(R+1)*L-1 (the same ``worker_main`` as node 0's
workers: join the group, load the model from the same path and keep this rank's shard, run
the steps rank 0 broadcasts), and wait. It returns 0 when every rank stopped because rank 0
stopped the group, and 1 (naming the rank) as soon as one fails, after killing the others:
an engine cannot lose a rank, so the orchestrator restarts the whole group (a
LeaderWorkerSet's RecreateGroupOnPodRestart). This node never serves requests and never
registers anywhere; the ranks die with this process (their parent-death watch).

Trust: the settings travel pickled through the store, as torch.distributed's own store is
unauthenticated: its port must be reachable only from the group's nodes (the operator's
NetworkPolicy admits only the group's pods).
"""

from __future__ import annotations

import datetime
import logging
import pickle
from multiprocessing.connection import wait

import torch.distributed as dist

from pagoda.engine.parallel.workers import GROUP_KEY, spawn_ranks

logger = logging.getLogger(__name__)


def split_leader(address: str) -> tuple[str, int]:
    """``HOST:PORT`` -> (host, port). Raises ValueError naming the problem."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--leader-address: must be HOST:PORT, got {address!r}")
    return host.strip("[]"), int(port)


def run_node(leader: str, node_rank: int, nodes: int, timeout_s: float = 600.0,
             tensor_parallel_size: int | None = None, pipeline_parallel_size: int | None = None) -> int:
    """Run this node's ranks of the group whose store is at ``leader`` until they end.

    Args:
        leader: ``HOST:PORT`` of node 0's store.
        node_rank: this node, 1..nodes-1.
        nodes: nodes in the group; must equal the leader engine's ``tensor_parallel_nodes``.
        timeout_s: how long to wait for the leader's store and settings.
        tensor_parallel_size, pipeline_parallel_size: if given, must equal the leader's.
    Returns:
        0 when the group stopped in order, 1 when a rank of this node failed.
    Raises:
        ValueError: a bad address, or ``node_rank``/``nodes`` that disagree with the leader's.
        RuntimeError: the leader's store did not answer within ``timeout_s``.
    """
    host, port = split_leader(leader)
    if not 0 < node_rank < nodes:
        raise ValueError(f"--node-rank: must be 1..{nodes - 1} on a worker node (0 is the leader), got {node_rank}")
    try:
        store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
        config, model_config, model_path = pickle.loads(store.get(GROUP_KEY))
    except (RuntimeError, TimeoutError) as exc:  # torch raises DistStoreError (a RuntimeError) on timeouts
        raise RuntimeError(f"the leader's store at {leader} did not answer within {timeout_s:g} s: {exc}") from exc
    if config.tensor_parallel_nodes != nodes:
        raise ValueError(f"--nodes: {nodes}, but the leader at {leader} runs tensor_parallel_nodes="
                         f"{config.tensor_parallel_nodes}")
    given = {"tensor_parallel_size": tensor_parallel_size, "pipeline_parallel_size": pipeline_parallel_size}
    for name, value in given.items():
        if value is not None and value != getattr(config, name):
            raise ValueError(f"--{name.replace('_', '-')}: {value}, but the leader at {leader} runs "
                             f"{name}={getattr(config, name)}")
    local = config.world_size // nodes
    ranks = range(node_rank * local, (node_rank + 1) * local)
    processes = spawn_ranks(ranks, host, port, config, model_config, model_path)
    logger.info("node %d of %d: ranks %d..%d of %d, pids %s", node_rank, nodes, ranks[0], ranks[-1],
                config.world_size, [p.pid for p in processes])
    return _wait(dict(zip(ranks, processes)))


def _wait(processes: dict) -> int:
    """Wait for the ranks; on the first failure kill the rest and name it."""
    alive = dict(processes)
    while alive:
        wait([p.sentinel for p in alive.values()])
        for rank, process in list(alive.items()):
            if process.exitcode is None:
                continue
            del alive[rank]
            if process.exitcode != 0:
                logger.error("rank %d (pid %d) exited with code %d; stopping this node",
                             rank, process.pid, process.exitcode)
                for other in alive.values():
                    other.kill()
                    other.join(timeout=10)
                return 1
    return 0
