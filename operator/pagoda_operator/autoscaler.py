"""The autoscaling policy: replica loads in, desired replica count out. Pure; clock injected.

Algorithm (one `decide` call per timer tick):
1. Raw recommendation. For each target, a usage ratio over the replicas that reported:
     waiting:  mean waiting requests per replica / targetWaitingPerReplica
     kv:       mean KV cache usage             / targetKVCacheUsage (only if the target > 0)
     ttft:     fleet P90 TTFT                  / ttftSLOSeconds   (only if the SLO > 0)
     itl:      fleet P90 inter-token latency   / itlSLOSeconds    (only if the SLO > 0)
   The fleet P90 is one quantile over every replica's recent requests together: the
   replicas' histogram buckets (TTFT: heartbeat `ttft_buckets` or the metrics scrape's
   bucket deltas; ITL: the scrape's deltas of vllm:inter_token_latency_seconds) are summed
   first. A replica that reports no buckets counts with its own P90 (the larger of the two
   is used). It was the worst replica's P90, which let a few cold prefills on one replica
   scale the whole fleet by their ratio (replayed: docs/kubernetes.md).
   Each pool has its own policy object and spec (spec.disaggregation): the prefill pool's
   has no KV target (queue and TTFT), the decode pool's keeps spec.autoscaling's (KV usage,
   and the ITL SLO when set).
   A ratio within [1 - tolerance, 1 + tolerance] recommends `current` (hysteresis band);
   otherwise ceil(current * ratio). The raw recommendation is the largest over targets,
   so any one target under pressure scales up. No report at all -> keep `current`.
2. Stabilization (as Kubernetes' HPA behavior): every raw recommendation is remembered
   with its time. A scale-up goes to the LOWEST recommendation seen within
   `scaleUpStabilizationSeconds` (default 0: react at once); a scale-down goes to the
   HIGHEST recommendation within `scaleDownStabilizationSeconds` (default 300 s), so a
   short lull never removes replicas and scale-down waits for a sustained low.
3. Rate limits: at most `maxScaleUpStep` replicas added per decision; at most ONE
   removed, because every removal is drained first (drain.py).
4. Clamp to [min, max]; a current count outside the bounds (spec changed) is corrected
   at once, whatever the windows say.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable

from pagoda_operator.load import ReplicaLoad, histogram_quantile
from pagoda_operator.spec import AutoscalingSpec

Clock = Callable[[], float]


@dataclass(frozen=True)
class FleetLoad:
    """The aggregate the policy looks at (also reported in status.observedLoad)."""

    num_replicas: int
    waiting: float
    running: float
    kv_usage: float
    ttft_p90: float
    itl_p90: float = 0.0

    @classmethod
    def of(cls, loads: Iterable[ReplicaLoad]) -> "FleetLoad":
        loads = list(loads)
        n = len(loads)
        return cls(
            num_replicas=n,
            waiting=sum(x.waiting for x in loads),
            running=sum(x.running for x in loads),
            kv_usage=sum(x.kv_usage for x in loads) / n if n else 0.0,
            ttft_p90=fleet_ttft_p90(loads),
            itl_p90=fleet_p90(loads, "itl_p90", "itl_buckets"),
        )


def fleet_p90(loads: list[ReplicaLoad], p90_field: str, buckets_field: str) -> float:
    """P90 of all replicas' recent samples together: their histogram buckets summed, and the
    own P90 of each replica that reported no buckets (module docstring)."""
    merged: dict[float, float] = {}
    for load in loads:
        for bound, count in (getattr(load, buckets_field) or {}).items():
            merged[bound] = merged.get(bound, 0.0) + count
    without = [getattr(x, p90_field) for x in loads if not getattr(x, buckets_field)]
    return max([histogram_quantile(0.9, merged)] + without)


def fleet_ttft_p90(loads: list[ReplicaLoad]) -> float:
    """P90 TTFT of all replicas' recent requests together (module docstring)."""
    return fleet_p90(loads, "ttft_p90", "ttft_buckets")


