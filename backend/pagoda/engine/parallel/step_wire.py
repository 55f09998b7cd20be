"""One step's deltas as one packed int64 tensor, sent once from rank 0 (``StepSender``)
and read back into the forward's inputs on every other rank (``StepReceiver``).

How it travels is the *path*: ``BroadcastPath`` (one broadcast to every rank: tensor
parallelism, and pipeline parallelism with one step in flight) or ``PipelinePath``
(pipeline parallelism with several steps in flight, ``core.batch_queue``): rank 0 sends the
tensor to stage 1 (under TP x PP: broadcasts it in stage 0's group first, and each rank
passes it to its TP peer in the next stage), each stage forwards it to the next as soon as
it has it, then receives the step's hidden states. A broadcast is a collective of every
rank, so rank 0 could not issue step i+1 while the last stage still computes step i; the
point-to-point sends do not wait (``group.ProcessGroup.send``), and each stage handles the
steps in order. A forwarded message is a copy: a sent tensor must not change until it is
received.

The scheduler's plan is already a delta (``engine.scheduler_output``): new block ids
only, token ids only for prompt chunks and tokens the runner does not hold. Rank 0 applies
it to its ``RequestStates`` and packs the same delta; a worker keeps its own block tables
from it, so the tables cross the wire once. Requests are named on the wire by a small
integer *slot* that rank 0 assigns when a request is new to the runner (``is_new``) and
forgets when it is preempted or finished. Layout (int64 words)::

    header   kind, length (words), num_scheduled, num_dropped
    dropped  slot * num_dropped                 (preempted and finished, dropped first)
    copies   n, (device src, host dst) * n      (KV tier: swap-outs, run first)
             m, (host src, device dst) * m      (swap-ins then prefix copy-backs)
    states   four lists as the copies: state swap-outs, swap-ins (the KV tier, with the
             blocks), restores (before the forward), checkpoints (after it); recurrent-state
             slots of a hybrid model (``engine.kv.state_manager``), empty otherwise
    per scheduled request, in batch order:
             slot, flags (1: is_new, 2: is_sampling), adapter (0: none, else its number),
             num_spec (drafted tokens, the last of the inputs: prompt-lookup speculation),
             prompt_rows (0, or 1 + the rows of prompt log-probabilities it asks this step),
             num_computed_tokens, num_new_tokens,
             per KV cache group (``engine.kv.layout``; one for most models): num_new_blocks,
             new block ids...; then the step's num_new_tokens input tokens

LoRA adapters are numbered on the wire too: before the first step that uses an adapter
(or a re-registered one: a new ``LoRAAdapter`` object under an old name), rank 0 sends a
``KIND_LORA`` message — ``number``, then the UTF-8 bytes of ``name NUL path``, one per
word — and each worker loads the adapter from the same path (``on_adapter``).

Every input token travels, so a worker holds no sampled tokens: the one a decode feeds
back (``StepInput.num_device_tokens``, async scheduling) is copied into its word on the
device (``index_copy_`` of the runner's kept tokens, no host round trip), the others come
from rank 0's host copy. Nothing comes back: rank 0 samples from the gathered logits.

The buffer has a fixed capacity sized for a full step (``capacity_for``); a step that does
not fit (a long prefix-cached table re-sent after a preemption) sends its header first,
then the whole payload in a second broadcast (``overflows`` counts them). ``KIND_STOP``
ends the workers' loop. ``send`` times itself: ``total_s`` / ``steps`` is the host cost
of a step's broadcast (packing, the copy, the collective); ``last_s`` / ``last_is_decode``
describe the last one.
"""

from __future__ import annotations

import time
from typing import Callable, Optional, Sequence

import torch

from pagoda.engine.runner.request_states import StepInput
from pagoda.engine.scheduler_output import SchedulerOutput

KIND_STEP, KIND_STOP, KIND_LORA = 1, 2, 3
HEADER = 4
_IS_NEW, _IS_SAMPLING = 1, 2


