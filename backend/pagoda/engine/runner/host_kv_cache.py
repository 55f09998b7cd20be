"""Host KV cache and the block copies of the CPU tier (``kv.host_tier`` decides, this moves).

``HostKVCache`` preallocates, per layer, a K and a V tensor shaped like the runner's
device caches but with ``num_blocks`` host blocks: ``[num_host_blocks, block_size,
num_kv_heads, head_dim]`` (a multi-head-latent-attention layer: its one latent tensor),
pinned when the device is CUDA so copies can use DMA. On a
CPU-only machine the "device" cache is host memory too, but the tier is still a separate
pool and every copy is a real copy.

``execute(scheduler_output)`` runs one step's copies before the forward pass: first all
device -> host pairs (``blocks_to_swap_out``), then all host -> device pairs
(``blocks_to_swap_in`` and ``blocks_to_copy_back``), each as one batched
``index_select`` + ``index_copy_`` per layer and per K/V. Destinations within one batch
are unique (the scheduler side guarantees it), as ``index_copy_`` requires.

KV cache groups (``engine.kv.layout``): the copies run over the runner's distinct tensor
pairs (``kv_tensors``: a pair shared by layers of several groups is copied once; a block
id is one page in each), and a hybrid model's swaps also move recurrent states: host
state slots (``[num_state_slots, *shape]`` per state layer: the budget's first half at
most; one slot per sequence at most without prefix caching, else the whole half, whose
slots beyond the swaps' hold state checkpoints the device evicted, ``kv.host_states``) take
``states_to_swap_out`` (swaps and evicted checkpoints) before the block copies' second half
and give back ``states_to_swap_in`` (swaps and restored checkpoints) with them.

``calibrate`` measures the cost model's inputs at start: a one-block and a many-block
round trip give the fixed copy latency and the bandwidth; one prefill of up to 128
tokens into unused blocks gives seconds per recomputed token.
"""

from __future__ import annotations

import statistics
import time
from typing import Sequence

import torch

from pagoda.engine.kv.host_tier import BlockPairs
from pagoda.engine.kv.swap_cost import SwapCostModel
from pagoda.engine.runner.model_runner import ModelRunner

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


