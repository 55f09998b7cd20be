"""Which LoRA adapters the engine knows, and which of them sit in the device slots.

Two tiers, as in vLLM: *registered* adapters (host copies, fused and padded by
``models.lora.load_peft_adapter``; at most ``max_cpu_loras``) and *slots* on the model's
device (``models.lora.LoRASlots``; ``max_loras`` of them). Before each forward the runner
calls ``prepare(adapter ids of the step's requests, token counts)``: adapters already in a
slot stay; missing ones are copied into free slots, or into the least recently used slot
no request of this step needs. The scheduler guarantees a step never needs more than
``max_loras`` distinct adapters (``core.sched.constraints.LoRASlotLimit``), so a slot is always found.

Identity: an adapter's name is its id everywhere — in ``Request.adapter_id``, in every
block hash's extra keys (two adapters never share KV blocks; the router's prefix index
sees the same hashes), in metrics and at the API (Triton ``lora_name``, OpenAI ``model``).

Loading is split in two so a server can load at run time without stalling its engine
thread: ``load`` (file I/O and fusing, any thread) and ``register`` (the engine thread, a
dict insert); ``add`` does both for the offline API and start-up adapters.

Invariants: a registered adapter's name is unique; ``remove`` refuses an adapter that a
live request still uses (the engine checks) and clears its slot; slots hold either
nothing or a registered adapter.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Optional

import torch

from pagoda.models.lora import LoRAAdapter, LoRABatch, LoRASlots, load_peft_adapter

logger = logging.getLogger(__name__)


class LoRAManager:
    def __init__(self, model, max_loras: int, max_lora_rank: int, max_cpu_loras: int) -> None:
        self.model = model
        self.max_rank = max_lora_rank
        self.max_cpu_loras = max_cpu_loras
        self.slots = LoRASlots(model, max_loras, max_lora_rank)
        self.adapters: dict[str, LoRAAdapter] = {}
        self._slot_of: OrderedDict[str, int] = OrderedDict()  # name -> slot, least recently used first
        self.num_slot_loads = 0
        logger.info("LoRA: %d device slots of rank %d (%.1f MiB each)", max_loras, max_lora_rank,
                    self.slots.bytes_per_slot() / 2**20)

    # ---- registry --------------------------------------------------------------------

    def add(self, name: str, path: str) -> LoRAAdapter:
        """Load an adapter and register it under ``name`` (``register(load(name, path))``).

        Raises:
            ValueError: as ``load`` and ``register``.
        """
        return self.register(self.load(name, path))

    def load(self, name: str, path: str) -> LoRAAdapter:
        """Read and fuse an adapter on the host, without registering it.

        Safe on any thread while the engine runs: it reads only the model's (immutable)
        config and dtype, so the file I/O and fusing of a run-time load never stall the
        engine thread. The name checks here are early answers; ``register`` repeats them.

        Raises:
            ValueError: the name is invalid or taken, the registry is full, or the folder is
                not a LoRA adapter this model can use (see ``load_peft_adapter``).
        """
        self._check_can_register(name)
        return load_peft_adapter(name, path, self.model.config, self.max_rank, self.model.dtype)

    def register(self, adapter: LoRAAdapter) -> LoRAAdapter:
        """Make a loaded adapter known under its name (the engine thread; no I/O).

        The next step may use it: slots are filled in ``prepare`` from ``adapters``.

        Raises:
            ValueError: the name is invalid or taken, or the registry is full.
        """
        self._check_can_register(adapter.name)
        self.adapters[adapter.name] = adapter
        logger.info("LoRA adapter %r loaded from %s (rank %d)", adapter.name, adapter.path, adapter.rank)
        return adapter

    def _check_can_register(self, name: str) -> None:
        if not isinstance(name, str) or not name or name.strip() != name:
            raise ValueError(f"lora_name: must be a non-empty string without surrounding spaces, got {name!r}")
        if name in self.adapters:
            raise ValueError(f"lora_name: an adapter named {name!r} is already loaded")
        if len(self.adapters) >= self.max_cpu_loras:
            raise ValueError(f"cannot load {name!r}: {self.max_cpu_loras} adapters are loaded (max_cpu_loras); "
                             "unload one first")

    def remove(self, name: str) -> None:
        """Forget ``name`` and clear its slot. Raises ValueError when it is not loaded."""
        if name not in self.adapters:
            raise ValueError(f"lora_name: no adapter named {name!r} is loaded")
        del self.adapters[name]
        slot = self._slot_of.pop(name, None)
        if slot is not None:
            self.slots.load(slot, None)

    def names(self) -> list[str]:
        return sorted(self.adapters)

    def paths(self) -> dict[str, str]:
        """Registered adapter name -> the folder it was loaded from."""
        return {name: self.adapters[name].path for name in self.names()}

    def check(self, name: Optional[str]) -> None:
        """Raise ValueError naming the loaded adapters when ``name`` is not one of them."""
        if name is not None and name not in self.adapters:
            loaded = ", ".join(self.names()) or "none"
            raise ValueError(f"lora_name: unknown adapter {name!r}; loaded adapters: {loaded}")

    # ---- slots -----------------------------------------------------------------------

    def prepare(self, adapter_ids: list[Optional[str]], num_tokens: list[int],
                device: torch.device) -> Optional[LoRABatch]:
        """Put the step's adapters in slots; the per-token batch, or None when no request has one."""
        needed = {a for a in adapter_ids if a is not None}
        if not needed:
            return None
        assert len(needed) <= self.slots.num_slots, \
            f"a step needs {len(needed)} adapters but there are {self.slots.num_slots} slots (scheduler bug)"
        for name in needed:
            if name in self._slot_of:
                self._slot_of.move_to_end(name)
            else:
                self._slot_of[name] = self._free_slot(needed)
                self.slots.load(self._slot_of[name], self.adapters[name])
                self.num_slot_loads += 1
                self._slot_of.move_to_end(name)
        slots = [self._slot_of[a] if a is not None else -1 for a in adapter_ids]
        return LoRABatch.build(slots, num_tokens, device)

    def _free_slot(self, needed: set[str]) -> int:
        used = set(self._slot_of.values())
        for slot in range(self.slots.num_slots):
            if slot not in used:
                return slot
        for name, slot in self._slot_of.items():  # least recently used first
            if name not in needed:
                del self._slot_of[name]
                return slot
        raise AssertionError("no slot free although the step fits the slots")

