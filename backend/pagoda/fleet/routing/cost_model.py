"""What the router and the fleet simulator estimate time with: an engine step and a KV transfer.

``StepTimeModel``: seconds per engine step, ``a + b * num_batched_tokens + c *
sum_context_tokens``, fitted by ``pagoda bench routing --calibrate`` (``DEFAULT_STEP_MODEL``:
SmolLM2-135M fp32 on 2 CPU cores, docs/fleet_step_time.json). ``TransferModel``: seconds to
move ``n`` KV blocks over a connector. The simulator (``fleet.sim``) replays fleets with
them; the router's peer prefix pull (``routing.peer_pull``) weighs a pull against a
recompute with the same numbers. Here, not in ``fleet.sim``, so routing never imports the
simulator (which imports routing and the engine).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class StepTimeModel:
    """Seconds per engine step: ``a + b * num_batched_tokens + c * sum_context_tokens``."""

    a: float
    b: float
    c: float
    source: str = ""  # where the coefficients were measured

    def step_time(self, num_batched_tokens: int, sum_context_tokens: int) -> float:
        return self.a + self.b * num_batched_tokens + self.c * sum_context_tokens

    def save(self, path: str) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path: str) -> "StepTimeModel":
        return cls(**json.loads(Path(path).read_text()))


# SmolLM2-135M fp32 on 2 CPU cores (`pagoda bench routing --calibrate`);
# docs/fleet_step_time.json holds the same numbers with their provenance.
DEFAULT_STEP_MODEL = StepTimeModel(a=0.05, b=0.0018, c=0.00004, source="docs/fleet_step_time.json")


@dataclass(frozen=True)
class TransferModel:
    """Seconds to move ``n`` KV blocks: ``latency_s + n * block_bytes / bandwidth``. The
    defaults are SmolLM2-135M fp32 blocks of 16 tokens (737,280 bytes) over pagoda's TCP
    connector on loopback (``pagoda bench kv-transfer``: ~300 MB/s on 2 shared cores)."""

    block_bytes: int = 737_280
    mb_per_s: float = 300.0
    latency_s: float = 0.005

    def seconds(self, num_blocks: int) -> float:
        return self.latency_s + num_blocks * self.block_bytes / (self.mb_per_s * 1e6) if num_blocks else 0.0
