"""CUDA graphs for decode-only steps: the model forward replayed without launch overhead.

A Llama forward is a few hundred small kernel launches; at batch 1 the GPU finishes each
faster than Python can issue the next, so an eager decode step is bound by the host, not
by memory bandwidth. ``DecodeGraphs`` captures the whole forward once per *padded batch
size* (1, 2, 4, ... up to ``max_num_seqs``) and replays it for every step whose
sequences all bring exactly one new token and whose count fits a captured size. Any other
step (prefill chunks, mixed steps, speculative verification, too many sequences) runs
eagerly, unchanged.

Static inputs. A graph reads fixed device addresses, so each step's inputs are copied into
buffers allocated once (``DecodeInputs``), sized for the largest capture:
``input_ids``, ``positions``, ``slot_mapping`` [max_batch] int64, ``seq_lens``
[max_batch] int32, ``block_tables`` [max_batch, max_blocks_per_seq] int32 (max blocks
from ``max_model_len``), and ``query_start_loc`` = 0..max_batch (every sequence has one
query token, so it never changes). A graph of size ``b`` uses the first ``b`` rows.

Padding. Rows ``num_seqs..b-1`` are dummy sequences: token 0 at position 0, slot -1
(``write_kv`` skips negative slots, so nothing is written to the cache), context length
1 and block table ``[0, ...]`` (block 0 always exists; reading it is harmless). Every
output row is thus finite and the real rows are exactly what an unpadded step computes.
Only entries a sequence can read are refreshed: ``ceil(seq_len / block_size)`` table
columns for a real row, column 0 for a dummy row; stale columns beyond are never read,
and only the step's widest column range is copied to the device (a 128k-token context
has 8k columns per row; a step rarely needs them all).

Launch parameters. The Triton wrappers derive grids, tile shapes and the split-K count
from tensor shapes and from ``AttentionMetadata.num_seqs`` / ``max_query_len`` /
``max_seq_len`` (host values). Under a graph those are frozen at capture, so the
metadata handed to the captured forward has ``num_seqs = b``, ``max_query_len = 1`` and
``max_seq_len = max_model_len`` (the longest context any replay may see). The split
count and slice length are then what the eager path would choose at ``max_model_len``;
at shorter contexts the trailing slices hold no key and weigh nothing in the combine.
Nothing else in the kernels reads host state (the host length lists are used only by
the torch references, which is why graphs require the Triton kernels).

KV cache groups (``engine.kv.layout``). Each paged group other than the first has its own
``slot_mapping`` and ``block_tables`` buffers (its metadata shares the rest and goes to its
layers through ``layer_metadata``), filled from the row's table in that group; a
recurrent-state group's ``state_indices`` / ``has_initial_state`` buffers hold each row's
working slot (-1 for a dummy row: nothing read or written). Under a graph the state kernels
must read only these device tensors: their host copies are frozen at capture.

When. Only on CUDA with ``EngineConfig.enable_cuda_graphs`` and the Triton kernels
serving the model (``PAGODA_KERNELS=torch`` turns graphs off: the references read host
lists and synchronise). All sizes share one memory pool and are captured largest first,
each after one eager warm-up at its size (compiles the Triton variants outside capture).
If capture fails, the error is logged and the runner serves every step eagerly.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Optional, Sequence

import torch

from pagoda.engine.kv.layout import KVCacheLayout
from pagoda.kernels import AttentionMetadata

logger = logging.getLogger(__name__)


def capture_batch_sizes(max_num_seqs: int) -> list[int]:
    """Powers of two below ``max_num_seqs``, then ``max_num_seqs`` itself (ascending)."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes, size = [], 1
    while size < max_num_seqs:
        sizes.append(size)
        size *= 2
    return sizes + [max_num_seqs]


def padded_batch_size(num_seqs: int, sizes: Sequence[int]) -> Optional[int]:
    """The smallest captured size that holds ``num_seqs`` sequences, or None."""
    return next((s for s in sorted(sizes) if s >= num_seqs), None)


