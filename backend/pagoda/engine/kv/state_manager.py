"""The recurrent-state group: a working slot per request, and checkpoints for prefix caching.

Linear-attention layers (Gated DeltaNet, Mamba) keep one fixed-size state per sequence,
whatever its length. The state pool (``kv.layout``) is a ``BlockPool`` of slots; slot 0
is the null slot. A running request holds one *working slot*: the model reads the state
from it (zeros when ``num_computed_tokens`` is 0) and writes the state after the step's
last token back into it, so a prompt computed in chunks carries its state across them.

Prefix caching needs the state *at* a cached position, and the working slot only ever
holds the latest one. So the state is **checkpointed at block boundaries**: when a step
ends at a checkpoint position ``p`` (a multiple of ``block_size``), a free slot receives
a copy of the working slot after the forward (``take_copies``: the *after* pairs), and
once the step is applied it enters the pool's hash map under the request's hash of the
block ending at ``p`` (whose chain covers every token before ``p``, the cache salt and
LoRA adapter included), then goes free-but-cached in LRU order like any cached block.
A later request whose prefix hit reaches ``p`` in every other group (``find_hit`` scans
right to left for the last checkpoint, as vLLM's ``MambaManager`` does) gets a new working
slot filled from the checkpoint before its first forward (the *before* pairs;
``num_restored`` counts them) and starts at ``p`` instead of 0.

Which positions are checkpoints (this is vLLM's "align" mode, made adaptive): the model
only hands out the state after a step's last token, so the scheduler ends prefill chunks
at the positions worth keeping (``next_cut``), each costing a step boundary and one copy:

1. the last block boundary of the prompt (a repeated prompt, n > 1 siblings and a
   retried request resume there and recompute at most one block);
2. the *junction*: where a request's full-attention hit ended but no checkpoint existed
   (it recomputes the shared prefix once and leaves a checkpoint at its end, so every
   later request sharing that prefix — a system prompt — resumes it);
3. every block boundary a *decode* step reaches (no cut needed: a decode ends at each
   position), keeping only the request's latest such checkpoint (the one before is
   forgotten, so a long generation does not flush the other checkpoints out of the LRU):
   a finished request leaves its state at its last boundary, where the next turn of a
   conversation (its prompt: this one's prompt and answer, then more) resumes;
4. every ``checkpoint_interval`` tokens (0, the default: never), prompt and output alike,
   for long prompts that share prefixes at no predictable place.

Pinning: a checkpoint being copied from is referenced until the step's copies are taken,
so no allocation in the same step can reuse it. A checkpoint slot whose step is undone
or whose request is freed before the step is applied is released without a hash.
No torch.
"""

from __future__ import annotations

from typing import Optional

from pagoda.engine.kv.block_pool import BlockPool, KVCacheBlock
from pagoda.engine.kv.host_tier import BlockPairs
from pagoda.engine.kv.layout import KVCacheGroup
from pagoda.engine.request import Request