@dataclass(frozen=True)
class Decision:
    """One decision: `desired` is what to scale to; `raw` is before stabilization."""

    current: int
    desired: int
    raw: int
    reason: str

    @property
    def is_scale_up(self) -> bool:
        return self.desired > self.current

    @property
    def is_scale_down(self) -> bool:
        return self.desired < self.current


class AutoscalerPolicy:
    """Stateful only in its recommendation history; one instance per scaled pool of an LLMService."""

    def __init__(self, spec: AutoscalingSpec, min_replicas: int, max_replicas: int,
                 clock: Clock):
        assert 1 <= min_replicas <= max_replicas, "bounds are validated by spec.py"
        self.spec = spec
        self.min_replicas = min_replicas
        self.max_replicas = max_replicas
        self.clock = clock
        self._history: deque[tuple[float, int]] = deque()

    def reconfigure(self, spec: AutoscalingSpec, min_replicas: int, max_replicas: int) -> None:
        """Adopt a new spec; the history is kept (it is still true about the past)."""
        self.spec, self.min_replicas, self.max_replicas = spec, min_replicas, max_replicas

    def _ratios(self, fleet: FleetLoad) -> list[tuple[str, float]]:
        n = fleet.num_replicas
        ratios = [("waiting", fleet.waiting / n / self.spec.target_waiting_per_replica)]
        if self.spec.target_kv_cache_usage > 0:
            ratios.append(("kv_cache_usage", fleet.kv_usage / self.spec.target_kv_cache_usage))
        if self.spec.ttft_slo_seconds > 0:
            ratios.append(("ttft_p90", fleet.ttft_p90 / self.spec.ttft_slo_seconds))
        if self.spec.itl_slo_seconds > 0:
            ratios.append(("itl_p90", fleet.itl_p90 / self.spec.itl_slo_seconds))
        return ratios

    def recommend(self, fleet: FleetLoad, current: int) -> tuple[int, str]:
        """Raw recommendation (step 1 above) and a reason naming the deciding target."""
        if fleet.num_replicas == 0 or current == 0:
            return current, "no load reported"
        best, reason = 0, ""
        for name, ratio in self._ratios(fleet):
            if abs(ratio - 1.0) <= self.spec.tolerance:
                wanted = current
            else:
                wanted = math.ceil(current * ratio - 1e-9)
            if wanted > best or not reason:
                best, reason = wanted, f"{name} at {ratio:.2f}x target"
        return best, reason

    def _window(self, now: float, seconds: float) -> list[int]:
        """Recommendations younger than `seconds`, always including the latest one
        (so a zero window means "the latest only", even for samples at the same time)."""
        latest = self._history[-1][1]
        return [r for t, r in list(self._history)[:-1] if now - t < seconds] + [latest]

    def decide(self, loads: Iterable[ReplicaLoad], current: int) -> Decision:
        """Decide the replica count for this tick.

        Args:
            loads: fresh samples of the replicas that reported.
            current: the replica count now (the Deployment's spec.replicas).
        Returns:
            The Decision; `desired` is always within [min, max].
        """
        now = self.clock()
        raw, reason = self.recommend(FleetLoad.of(loads), current)
        self._history.append((now, raw))
        horizon = max(self.spec.scale_up_stabilization_seconds,
                      self.spec.scale_down_stabilization_seconds)
        while self._history and now - self._history[0][0] > horizon:
            self._history.popleft()

        desired = current
        if raw > current:
            window = self._window(now, self.spec.scale_up_stabilization_seconds)
            desired = min(max(current, min(window)), current + self.spec.max_scale_up_step)
            if desired == current:
                reason += "; held by the scale-up window"
        elif raw < current:
            window = self._window(now, self.spec.scale_down_stabilization_seconds)
            desired = max(min(current, max(window)), current - 1)
            if desired == current:
                reason += "; held by the scale-down window"

        clamped = min(max(desired, self.min_replicas), self.max_replicas)
        if clamped != desired:
            reason += f"; clamped to [{self.min_replicas}, {self.max_replicas}]"
        return Decision(current=current, desired=clamped, raw=raw, reason=reason)