def is_graphable_step(scheduled: Sequence, max_batch: int, max_context: int) -> bool:
    """Whether a step can replay a decode graph: 1..max_batch sequences, one new token
    each (no speculative tokens to verify), every context within ``max_context``."""
    if not 0 < len(scheduled) <= max_batch:
        return False
    return all(it.num_new_tokens == 1 and it.num_computed_tokens < max_context
               and not getattr(it, "spec_token_ids", None) for it in scheduled)  # fmt: skip


class DecodeInputs:
    """The static input buffers of the decode graphs and how a step fills them."""

    def __init__(self, max_batch: int, max_context: int, block_size: int, device: torch.device | str,
                 layout: Optional[KVCacheLayout] = None) -> None:
        self.max_batch = max_batch
        self.max_context = max_context
        self.block_size = block_size
        self.max_blocks = -(-max_context // block_size)
        self.groups = GroupBuffers(layout, max_batch, self.max_blocks, device)
        kw = dict(dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(max_batch, **kw)  # [max_batch]
        self.positions = torch.zeros(max_batch, **kw)
        self.slot_mapping = torch.full((max_batch,), -1, **kw)
        kw["dtype"] = torch.int32
        self.seq_lens = torch.ones(max_batch, **kw)
        self.query_start_loc = torch.arange(max_batch + 1, **kw)  # one query token per sequence
        self.block_tables = torch.zeros(max_batch, self.max_blocks, **kw)  # [max_batch, max_blocks]
        # Host staging: filled row by row through numpy views, then one copy per buffer.
        self._host_tokens = torch.zeros(3, max_batch, dtype=torch.int64)  # ids, positions, slots
        self._host_seq_lens = torch.ones(max_batch, dtype=torch.int32)
        self._host_tables = torch.zeros(max_batch, self.max_blocks, dtype=torch.int32)
        self._tokens_np = self._host_tokens.numpy()
        self._seq_lens_np = self._host_seq_lens.numpy()
        self._tables_np = self._host_tables.numpy()

    def metadata(self, batch_size: int) -> AttentionMetadata:
        """Metadata over the first ``batch_size`` rows, with the host values frozen for
        capture (see the module docstring): ``max_seq_len`` is ``max_context``."""
        assert 0 < batch_size <= self.max_batch, f"batch {batch_size} outside 1..{self.max_batch}"
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:batch_size],
            query_start_loc=self.query_start_loc[: batch_size + 1],
            seq_lens=self.seq_lens[:batch_size],
            block_tables=self.block_tables[:batch_size],
            max_query_len=1,
            max_seq_len=self.max_context,
            query_lens_host=[1] * batch_size,
            seq_lens_host=[self.max_context] * batch_size,
        )
        return self.groups.metadata(meta, batch_size)

    def fill(self, scheduled: Sequence, batch_size: int) -> None:
        """Copy a decode-only step into the first ``batch_size`` rows, padding the rest.

        Args:
            scheduled: ``StepInput``-like items with ``num_new_tokens == 1``
                (``token_ids``, ``num_computed_tokens``, ``block_ids``).
            batch_size: the captured size to pad to (>= ``len(scheduled)``).
        """
        num_seqs = len(scheduled)
        assert num_seqs <= batch_size <= self.max_batch, f"{num_seqs} sequences do not fit {batch_size}"
        tokens, seq_lens, tables, bs = self._tokens_np, self._seq_lens_np, self._tables_np, self.block_size
        num_cols = 1  # table columns any row of this step reads
        for row, item in enumerate(scheduled):
            pos = item.num_computed_tokens
            assert item.num_new_tokens == 1 and pos < self.max_context, "not a decode row that fits"
            num_blocks = pos // bs + 1
            num_cols = max(num_cols, num_blocks)
            tables[row, :num_blocks] = item.block_ids[:num_blocks]
            tokens[0, row] = item.token_ids[0] if item.token_ids else 0  # a placeholder: see execute
            tokens[1, row] = pos
            tokens[2, row] = int(tables[row, pos // bs]) * bs + pos % bs
            seq_lens[row] = pos + 1
        tokens[:, num_seqs:batch_size] = ((0,), (0,), (-1,))  # dummy: token 0, position 0, no write
        seq_lens[num_seqs:batch_size] = 1
        tables[num_seqs:batch_size, 0] = 0
        self.groups.fill(scheduled, batch_size, bs, num_cols)
        self.input_ids[:batch_size].copy_(self._host_tokens[0, :batch_size])
        self.positions[:batch_size].copy_(self._host_tokens[1, :batch_size])
        self.slot_mapping[:batch_size].copy_(self._host_tokens[2, :batch_size])
        self.seq_lens[:batch_size].copy_(self._host_seq_lens[:batch_size])
        self.block_tables[:batch_size, :num_cols].copy_(self._host_tables[:batch_size, :num_cols])


class GroupBuffers:
    """The static buffers of the KV cache groups beyond the first (see the module docstring)."""

    def __init__(self, layout: Optional[KVCacheLayout], max_batch: int, max_blocks: int,
                 device: torch.device | str) -> None:
        self.layout = layout
        self.others = [g.index for g in layout.paged_groups[1:]] if layout is not None else []
        self.state = layout.state_group.index if layout is not None and layout.state_group else None
        n = len(self.others)
        self.tables = torch.zeros(n, max_batch, max_blocks, dtype=torch.int32, device=device)
        self.slots = torch.full((n, max_batch), -1, dtype=torch.int64, device=device)
        self.state_indices = torch.full((max_batch,), -1, dtype=torch.int32, device=device)
        self.has_initial_state = torch.zeros(max_batch, dtype=torch.bool, device=device)
        self._host_tables = torch.zeros(n, max_batch, max_blocks, dtype=torch.int32)
        self._host_slots = torch.full((n, max_batch), -1, dtype=torch.int64)
        self._host_states = torch.zeros(2, max_batch, dtype=torch.int32)  # slot, has initial state

    def fill(self, scheduled: Sequence, batch_size: int, block_size: int, num_cols: int) -> None:
        """Rows of the other groups' tables and slots, and the state slots; dummies padded."""
        if not self.others and self.state is None:
            return
        tables, slots, states = self._host_tables.numpy(), self._host_slots.numpy(), self._host_states.numpy()
        for row, item in enumerate(scheduled):
            pos = item.num_computed_tokens
            for i, group in enumerate(self.others):
                table = item.group_block_ids[group][:pos // block_size + 1]
                tables[i, row, :len(table)] = table
                slots[i, row] = table[pos // block_size] * block_size + pos % block_size
            if self.state is not None:
                states[:, row] = (item.group_block_ids[self.state][0], pos > 0)
        tables[:, len(scheduled):batch_size, 0] = 0
        slots[:, len(scheduled):batch_size] = -1
        states[:, len(scheduled):batch_size] = ((-1,), (0,))  # a padding row: no state read or written
        self.tables[:, :batch_size, :num_cols].copy_(self._host_tables[:, :batch_size, :num_cols])
        self.slots[:, :batch_size].copy_(self._host_slots[:, :batch_size])
        self.state_indices[:batch_size].copy_(self._host_states[0, :batch_size])
        self.has_initial_state[:batch_size].copy_(self._host_states[1, :batch_size].bool())

    def metadata(self, base: AttentionMetadata, batch_size: int) -> AttentionMetadata:
        """``base`` (group 0's) with the other groups' metadata per layer and the state slots."""
        if self.layout is None or self.layout.num_groups == 1:
            return base
        metas = {self.layout.paged_groups[0].index: base}
        for i, group in enumerate(self.others):
            metas[group] = dataclasses.replace(base, slot_mapping=self.slots[i, :batch_size],
                                               block_tables=self.tables[i, :batch_size], cpu_plans={})
        for meta in metas.values():
            meta.state_indices = self.state_indices[:batch_size]
            meta.has_initial_state = self.has_initial_state[:batch_size]
            meta.state_indices_host, meta.has_initial_state_host = [-1] * batch_size, [False] * batch_size
        base.layer_metadata = [metas.get(group, base) for group, _ in self.layout.layer_slots]
        return base


class DecodeGraphs:
    """One captured forward per padded batch size, over shared static inputs."""

    def __init__(self, model, kv_caches, max_num_seqs: int, max_context: int, block_size: int,
                 layout: Optional[KVCacheLayout] = None) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = capture_batch_sizes(max_num_seqs)
        self.inputs = DecodeInputs(self.sizes[-1], max_context, block_size, model.device, layout)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    @classmethod
    def maybe_capture(cls, runner) -> Optional["DecodeGraphs"]:
        """Capture for a ``ModelRunner`` when graphs apply (see the module docstring),
        else None: CPU, ``enable_cuda_graphs=False``, or the torch reference kernels."""
        from pagoda import kernels

        config = runner.config
        if not should_use_graphs(config.enable_cuda_graphs, runner.device, kernels.use_triton(runner.kv_tensors[0][0])):
            return None
        max_context = runner.model_config.check_max_model_len(config.max_model_len)
        graphs = cls(runner.model, runner.kv_caches, config.max_num_seqs, max_context, runner.block_size,
                     runner.kv_layout)
        try:
            graphs.capture()
        except Exception:  # noqa: BLE001  (any capture failure: serve eagerly rather than not at all)
            logger.exception("CUDA graph capture failed; decode steps run eagerly (enable_cuda_graphs=False "
                             "silences this)")  # fmt: skip
            return None
        return graphs

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up and capture every size, largest first, into one memory pool."""
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            self.inputs.fill([], size)  # all rows dummy: capture writes nothing anywhere
            self._forward(size)  # warm-up: compiles kernels, initialises cuBLAS
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = self._forward(size)  # [size, hidden]
            self._graphs[size] = (graph, hidden)
        torch.cuda.synchronize()
        logger.info("captured decode CUDA graphs for batch sizes %s (max context %d)",
                    self.sizes, self.inputs.max_context)

    def _forward(self, size: int) -> torch.Tensor:
        inputs = self.inputs
        return self.model(inputs.input_ids[:size], inputs.positions[:size], self.kv_caches, inputs.metadata(size))

    def can_run(self, scheduled: Sequence) -> bool:
        return is_graphable_step(scheduled, self.sizes[-1], self.inputs.max_context)

    @torch.inference_mode()
    def execute(self, scheduled: Sequence, placeholder_rows: Sequence[int] = (),
                placeholder_tokens: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``ModelRunner.compute_logits`` for a step that ``can_run``: same contract (float32
        logits of the sampling rows, in batch order). ``placeholder_rows`` get their input
        token from ``placeholder_tokens`` (on the device; async scheduling)."""
        size = padded_batch_size(len(scheduled), self.sizes)
        self.inputs.fill(scheduled, size)
        if placeholder_rows:
            rows = torch.tensor(list(placeholder_rows), dtype=torch.int64, device=self.inputs.input_ids.device)
            self.inputs.input_ids.index_copy_(0, rows, placeholder_tokens)
        graph, hidden = self._graphs[size]
        graph.replay()
        sample_rows = [row for row, item in enumerate(scheduled) if item.is_sampling]
        if len(sample_rows) == len(scheduled):
            selected = hidden[: len(scheduled)]
        else:
            selected = hidden[torch.tensor(sample_rows, dtype=torch.int64, device=hidden.device)]
        return self.model.compute_logits(selected).float()


def should_use_graphs(enabled: bool, device: torch.device, triton_kernels: bool) -> bool:
    """Graphs need CUDA, the config switch, and the Triton kernels (graph-safe wrappers)."""
    return enabled and device.type == "cuda" and triton_kernels