class StateGroupManager:
    """Args:
    group: the state group (its index keys the checkpoints' hash map and events).
    pool: the state pool.
    block_size: tokens per block (checkpoints sit at block boundaries).
    enable_caching: take and look up checkpoints.
    checkpoint_interval: tokens between periodic checkpoints (a multiple of block_size; 0: none).
    """

    def __init__(self, group: KVCacheGroup, pool: BlockPool, block_size: int, enable_caching: bool,
                 checkpoint_interval: int = 0) -> None:
        if checkpoint_interval % block_size:
            raise ValueError(f"state_checkpoint_interval: must be a multiple of block_size {block_size}, "
                             f"got {checkpoint_interval}")
        self.group = group
        self.group_idx = group.index
        self.pool = pool
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.checkpoint_interval = checkpoint_interval
        self.req_to_slot: dict[str, KVCacheBlock] = {}
        self._pending: dict[str, list[tuple[int, KVCacheBlock]]] = {}  # (position, slot) of steps not applied
        self._latest_decode: dict[str, KVCacheBlock] = {}  # the request's latest decode checkpoint (held)
        self._junction: dict[str, int] = {}
        self._before: list[tuple[int, int]] = []  # (checkpoint, working slot): restores, before the forward
        self._after: list[tuple[int, int]] = []  # (working slot, checkpoint): after the forward
        self._pinned: list[KVCacheBlock] = []  # checkpoints read this step
        self.num_restored = 0  # requests that resumed a checkpoint instead of computing its prefix
        self.num_restored_tokens = 0
        self.num_checkpoints = 0  # checkpoint copies scheduled

    # Lookup ---------------------------------------------------------------------------

    def find_hit(self, request: Request, max_blocks: int) -> list[KVCacheBlock]:
        """The last checkpoint at a block boundary ``p <= max_blocks * block_size``, as a table of
        ``p / block_size`` entries (null, then the checkpoint last); [] when there is none."""
        if not self.enable_caching:
            return []
        size, null = self.block_size, self.pool.null_block
        for i in range(min(max_blocks, len(request.block_hashes)) - 1, -1, -1):
            slot = self.pool.get_cached_block(request.block_hashes[i], self.group_idx)
            if slot is not None and list(slot.token_ids) == request.all_token_ids[i * size:(i + 1) * size]:
                return [null] * i + [slot]
        return []

    # Allocation -----------------------------------------------------------------------

    def num_new_slots(self, request_id: str, hit: list[KVCacheBlock]) -> int:
        """Slots an allocation takes from the free queue: a working slot if the request has
        none, and a free checkpoint it restores from (pinned for the step)."""
        num = 0 if request_id in self.req_to_slot else 1
        return num + (1 if hit and hit[-1].ref_cnt == 0 else 0)

    def allocate(self, request: Request, hit: list[KVCacheBlock], junction: int = 0) -> None:
        """Give ``request`` a working slot (restored from ``hit``'s checkpoint); ``junction``:
        where its full-attention hit ended, checkpointed if the state hit stops before it."""
        request_id = request.request_id
        if hit:  # pinned first: the working slot's allocation must not evict it
            self.pool.touch([hit[-1]])
            self._pinned.append(hit[-1])
        if request_id not in self.req_to_slot:
            self.req_to_slot[request_id] = self.pool.get_new_blocks(1)[0]
        if hit:
            self._before.append((hit[-1].block_id, self.req_to_slot[request_id].block_id))
            self.num_restored += 1
            self.num_restored_tokens += len(hit) * self.block_size
        if self.enable_caching and junction > len(hit) * self.block_size:
            self._junction[request_id] = junction

    def slot_id(self, request_id: str) -> int:
        slot = self.req_to_slot.get(request_id)
        return slot.block_id if slot is not None else 0

    # Checkpoints ----------------------------------------------------------------------

    def next_cut(self, request: Request, start: int, num_new: int, junction: int = 0) -> int:
        """``num_new`` shortened so a step from ``start`` ends at the first checkpoint position
        inside it (see the module docstring), unless that position is checkpointed already.
        ``junction``: a waiting request's, known from its hit before ``allocate`` records it."""
        if not self.enable_caching or num_new <= 1:
            return num_new
        end = start + num_new
        candidates = [junction or self._junction.get(request.request_id, 0), self._prompt_end(request)]
        if self.checkpoint_interval:
            candidates.append((start // self.checkpoint_interval + 1) * self.checkpoint_interval)
        for pos in sorted(c for c in candidates if start < c < end):
            if not self._is_cached(request, pos):
                return pos - start
        return num_new

    def plan_checkpoint(self, request: Request, start: int, num_new: int) -> None:
        """Copy the working slot into a free slot after this step when it ends at a checkpoint
        position; skipped when no slot is free or the position is checkpointed already."""
        end, request_id = start + num_new, request.request_id
        if not self.enable_caching or self._is_cached(request, end):
            return
        if not (self._is_checkpoint(request, end) or (num_new == 1 and end > 0 and end % self.block_size == 0)):
            return
        if self.pool.num_free_blocks == 0 or any(pos == end for pos, _ in self._pending.get(request_id, ())):
            return
        slot = self.pool.get_new_blocks(1)[0]
        self._pending.setdefault(request_id, []).append((end, slot))
        self._after.append((self.req_to_slot[request_id].block_id, slot.block_id))
        self.num_checkpoints += 1

    def cache(self, request: Request, num_computed_tokens: int) -> None:
        """Enter the checkpoints of applied steps (positions ``<= num_computed_tokens``)."""
        pending = self._pending.get(request.request_id)
        if not pending:
            return
        keep = []
        for pos, slot in pending:
            index = pos // self.block_size - 1
            if pos > num_computed_tokens or index >= len(request.block_hashes):
                keep.append((pos, slot))
                continue
            is_cached = self.pool.cache_block(request, slot, index, self.block_size, self.group_idx)
            if is_cached and not self._is_checkpoint(request, pos):  # a decode boundary: keep only the latest
                slot = self._keep_latest(request.request_id, slot)
            if slot is not None:
                self.pool.free_blocks([slot])  # cached and free (or a duplicate: just free)
        self._pending[request.request_id] = keep

    def _keep_latest(self, request_id: str, slot: KVCacheBlock) -> Optional[KVCacheBlock]:
        """Hold ``slot`` as the request's latest decode checkpoint; forget the one before.
        Returns the slot to free now (the previous one), or None."""
        previous = self._latest_decode.get(request_id)
        self._latest_decode[request_id] = slot
        if previous is not None:
            self.pool.uncache(previous)
        return previous

    def drop_pending(self, request_id: str) -> None:
        """Release checkpoints whose step will not be applied (undone, or the request left)."""
        for _, slot in self._pending.pop(request_id, ()):
            self.pool.free_blocks([slot])

    def _is_checkpoint(self, request: Request, pos: int) -> bool:
        if pos <= 0 or pos % self.block_size:
            return False
        if self.checkpoint_interval and pos % self.checkpoint_interval == 0:
            return True
        return pos == self._junction.get(request.request_id) or pos == self._prompt_end(request)

    def _prompt_end(self, request: Request) -> int:
        return (request.num_prompt_tokens - 1) // self.block_size * self.block_size

    def _is_cached(self, request: Request, pos: int) -> bool:
        """Whether a checkpoint at block boundary ``pos`` exists (False for any other position)."""
        index = pos // self.block_size - 1
        if pos % self.block_size or not 0 <= index < len(request.block_hashes):
            return False
        return self.pool.get_cached_block(request.block_hashes[index], self.group_idx) is not None

    # Freeing and the step boundary ----------------------------------------------------

    def free(self, request_id: str) -> None:
        """Release the request's slots; copies this step planned for them are dropped (the slots
        may be handed out again in the same step, and a copy must not land on a new owner)."""
        self.drop_pending(request_id)
        self._junction.pop(request_id, None)
        latest = self._latest_decode.pop(request_id, None)
        if latest is not None:  # stays cached: the next turn of a conversation resumes it
            self.pool.free_blocks([latest])
        slot = self.req_to_slot.pop(request_id, None)
        if slot is not None:
            self._before = [pair for pair in self._before if pair[1] != slot.block_id]
            self._after = [pair for pair in self._after if pair[0] != slot.block_id]
            self.pool.free_blocks([slot])

    def take_copies(self) -> tuple[BlockPairs, BlockPairs]:
        """This step's (before the forward, after the forward) slot copies as (src, dst);
        releases the checkpoints pinned for reading."""
        before, after = self._before, self._after
        self._before, self._after = [], []
        pinned, self._pinned = self._pinned, []
        self.pool.free_blocks(pinned)
        return before, after

    def reset(self) -> Optional[bool]:
        return self.pool.reset_prefix_cache()