def capacity_for(max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """Words for a step of up to ``max_num_batched_tokens`` input tokens, as many new blocks,
    and 8 words plus 2 more blocks per request; a larger step takes the overflow path."""
    return HEADER + 10 * max_num_seqs + 2 * max_num_batched_tokens


class BroadcastPath:
    """Every rank gets the message in one broadcast from rank 0 (``put`` there, ``take`` elsewhere)."""

    def __init__(self, group) -> None:
        self.group = group

    def put(self, tensor: torch.Tensor) -> None:
        self.group.broadcast(tensor)

    take = put


class PipelinePath:
    """Rank 0 ``put``s to stage 1; a rank of stage s ``take``s from stage s - 1 and forwards
    a copy to stage s + 1 (not from the last). ``stages``: this rank's pipeline view (``rank``
    and ``size`` are its stage and the number of stages; ``send``/``recv`` reach the same
    tensor-parallel index in another stage: the world itself without TP). ``stage_group``:
    stage 0's tensor-parallel group under TP x PP (rank 0 broadcasts each message in it
    first, so every rank of stage 0 has it), else None."""

    def __init__(self, stages, stage_group=None) -> None:
        self.stages, self.stage_group = stages, stage_group

    def put(self, tensor: torch.Tensor) -> None:
        if self.stage_group is not None:
            self.stage_group.broadcast(tensor)
        self.stages.send(tensor.clone(), 1)

    def take(self, tensor: torch.Tensor) -> None:
        if self.stages.rank == 0:
            self.stage_group.broadcast(tensor)
        else:
            self.stages.recv(tensor, self.stages.rank - 1)
        if self.stages.rank + 1 < self.stages.size:
            self.stages.send(tensor.clone(), self.stages.rank + 1)


def make_path(world, micro_batches: int, stages=None, stage_group=None):
    """The step's path: down the pipeline (``stages``, ``stage_group``: ``PipelinePath``'s, the
    runner's ``group`` and ``tp``) with several steps in flight, else one broadcast in ``world``."""
    if micro_batches == 1:
        return BroadcastPath(world)
    return PipelinePath(stages if stages is not None else world, stage_group)


class StepSender:
    """Rank 0's side. Args: group (``ProcessGroup``), capacity (words), device, and
    ``adapters`` (adapter name -> its ``LoRAAdapter``: the runner's registry) or None;
    ``path`` (default: ``BroadcastPath(group)``)."""

    def __init__(self, group, capacity: int, device: torch.device, adapters: Optional[dict] = None,
                 path=None) -> None:
        self.group, self.capacity, self.device = group, capacity, device
        self.path = path if path is not None else BroadcastPath(group)
        self.adapters = adapters if adapters is not None else {}
        self._announced: dict[str, tuple[int, object]] = {}  # name -> (wire number, the adapter sent)
        self.buffer = torch.zeros(capacity, dtype=torch.int64, device=device)
        self._slots: dict[str, int] = {}
        self._next_slot = 0
        self.total_s, self.steps, self.overflows = 0.0, 0, 0
        self.last_s, self.last_is_decode = 0.0, False  # the last send (benchmarks split decode steps)

    def send(self, scheduler_output: SchedulerOutput, inputs: Sequence[StepInput],
             placeholder_tokens: Callable[[Sequence[StepInput], list[int]], torch.Tensor]) -> None:
        """Broadcast one step (``inputs``: ``RequestStates.update``'s result for it)."""
        start = time.perf_counter()
        for step_input in inputs:
            if step_input.adapter_id is not None:
                self._announce(step_input.adapter_id)
        words, fill_at, fill_rows = self._pack(scheduler_output, inputs)
        payload = self._payload(words)
        if fill_rows:
            index = torch.tensor(fill_at, dtype=torch.int64, device=self.device)
            payload.index_copy_(0, index, placeholder_tokens(inputs, fill_rows))
        self._broadcast(payload, len(words))
        self.last_s = time.perf_counter() - start
        self.last_is_decode = bool(inputs) and all(i.num_new_tokens == 1 for i in inputs)
        self.total_s += self.last_s
        self.steps += 1

    def _broadcast(self, payload: torch.Tensor, length: int) -> None:
        if length > self.capacity:
            self.overflows += 1
            self.buffer[:HEADER] = payload[:HEADER]
            self.path.put(self.buffer)
        self.path.put(payload)

    def _announce(self, name: str) -> None:
        adapter = self.adapters[name]
        known = self._announced.get(name)
        if known is not None and known[1] is adapter:
            return
        number = known[0] if known is not None else len(self._announced) + 1
        self._announced[name] = (number, adapter)
        text = list(f"{name}\0{adapter.path}".encode())
        words = [KIND_LORA, HEADER + len(text), number, 0, *text]
        self._broadcast(self._payload(words), len(words))

    def stop(self) -> None:
        """Tell the workers to leave their loop."""
        self.buffer[:HEADER] = torch.tensor([KIND_STOP, HEADER, 0, 0])
        self.path.put(self.buffer)

    def _payload(self, words: list[int]) -> torch.Tensor:
        host = torch.tensor(words, dtype=torch.int64)
        if len(words) > self.capacity:
            return host.to(self.device)
        self.buffer[:len(words)].copy_(host, non_blocking=True)
        return self.buffer

    def _pack(self, scheduler_output: SchedulerOutput,
              inputs: Sequence[StepInput]) -> tuple[list[int], list[int], list[int]]:
        dropped = [self._slots.pop(request_id) for request_id in
                   scheduler_output.preempted_request_ids + scheduler_output.finished_request_ids
                   if request_id in self._slots]
        words = [KIND_STEP, 0, len(inputs), len(dropped), *dropped]
        for pairs in (scheduler_output.blocks_to_swap_out,
                      list(scheduler_output.blocks_to_swap_in) + list(scheduler_output.blocks_to_copy_back),
                      scheduler_output.states_to_swap_out, scheduler_output.states_to_swap_in,
                      scheduler_output.states_to_restore, scheduler_output.states_to_checkpoint):
            words += [len(pairs), *(block for pair in pairs for block in pair)]
        fill_at, fill_rows = [], []
        for row, (item, step_input) in enumerate(zip(scheduler_output.scheduled, inputs)):
            if item.request_id not in self._slots:  # a re-admitted request keeps its slot (is_new resets it)
                self._slots[item.request_id] = self._next_slot
                self._next_slot += 1
            flags = (_IS_NEW if item.is_new else 0) | (_IS_SAMPLING if item.is_sampling else 0)
            adapter = self._announced[step_input.adapter_id][0] if step_input.adapter_id is not None else 0
            words += [self._slots[item.request_id], flags, adapter, len(step_input.spec_token_ids),
                      _prompt_rows(step_input), item.num_computed_tokens, item.num_new_tokens]
            for ids in item.new_block_ids:
                words += [len(ids), *ids]
            if step_input.num_device_tokens:
                fill_at.append(len(words))
                fill_rows.append(row)
                words.append(0)
            words += step_input.token_ids
        words[1] = len(words)
        return words, fill_at, fill_rows


def _prompt_rows(step_input: StepInput) -> int:
    """0 without prompt log-probabilities, else 1 + the rows ``PromptRows.build`` takes for it."""
    if step_input.prompt_logprobs is None:
        return 0
    start = step_input.num_computed_tokens
    end = min(start + step_input.num_new_tokens, len(step_input.prompt_token_ids) - 1)
    return 1 + max(end - start, 0)


class StepReceiver:
    """A worker's side: ``recv()`` returns the step's ``StepInput``s, or None for stop.
    ``on_adapter(name, path)`` loads an announced LoRA adapter (the worker's registry);
    ``host`` (a ``HostKVCache``, or None) runs each step's KV-tier copies before it returns;
    ``path``: as the sender's."""

    def __init__(self, group, capacity: int, device: torch.device,
                 on_adapter: Optional[Callable[[str, str], None]] = None, path=None, num_groups: int = 1,
                 copy_states: Optional[Callable[[list], None]] = None) -> None:
        self.group, self.device = group, device
        self.path = path if path is not None else BroadcastPath(group)
        self.buffer = torch.zeros(capacity, dtype=torch.int64, device=device)
        self.on_adapter = on_adapter
        self.num_groups = num_groups  # KV cache groups: block tables per request
        self.copy_states = copy_states  # the runner's state slot copies (hybrid models)
        self._tables: dict[int, list[list[int]]] = {}
        self._adapters: dict[int, str] = {}
        self.host = None
        self.states_after: list = []  # this step's state checkpoints, copied after its forward (``finish``)

    def recv(self) -> Optional[list[StepInput]]:
        while True:
            words = self._message()
            if words[0] == KIND_STOP:
                return None
            if words[0] == KIND_STEP:
                return self._unpack(words)
            name, path = bytes(words[HEADER:]).decode().split("\0", 1)
            self._adapters[words[2]] = name
            assert self.on_adapter is not None, "a LoRA adapter was announced to a worker without LoRA"
            self.on_adapter(name, path)

    def _message(self) -> list[int]:
        self.path.take(self.buffer)
        kind, length = self.buffer[:2].tolist()
        if kind == KIND_STOP:
            return [kind]
        if length > self.buffer.numel():
            payload = torch.empty(length, dtype=torch.int64, device=self.device)
            self.path.take(payload)
        else:
            payload = self.buffer
        return payload[:length].tolist()

    def _unpack(self, words: list[int]) -> list[StepInput]:
        num_scheduled, num_dropped = words[2], words[3]
        for slot in words[HEADER:HEADER + num_dropped]:
            self._tables.pop(slot, None)
        at, inputs = self._copies(words, HEADER + num_dropped), []
        for _ in range(num_scheduled):
            slot, flags, adapter, num_spec, prompt_rows, computed, num_new = words[at:at + 7]
            at += 7
            if flags & _IS_NEW:
                self._tables[slot] = [[] for _ in range(self.num_groups)]
            tables = self._tables[slot]
            for table in tables:
                table.extend(words[at + 1:at + 1 + words[at]])
                at += 1 + words[at]
            tokens = words[at:at + num_new]
            at += num_new
            inputs.append(StepInput(str(slot), computed, num_new, tokens, tables[0], bool(flags & _IS_SAMPLING),
                                    tokens[num_new - num_spec:] if num_spec else [],
                                    adapter_id=self._adapters[adapter] if adapter else None,
                                    # a stand-in prompt whose length gives PromptRows the same rows
                                    prompt_logprobs=0 if prompt_rows else None,
                                    prompt_token_ids=range(computed + prompt_rows) if prompt_rows else (),
                                    group_block_ids=tuple(tables) if self.num_groups > 1 else ()))
        return inputs

    def _copies(self, words: list[int], at: int) -> int:
        """Run the step's KV-tier and state copies that precede its forward; keep the state
        checkpoints for ``finish``. Returns the position after them."""
        lists = []
        for _ in range(6):
            n = words[at]
            lists.append([(words[at + 1 + 2 * i], words[at + 2 + 2 * i]) for i in range(n)])
            at += 1 + 2 * n
        swap_out, swap_in, states_out, states_in, restores, self.states_after = lists
        if self.host is not None:
            self.host.swap_out(swap_out)
            self.host.swap_states(states_out, to_host=True)
            self.host.swap_in(swap_in)
            self.host.swap_states(states_in, to_host=False)
        if restores and self.copy_states is not None:
            self.copy_states(restores)
        return at

    def finish(self) -> None:
        """After the step's forward: its state checkpoints."""
        if self.states_after and self.copy_states is not None:
            self.copy_states(self.states_after)
        self.states_after = []
