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
  ``send`` does not wait (an ``isend``): with several steps in flight, stage 0's hand-over of
  step i+1 and the last stage's logits of step i would otherwise wait on each other (gloo's
  send completes only once the peer posted the matching receive). The work (which holds the
  tensor) is kept until it completes: ``send`` drops the works that report completion (NCCL;
  gloo's report it only once waited for) and waits for the oldest beyond ``max_pending``
  (``8 + 4 * size``: more than the messages of the at most ``size`` steps in flight, so by
  then it was received and the wait returns at once), ``flush`` for all of them. A caller
  must not change a tensor after sending it.

Tensor x pipeline parallelism (``make_groups``): world rank ``r`` is stage ``r // tp``,
tensor-parallel index ``r % tp`` (rank 0: stage 0, index 0, the engine). The world group
carries the step broadcast and ``min_int``; each stage's ``tp`` ranks form a group of their
own (the model's all-reduces and logits gather, made over a store prefix per stage); a
``StageLinks`` addresses the same index in another stage for the hand-overs.

A peer that died makes a collective raise (gloo: the connection closed) or time out
after ``timeout_s``; the caller names the rank (``workers.TensorParallelWorkers``).
"""

from __future__ import annotations

import datetime
from collections import deque

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
        self._sends: deque = deque()  # works of sends not known to be complete, oldest first
        self.max_pending = 8 + 4 * size
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
        while self._sends and self._sends[0].is_completed():
            self._sends.popleft()
        self._sends.append(self.pg.send([tensor], dst, 0))
        while len(self._sends) > self.max_pending:
            self._sends.popleft().wait()

    def flush(self) -> None:
        """Wait until every send has been received (raises if a peer is gone)."""
        while self._sends:
            self._sends.popleft().wait()

    def recv(self, tensor: torch.Tensor, src: int) -> None:
        self.pg.recv([tensor], src, 0).wait()

    def min_int(self, value: int) -> int:
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MIN
        tensor = torch.tensor([value], dtype=torch.int64, device=self.device)
        self.pg.allreduce([tensor], options).wait()
        return int(tensor.item())


class StageLinks:
    """One rank's pipeline view of the world group: ``rank``/``size`` are its stage and the
    number of stages; ``send``/``recv`` reach the rank of the same tensor-parallel index in
    stage ``dst``/``src``; ``min_int`` is over the whole world."""

    def __init__(self, world: ProcessGroup, tp: int) -> None:
        self.world, self.tp = world, tp
        self.rank, self.size, self.tp_rank = world.rank // tp, world.size // tp, world.rank % tp

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        self.world.send(tensor, dst * self.tp + self.tp_rank)

    def recv(self, tensor: torch.Tensor, src: int) -> None:
        self.world.recv(tensor, src * self.tp + self.tp_rank)

    def flush(self) -> None:
        self.world.flush()

    def min_int(self, value: int) -> int:
        return self.world.min_int(value)


def make_groups(world: ProcessGroup, tp: int, pp: int, timeout_s: float) -> dict:
    """``ModelRunner``'s keywords for this rank of a ``tp`` x ``pp`` world: ``tp=`` (the world,
    or this stage's own group when ``pp > 1``) and/or ``pp=`` (the world, or a ``StageLinks``).
    With both, every rank of a stage must call this together (the stage's group forms)."""
    if pp == 1:
        return {"tp": world}
    if tp == 1:
        return {"pp": world}
    stage = world.rank // tp
    own = ProcessGroup(world.rank % tp, tp, dist.PrefixStore(f"stage{stage}/", world.store), world.device, timeout_s)
    return {"tp": own, "pp": StageLinks(world, tp)}