class HostKVCache:
    """Args:
    device_caches: the runner's per-layer (K, V) caches.
    num_blocks: host blocks to allocate.
    """

    def __init__(self, device_caches: KVCaches, num_blocks: int, device_states: Sequence = (),
                 num_state_slots: int = 0) -> None:
        assert num_blocks >= 1, f"num_blocks must be >= 1, got {num_blocks}"
        self.device_caches = device_caches
        self.num_blocks = num_blocks
        self.device = device_caches[0][0].device
        pin = self.device.type == "cuda"
        # Each device tensor's host twin (K and V, or a latent cache's one tensor: shapes may differ).
        self.host_caches: KVCaches = [
            tuple(torch.zeros((num_blocks, *t.shape[1:]), dtype=t.dtype, pin_memory=pin) for t in layer)
            for layer in device_caches
        ]
        # Recurrent states (one (conv, ssm) pair per state layer), when the model has them.
        self.device_states = list(device_states)
        self.num_state_slots = num_state_slots if self.device_states else 0
        self.host_states = [tuple(torch.zeros((self.num_state_slots, *t.shape[1:]), dtype=t.dtype, pin_memory=pin)
                                  for t in layer) for layer in self.device_states]
        self.file_io = None  # runner.file_tier_io.FileTierIO, with the disk or shared tier

    @classmethod
    def for_runner(cls, runner: ModelRunner, num_bytes: int) -> "HostKVCache":
        """A host cache of ``num_bytes // bytes_per_block`` blocks for ``runner``'s caches.

        Under tensor (pipeline) parallelism a block holds this rank's KV heads (layers), and every rank takes
        the smallest count (a collective: every rank calls this at the same point).

        Raises:
            ValueError: ``num_bytes`` is smaller than one block.
        """
        per_block = block_bytes(runner.kv_tensors)
        states = [c for c in runner.kv_caches if hasattr(c, "ssm_states")]
        slot_bytes = sum(t[0].numel() * t.element_size() for c in states for t in c)
        # Swaps need one slot per sequence; with prefix caching the rest of the half holds evicted checkpoints.
        max_slots = (num_bytes // 2) // slot_bytes if states else 0
        num_slots = max_slots if runner.config.enable_prefix_caching else \
            min(runner.config.max_num_seqs, max_slots)
        num_blocks = (num_bytes - num_slots * slot_bytes) // per_block
        if runner.group is not None:  # tensor- or pipeline-parallel ranks agree on the host block ids
            num_blocks = runner.group.min_int(int(num_blocks))
            num_slots = runner.group.min_int(int(num_slots)) if states else 0
        if num_blocks < 1:
            raise ValueError(f"cpu_offload_bytes: {num_bytes} bytes is smaller than one KV block "
                             f"({per_block} bytes); raise it or set 0 to disable the CPU tier")
        return cls(runner.kv_tensors, int(num_blocks), states, int(num_slots))

    @property
    def bytes_per_block(self) -> int:
        return block_bytes(self.host_caches)

    @torch.inference_mode()
    def execute(self, scheduler_output) -> None:
        """Run a step's copies: device -> host first, then the file tiers' captures and loads
        (so a captured row is the one just copied in), then host -> device."""
        self.swap_out(scheduler_output.blocks_to_swap_out)
        self.swap_states(scheduler_output.states_to_swap_out, to_host=True)
        if self.file_io is not None:
            self.file_io.execute(scheduler_output.blocks_to_store, scheduler_output.blocks_to_load)
        self.swap_in(list(scheduler_output.blocks_to_swap_in) + list(scheduler_output.blocks_to_copy_back))
        self.swap_states(scheduler_output.states_to_swap_in, to_host=False)

    def swap_states(self, pairs: BlockPairs, to_host: bool) -> None:
        """Copy recurrent-state slots, device -> host (``to_host``; pairs (device, host)) or back."""
        if to_host:
            _copy_rows(self.device_states, self.host_states, pairs, to_host=True)
        else:
            _copy_rows(self.host_states, self.device_states, pairs, to_host=False)

    @torch.inference_mode()
    def swap_out(self, pairs: BlockPairs) -> None:
        """Copy device blocks to host blocks; ``pairs`` are (device src, host dst)."""
        if not pairs:
            return
        src = torch.tensor([p[0] for p in pairs], dtype=torch.int64, device=self.device)
        dst = torch.tensor([p[1] for p in pairs], dtype=torch.int64)
        for device_kv, host_kv in zip(self.device_caches, self.host_caches):
            for device_t, host_t in zip(device_kv, host_kv):
                _raw(host_t).index_copy_(0, dst, _raw(device_t).index_select(0, src).to("cpu"))

    @torch.inference_mode()
    def swap_in(self, pairs: BlockPairs) -> None:
        """Copy host blocks to device blocks; ``pairs`` are (host src, device dst)."""
        if not pairs:
            return
        src = torch.tensor([p[0] for p in pairs], dtype=torch.int64)
        dst = torch.tensor([p[1] for p in pairs], dtype=torch.int64, device=self.device)
        # Synchronous: the gathered rows are pageable, and the forward pass reads them next.
        for device_kv, host_kv in zip(self.device_caches, self.host_caches):
            for device_t, host_t in zip(device_kv, host_kv):
                _raw(device_t).index_copy_(0, dst, _raw(host_t).index_select(0, src).to(self.device))

    def time_round_trip(self, device_block_ids: Sequence[int], repeats: int = 5) -> float:
        """Median seconds of one direction (half a device -> host -> device round trip)."""
        pairs_out = [(d, h) for h, d in enumerate(device_block_ids)]
        pairs_in = [(h, d) for d, h in pairs_out]
        times = []
        for _ in range(repeats):
            _sync(self.device)
            start = time.perf_counter()
            self.swap_out(pairs_out)
            self.swap_in(pairs_in)
            _sync(self.device)
            times.append((time.perf_counter() - start) / 2)
        return statistics.median(times)


def calibrate(host: HostKVCache, runner: ModelRunner, bandwidth: float | None = None,
              latency_s: float | None = None, prefill_s_per_token: float | None = None) -> SwapCostModel:
    """The cost model, measuring whatever is not given. Call before serving: it writes
    into unused device and host blocks.

    Args:
        host: the host cache (its first blocks are used).
        runner: the model runner (its first device blocks are used).
        bandwidth, latency_s, prefill_s_per_token: configured values; None measures.
    """
    if bandwidth is None or latency_s is None:
        many = max(1, min(32, host.num_blocks, runner.num_blocks - 1))
        t_one = host.time_round_trip([1])
        t_many = host.time_round_trip(list(range(1, many + 1)))
        per_block = max((t_many - t_one) / max(many - 1, 1), 1e-12)
        if bandwidth is None:
            bandwidth = host.bytes_per_block / per_block
        if latency_s is None:
            latency_s = max(t_one - host.bytes_per_block / bandwidth, 0.0)
    if prefill_s_per_token is None:
        prefill_s_per_token = measure_prefill_s_per_token(runner)
    return SwapCostModel(host.bytes_per_block, float(bandwidth), float(latency_s), float(prefill_s_per_token))


class PrefillItem:
    """A stand-in for ``StepInput`` (``compute_logits`` reads only these fields)."""

    def __init__(self, token_ids: list[int], block_ids: list[int], group_block_ids: tuple[list[int], ...] = ()) -> None:
        self.token_ids = token_ids
        self.num_computed_tokens = 0
        self.num_new_tokens = len(token_ids)
        self.block_ids = block_ids
        self.group_block_ids = group_block_ids
        self.is_sampling = True
        self.spec_token_ids: list[int] = []
        self.adapter_id = None
        self.request_id = ""


def measure_prefill_s_per_token(runner: ModelRunner, max_tokens: int = 128, repeats: int = 2) -> float:
    """Seconds per token of a prefill through ``runner`` (best of ``repeats``), written
    into the runner's first blocks."""
    num_tokens = max(1, min(max_tokens, (runner.num_blocks - 1) * runner.block_size))
    num_blocks = -(-num_tokens // runner.block_size)
    block_ids = list(range(1, num_blocks + 1))
    # KV cache groups: every paged group writes the same (unused) blocks, a state group slot 1 (unused
    # before serving; a fresh state, as num_computed_tokens is 0): a timing, not a result.
    groups = runner.kv_layout.groups
    item = PrefillItem([(7 * i) % runner.model_config.vocab_size for i in range(num_tokens)], block_ids,
                       tuple([1] if g.spec.is_state else block_ids for g in groups) if len(groups) > 1 else ())
    runner.compute_logits([item])  # warm-up
    best = float("inf")
    for _ in range(repeats):
        _sync(runner.device)
        start = time.perf_counter()
        runner.compute_logits([item])
        _sync(runner.device)
        best = min(best, time.perf_counter() - start)
    return best / num_tokens


@torch.inference_mode()
def _copy_rows(sources: Sequence, targets: Sequence, pairs: BlockPairs, to_host: bool) -> None:
    """Copy slot rows between per-layer tensor tuples; ``pairs`` are (src slot, dst slot)."""
    if not pairs or not sources:
        return
    src = torch.tensor([p[0] for p in pairs], dtype=torch.int64, device=sources[0][0].device)
    dst = torch.tensor([p[1] for p in pairs], dtype=torch.int64, device=targets[0][0].device)
    for source_layer, target_layer in zip(sources, targets):
        for source, target in zip(source_layer, target_layer):
            rows = source.index_select(0, src)
            target.index_copy_(0, dst, rows.to("cpu") if to_host else rows.to(target.device))


@torch.inference_mode()
def copy_device_blocks(device_caches: KVCaches, pairs: BlockPairs) -> None:
    """Copy device blocks to device blocks in every layer's K and V; ``pairs`` are (src, dst).
    A beam fork's copy-on-write (``KVCacheManager.fork``); sources are never destinations."""
    src = torch.tensor([p[0] for p in pairs], dtype=torch.int64, device=device_caches[0][0].device)
    dst = torch.tensor([p[1] for p in pairs], dtype=torch.int64, device=src.device)
    for layer in device_caches:
        for cache in layer:
            _raw(cache).index_copy_(0, dst, _raw(cache).index_select(0, src))


def block_bytes(caches: KVCaches) -> int:
    """Bytes one block id takes across the per-layer cache tensors."""
    return sum(t[0].numel() * t.element_size() for layer in caches for t in layer)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _raw(cache: torch.Tensor) -> torch.Tensor:
    """An fp8 cache as its bytes (``index_copy_`` has no float8 kernel); others as they are."""
    return cache.view(torch.uint8) if cache.dtype == torch.float8_e4m3fn else cache
