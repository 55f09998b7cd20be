"""``ProcessGroup``: one tensor- or pipeline-parallel group's collectives, without torch's global state.

Rank 0 is the engine's own process; it opens a ``TCPStore`` on a free port of 127.0.0.1
and the workers (``engine.parallel.workers``) join it. The group is a backend object made
directly (``ProcessGroupGloo`` on CPU, ``ProcessGroupNCCL`` on CUDA), never
``init_process_group``: an engine process may hold several engines one after the other
(tests, benchmarks) and the user's own default group stays untouched.

The collectives the model and the runner use, all issued from one thread per rank in
the same order on every rank (the device worker thread on rank 0, the main thread on the
others), so no tag is needed:

* ``all_reduce(t)``: in place, sum (row-parallel projections, the vocabulary-parallel
  embedding);
* ``gather_logits(t)``: rank 0 gets every rank's ``[rows, vocab/tp]`` slice concatenated
  into ``[rows, vocab]``; the others get an empty tensor;
* ``broadcast(t)``: rank 0's tensor into every rank's (the step, ``step_wire``);
* ``min_int(v)``: the smallest ``v`` over ranks (the KV cache's block count);
* ``send(t, dst)`` / ``recv(t, src)``: point to point (pipeline parallelism: a stage's hidden
  states to the next stage, the last stage's logits to rank 0; ``models.pipeline_parallel``).

A peer that died makes a collective raise (gloo: the connection closed) or time out
after ``timeout_s``; the caller names the rank (``workers.TensorParallelWorkers``).
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist


class ProcessGroup:
    """Args:
    rank, size: this process's rank and the group's size.
    store: the group's store (rank 0 hosts it).
    device: where the collectives' tensors live (CUDA: NCCL; CPU: gloo).
    timeout_s: how long a collective waits for its peers before it raises.
    """

    def __init__(self, rank: int, size: int, store: dist.Store, device: torch.device, timeout_s: float) -> None:
        self.rank, self.size, self.device = rank, size, device
        self.store = store
        prefixed = dist.PrefixStore("pagoda-tp/", store)
        timeout = datetime.timedelta(seconds=timeout_s)
        if device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.pg = dist.ProcessGroupNCCL(prefixed, rank, size, options)
        else:
            self.pg = dist.ProcessGroupGloo(prefixed, rank, size, timeout)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        self.pg.allreduce([tensor]).wait()
        return tensor

    def gather_logits(self, tensor: torch.Tensor) -> torch.Tensor:
        options = dist.GatherOptions()
        options.rootRank = 0
        tensor = tensor.contiguous()
        if self.rank != 0:
            self.pg.gather([], [tensor], options).wait()
            return tensor.new_empty(0, tensor.shape[-1] * self.size)
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        self.pg.gather([parts], [tensor], options).wait()
        return torch.cat(parts, dim=-1)

    def broadcast(self, tensor: torch.Tensor) -> None:
        self.pg.broadcast(tensor, 0).wait()

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        self.pg.send([tensor], dst, 0).wait()

    def recv(self, tensor: torch.Tensor, src: int) -> None:
        self.pg.recv([tensor], src, 0).wait()

    def min_int(self, value: int) -> int:
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MIN
        tensor = torch.tensor([value], dtype=torch.int64, device=self.device)
        self.pg.allreduce([tensor], options).wait()
        return int(tensor.item())
